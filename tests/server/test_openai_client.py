"""The official `openai` Python client against a running `turbospark serve`.

Run by crates/server/tests/openai_client.rs, which starts the server in-process and sets
TS_SERVER_URL (http://127.0.0.1:PORT) and TS_MODEL_ID. Every call has a timeout and no retries.
"""

import os
import sys
import unittest

import openai

URL = os.environ["TS_SERVER_URL"]
MODEL = os.environ["TS_MODEL_ID"]
KEY = os.environ.get("TS_API_KEY", "not-needed")
CLIENT = openai.OpenAI(base_url=URL + "/v1", api_key=KEY, timeout=60, max_retries=0)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


class OpenAIClient(unittest.TestCase):
    def test_models(self):
        ids = [m.id for m in CLIENT.models.list()]
        self.assertIn(MODEL, ids)

    def test_chat_whole_and_streamed(self):
        r = CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
        text = r.choices[0].message.content
        self.assertTrue(text.strip())
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        stream = CLIENT.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        parts, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    parts.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        self.assertEqual("".join(parts), text)
        self.assertEqual(finish, r.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, r.usage.completion_tokens)

    def test_completions_whole_and_streamed(self):
        r = CLIENT.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        text = r.choices[0].text
        self.assertTrue(text)
        streamed = "".join(c.choices[0].text for c in CLIENT.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
        self.assertEqual(streamed, text)

    def test_wrong_key_is_refused(self):
        if "TS_API_KEY" not in os.environ:
            self.skipTest("the server has no API key")
        wrong = openai.OpenAI(base_url=URL + "/v1", api_key=KEY + "x", timeout=60, max_retries=0)
        with self.assertRaises(openai.AuthenticationError) as cm:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        self.assertEqual(cm.exception.status_code, 401)
        self.assertEqual(cm.exception.code, "invalid_api_key")

    def test_json_mode(self):
        import json
        r = CLIENT.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a cat as a JSON object with its name and age."}],
            max_tokens=200,
            temperature=0,
            response_format={"type": "json_object"},
        )
        c = r.choices[0]
        if c.finish_reason == "stop":
            self.assertIsInstance(json.loads(c.message.content), dict)
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        }
        r = CLIENT.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a cat."}],
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "cat", "strict": True, "schema": schema}},
        )
        c = r.choices[0]
        if c.finish_reason == "stop":
            obj = json.loads(c.message.content)
            self.assertEqual(sorted(obj), ["age", "name"])
            self.assertIsInstance(obj["age"], int)
        with self.assertRaises(openai.BadRequestError) as cm:
            CLIENT.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=5, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}
            )
        self.assertIn("root must be an object", str(cm.exception))

    def test_several_choices(self):
        r = CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.9, seed=11, n=2)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        self.assertTrue(all(c.message.content for c in r.choices))
        parts = {0: [], 1: []}
        for chunk in CLIENT.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0.9, seed=11, n=2, stream=True
        ):
            for c in chunk.choices:
                if c.delta.content:
                    parts[c.index].append(c.delta.content)
        self.assertEqual(["".join(parts[i]) for i in (0, 1)], [c.message.content for c in r.choices])

    def test_stop_and_logprobs(self):
        full = CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0).choices[0].message.content
        words = full.split()
        self.assertGreaterEqual(len(words), 4, full)
        stop = words[len(words) // 2]
        r = CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
        self.assertEqual(r.choices[0].message.content, full[: full.index(stop)])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        r = CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        self.assertTrue(content)
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 2)

    def test_seeded_sampling_repeats(self):
        kw = dict(model=MODEL, prompt="My favourite colour is", max_tokens=10, temperature=0.9, seed=7,
                  extra_body={"top_k": 40, "min_p": 0.05})
        a = CLIENT.completions.create(**kw).choices[0].text
        b = CLIENT.completions.create(**kw).choices[0].text
        self.assertEqual(a, b)

    def test_errors_are_typed(self):
        with self.assertRaises(openai.NotFoundError) as e:
            CLIENT.chat.completions.create(model="no-such-model", messages=MESSAGES)
        self.assertIn("no-such-model", str(e.exception))
        with self.assertRaises(openai.BadRequestError):
            CLIENT.chat.completions.create(model=MODEL, messages=[])
        with self.assertRaises(openai.BadRequestError) as e:
            CLIENT.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10**6)
        self.assertIn("context", str(e.exception))
        with self.assertRaises(openai.BadRequestError):
            CLIENT.completions.create(model=MODEL, prompt="x", temperature=5)


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    failed = len(result.failures) + len(result.errors)
    print(f"{result.testsRun - failed} passed, {failed} failed")
    sys.exit(1 if failed or not result.testsRun else 0)
