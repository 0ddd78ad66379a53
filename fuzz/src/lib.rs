//! # ts-fuzz — fuzz target bodies for turbospark's untrusted inputs
//!
//! Each public function takes arbitrary bytes and drives one parser the way the runtime does;
//! it must return (an error is fine) without panicking, hanging or allocating without bound.
//! The libFuzzer entry points in `fuzz_targets/` call them; `fuzz/smoke.sh` runs each for a
//! bounded time (CI) and `docs/RELIABILITY.md` records longer runs.
//!
//! * [`gguf`]           — the GGUF reader over the bytes, then every tensor's bytes and one
//!   dequantised row of each tensor whose type has a reference dequantiser.
//! * [`hf`]             — a Hugging Face folder built from the bytes (`config.json` +
//!   `model.safetensors`), then every tensor's bytes.
//! * [`tokenizer`]      — SmolLM2's real vocabulary: encode lossy-UTF-8 text (with and without
//!   special-token parsing), decode arbitrary ids (out of range included), stream-decode them.
//! * [`chat_template`]  — arbitrary template source rendered over arbitrary messages (fuel and
//!   output limits must stop it), and the model's own template over arbitrary messages.
//! * [`server_request`] — the server's JSON → request validation (`ts_server::api`), then the
//!   chat template and tokenizer as a chat request would use them, without a socket.

use std::path::PathBuf;
use std::sync::OnceLock;

use ts_engine::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};
use ts_formats::gguf::GgufFile;
use ts_formats::hf::HfFolder;
use ts_formats::quant::dequantize;
use ts_formats::{TensorData, TensorSource};

/// The SmolLM2 file the tokenizer targets use: `$TURBOSPARK_FUZZ_MODEL`, else the model cache
/// (fetched with [`ts_engine::hub::ensure`] when missing).
fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TURBOSPARK_FUZZ_MODEL") {
        return PathBuf::from(p);
    }
    let cached = ts_engine::hub::cached_path(&ts_engine::hub::SMOLLM2);
    if cached.is_file() {
        return cached;
    }
    ts_engine::hub::ensure(&ts_engine::hub::SMOLLM2, &mut |m| eprintln!("{m}"))
        .unwrap_or_else(|e| panic!("ts-fuzz needs SmolLM2 for its vocabulary: {e}"))
}

/// SmolLM2's tokenizer and chat template, loaded once per process.
fn smollm2() -> &'static (Tokenizer, ChatTemplate) {
    static T: OnceLock<(Tokenizer, ChatTemplate)> = OnceLock::new();
    T.get_or_init(|| {
        let f = GgufFile::open(smollm2_path()).expect("open SmolLM2");
        let tok = Tokenizer::from_gguf_metadata(f.metadata()).expect("SmolLM2 tokenizer");
        let tmpl = ChatTemplate::from_gguf_metadata(f.metadata()).expect("SmolLM2 chat template");
        (tok, tmpl)
    })
}

/// Reads every byte of `t` and dequantises its first row when its type has a dequantiser.
fn touch(t: &TensorData<'_>) -> u64 {
    let mut sum = t.data.iter().fold(0u64, |a, &b| a.wrapping_add(b as u64));
    let ne0 = t.shape.first().copied().unwrap_or(1);
    // The invariant TensorData promises: the bytes match dtype and shape.
    let want = t.dtype.row_bytes(ne0).and_then(|r| t.shape.iter().skip(1).try_fold(r, |a, &d| a.checked_mul(d)));
    assert_eq!(want, Some(t.data.len()), "tensor '{}': size does not match dtype and shape", t.name);
    // One row, capped so a wide row costs bounded work.
    let n = ne0.min(1 << 16);
    let n = n - n % t.dtype.block_size();
    if n > 0 {
        let mut row = vec![0f32; n];
        if dequantize(t.dtype, t.data, &mut row).is_ok() {
            sum = row.iter().fold(sum, |a, x| a.wrapping_add(x.to_bits() as u64));
        }
    }
    sum
}

/// Touches every tensor and reads every metadata value of `src`.
fn walk(src: &dyn TensorSource) -> u64 {
    let mut sum = 0u64;
    for (k, v) in src.metadata() {
        sum = sum.wrapping_add(k.len() as u64).wrapping_add(v.short().len() as u64);
    }
    for name in src.tensor_names() {
        let t = src.tensor(name).unwrap_or_else(|| panic!("listed tensor '{name}' cannot be fetched"));
        sum = sum.wrapping_add(touch(&t));
    }
    sum
}

/// GGUF reader over `data` (see the crate docs).
pub fn gguf(data: &[u8]) {
    if let Ok(f) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) {
        std::hint::black_box(walk(&f));
        for t in f.tensor_infos() {
            assert!(f.data_start() + t.offset + t.size <= f.file_size(), "tensor '{}' past the end", t.name);
        }
    }
}

/// A per-process scratch folder for [`hf`].
fn hf_dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("ts-fuzz-hf-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("create the fuzz scratch folder");
        d
    })
}

/// Hugging Face folder from `data`: the first two bytes (little-endian) are the length of
/// `config.json`, which follows; the rest is `model.safetensors`.
pub fn hf(data: &[u8]) {
    let (cfg, st) = match data {
        [a, b, rest @ ..] => {
            let n = (u16::from_le_bytes([*a, *b]) as usize).min(rest.len());
            rest.split_at(n)
        }
        _ => (data, &[][..]),
    };
    let dir = hf_dir();
    std::fs::write(dir.join("config.json"), cfg).expect("write config.json");
    std::fs::write(dir.join("model.safetensors"), st).expect("write model.safetensors");
    if let Ok(f) = HfFolder::open(dir) {
        std::hint::black_box(walk(&f));
    }
    // Also through the dispatcher the CLI uses.
    if let Ok(m) = ts_formats::open_model(dir) {
        std::hint::black_box(m.tensor_names().len());
    }
}

/// Tokenizer round trips with SmolLM2's vocabulary (see the crate docs). The first byte picks
/// the flags; the input is read both as text and as little-endian u32 ids.
pub fn tokenizer(data: &[u8]) {
    let (tok, _) = smollm2();
    let Some((&flags, rest)) = data.split_first() else { return };
    let text = String::from_utf8_lossy(rest);
    if let Ok(ids) = tok.encode_with(&text, flags & 1 != 0, flags & 2 != 0) {
        assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()), "encode produced an id outside the vocabulary");
        let back = tok.decode_with(&ids, flags & 4 != 0);
        std::hint::black_box(back);
    }
    let ids: Vec<u32> = rest
        .chunks(4)
        .map(|c| {
            let mut b = [0u8; 4];
            b[..c.len()].copy_from_slice(c);
            let v = u32::from_le_bytes(b);
            // Mostly in-vocabulary ids, some far outside.
            if flags & 8 != 0 { v } else { v % (tok.vocab_size() as u32 + 16) }
        })
        .collect();
    std::hint::black_box(tok.decode_with(&ids, flags & 4 != 0));
    let mut dec = StreamDecoder::with_special(tok, flags & 16 != 0);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&dec.push(id));
        std::hint::black_box(tok.token_bytes(id, true));
        std::hint::black_box(tok.token_str(id));
        std::hint::black_box(tok.is_eog(id));
    }
    streamed.push_str(&dec.flush());
    assert!(dec.pending().is_empty(), "flush left bytes pending");
}

/// Splits `data` at 0xFF bytes into messages: alternating role and content (lossy UTF-8).
fn messages(data: &[u8]) -> Vec<ChatMessage> {
    let parts: Vec<String> = data.split(|&b| b == 0xFF).map(|p| String::from_utf8_lossy(p).into_owned()).collect();
    parts.chunks(2).map(|c| ChatMessage::new(c[0].clone(), c.get(1).cloned().unwrap_or_default())).collect()
}

/// Chat templates (see the crate docs). First byte: bit 0 selects the model's template over
/// the input's own; the rest is `template source 0xFE messages`.
pub fn chat_template(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else { return };
    let (src, msgs) = match rest.iter().position(|&b| b == 0xFE) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let msgs = messages(msgs);
    let gen = flags & 2 != 0;
    if flags & 1 != 0 {
        let (_, tmpl) = smollm2();
        let full: Vec<ChatMessage> = messages(rest);
        std::hint::black_box(tmpl.render(&full, gen, "<|im_start|>", "<|im_end|>").ok());
        return;
    }
    let src = String::from_utf8_lossy(src);
    if let Ok(t) = ChatTemplate::new(&src) {
        let started = std::time::Instant::now();
        let out = t.render(&msgs, gen, "<s>", "</s>");
        if let Ok(s) = &out {
            assert!(s.len() <= ts_engine::chat::MAX_OUTPUT_BYTES, "output limit not enforced");
        }
        // Fuel must bound the time (generous: instrumented builds are slow).
        assert!(started.elapsed().as_secs() < 20, "render ran {:?}", started.elapsed());
    }
}

/// The server's request validation (see the crate docs): the body is parsed as a chat request
/// and as a completions request, the chat messages are rendered with SmolLM2's template and
/// tokenised, as `POST /v1/chat/completions` does before anything reaches the engine.
pub fn server_request(data: &[u8]) {
    use ts_server::api;
    let Ok(obj) = api::parse_body(data) else { return };
    let (tok, tmpl) = smollm2();
    for chat in [true, false] {
        let Ok(c) = api::parse_common(&obj, chat) else { continue };
        assert!(c.stop.len() <= api::MAX_STOPS, "too many stop strings accepted");
        if let Some(m) = c.max_tokens {
            assert!(m >= 1, "max_tokens 0 accepted");
        }
        if chat {
            if let Ok(msgs) = api::parse_messages(&obj) {
                if let Ok(text) = tmpl.render(&msgs, true, "<|im_start|>", "<|im_end|>") {
                    std::hint::black_box(tok.encode_with(&text, tok.add_bos(), true).ok());
                }
            }
        } else if let Ok(p) = api::parse_prompt(&obj) {
            if let api::Prompt::Text(t) = p {
                std::hint::black_box(tok.encode_with(&t, tok.add_bos(), true).ok());
            }
        }
    }
}
