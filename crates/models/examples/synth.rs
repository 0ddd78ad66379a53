//! `cargo run --release -p ts-models --example synth -- <preset> <quant> <out> [gguf|gguf-legacy|hf] [seed]`
//! Writes a random-weight deepseek2 model and prints how long it took (what `turbospark synth` calls).
use std::path::PathBuf;
use std::time::Instant;

use ts_formats::GgmlType;
use ts_models::synth::{synth, Preset, SynthFormat};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 4 {
        eprintln!("usage: synth <deepseek-v2-lite|tiny> <q8_0|bf16|f16|f32> <out> [gguf|gguf-legacy|hf] [seed]");
        std::process::exit(2);
    }
    let Some(preset) = Preset::parse(&a[1]) else {
        eprintln!("unknown preset {}", a[1]);
        std::process::exit(2)
    };
    let Some(q) = GgmlType::parse(&a[2]) else {
        eprintln!("unknown type {}", a[2]);
        std::process::exit(2)
    };
    let fmt = match a.get(4).map(String::as_str) {
        None | Some("gguf") => SynthFormat::Gguf,
        Some("gguf-legacy") => SynthFormat::GgufLegacy,
        Some("hf") => SynthFormat::Hf,
        Some(o) => {
            eprintln!("unknown format {o}");
            std::process::exit(2)
        }
    };
    let seed = a.get(5).and_then(|s| s.parse().ok()).unwrap_or(0);
    let out = PathBuf::from(&a[3]);
    let t = Instant::now();
    if let Err(e) = synth(preset, q, seed, &out, fmt) {
        eprintln!("{e}");
        std::process::exit(1);
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    println!("{} params, {:.2} GB in {secs:.1} s ({:.0} MB/s)", preset.spec().n_params(), bytes as f64 / 1e9, bytes as f64 / 1e6 / secs);
}
