//! Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered with minijinja.
//!
//! The environment mirrors what Hugging Face `transformers` gives templates: `trim_blocks` and
//! `lstrip_blocks` on, Python string/dict/list methods (`.strip()`, `.startswith()`, `.items()`
//! … via `minijinja_contrib::pycompat`), `raise_exception(msg)`, `strftime_now(fmt)` (UTC), a
//! `tojson` filter that does not HTML-escape (like `json.dumps`), and the variables `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token` (plus any extra ones passed to
//! [`ChatTemplate::render_value`]).
//!
//! Sandboxing: there is no template loader (`include`/`import`/`extends` fail), execution is
//! limited by minijinja fuel ([`FUEL`] instructions) and the output by [`MAX_OUTPUT_BYTES`], so a
//! hostile template can neither read files nor hang the server. Fuel counts instructions, not
//! bytes: a template that doubles a string in a loop reaches gigabytes in 40 instructions, and
//! minijinja has no memory budget. So a program that loads templates from strangers' model files
//! calls [`render_in_child_process`] once (the `turbospark` binary does): every model-supplied
//! template is then rendered by a child process (`<exe> __render-template`, see [`child_main`])
//! that limits its own address space to [`CHILD_MEMORY_BYTES`] and its CPU time to
//! [`CHILD_CPU_SECONDS`]; a child that dies is reported as a render error and the parent goes on.
//! The built-in templates are trusted and rendered in process. Spawning costs a few milliseconds
//! per conversation rendered.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde::Serialize;
use ts_formats::Value;

/// Instruction budget of one render (minijinja fuel).
pub const FUEL: u64 = 5_000_000;

/// Largest rendered prompt, in bytes.
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;

/// Address-space limit of the rendering child process (module doc, "Sandboxing").
pub const CHILD_MEMORY_BYTES: u64 = 2 << 30;

/// CPU-time limit of the rendering child process, in seconds.
pub const CHILD_CPU_SECONDS: u64 = 20;

/// The subcommand the rendering child is started with.
pub const CHILD_ARG: &str = "__render-template";

/// The executable that renders model-supplied templates, when set (see
/// [`render_in_child_process`]).
static CHILD_EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

/// From now on, render every model-supplied template in a child process `exe __render-template`
/// whose `main` calls [`child_main`]. Only on Unix (elsewhere the call does nothing and templates
/// render in process). The first call wins.
pub fn render_in_child_process(exe: std::path::PathBuf) {
    if cfg!(unix) {
        let _ = CHILD_EXE.set(exe);
    }
}

/// What the parent sends the child on stdin.
#[derive(Serialize, serde::Deserialize)]
struct ChildRequest {
    source: String,
    ctx: serde_json::Value,
}

/// What the child answers on stdout: `ok` (the text) or `syntax` / `render` (the message).
#[derive(Serialize, serde::Deserialize)]
struct ChildReply {
    ok: Option<String>,
    syntax: Option<String>,
    render: Option<String>,
}

/// The rendering child's `main`: limits its own address space and CPU time, reads one
/// request (JSON `{source, ctx}`) from stdin, renders it in process and writes the reply (JSON)
/// to stdout. Returns the exit code. An allocation beyond the limit aborts the child, which the
/// parent reports as a render error.
pub fn child_main() -> i32 {
    #[cfg(unix)]
    unsafe {
        let mem = libc::rlimit { rlim_cur: CHILD_MEMORY_BYTES as libc::rlim_t, rlim_max: CHILD_MEMORY_BYTES as libc::rlim_t };
        let cpu = libc::rlimit { rlim_cur: CHILD_CPU_SECONDS as libc::rlim_t, rlim_max: CHILD_CPU_SECONDS as libc::rlim_t };
        if libc::setrlimit(libc::RLIMIT_AS, &mem) != 0 || libc::setrlimit(libc::RLIMIT_CPU, &cpu) != 0 {
            return 3;
        }
    }
    let mut input = String::new();
    if std::io::Read::read_to_string(&mut std::io::stdin(), &mut input).is_err() {
        return 2;
    }
    let Ok(req) = serde_json::from_str::<ChildRequest>(&input) else { return 2 };
    let reply = match ChatTemplate::new_in_process(&req.source).and_then(|t| t.render_here(&req.ctx)) {
        Ok(text) => ChildReply { ok: Some(text), syntax: None, render: None },
        Err(ChatError::Syntax(m)) => ChildReply { ok: None, syntax: Some(m), render: None },
        Err(e) => ChildReply { ok: None, syntax: None, render: Some(e.to_string()) },
    };
    match serde_json::to_writer(std::io::stdout().lock(), &reply) {
        Ok(()) => 0,
        Err(_) => 2,
    }
}

/// Renders `source` with `ctx` in a child process `exe __render-template`.
fn render_in_child(exe: &std::path::Path, source: &str, ctx: &serde_json::Value) -> Result<String, ChatError> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let fail = |why: String| ChatError::Render(why);
    let req = serde_json::to_vec(&ChildRequest { source: source.to_string(), ctx: ctx.clone() })
        .map_err(|e| fail(format!("cannot encode the render request: {e}")))?;
    let mut child = Command::new(exe)
        .arg(CHILD_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(format!("cannot start the rendering process {}: {e}", exe.display())))?;
    // The child reads all of its input before it writes anything: no deadlock.
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&req);
    }
    let out = child.wait_with_output().map_err(|e| fail(format!("rendering process: {e}")))?;
    if !out.status.success() {
        return Err(fail(format!(
            "rendering stopped: the template exceeded its sandbox ({} GiB of memory, {CHILD_CPU_SECONDS} s of CPU; {})",
            CHILD_MEMORY_BYTES >> 30,
            out.status
        )));
    }
    let reply: ChildReply =
        serde_json::from_slice(&out.stdout).map_err(|e| fail(format!("unreadable reply from the rendering process: {e}")))?;
    match reply {
        ChildReply { ok: Some(text), .. } if text.len() <= MAX_OUTPUT_BYTES => Ok(text),
        ChildReply { ok: Some(_), .. } => Err(fail(format!("output exceeds {MAX_OUTPUT_BYTES} bytes"))),
        ChildReply { syntax: Some(m), .. } => Err(ChatError::Syntax(m)),
        ChildReply { render: Some(m), .. } => Err(ChatError::Render(m.trim_start_matches("chat template: ").to_string())),
        _ => Err(fail("empty reply from the rendering process".into())),
    }
}

/// The ChatML template used when a model has none.
/// Gemma's turn format (as Google's Gemma 3 template: a system message is prefixed to the first
/// user turn; the assistant role is called `model`).
pub const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{%- if messages and messages[0]['role'] == 'system' -%}\
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}\
{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}\
{%- for message in loop_messages -%}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

pub const CHATML_TEMPLATE: &str = "{%- for message in messages -%}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// Errors of template compilation and rendering, one line each.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChatError {
    /// The metadata value is not a string.
    #[error("metadata 'tokenizer.chat_template': {0}")]
    Metadata(String),
    /// The template does not parse.
    #[error("chat template: syntax error: {0}")]
    Syntax(String),
    /// Rendering failed (including `raise_exception`, fuel exhaustion, output limit).
    #[error("chat template: {0}")]
    Render(String),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Plain-text content.
    pub content: String,
}

impl ChatMessage {
    /// Builds a message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A compiled-and-checked chat template with its sandboxed environment.
pub struct ChatTemplate {
    source: String,
    env: Environment<'static>,
    is_fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("len", &self.source.len()).field("is_fallback", &self.is_fallback).finish()
    }
}

fn flatten(e: &JError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s.replace('\n', " ")
}

/// `strftime` for the few directives chat templates use (UTC).
fn strftime_utc(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, (tod % 3600) / 60, tod % 60);
    // Civil from days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3).
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('-') => match it.next() {
                Some('d') => out.push_str(&d.to_string()),
                Some('m') => out.push_str(&m.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(month),
            Some('b') | Some('h') => out.push_str(&month[..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 })),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

fn tojson(value: &JValue, kwargs: Kwargs) -> Result<String, JError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accept (and ignore) the other json.dumps-style arguments templates pass.
    let _: Option<JValue> = kwargs.get("ensure_ascii")?;
    let _: Option<JValue> = kwargs.get("sort_keys")?;
    let _: Option<JValue> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let res = match indent {
        None => serde_json::to_string(value),
        Some(n) => {
            let ind = vec![b' '; n];
            let mut buf = Vec::new();
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&ind);
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
            value.serialize(&mut ser).map(|_| String::from_utf8_lossy(&buf).into_owned())
        }
    };
    res.map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))
}

/// A `fmt::Write` sink that stops at [`MAX_OUTPUT_BYTES`].
struct LimitedWriter {
    buf: String,
    limit: usize,
}

impl std::fmt::Write for LimitedWriter {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if self.buf.len() + s.len() > self.limit {
            return Err(std::fmt::Error);
        }
        self.buf.push_str(s);
        Ok(())
    }
}

fn make_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<JValue, JError> {
        Err(JError::new(ErrorKind::InvalidOperation, format!("raise_exception: {msg}")))
    });
    env.add_function("strftime_now", |fmt: String| -> String {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        strftime_utc(&fmt, secs)
    });
    env.add_filter("tojson", tojson);
    env
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors are reported now rather than at first use. (Compiling
    /// allocates in proportion to the source only; rendering is what may need the sandbox.)
    pub fn new(source: &str) -> Result<ChatTemplate, ChatError> {
        Self::new_in_process(source)
    }

    fn new_in_process(source: &str) -> Result<ChatTemplate, ChatError> {
        let env = make_env();
        env.template_from_str(source).map_err(|e| ChatError::Syntax(flatten(&e)))?;
        Ok(ChatTemplate { source: source.to_string(), env, is_fallback: false })
    }

    /// The built-in ChatML template ([`CHATML_TEMPLATE`]).
    pub fn chatml() -> ChatTemplate {
        ChatTemplate { source: CHATML_TEMPLATE.to_string(), env: make_env(), is_fallback: true }
    }

    /// The built-in template for a family whose files often lack one (Gemma's turn markers for
    /// gemma/gemma2/gemma3), else ChatML.
    pub fn fallback_for(arch: Option<&str>) -> ChatTemplate {
        match arch {
            Some("gemma" | "gemma2" | "gemma3") => ChatTemplate { source: GEMMA_TEMPLATE.to_string(), env: make_env(), is_fallback: true },
            _ => Self::chatml(),
        }
    }

    /// The model's `tokenizer.chat_template`; when the key is absent or empty, the family's
    /// built-in template ([`ChatTemplate::fallback_for`]).
    pub fn from_gguf_metadata(md: &BTreeMap<String, Value>) -> Result<ChatTemplate, ChatError> {
        let arch = md.get("general.architecture").and_then(Value::as_str);
        match md.get("tokenizer.chat_template") {
            None => Ok(Self::fallback_for(arch)),
            Some(v) => match v.as_str() {
                Some(s) if s.trim().is_empty() => Ok(Self::fallback_for(arch)),
                Some(s) => Self::new(s),
                None => Err(ChatError::Metadata(format!("expected a string, got {}", v.short()))),
            },
        }
    }

    /// True when this is the built-in ChatML fallback.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String, ChatError> {
        let ctx = serde_json::json!({
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        });
        self.render_value(&ctx)
    }

    /// Renders with an arbitrary context object (e.g. messages with structured content, `tools`).
    /// The context should contain at least `messages`; missing variables are undefined (lenient,
    /// as in Jinja2).
    /// Model-supplied templates go to the rendering child process when one is set (module doc,
    /// "Sandboxing").
    pub fn render_value(&self, ctx: &serde_json::Value) -> Result<String, ChatError> {
        match CHILD_EXE.get() {
            Some(exe) if !self.is_fallback => render_in_child(exe, &self.source, ctx),
            _ => self.render_here(ctx),
        }
    }

    /// Renders in this process (fuel and output limits only).
    fn render_here(&self, ctx: &serde_json::Value) -> Result<String, ChatError> {
        let tmpl = self.env.template_from_str(&self.source).map_err(|e| ChatError::Syntax(flatten(&e)))?;
        let mut w = LimitedWriter { buf: String::new(), limit: MAX_OUTPUT_BYTES };
        let ctx = JValue::from_serialize(ctx);
        match tmpl.render_captured_to(ctx, &mut FmtToIo(&mut w)) {
            Ok(_) => Ok(w.buf),
            Err(e) if e.kind() == ErrorKind::WriteFailure => Err(ChatError::Render(format!("output exceeds {MAX_OUTPUT_BYTES} bytes"))),
            Err(e) => Err(ChatError::Render(flatten(&e))),
        }
    }
}

/// Adapts a `fmt::Write` to `io::Write` (minijinja's `render_to_write` takes `io::Write`).
struct FmtToIo<'a>(&'a mut LimitedWriter);

impl std::io::Write for FmtToIo<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let s = std::str::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        std::fmt::Write::write_str(self.0, s).map_err(|_| std::io::Error::other("output limit"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Google's Gemma 3 chat template (as published with the HF checkpoints; the GGUF used for
    /// tests carries none).
    const GEMMA3_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '

' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '

' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '
' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>
' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model
'}}
{%- endif -%}
"#;

    fn conv() -> Vec<ChatMessage> {
        vec![ChatMessage::new("system", "You are terse."), ChatMessage::new("user", "Hi there")]
    }

    #[test]
    fn smollm2_template_from_file() {
        let Some(path) = crate::test_model_path("SmolLM2-135M-Instruct.Q4_1.gguf") else {
            eprintln!("SKIP: SmolLM2-135M-Instruct.Q4_1.gguf not found in $TURBOSPARK_HOME/models; test not run");
            return;
        };
        let f = ts_formats::gguf::GgufFile::open(&path).expect("open");
        let t = ChatTemplate::from_gguf_metadata(f.metadata()).expect("template");
        assert!(!t.is_fallback());
        let want = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n";
        assert_eq!(t.render(&conv(), false, "<|im_start|>", "<|im_end|>").expect("render"), want);
        assert_eq!(t.render(&conv(), true, "<|im_start|>", "<|im_end|>").expect("render"), format!("{want}<|im_start|>assistant\n"));
        // Without a system message the template inserts its default one.
        let out = t.render(&[ChatMessage::new("user", "Hi")], true, "", "").expect("render");
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gemma3_template() {
        let t = ChatTemplate::new(GEMMA3_TEMPLATE).expect("compile");
        let out = t.render(&conv(), true, "<bos>", "<eos>").expect("render");
        assert_eq!(out, "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n");
        let out = t.render(&conv(), false, "<bos>", "<eos>").expect("render");
        assert_eq!(out, "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n");
        // raise_exception surfaces as an error.
        let bad = [ChatMessage::new("assistant", "x")];
        let err = t.render(&bad, false, "<bos>", "<eos>").expect_err("must raise");
        assert!(err.to_string().contains("Conversation roles must alternate"), "{err}");
        // Gemma 3's file carries no template → the built-in Gemma fallback.
        if let Some(path) = crate::test_model_path("gemma-3-270m-q4_k_m.gguf") {
            let f = ts_formats::gguf::GgufFile::open(&path).expect("open");
            let md = f.metadata();
            let t = ChatTemplate::from_gguf_metadata(md).expect("template");
            assert_eq!(t.is_fallback(), !md.contains_key("tokenizer.chat_template"));
        } else {
            eprintln!("SKIP: gemma-3-270m-q4_k_m.gguf not found; fallback check not run");
        }
    }

    #[test]
    fn gemma_fallback() {
        let mut md = BTreeMap::new();
        md.insert("general.architecture".to_string(), Value::String("gemma3".into()));
        let t = ChatTemplate::from_gguf_metadata(&md).expect("fallback");
        assert!(t.is_fallback());
        assert_eq!(
            t.render(&conv(), true, "<bos>", "<eos>").expect("render"),
            "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn chatml_fallback() {
        let t = ChatTemplate::from_gguf_metadata(&BTreeMap::new()).expect("fallback");
        assert!(t.is_fallback());
        assert_eq!(
            t.render(&conv(), true, "", "").expect("render"),
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_tojson_strftime() {
        let src = "{{ messages[0]['content'].strip().upper() }}|{{ messages[0]['content'].startswith('  he') }}|\
{{ messages[0] | tojson }}|{{ {'a': '<b>'} | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(src).expect("compile");
        let out = t.render(&[ChatMessage::new("user", "  hello ")], false, "", "").expect("render");
        assert_eq!(out, "HELLO|True|{\"content\":\"  hello \",\"role\":\"user\"}|{\n  \"a\": \"<b>\"\n}|4");
        assert_eq!(strftime_utc("%d %b %Y %H:%M:%S %A %j", 1_709_251_199), "29 Feb 2024 23:59:59 Thursday 060");
        assert_eq!(strftime_utc("%-d %B %y", 0), "1 January 70");
    }

    #[test]
    fn sandboxed() {
        // Syntax error.
        assert!(matches!(ChatTemplate::new("{% for %}"), Err(ChatError::Syntax(_))));
        // No loader: include fails.
        let t = ChatTemplate::new("{% include '/etc/passwd' %}").expect("compile");
        assert!(t.render(&[], false, "", "").is_err());
        // Infinite-ish loops run out of fuel.
        let t = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}").expect("compile");
        let err = t.render(&[], false, "", "").expect_err("fuel");
        assert!(err.to_string().to_lowercase().contains("fuel"), "{err}");
        // Huge output is cut off.
        let t = ChatTemplate::new("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}").expect("compile");
        let big = "x".repeat(1000);
        let err = t.render(&[ChatMessage::new("user", big)], false, "", "").expect_err("size");
        assert!(err.to_string().contains("exceeds"), "{err}");
    }

    /// Renders `src` over one message on a thread with a 2 MiB stack (what tokio's workers and
    /// test threads get), returning the error text; each must come within a few seconds.
    fn hostile(src: &str) -> String {
        let src = src.to_string();
        let h = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let t0 = std::time::Instant::now();
                let r = ChatTemplate::new(&src).and_then(|t| t.render(&[ChatMessage::new("user", "hi")], true, "<s>", "</s>"));
                (r, t0.elapsed())
            })
            .expect("spawn");
        let (r, took) = h.join().expect("render must not panic");
        assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
        match r {
            Ok(out) => panic!("expected an error, rendered {} bytes", out.len()),
            Err(e) => {
                let e = e.to_string();
                assert!(!e.contains('\n'), "one line: {e:?}");
                e
            }
        }
    }

    #[test]
    fn hostile_templates_end_quickly_with_a_clear_error() {
        // Loops "forever" (as long as ranges allow): out of fuel.
        let e = hostile("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}");
        assert!(e.to_lowercase().contains("fuel"), "{e}");
        // Loops over a repeated sequence (10^10 items, lazily): out of fuel too.
        let e = hostile("{% for x in [1] * 100000 * 100000 %}{% endfor %}");
        assert!(e.to_lowercase().contains("fuel") || e.contains("too"), "{e}");
        // Recursion without end: the recursion limit, not a stack overflow on a 2 MiB stack.
        let e = hostile("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
        assert!(e.contains("recursion"), "{e}");
        let e = hostile("{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}");
        assert!(e.contains("recursion") || e.to_lowercase().contains("fuel"), "{e}");
        // Huge strings: one repeat beyond minijinja's cap; output beyond MAX_OUTPUT_BYTES.
        let e = hostile("{{ 'x' * 1000000000000 }}");
        assert!(e.contains("too large"), "{e}");
        let e = hostile("{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}");
        assert!(e.contains("exceeds"), "{e}");
        // No file access: include, import, extends all fail.
        for src in ["{% include 'x.j2' %}", "{% import '/etc/passwd' as p %}", "{% extends 'base' %}", "{% from 'a' import b %}"] {
            let e = hostile(src);
            assert!(e.contains("not found") || e.contains("template"), "{src}: {e}");
        }
        // Deep nesting in the source itself is a syntax error, not a stack overflow.
        let e = hostile(&format!("{{{{ {}1{} }}}}", "(".repeat(5000), ")".repeat(5000)));
        assert!(e.contains("syntax") || e.contains("nest"), "{e}");
        let e = hostile(&format!("{}{}", "{% if true %}".repeat(2000), "{% endif %}".repeat(2000)));
        assert!(e.contains("syntax") || e.contains("nest"), "{e}");
    }
}
