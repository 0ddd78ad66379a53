//! Every CUDA op against the CPU reference (`ts_cpu::CpuBackend`) on fresh random inputs.
//!
//! Outputs are poisoned with NaN on both backends before each op and every element of the output
//! view is checked: `|gpu - cpu| <= atol * rms(cpu) + rtol * |cpu|`, with `atol`/`rtol` chosen per
//! path (f32 kernels tight; paths where the CPU quantises activations to Q8 or the GPU rounds to
//! bf16 for cuBLAS looser). Matmuls are also checked against an f64 product of the dequantised
//! weight, which is what isolates the GPU's own error. Each case prints one line (run with
//! `--nocapture`); a test lists all its failing cases before failing.
//!
//! Without a GPU (or libcuda) every test prints `SKIP: no CUDA device` and passes.

use std::sync::OnceLock;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use ts_core::*;
use ts_cpu::CpuBackend;
use ts_cuda::CudaBackend;
use ts_formats::quant;

static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
static CPU: OnceLock<CpuBackend> = OnceLock::new();
static SEED: OnceLock<u64> = OnceLock::new();

fn gpu() -> Option<&'static CudaBackend> {
    GPU.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => {
            let (arch, cached) = b.kernel_build();
            let (free, total) = b.memory_info().unwrap_or((0, 0));
            eprintln!("GPU: {} ({arch}, kernels {}), {} MiB free of {} MiB", b.name(), if cached { "from the disk cache" } else { "compiled by NVRTC" }, free >> 20, total >> 20);
            Some(b)
        }
        Err(e) => {
            eprintln!("\n*** SKIP: no CUDA device ({e}) ***\n");
            None
        }
    })
    .as_ref()
}

fn cpu() -> &'static CpuBackend {
    CPU.get_or_init(|| CpuBackend::new(None).expect("cpu backend"))
}

/// A fresh generator per test: the seed comes from the clock (printed) unless TS_SEED is set.
fn rng(salt: u64) -> StdRng {
    let seed = *SEED.get_or_init(|| {
        let s = std::env::var("TS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
        });
        eprintln!("seed {s} (rerun with TS_SEED={s})");
        s
    });
    StdRng::seed_from_u64(seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Roughly normal values (sum of 4 uniforms), scaled.
fn randn(r: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (0..4).map(|_| r.random::<f32>() - 0.5).sum::<f32>() * 1.7 * scale).collect()
}

struct Report {
    name: &'static str,
    failures: Vec<String>,
    worst: f64,
}

impl Report {
    fn new(name: &'static str) -> Self {
        Report { name, failures: Vec::new(), worst: 0.0 }
    }
    /// Compare; returns the max |d| / rms(want).
    fn check(&mut self, label: &str, got: &[f32], want: &[f32], atol: f64, rtol: f64) -> f64 {
        assert_eq!(got.len(), want.len());
        let rms = (want.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / want.len().max(1) as f64).sqrt().max(1e-30);
        let (mut worst_ratio, mut worst_i, mut maxd) = (0.0f64, 0usize, 0.0f64);
        let mut bad = 0usize;
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let d = (g as f64 - w as f64).abs();
            let allowed = atol * rms + rtol * (w as f64).abs();
            let ratio = if !(g.is_finite() && w.is_finite()) { f64::INFINITY } else if d == 0.0 { 0.0 } else { d / allowed };
            if !(ratio <= 1.0) {
                bad += 1;
            }
            if !(ratio <= worst_ratio) {
                worst_ratio = ratio;
                worst_i = i;
            }
            if d.is_finite() && d > maxd {
                maxd = d;
            }
        }
        let rel = maxd / rms;
        eprintln!(
            "  {:<58} n={:<7} max|d|/rms={:.2e} worst/allowed={:.3}{}",
            format!("{}: {label}", self.name),
            got.len(),
            rel,
            worst_ratio,
            if bad > 0 { format!("  FAIL ({bad} bad, e.g. [{worst_i}] gpu {} cpu {})", got[worst_i], want[worst_i]) } else { String::new() }
        );
        if bad > 0 {
            self.failures.push(format!("{label}: {bad} elements out of tolerance, e.g. [{worst_i}] gpu {} vs {}", got[worst_i], want[worst_i]));
        }
        if rel.is_finite() {
            self.worst = self.worst.max(rel);
        } else {
            self.worst = f64::INFINITY;
        }
        rel
    }
    fn finish(self) {
        eprintln!("{}: worst max|d|/rms {:.2e}", self.name, self.worst);
        assert!(self.failures.is_empty(), "{} failing cases:\n{}", self.name, self.failures.join("\n"));
    }
}

fn buf<B: Backend>(b: &B, data: &[f32]) -> B::Buf {
    let x = b.alloc(data.len()).expect("alloc");
    b.write(&x, 0, data).expect("write");
    x
}
fn poison<B: Backend>(b: &B, x: &B::Buf, len: usize) {
    b.write(x, 0, &vec![f32::NAN; len]).expect("poison");
}
fn get<B: Backend>(b: &B, x: &B::Buf, r: Rows) -> Vec<f32> {
    let mut v = vec![0f32; r.n * r.width];
    b.read(x, r, &mut v).expect("read (a kernel error shows here)");
    v
}
fn batch<B: Backend>(b: &B, meta: &BatchMeta) -> B::Batch {
    let mut h = b.alloc_batch(meta.len().max(1)).expect("alloc batch");
    b.upload_batch(meta, &mut h).expect("upload batch");
    h
}

/// Random weight of `ty` with GGML shape `shape`: (bytes, dequantised f32).
fn weight(r: &mut StdRng, ty: GgmlType, shape: &[usize], scale: f32) -> (Vec<u8>, Vec<f32>) {
    let n: usize = shape.iter().product();
    let v = randn(r, n, scale);
    let rows = n / shape[0];
    let mut bytes = vec![0u8; ty.row_bytes(shape[0]).expect("whole blocks") * rows];
    quant::quantize(ty, &v, &mut bytes).expect("quantize");
    let mut deq = vec![0f32; n];
    quant::dequantize(ty, &bytes, &mut deq).expect("dequantize");
    (bytes, deq)
}

fn td<'a>(name: &'a str, ty: GgmlType, shape: &'a [usize], data: &'a [u8]) -> TensorData<'a> {
    TensorData { name, dtype: ty, shape, data }
}

const ALL_TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

fn seq_meta(n: usize, start: u32, slot: u32, vocab: u32, r: &mut StdRng) -> Vec<TokenMeta> {
    (0..n).map(|i| TokenMeta { token: r.random_range(0..vocab), pos: start + i as u32, slot }).collect()
}

// ------------------------------------------------------------------------------------------

#[test]
fn elementwise_ops() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(1);
    let mut rep = Report::new("elementwise");
    for &n in &[1usize, 3, 64, 300] {
        for &w in &[7usize, 64, 2053] {
            // Strided views: rows of w inside rows of w + 5, starting at column 2.
            let stride = w + 5;
            let len = n * stride + 8;
            let a = randn(&mut r, len, 2.0);
            let bv = randn(&mut r, len, 1.0);
            let nw = randn(&mut r, w, 1.0);
            let view = Rows { off: 2, n, width: w, stride };
            let packed = Rows::packed(n, w);
            let (nwb, _) = (nw.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>(), ());
            let shape = [w];
            let wt = td("norm", GgmlType::F32, &shape, &nwb);
            let (gw, cw) = (g.upload_weight(&wt, WeightUse::Vector).unwrap(), c.upload_weight(&wt, WeightUse::Vector).unwrap());
            macro_rules! both {
                ($label:expr, $atol:expr, $rtol:expr, $outr:expr, $outlen:expr, $inplace:expr, |$b:ident, $x:ident, $y:ident, $o:ident, $wt:ident| $body:expr) => {{
                    let gx = buf(g, &a);
                    let gy = buf(g, &bv);
                    let go = g.alloc($outlen).unwrap();
                    poison(g, &go, $outlen);
                    let cx = buf(c, &a);
                    let cy = buf(c, &bv);
                    let co = c.alloc($outlen).unwrap();
                    poison(c, &co, $outlen);
                    {
                        let ($b, $x, $y, $o, $wt) = (g, &gx, &gy, &go, &gw);
                        $body;
                    }
                    {
                        let ($b, $x, $y, $o, $wt) = (c, &cx, &cy, &co, &cw);
                        $body;
                    }
                    let lab = format!("{} n={n} w={w}", $label);
                    let (gr, cr) = if $inplace { (&gx, &cx) } else { (&go, &co) };
                    rep.check(&lab, &get(g, gr, $outr), &get(c, cr, $outr), $atol, $rtol);
                }};
            }
            both!("rms_norm weighted strided->packed", 1e-5, 1e-5, packed, n * w, false, |b, x, _y, o, wt| b.rms_norm(x, view, Some(wt), 1e-6, o, packed));
            both!("rms_norm no weight", 1e-5, 1e-5, packed, n * w, false, |b, x, _y, o, _wt| b.rms_norm(x, view, None, 1e-5, o, packed));
            both!("rms_norm in place", 1e-5, 1e-5, view, len, true, |b, x, _y, _o, wt| b.rms_norm(x, view, Some(wt), 1e-6, x, view));
            both!("add strided", 0.0, 1e-6, packed, n * w, false, |b, x, y, o, _wt| b.add(x, view, y, view, o, packed));
            both!("add in place", 0.0, 1e-6, view, len, true, |b, x, y, _o, _wt| b.add(x, view, y, view, x, view));
            both!("scale", 0.0, 1e-6, view, len, true, |b, x, _y, _o, _wt| b.scale(x, view, -0.37));
            both!("swiglu", 1e-6, 1e-5, packed, n * w, false, |b, x, y, o, _wt| b.glu(Glu::SwiGlu, x, view, y, view, o, packed));
            both!("geglu-tanh in place", 1e-6, 1e-5, view, len, true, |b, x, y, _o, _wt| b.glu(Glu::GeGluTanh, x, view, y, view, x, view));
            both!("softcap", 1e-6, 1e-5, view, len, true, |b, x, _y, _o, _wt| b.softcap(x, view, 3.0));
            both!("copy strided->packed", 0.0, 0.0, packed, n * w, false, |b, x, _y, o, _wt| b.copy(x, view, o, packed));
        }
    }
    rep.finish();
}

#[test]
fn embed_all_types() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(2);
    let mut rep = Report::new("embed");
    for ty in ALL_TYPES {
        for &dim in &[256usize, 512] {
            let vocab = 37;
            let shape = [dim, vocab];
            let (bytes, _) = weight(&mut r, ty, &shape, 1.0);
            let t = td("tok", ty, &shape, &bytes);
            let (gw, cw) = (g.upload_weight(&t, WeightUse::Embedding).unwrap(), c.upload_weight(&t, WeightUse::Embedding).unwrap());
            for &n in &[1usize, 3, 64, 300] {
                let meta = BatchMeta { tokens: seq_meta(n, 0, 0, vocab as u32, &mut r), outputs: vec![], slot_len: 4096 };
                let o = Rows { off: 3, n, width: dim, stride: dim + 1 };
                let len = o.end();
                let (gb, cb) = (batch(g, &meta), batch(c, &meta));
                let (go, co) = (g.alloc(len).unwrap(), c.alloc(len).unwrap());
                poison(g, &go, len);
                poison(c, &co, len);
                g.embed(&gw, &gb, 1.5, &go, o);
                c.embed(&cw, &cb, 1.5, &co, o);
                rep.check(&format!("{} dim={dim} n={n}", ty.name()), &get(g, &go, o), &get(c, &co, o), 0.0, 1e-6);
            }
        }
    }
    // Float types with an odd width.
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        let (dim, vocab) = (45usize, 11usize);
        let shape = [dim, vocab];
        let (bytes, _) = weight(&mut r, ty, &shape, 1.0);
        let t = td("tok", ty, &shape, &bytes);
        let (gw, cw) = (g.upload_weight(&t, WeightUse::Embedding).unwrap(), c.upload_weight(&t, WeightUse::Embedding).unwrap());
        let meta = BatchMeta { tokens: seq_meta(5, 0, 0, vocab as u32, &mut r), outputs: vec![], slot_len: 64 };
        let o = Rows::packed(5, dim);
        let (gb, cb) = (batch(g, &meta), batch(c, &meta));
        let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
        poison(g, &go, o.end());
        poison(c, &co, o.end());
        g.embed(&gw, &gb, 1.0, &go, o);
        c.embed(&cw, &cb, 1.0, &co, o);
        rep.check(&format!("{} dim={dim} (odd)", ty.name()), &get(g, &go, o), &get(c, &co, o), 0.0, 0.0);
    }
    rep.finish();
}

/// f64 product of dequantised weight rows (`m` of `k`) with activation rows.
fn matmul_f64(w: &[f32], m: usize, k: usize, x: &[f32], xr: Rows) -> Vec<f32> {
    let mut out = vec![0f32; xr.n * m];
    for j in 0..xr.n {
        let xrow = &x[xr.off + j * xr.stride..][..k];
        for i in 0..m {
            out[j * m + i] = w[i * k..(i + 1) * k].iter().zip(xrow).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
        }
    }
    out
}

/// Tolerances (atol vs the CPU reference, atol vs the f64 product) for a weight type and a token
/// count: the CPU quantises activations to Q8 for quantised weights; the GPU rounds weights and
/// activations to bf16 above GEMV_MAX_TOKENS.
fn matmul_tol(ty: GgmlType, n_per_matrix: usize) -> (f64, f64) {
    let cublas_bf16 = n_per_matrix > ts_cuda::GEMV_MAX_TOKENS && ty != GgmlType::F32;
    // Q8_0 GEMV (dp4a) quantises activations to Q8_0 like the CPU (and llama.cpp) do.
    let q8_gemv = !cublas_bf16 && ty == GgmlType::Q8_0;
    let vs_exact = if cublas_bf16 { 2e-2 } else if q8_gemv { 5e-2 } else { 1e-4 };
    let vs_cpu = if is_float(ty) { if cublas_bf16 { 2e-2 } else { 1e-4 } } else { 6e-2 };
    (vs_cpu, vs_exact)
}

#[test]
fn matmul_all_types() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(3);
    let mut rep = Report::new("matmul");
    for ty in ALL_TYPES {
        let mut shapes = vec![(512usize, 97usize), (256, 320)];
        if is_float(ty) {
            shapes.push((45, 13)); // odd width
        }
        if ty == GgmlType::Q8_0 {
            // Short rows (8 lanes per row), a width that is not a whole number of 4-block groups
            // and a long row (the fast GEMV's shared-memory activations at 8 tokens).
            shapes.extend([(128, 40), (1408, 70), (10944, 24)]);
        }
        for (k, m) in shapes {
            let shape = [k, m];
            let (bytes, deq) = weight(&mut r, ty, &shape, 0.5);
            let t = td("w", ty, &shape, &bytes);
            let (gw, cw) = (g.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap());
            for &n in &[1usize, 2, 3, 8, 64, 300] {
                let xr = Rows { off: 1, n, width: k, stride: k + 3 };
                let x = randn(&mut r, xr.end(), 1.0);
                let o = Rows { off: 2, n, width: m, stride: m + 2 };
                let (gx, cx) = (buf(g, &x), buf(c, &x));
                let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
                poison(g, &go, o.end());
                poison(c, &co, o.end());
                g.matmul(&gx, xr, &gw, &go, o);
                c.matmul(&cx, xr, &cw, &co, o);
                let got = get(g, &go, o);
                let (tc, te) = matmul_tol(ty, n);
                rep.check(&format!("{} {k}x{m} n={n} vs cpu", ty.name()), &got, &get(c, &co, o), tc, 1e-3);
                rep.check(&format!("{} {k}x{m} n={n} vs f64", ty.name()), &got, &matmul_f64(&deq, m, k, &x, xr), te, 1e-4);
            }
        }
    }
    rep.finish();
}

/// F32 weights with 16-byte aligned activation rows: the split-K GEMV (the MoE router's path).
#[test]
fn matmul_f32_aligned_rows() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(10);
    let mut rep = Report::new("matmul_f32_aligned");
    for (k, m) in [(2048usize, 64usize), (512, 97), (128, 3)] {
        let shape = [k, m];
        let (bytes, deq) = weight(&mut r, GgmlType::F32, &shape, 0.5);
        let t = td("w", GgmlType::F32, &shape, &bytes);
        let (gw, cw) = (g.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap());
        for &n in &[1usize, 3, 8] {
            let xr = Rows { off: 4, n, width: k, stride: k + 4 };
            let x = randn(&mut r, xr.end(), 1.0);
            let o = Rows { off: 2, n, width: m, stride: m + 2 };
            let (gx, cx) = (buf(g, &x), buf(c, &x));
            let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
            poison(g, &go, o.end());
            poison(c, &co, o.end());
            g.matmul(&gx, xr, &gw, &go, o);
            c.matmul(&cx, xr, &cw, &co, o);
            let got = get(g, &go, o);
            rep.check(&format!("F32 {k}x{m} n={n} vs cpu"), &got, &get(c, &co, o), 1e-4, 1e-3);
            rep.check(&format!("F32 {k}x{m} n={n} vs f64"), &got, &matmul_f64(&deq, m, k, &x, xr), 1e-4, 1e-4);
        }
    }
    rep.finish();
}

#[test]
fn matmul_grouped_types() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(4);
    let mut rep = Report::new("matmul_grouped");
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F16, GgmlType::F32, GgmlType::BF16, GgmlType::Q6K] {
        let (k, m, gr) = (256usize, 64usize, 4usize);
        let shape = [k, m, gr];
        let (bytes, deq) = weight(&mut r, ty, &shape, 0.5);
        let t = td("wg", ty, &shape, &bytes);
        let (gw, cw) = (g.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap());
        for &ntok in &[1usize, 3, 64] {
            let n = ntok * gr;
            let xr = Rows::packed(n, k);
            let x = randn(&mut r, xr.end(), 1.0);
            let o = Rows::packed(n, m);
            let (gx, cx) = (buf(g, &x), buf(c, &x));
            let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
            poison(g, &go, o.end());
            poison(c, &co, o.end());
            g.matmul_grouped(&gx, xr, &gw, &go, o);
            c.matmul_grouped(&cx, xr, &cw, &co, o);
            let got = get(g, &go, o);
            // f64 reference: row j uses matrix j % gr.
            let mut exact = vec![0f32; n * m];
            for j in 0..n {
                let h = j % gr;
                let one = matmul_f64(&deq[h * m * k..(h + 1) * m * k], m, k, &x, Rows { off: j * k, n: 1, width: k, stride: k });
                exact[j * m..(j + 1) * m].copy_from_slice(&one);
            }
            let (tc, te) = matmul_tol(ty, ntok);
            rep.check(&format!("{} [{k},{m},{gr}] tokens={ntok} vs cpu", ty.name()), &got, &get(c, &co, o), tc, 1e-3);
            rep.check(&format!("{} [{k},{m},{gr}] tokens={ntok} vs f64", ty.name()), &got, &exact, te, 1e-4);
        }
    }
    rep.finish();
}

#[test]
fn rope_modes() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(5);
    let mut rep = Report::new("rope");
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        for &(dim, width) in &[(64usize, 64usize), (32, 80)] {
            let freqs: Vec<f32> = (0..dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / dim as f32)).collect();
            let spec = RopeSpec { mode, dim, freqs, mscale: 0.93 };
            let (gr, cr) = (g.upload_rope(&spec).unwrap(), c.upload_rope(&spec).unwrap());
            for &n in &[1usize, 3, 64, 300] {
                let heads = 4;
                let mut toks = seq_meta(n / 2, r.random_range(0..3000), 0, 100, &mut r);
                toks.extend(seq_meta(n - n / 2, r.random_range(0..3000), 1, 100, &mut r));
                let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len: 8192 };
                let xr = Rows { off: 5, n: n * heads, width, stride: width + 16 };
                let x = randn(&mut r, xr.end(), 1.0);
                let (gx, cx) = (buf(g, &x), buf(c, &x));
                let (gb, cb) = (batch(g, &meta), batch(c, &meta));
                g.rope(&gx, xr, heads, &gb, &gr);
                c.rope(&cx, xr, heads, &cb, &cr);
                let full = Rows::packed(1, xr.end());
                rep.check(&format!("{mode:?} dim={dim} width={width} n={n}"), &get(g, &gx, full), &get(c, &cx, full), 1e-5, 1e-4);
            }
        }
    }
    rep.finish();
}

/// A cache of `slots * slot_len` rows filled through `cache_write` from random rows (same on both).
fn fill_cache<B: Backend>(b: &B, cache: &B::Cache, rows: &[f32], width: usize, toks: &[TokenMeta], slot_len: u32) {
    let meta = BatchMeta { tokens: toks.to_vec(), outputs: vec![], slot_len };
    let bb = batch(b, &meta);
    let src = buf(b, rows);
    b.cache_write(cache, &src, Rows::packed(toks.len(), width), &bb);
}

#[test]
fn cache_write_and_attention() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(6);
    let mut rep = Report::new("attention");
    let slot_len = 2048u32;
    let slots = 3usize;
    // (n_heads, n_kv_heads, head_dim, v_dim, window, softcap)
    let cases: &[(usize, usize, usize, usize, Option<u32>, Option<f32>)] = &[
        (8, 2, 64, 64, None, None),
        (4, 4, 128, 128, None, None),
        (6, 1, 256, 256, Some(16), Some(30.0)),
        (8, 4, 80, 48, Some(100), None),
        (2, 1, 192, 128, None, Some(50.0)),
    ];
    for &(nh, nkv, hd, vd, window, softcap) in cases {
        for &n in &[1usize, 3, 64, 300] {
            let (kw, vw) = (nkv * hd, nkv * vd);
            // Two sequences: slot 2 with a long history, slot 0 with a short one; the batch holds
            // each sequence's next tokens (history already cached, the batch's own rows written now).
            let hist = [r.random_range(0..1500u32), r.random_range(0..40u32)];
            let n0 = n.div_ceil(2);
            let mut toks = seq_meta(n0, hist[0], 2, 100, &mut r);
            toks.extend(seq_meta(n - n0, hist[1], 0, 100, &mut r));
            let mut prior: Vec<TokenMeta> = (0..hist[0]).map(|p| TokenMeta { token: 0, pos: p, slot: 2 }).collect();
            prior.extend((0..hist[1]).map(|p| TokenMeta { token: 0, pos: p, slot: 0 }));
            let all: Vec<TokenMeta> = prior.iter().chain(toks.iter()).copied().collect();
            let kr = randn(&mut r, all.len() * kw, 1.0);
            let vr = randn(&mut r, all.len() * vw, 1.0);
            let rows = slots * slot_len as usize;
            let (gk, gv) = (g.alloc_cache(rows, kw).unwrap(), g.alloc_cache(rows, vw).unwrap());
            let (ck, cv) = (c.alloc_cache(rows, kw).unwrap(), c.alloc_cache(rows, vw).unwrap());
            if !all.is_empty() {
                fill_cache(g, &gk, &kr, kw, &all, slot_len);
                fill_cache(g, &gv, &vr, vw, &all, slot_len);
                fill_cache(c, &ck, &kr, kw, &all, slot_len);
                fill_cache(c, &cv, &vr, vw, &all, slot_len);
            }
            let meta = BatchMeta { tokens: toks.clone(), outputs: vec![], slot_len };
            let (gb, cb) = (batch(g, &meta), batch(c, &meta));
            let qr = Rows { off: 4, n, width: nh * hd, stride: nh * hd + 4 };
            let q = randn(&mut r, qr.end(), 1.0);
            let o = Rows { off: 1, n, width: nh * vd, stride: nh * vd + 3 };
            let (gq, cq) = (buf(g, &q), buf(c, &q));
            let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
            poison(g, &go, o.end());
            poison(c, &co, o.end());
            let p = AttnParams { n_heads: nh, n_kv_heads: nkv, head_dim: hd, v_dim: vd, scale: 1.0 / (hd as f32).sqrt(), window, softcap };
            g.attention(&gq, qr, &gk, &gv, &gb, &p, &go, o);
            c.attention(&cq, qr, &ck, &cv, &cb, &p, &co, o);
            let label = format!("h={nh}/{nkv} hd={hd} vd={vd} win={window:?} cap={softcap:?} n={n} hist={hist:?}");
            rep.check(&label, &get(g, &go, o), &get(c, &co, o), 2e-5, 1e-4);
        }
    }
    rep.finish();
}

#[test]
fn mla_attention_latent_cache() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(7);
    let mut rep = Report::new("mla_attention");
    let slot_len = 4096u32;
    for &(nh, kl, rd) in &[(16usize, 512usize, 64usize), (4, 128, 32)] {
        let w = kl + rd;
        for &n in &[1usize, 3, 64, 300] {
            // Decode sizes also with long histories: the split kernel then runs several tiles per split.
            let long = if n <= 3 { r.random_range(2000..4000u32) } else { r.random_range(0..700u32) };
            let hist = [long, r.random_range(0..20u32)];
            let n0 = n.div_ceil(2);
            let mut toks = seq_meta(n0, hist[0], 1, 100, &mut r);
            toks.extend(seq_meta(n - n0, hist[1], 0, 100, &mut r));
            let mut all: Vec<TokenMeta> = (0..hist[0]).map(|p| TokenMeta { token: 0, pos: p, slot: 1 }).collect();
            all.extend((0..hist[1]).map(|p| TokenMeta { token: 0, pos: p, slot: 0 }));
            all.extend(toks.iter().copied());
            let rows_data = randn(&mut r, all.len() * w, 1.0);
            let rows = 2 * slot_len as usize;
            let (gc, cc) = (g.alloc_cache(rows, w).unwrap(), c.alloc_cache(rows, w).unwrap());
            fill_cache(g, &gc, &rows_data, w, &all, slot_len);
            fill_cache(c, &cc, &rows_data, w, &all, slot_len);
            let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len };
            let (gb, cb) = (batch(g, &meta), batch(c, &meta));
            let qr = Rows { off: 0, n: n * nh, width: w, stride: w + 8 };
            let q = randn(&mut r, qr.end(), 0.5);
            let o = Rows::packed(n * nh, kl);
            let (gq, cq) = (buf(g, &q), buf(c, &q));
            let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
            poison(g, &go, o.end());
            poison(c, &co, o.end());
            let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
            g.mla_attention(&gq, qr, &gc, &gb, &p, &go, o);
            c.mla_attention(&cq, qr, &cc, &cb, &p, &co, o);
            rep.check(&format!("heads={nh} kv_lora={kl} rope={rd} n={n} hist={hist:?}"), &get(g, &go, o), &get(c, &co, o), 2e-5, 1e-4);
        }
    }
    rep.finish();
}

/// f64 MoE with the CPU's routing (`ts_cpu::route`) and dequantised expert weights.
fn moe_f64(x: &[f32], xr: Rows, lg: &[f32], lr: Rows, w: [&[f32]; 3], hdim: usize, ff: usize, p: &MoeParams) -> Vec<f32> {
    let mut out = vec![0f32; xr.n * hdim];
    let mut sel = Vec::new();
    for t in 0..xr.n {
        ts_cpu::route(&lg[lr.off + t * lr.stride..][..lr.width], p, &mut sel);
        let xv = &x[xr.off + t * xr.stride..][..hdim];
        let mut acc = vec![0f64; hdim];
        for &(e, wt) in &sel {
            let (gm, um) = (&w[0][e * ff * hdim..(e + 1) * ff * hdim], &w[1][e * ff * hdim..(e + 1) * ff * hdim]);
            let dm = &w[2][e * hdim * ff..(e + 1) * hdim * ff];
            let h: Vec<f64> = (0..ff)
                .map(|i| {
                    let gv: f64 = gm[i * hdim..(i + 1) * hdim].iter().zip(xv).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let uv: f64 = um[i * hdim..(i + 1) * hdim].iter().zip(xv).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let act = match p.glu {
                        Glu::SwiGlu => gv / (1.0 + (-gv).exp()),
                        Glu::GeGluTanh => 0.5 * gv * (1.0 + (0.7978845608028654 * (gv + 0.044715 * gv * gv * gv)).tanh()),
                    };
                    act * uv
                })
                .collect();
            for (j, a) in acc.iter_mut().enumerate() {
                let y: f64 = dm[j * ff..(j + 1) * ff].iter().zip(&h).map(|(&a, &b)| a as f64 * b).sum();
                *a += wt as f64 * y;
            }
        }
        for j in 0..hdim {
            out[t * hdim + j] = acc[j] as f32;
        }
    }
    out
}

#[test]
fn moe_routing_and_experts() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(8);
    let mut rep = Report::new("moe");
    let (hdim, ff, ne) = (256usize, 512usize, 16usize);
    let configs = [
        (Gating::Softmax, false, 1.0f32, 1usize, 1usize, 4usize, Glu::SwiGlu),
        (Gating::Sigmoid, true, 2.5, 4, 2, 3, Glu::SwiGlu),
        (Gating::Softmax, true, 1.0, 8, 3, 6, Glu::GeGluTanh),
    ];
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::F16, GgmlType::BF16] {
        let gs = [hdim, ff, ne];
        let ds = [ff, hdim, ne];
        let (gbytes, gdq) = weight(&mut r, ty, &gs, 0.3);
        let (ubytes, udq) = weight(&mut r, ty, &gs, 0.3);
        let (dbytes, ddq) = weight(&mut r, ty, &ds, 0.3);
        let (tg, tu, tdn) = (td("g", ty, &gs, &gbytes), td("u", ty, &gs, &ubytes), td("d", ty, &ds, &dbytes));
        let gw = [g.upload_weight(&tg, WeightUse::Matmul).unwrap(), g.upload_weight(&tu, WeightUse::Matmul).unwrap(), g.upload_weight(&tdn, WeightUse::Matmul).unwrap()];
        let cw = [c.upload_weight(&tg, WeightUse::Matmul).unwrap(), c.upload_weight(&tu, WeightUse::Matmul).unwrap(), c.upload_weight(&tdn, WeightUse::Matmul).unwrap()];
        for (ci, &(gating, norm_topk, scale, n_group, topk_group, k, glu)) in configs.iter().enumerate() {
            let p = MoeParams { n_experts: ne, k, gating, norm_topk, scale, n_group, topk_group, glu };
            for &n in &[1usize, 3, 64, 300] {
                let xr = Rows { off: 2, n, width: hdim, stride: hdim + 2 };
                let x = randn(&mut r, xr.end(), 1.0);
                let lr = Rows::packed(n, ne);
                let lg = randn(&mut r, lr.end(), 2.0);
                let o = Rows { off: 1, n, width: hdim, stride: hdim + 1 };
                let (gx, cx, gl, cl) = (buf(g, &x), buf(c, &x), buf(g, &lg), buf(c, &lg));
                let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
                poison(g, &go, o.end());
                poison(c, &co, o.end());
                g.moe(&gx, xr, &gl, lr, Experts { gate: &gw[0], up: &gw[1], down: &gw[2] }, &p, &go, o);
                c.moe(&cx, xr, &cl, lr, Experts { gate: &cw[0], up: &cw[1], down: &cw[2] }, &p, &co, o);
                let got = get(g, &go, o);
                // vs CPU: for quantised weights the CPU quantises both the input and the GLU output
                // (heavy-tailed; Q8_K uses one scale per 256) to 8 bits, which alone moves outputs
                // by up to ~12% of their rms; the f64 check below is the tight one.
                let atol = if is_float(ty) { 1e-4 } else { 0.25 };
                let label = format!("{} cfg{ci} ({gating:?} k={k} groups={n_group}/{topk_group}) n={n}", ty.name());
                rep.check(&format!("{label} vs cpu"), &got, &get(c, &co, o), atol, 1e-3);
                let exact = moe_f64(&x, xr, &lg, lr, [&gdq, &udq, &ddq], hdim, ff, &p);
                // Q8_0 decode (fast path) quantises the input and the GLU output to Q8_0.
                let q8_fast = ty == GgmlType::Q8_0 && n <= ts_cuda::GEMV_MAX_TOKENS;
                rep.check(&format!("{label} vs f64"), &got, &exact, if q8_fast { 5e-2 } else { 1e-4 }, 1e-4);
            }
        }
    }
    rep.finish();
}

/// A recorded step (graph_begin / graph_end) gives the same results as eager ops when replayed
/// with new inputs: eager the first time, captured the second, replayed after.
#[test]
fn recorded_steps_replay() {
    if gpu().is_none() {
        return;
    }
    // A backend of its own (its own stream): a capture must not see other tests' work.
    let g = &CudaBackend::new(0).expect("second backend");
    let c = cpu();
    let mut r = rng(9);
    let mut rep = Report::new("graph");
    let (k, m) = (512usize, 96usize);
    let (bytes, _) = weight(&mut r, GgmlType::Q8_0, &[k, m], 0.5);
    let shape = [k, m];
    let t = td("w", GgmlType::Q8_0, &shape, &bytes);
    let (gw, cw) = (g.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap());
    let xr = Rows::packed(1, k);
    let o = Rows::packed(1, m);
    let (gx, cx) = (g.alloc(k).unwrap(), c.alloc(k).unwrap());
    let (gh, ch) = (g.alloc(k).unwrap(), c.alloc(k).unwrap());
    let (go, co) = (g.alloc(m).unwrap(), c.alloc(m).unwrap());
    let key = 0x5eed_u64 ^ r.random::<u64>();
    for step in 0..4 {
        let x = randn(&mut r, k, 1.0);
        g.write(&gx, 0, &x).unwrap();
        c.write(&cx, 0, &x).unwrap();
        poison(g, &go, m);
        poison(c, &co, m);
        let run_g = || {
            g.rms_norm(&gx, xr, None, 1e-6, &gh, xr);
            g.matmul(&gh, xr, &gw, &go, o);
        };
        if !g.graph_begin(key, 1) {
            run_g();
            if !g.graph_end() {
                run_g();
            }
        }
        c.rms_norm(&cx, xr, None, 1e-6, &ch, xr);
        c.matmul(&ch, xr, &cw, &co, o);
        rep.check(&format!("step {step}"), &get(g, &go, o), &get(c, &co, o), 6e-2, 1e-3);
    }
    rep.finish();
}

#[test]
fn memory_errors_and_info() {
    let Some(g) = gpu() else { return };
    let (free, total) = g.memory_info().expect("memory info");
    assert!(free > 0 && free <= total, "free {free} total {total}");
    match g.alloc(1 << 42) {
        Err(BackendError::OutOfMemory { what, .. }) => eprintln!("  OOM reported as expected: {what}"),
        Err(e) => panic!("a 16 TiB allocation gave {e}, not OutOfMemory"),
        Ok(_) => panic!("a 16 TiB allocation succeeded"),
    }
    // The backend stays usable after the failed allocation.
    let b = g.alloc(10).unwrap();
    g.write(&b, 0, &[1.0; 10]).unwrap();
    g.scale(&b, Rows::packed(1, 10), 2.0);
    assert_eq!(get(g, &b, Rows::packed(1, 10)), vec![2.0; 10]);
    assert!(CudaBackend::new(1000).is_err(), "device 1000 must be an error, not a panic");
}

/// Rough timings (not a correctness check): `cargo test --release -p ts-cuda -- --ignored bench`.
/// Wall clock around 50 back-to-back launches, synchronised; launch overhead included.
#[test]
#[ignore]
fn bench_matmul() {
    let Some(g) = gpu() else { return };
    let mut r = rng(9);
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::BF16] {
        for &(k, m) in &[(2048usize, 10944usize), (2048, 102400)] {
            let shape = [k, m];
            let n_el = k * m;
            // Random bytes quantised from a small random row pattern repeated (fast to make).
            let row = randn(&mut r, k * 64, 0.5);
            let mut bytes = vec![0u8; ty.row_bytes(k).unwrap() * 64];
            quant::quantize(ty, &row, &mut bytes).unwrap();
            let bytes: Vec<u8> = bytes.iter().copied().cycle().take(ty.row_bytes(k).unwrap() * m).collect();
            let w = g.upload_weight(&td("w", ty, &shape, &bytes), WeightUse::Matmul).unwrap();
            for &n in &[1usize, 8, 512] {
                let x = buf(g, &randn(&mut r, n * k, 1.0));
                let o = g.alloc(n * m).unwrap();
                g.matmul(&x, Rows::packed(n, k), &w, &o, Rows::packed(n, m));
                g.synchronize().unwrap();
                let reps = 50;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    g.matmul(&x, Rows::packed(n, k), &w, &o, Rows::packed(n, m));
                }
                g.synchronize().unwrap();
                let us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;
                let gbs = w.bytes() as f64 / (us * 1e-6) / 1e9;
                let tflops = 2.0 * n as f64 * n_el as f64 / (us * 1e-6) / 1e12;
                eprintln!("  bench matmul {:<5} {k}x{m} n={n:<4} {us:>9.1} us  {gbs:>7.0} GB/s of weights  {tflops:>6.1} TFLOP/s", ty.name());
            }
        }
    }
}
