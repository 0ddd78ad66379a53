//! Bad input gives one clear line on stderr and a non-zero exit, never a panic or backtrace.

use std::path::Path;
use std::process::Command;

use ts_formats::GgmlType;
use ts_testkit::{Fill, TempPath, TinyLlama};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_turbospark"));
    c.env("RUST_BACKTRACE", "1");
    c
}

fn tmpdir(name: &str) -> TempPath {
    TempPath::dir("ts-cli", name)
}

/// Runs and asserts failure with exactly one `error: …` line that contains `needle`.
fn fails_with(args: &[&str], needle: &str) {
    let out = bin().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded; stderr: {err}");
    assert!(!err.contains("panicked") && !err.contains("stack backtrace"), "{args:?} panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one error line, got: {err}");
    assert!(lines[0].contains(needle), "{args:?}: error {:?} does not mention {needle:?}", lines[0]);
    // No other noise than progress/info lines of our own.
    for l in err.lines() {
        assert!(l.starts_with("error:") || l.starts_with("turbospark:") || l.trim().is_empty(), "{args:?}: unexpected stderr line {l:?}");
    }
}

/// A tiny llama GGUF (hidden 256) with random weights; `embd_type` lets a test pick an
/// unsupported type.
fn tiny_llama(path: &Path, arch: &str, embd_type: GgmlType) {
    TinyLlama { arch, hidden: 256, ff: 256, embd_type, fill: Fill::Random, ..Default::default() }.write(path);
}

#[test]
fn missing_model_file() {
    fails_with(&["run", "-m", "/nonexistent/model.gguf", "hi"], "/nonexistent/model.gguf");
}

#[test]
fn not_a_model() {
    let d = tmpdir("notmodel");
    let p = d.join("notes.txt");
    std::fs::write(&p, "hello, I am not a model").unwrap();
    fails_with(&["run", "-m", p.to_str().unwrap(), "hi"], "notes.txt");
    fails_with(&["inspect", p.to_str().unwrap()], "notes.txt");
}

#[test]
fn truncated_gguf() {
    let d = tmpdir("trunc");
    let p = d.join("tiny.gguf");
    tiny_llama(&p, "llama", GgmlType::F32);
    let bytes = std::fs::read(&p).unwrap();
    let cut = d.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&["logits", "-m", cut.to_str().unwrap(), "--tokens", "1,2", "-o", d.join("x.npy").to_str().unwrap()], "cut.gguf");
}

#[test]
fn unknown_architecture() {
    let d = tmpdir("arch");
    let p = d.join("mamba.gguf");
    tiny_llama(&p, "mamba", GgmlType::F32);
    fails_with(
        &["logits", "-m", p.to_str().unwrap(), "--tokens", "1,2", "-o", d.join("x.npy").to_str().unwrap()],
        "architecture 'mamba' is not supported",
    );
}

#[test]
fn unsupported_quant_type() {
    let d = tmpdir("quant");
    let p = d.join("q2k.gguf");
    tiny_llama(&p, "llama", GgmlType::Q2K);
    fails_with(&["logits", "-m", p.to_str().unwrap(), "--tokens", "1,2", "-o", d.join("x.npy").to_str().unwrap()], "Q2_K");
}

#[test]
fn token_outside_vocabulary_and_no_tokenizer() {
    let d = tmpdir("vocab");
    let p = d.join("tiny.gguf");
    tiny_llama(&p, "llama", GgmlType::F32);
    let m = p.to_str().unwrap();
    fails_with(&["logits", "-m", m, "--tokens", "1,99", "-o", d.join("x.npy").to_str().unwrap()], "99");
    fails_with(&["run", "-m", m, "hello"], "tokenizer");
    // And the happy path of the same file: logits are written as .npy.
    let out = bin().args(["logits", "-m", m, "--tokens", "1,2,3", "-o", d.join("ok.npy").to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let npy = std::fs::read(d.join("ok.npy")).unwrap();
    assert_eq!(&npy[..6], b"\x93NUMPY");
    assert_eq!(npy.len() % 64, (3 * 16 * 4) % 64);
}

#[test]
fn prompt_longer_than_context() {
    let d = tmpdir("ctx");
    let p = d.join("tiny.gguf");
    tiny_llama(&p, "llama", GgmlType::F32);
    let toks: Vec<String> = (0..40).map(|i| (i % 16).to_string()).collect();
    fails_with(
        &["logits", "-m", p.to_str().unwrap(), "-c", "8", "--tokens", &toks.join(","), "-o", d.join("x.npy").to_str().unwrap()],
        "context",
    );
}

#[test]
fn bad_flags_are_explained() {
    let out = bin().args(["run", "--temp", "hot", "hi"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--temp") && !err.contains("panicked"), "{err}");
}

#[test]
fn inspect_check_reports_nan_weights() {
    let d = tmpdir("nan");
    let p = d.join("tiny.gguf");
    tiny_llama(&p, "llama", GgmlType::F32);
    let ok = bin().args(["inspect", "--check", p.to_str().unwrap()]).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("every tensor is finite"));
    // Poison one value of blk.0.attn_q.weight with a NaN.
    let f = ts_formats::gguf::GgufFile::open(&p).unwrap();
    let info = f.tensor_info("blk.0.attn_q.weight").unwrap();
    let at = f.data_start() + info.offset + 4 * 7;
    drop(f);
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let bad = d.join("nan.gguf");
    std::fs::write(&bad, &bytes).unwrap();
    let out = bin().args(["inspect", "--check", bad.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("blk.0.attn_q.weight: 1 NaN"), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 tensors hold NaN or Inf"));
}
