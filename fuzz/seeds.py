#!/usr/bin/env python3
"""Writes the committed seed corpus of every fuzz target into fuzz/seeds/<target>/ (run once;
the outputs are committed). Standard library only."""
import json, os, struct

here = os.path.dirname(os.path.abspath(__file__))

def put(target, name, data):
    d = os.path.join(here, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())

def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b

def gguf(meta, tensors, version=3, align=32):
    """meta: [(key, type_id, packed_value)], tensors: [(name, shape, dtype_id, nbytes)]."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(meta))
    for k, ty, v in meta:
        out += gstr(k) + struct.pack("<I", ty) + v
    off = 0
    infos, datas = b"", b""
    for name, shape, ty, nbytes in tensors:
        infos += gstr(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        infos += struct.pack("<IQ", ty, off)
        blob = bytes((i * 37 + 11) % 251 for i in range(nbytes))
        pad = (-nbytes) % align
        datas += blob + b"\0" * pad
        off += nbytes + pad
    out += infos
    out += b"\0" * ((-len(out)) % align)
    return out + datas

meta = [
    ("general.architecture", 8, gstr("llama")),
    ("llama.block_count", 4, struct.pack("<I", 1)),
    ("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
    ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<fff", 0.0, -1.0, -2.0)),
    ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + gstr("a") + gstr("b")),
    ("general.flag", 7, b"\x01"),
]
# (dtype id, block elements, block bytes): F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16
types = [(0, 1, 4), (1, 1, 2), (2, 32, 18), (3, 32, 20), (6, 32, 22), (7, 32, 24), (8, 32, 34),
         (12, 256, 144), (13, 256, 176), (14, 256, 210), (30, 1, 2)]
tensors = [(f"t{ty}", [blk, 2], ty, size * 2) for ty, blk, size in types]
put("gguf", "all_types.gguf", gguf(meta, tensors))
put("gguf", "v2_meta_only.gguf", gguf(meta[:2], [], version=2))
put("gguf", "align64.gguf", gguf(meta[:1] + [("general.alignment", 4, struct.pack("<I", 64))],
                                 [("w", [4, 4], 0, 64), ("s", [], 0, 4)], align=64))

def safetensors(ts):
    header, data = {}, b""
    for name, dtype, shape, nbytes in ts:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += bytes((i * 13) % 256 for i in range(nbytes))
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data

def hf(config, ts):
    c = json.dumps(config).encode()
    return struct.pack("<H", len(c)) + c + safetensors(ts)

put("hf", "llama", hf({"model_type": "llama", "hidden_size": 8, "rope_scaling": {"factor": 2.0}, "eos_token_id": [1, 2], "x": None},
                      [("model.embed_tokens.weight", "F32", [3, 2], 24), ("norm", "BF16", [3], 6), ("s", "F16", [], 2)]))
put("hf", "unsupported_dtype", hf({"model_type": "qwen2"}, [("w", "I8", [4], 4)]))

for i, t in enumerate(["Hello, world!", "<|im_start|>user\nhi<|im_end|>", "  tabs\tand\nnewlines  ", "héllo 日本語 🎉",
                       "1234567890 3.14159", "<|endoftext|><|im_end|>"]):
    put("tokenizer", f"text{i}", bytes([i]) + t.encode())
put("tokenizer", "ids", bytes([8]) + struct.pack("<6I", 1, 2, 49151, 49152, 0xFFFFFFFF, 100))

chatml = ("{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
          "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
msgs = b"system\xffbe terse\xffuser\xffhello"
put("chat_template", "chatml", b"\x02" + chatml.encode() + b"\xfe" + msgs)
put("chat_template", "model", b"\x03" + msgs)
put("chat_template", "loops", b"\x00{% for i in range(10) %}{{ loop.index }}{{ messages[0].content|upper }}{% endfor %}"
    b"{% set ns = namespace(x='') %}{{ messages|tojson }}{{ raise_exception('no') if false }}\xfe" + msgs)
put("chat_template", "macro", b"\x00{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{{ n }}{% endmacro %}{{ f(5) }}"
    b"{{ 'ab'.strip().startswith('a') }}{{ strftime_now('%Y-%m-%d') }}\xfe" + msgs)

reqs = [
    {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True,
     "stream_options": {"include_usage": True}, "stop": ["\n", "x"], "temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4},
    {"prompt": "Once upon", "max_tokens": 3, "logprobs": 2, "stop": "end", "n": 1, "echo": False},
    {"prompt": [1, 2, 3], "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": -0.5},
    {"prompt": ["a"], "max_tokens": -1},
]
for i, r in enumerate(reqs):
    put("server_request", f"req{i}.json", json.dumps(r))
