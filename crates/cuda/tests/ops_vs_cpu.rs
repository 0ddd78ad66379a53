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
use ts_cpu::{CpuBackend, CpuWeight};
use ts_cuda::{CudaBackend, CudaBatch, CudaBuf, CudaRope, CudaWeight, Path, MLA_LONG_DEFAULT};
use ts_formats::quant;

static GPU: OnceLock<Option<CudaBackend>> = OnceLock::new();
static CPU: OnceLock<CpuBackend> = OnceLock::new();
static SEED: OnceLock<u64> = OnceLock::new();

fn gpu() -> Option<&'static CudaBackend> {
    GPU.get_or_init(|| match CudaBackend::new(0) {
        Ok(b) => {
            let (arch, cached) = b.kernel_build();
            let (free, total) = b.memory_info().unwrap_or((0, 0));
            eprintln!(
                "GPU: {} ({arch}, kernels {}), {} MiB free of {} MiB",
                b.name(),
                if cached { "from the disk cache" } else { "compiled by NVRTC" },
                free >> 20,
                total >> 20
            );
            Some(b)
        }
        Err(e) => {
            eprintln!("\n*** SKIP: no CUDA device ({e}) ***\n");
            None
        }
    })
    .as_ref()
}

/// The shared backend when its GPU has the tensor cores a test needs; else None, with a line
/// saying that `name` was skipped.
fn tc_gpu(name: &str) -> Option<&'static CudaBackend> {
    let g = gpu()?;
    if !g.tensor_cores() {
        eprintln!("{name}: no tensor cores, skipped");
        return None;
    }
    Some(g)
}

/// The shared GPU backend when it has int8 tensor cores and the fused kernels; else None, with a
/// line saying that `test` was skipped.
fn gpu_tc_fused(test: &str) -> Option<&'static CudaBackend> {
    let g = gpu()?;
    if !g.tensor_cores() || !g.fused() {
        eprintln!("{test}: no tensor cores or fused kernels, skipped");
        return None;
    }
    Some(g)
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
            let ratio = if !(g.is_finite() && w.is_finite()) {
                f64::INFINITY
            } else if d == 0.0 {
                0.0
            } else {
                d / allowed
            };
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
            if bad > 0 {
                format!("  FAIL ({bad} bad, e.g. [{worst_i}] gpu {} cpu {})", got[worst_i], want[worst_i])
            } else {
                String::new()
            }
        );
        if bad > 0 {
            self.failures
                .push(format!("{label}: {bad} elements out of tolerance, e.g. [{worst_i}] gpu {} vs {}", got[worst_i], want[worst_i]));
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
    TensorData { name, dtype: ty, shape, data, keep: None }
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
    for &n in &[1usize, 3, 64, 300, 600] {
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
            both!("rms_norm weighted strided->packed", 1e-5, 1e-5, packed, n * w, false, |b, x, _y, o, wt| b.rms_norm(
                x,
                view,
                Some(wt),
                1e-6,
                o,
                packed
            ));
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

/// The greedy pick on the device equals `ts_core::argmax` of the same rows (the CPU backend's),
/// id for id: random rows, rows whose maximum repeats (ties to the lowest index), NaN, ±0, ±inf,
/// strided views, vocabulary-sized rows.
#[test]
fn argmax_rows_exact() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(21);
    let mut cases = 0;
    // (rows, width, aligned): aligned views have row starts and strides that are multiples of
    // 4 values, as the model's logit rows do; the others start and step off that grid.
    let shapes = [(1usize, 7usize, false), (3, 1024, false), (5, 1025, false), (64, 102_400, false), (17, 262_144, false), (2, 1, false)];
    let aligned =
        [(64usize, 102_400usize, true), (9, 8_196, true), (8, 12, true), (1, 102_400, true), (3, 1_028, true), (128, 4_096, true)];
    for &(n, w, al) in shapes.iter().chain(aligned.iter()) {
        let (off, stride) = if al { (4, w + 4 * (n % 2)) } else { (2, w + 3) };
        let len = n * stride + 5;
        let mut a = randn(&mut r, len, 3.0);
        // Salt: quantised values make exact ties common; a few specials per row.
        for v in a.iter_mut() {
            *v = (*v * 4.0).round() / 4.0;
        }
        for j in 0..n {
            let row = &mut a[off + j * stride..off + j * stride + w];
            match j % 5 {
                0 => row[r.random_range(0..w)] = f32::NAN,
                1 => row.iter_mut().for_each(|v| *v = if *v > 0.0 { -0.0 } else { *v }),
                2 => row[r.random_range(0..w)] = f32::INFINITY,
                3 => row.iter_mut().for_each(|v| *v = f32::NAN),
                _ => {
                    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let k = r.random_range(0..w);
                    row[k] = m;
                }
            }
        }
        let view = Rows { off, n, width: w, stride };
        let (gx, cx) = (buf(g, &a), buf(c, &a));
        let (mut gi, mut ci) = (vec![u32::MAX; n], vec![u32::MAX; n]);
        g.argmax_rows(&gx, view, &mut gi).expect("gpu argmax");
        c.argmax_rows(&cx, view, &mut ci).expect("cpu argmax");
        assert_eq!(gi, ci, "argmax of {n} rows of {w} (aligned: {al})");
        for j in 0..n {
            assert_eq!(ci[j], ts_core::argmax(&a[off + j * stride..off + j * stride + w]));
        }
        cases += n;
    }
    eprintln!("argmax_rows: {cases} rows identical");
}

/// Chained steps (`argmax_rows_queued`, `argmax_collect`, `TOKEN_FROM_ARGMAX` tokens): a batch
/// uploaded after a queued arg-max embeds that arg-max's ids, taken on the device (out of row
/// order, in runs, beside plain ids), exactly as the CPU twin does with the same logits; the
/// collected ids are `ts_core::argmax` of the rows, oldest first, with two pending at a time; a
/// third pending, a collect of nothing and a row past the last arg-max are errors.
#[test]
fn chained_argmax_tokens() {
    if gpu().is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("second backend");
    let c = &ts_cpu::CpuBackend::new(Some(1)).expect("cpu twin");
    let mut r = rng(61);
    let (dim, vocab, n) = (64usize, 5000usize, 6usize);
    let shape = [dim, vocab];
    let (bytes, _) = weight(&mut r, GgmlType::F32, &shape, 1.0);
    let t = td("tok", GgmlType::F32, &shape, &bytes);
    let (gw, cw) = (g.upload_weight(&t, WeightUse::Embedding).unwrap(), c.upload_weight(&t, WeightUse::Embedding).unwrap());
    let xr = Rows { off: 1, n, width: vocab, stride: vocab + 2 };
    let (gx, cx) = (g.alloc(xr.end()).unwrap(), c.alloc(xr.end()).unwrap());
    let (mut gb, mut cb) = (g.alloc_batch(8).unwrap(), c.alloc_batch(8).unwrap());
    let o = Rows::packed(8, dim);
    let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
    let mut want: std::collections::VecDeque<Vec<u32>> = Default::default();
    let mut ok = 0;
    for round in 0..6 {
        let a = randn(&mut r, xr.end(), 2.0);
        g.write(&gx, 0, &a).unwrap();
        c.write(&cx, 0, &a).unwrap();
        g.argmax_rows_queued(&gx, xr).expect("gpu queued arg-max");
        c.argmax_rows_queued(&cx, xr).expect("cpu queued arg-max");
        let ids: Vec<u32> = (0..n).map(|j| ts_core::argmax(&a[xr.off + j * xr.stride..][..vocab])).collect();
        // Tokens: rows 5, 4 (a run backwards: two copies), 0, 1, 2 (one run), a plain id, row 3.
        let rows = [5u32, 4, 0, 1, 2, u32::MAX, 3, (round % n) as u32];
        let tokens: Vec<TokenMeta> = rows
            .iter()
            .enumerate()
            .map(|(i, &row)| TokenMeta { token: if row == u32::MAX { 17 } else { TOKEN_FROM_ARGMAX + row }, pos: i as u32, slot: 0 })
            .collect();
        let meta = BatchMeta { tokens, outputs: vec![], slot_len: 64 };
        g.upload_batch(&meta, &mut gb).expect("gpu batch");
        c.upload_batch(&meta, &mut cb).expect("cpu batch");
        poison(g, &go, o.end());
        g.embed(&gw, &gb, 1.0, &go, o);
        c.embed(&cw, &cb, 1.0, &co, o);
        let (ge, ce) = (get(g, &go, o), get(c, &co, o));
        assert_eq!(ge, ce, "round {round}: embedded rows of the chained tokens");
        for (i, &row) in rows.iter().enumerate() {
            let id = if row == u32::MAX { 17 } else { ids[row as usize] } as usize;
            let table: Vec<f32> =
                bytes[4 * dim * id..4 * dim * (id + 1)].chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert_eq!(&ge[i * dim..(i + 1) * dim], &table[..], "round {round} token {i}: not the embedding of id {id}");
        }
        want.push_back(ids);
        // Two pending: a third is refused; then the oldest comes back.
        if want.len() == 2 {
            assert!(g.argmax_rows_queued(&gx, xr).is_err(), "a third pending arg-max");
            let (mut gi, mut ci) = (vec![0u32; n], vec![0u32; n]);
            g.argmax_collect(&mut gi).expect("gpu collect");
            c.argmax_collect(&mut ci).expect("cpu collect");
            let w = want.pop_front().unwrap();
            assert_eq!((&gi, &ci), (&w, &w), "round {round}: collected ids");
            ok += 1;
        }
    }
    while let Some(w) = want.pop_front() {
        let mut gi = vec![0u32; n];
        g.argmax_collect(&mut gi).expect("gpu collect");
        assert_eq!(gi, w);
        let mut ci = vec![0u32; n];
        c.argmax_collect(&mut ci).expect("cpu collect");
        ok += 1;
    }
    // One-token batches (the chained decode step), uploaded and then written by batch_fill_1
    // (a fresh backend for the second, so its arg-max slots are mapped memory): a pick of the
    // queued arg-max, then a plain id, then a pick of a synchronous arg-max.
    let o1 = Rows::packed(1, dim);
    let row_of = |id: usize| -> Vec<f32> {
        bytes[4 * dim * id..4 * dim * (id + 1)].chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    };
    let gf = &CudaBackend::new(0).expect("third backend");
    gf.set_batch_fill(true);
    let gfw = gf.upload_weight(&t, WeightUse::Embedding).unwrap();
    let (gfx, gfo, mut gfb) = (gf.alloc(xr.end()).unwrap(), gf.alloc(o.end()).unwrap(), gf.alloc_batch(8).unwrap());
    for step in 0..6 {
        let (g, gx, go, gw, gb) = if step < 3 { (g, &gx, &go, &gw, &mut gb) } else { (gf, &gfx, &gfo, &gfw, &mut gfb) };
        let step = step % 3;
        let a = randn(&mut r, xr.end(), 2.0);
        g.write(gx, 0, &a).unwrap();
        let ids: Vec<u32> = (0..n).map(|j| ts_core::argmax(&a[xr.off + j * xr.stride..][..vocab])).collect();
        let mut got = vec![0u32; n];
        if step == 2 {
            g.argmax_rows(gx, xr, &mut got).expect("gpu arg-max");
        } else {
            g.argmax_rows_queued(gx, xr).expect("gpu queued arg-max");
        }
        for (token, want) in [(TOKEN_FROM_ARGMAX + 2, ids[2] as usize), (17, 17)] {
            let meta = BatchMeta { tokens: vec![TokenMeta { token, pos: 3, slot: 0 }], outputs: vec![0], slot_len: 64 };
            g.upload_batch(&meta, gb).expect("one-token batch");
            poison(g, go, o1.end());
            g.embed(gw, gb, 1.0, go, o1);
            assert_eq!(get(g, go, o1), row_of(want), "one-token step {step}, token {token:#x}");
        }
        if step < 2 {
            g.argmax_collect(&mut got).expect("gpu collect");
        }
        assert_eq!(got, ids, "one-token step {step}: ids");
        ok += 1;
    }
    assert!(g.argmax_collect(&mut [0u32; 6]).is_err(), "a collect of nothing");
    let past =
        BatchMeta { tokens: vec![TokenMeta { token: TOKEN_FROM_ARGMAX + n as u32, pos: 0, slot: 0 }], outputs: vec![], slot_len: 64 };
    assert!(g.upload_batch(&past, &mut gb).is_err(), "a row past the last arg-max");
    eprintln!("chained_argmax_tokens: {ok} collects, every embedded row exact");
}

/// `gather_outputs` copies the batch's output rows (indices uploaded with the batch) exactly, for
/// any order, repeats and strided views.
#[test]
fn gather_outputs_exact() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(23);
    for &(n, w) in &[(1usize, 7usize), (9, 2048), (64, 576), (300, 33)] {
        let xr = Rows { off: 3, n, width: w, stride: w + 5 };
        let x = randn(&mut r, xr.end(), 1.0);
        // Unique rows, at most one per token (what a batch can hold), the last first, so the
        // order is not the tokens' order.
        let mut outputs = vec![n as u32 - 1];
        outputs.extend((0..n as u32 - 1).filter(|&t| t == 0 || r.random_bool(0.5)));
        let meta = BatchMeta { tokens: seq_meta(n, 0, 0, 100, &mut r), outputs, slot_len: 4096 };
        let o = Rows { off: 1, n: meta.outputs.len(), width: w, stride: w + 2 };
        let (gb, cb) = (batch(g, &meta), batch(c, &meta));
        let (gx, cx) = (buf(g, &x), buf(c, &x));
        let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
        poison(g, &go, o.end());
        poison(c, &co, o.end());
        g.gather_outputs(&gx, xr, &gb, &go, o);
        c.gather_outputs(&cx, xr, &cb, &co, o);
        let (got, want) = (get(g, &go, o), get(c, &co, o));
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "gather of {} rows of {w}", o.n);
        for (i, &t) in meta.outputs.iter().enumerate() {
            assert_eq!(&want[i * w..(i + 1) * w], &x[xr.off + t as usize * xr.stride..][..w]);
        }
    }
    eprintln!("gather_outputs: exact");
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
            for &n in &[1usize, 3, 64, 300, 600] {
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
    // Above GEMV_MAX_TOKENS, Q8_0 goes to the int8 tensor cores (activations quantised as in
    // the GEMV) unless mmq is off; the other types to cuBLAS on bf16.
    let mmq = gpu().is_some_and(|g| g.tensor_cores()) && ty == GgmlType::Q8_0;
    let cublas_bf16 = n_per_matrix > ts_cuda::GEMV_MAX_TOKENS && ty != GgmlType::F32 && !mmq;
    // Q8_0 GEMV (dp4a) quantises activations to Q8_0 like the CPU (and llama.cpp) do.
    let q8_gemv = !cublas_bf16 && ty == GgmlType::Q8_0;
    let vs_exact = if cublas_bf16 {
        2e-2
    } else if q8_gemv {
        5e-2
    } else {
        1e-4
    };
    let vs_cpu = if is_float(ty) {
        if cublas_bf16 {
            2e-2
        } else {
            1e-4
        }
    } else {
        6e-2
    };
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
            for &n in &[1usize, 2, 3, 8, 12, 64, 300] {
                // 1, 3 and 8 tokens with 16-byte aligned activation rows (f16/bf16 then take the
                // vector GEMV, gemv_h16), the others misaligned (the generic GEMV).
                let aligned = (n % 2 == 1 || n == 8) && k % 4 == 0;
                let xr = if aligned { Rows { off: 4, n, width: k, stride: k + 4 } } else { Rows { off: 1, n, width: k, stride: k + 3 } };
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
        for &ntok in &[1usize, 3, 12, 64] {
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

/// One random Q8_0 product of `ntok` tokens (per matrix of `gr`; `matmul_grouped` when `gr > 1`)
/// on two backends from the same weight and activations: (a's output, b's output).
fn dense_q8_pair(a: &CudaBackend, b: &CudaBackend, r: &mut StdRng, (k, m, gr, ntok): (usize, usize, usize, usize)) -> (Vec<f32>, Vec<f32>) {
    let shape: Vec<usize> = if gr == 1 { vec![k, m] } else { vec![k, m, gr] };
    let (bytes, _) = weight(r, GgmlType::Q8_0, &shape, 0.5);
    let t = td("w", GgmlType::Q8_0, &shape, &bytes);
    let (wa, wb) = (a.upload_weight(&t, WeightUse::Matmul).unwrap(), b.upload_weight(&t, WeightUse::Matmul).unwrap());
    let n = ntok * gr;
    let xr = Rows { off: 1, n, width: k, stride: k + 3 };
    let o = Rows { off: 2, n, width: m, stride: m + 2 };
    let x = randn(r, xr.end(), 1.0);
    let (xa, xb) = (buf(a, &x), buf(b, &x));
    let (oa, ob) = (a.alloc(o.end()).unwrap(), b.alloc(o.end()).unwrap());
    poison(a, &oa, o.end());
    poison(b, &ob, o.end());
    if gr == 1 {
        a.matmul(&xa, xr, &wa, &oa, o);
        b.matmul(&xb, xr, &wb, &ob, o);
    } else {
        a.matmul_grouped(&xa, xr, &wa, &oa, o);
        b.matmul_grouped(&xb, xr, &wb, &ob, o);
    }
    (get(a, &oa, o), get(b, &ob, o))
}

/// Dense Q8_0 products on `mmq_q8_rows` (16-token tiles, the weights straight into the mma
/// fragments) give bit for bit what `mmq_q8_16` gives on the same tiles (so the same split K):
/// V2-Lite's kv_a, q and o_proj at batched-decode sizes, the absorbed output per head (3-D), and
/// 97 rows (a warp's 16 rows cut short; its 11 groups in 5 splits of 3 leave the last split
/// none, which must still write zeros).
#[test]
fn mmq_rows_dense_exact() {
    if tc_gpu("mmq_rows_dense_exact").is_none() {
        return;
    }
    let rows = &CudaBackend::new(0).expect("second backend");
    rows.set_mmq_tiles(16, 64);
    let plain = &CudaBackend::new(0).expect("third backend");
    plain.set_mmq_tiles(64, 0);
    let mut r = rng(34);
    let mut rep = Report::new("mmq_rows_dense");
    for &(k, m, gr, ntok) in &[
        (2048usize, 576usize, 1usize, 64usize),
        (2048, 3072, 1, 64),
        (2048, 2048, 1, 24),
        (2048, 576, 1, 12),
        (512, 128, 16, 64),
        (1408, 97, 1, 40),
    ] {
        let (got, want) = dense_q8_pair(rows, plain, &mut r, (k, m, gr, ntok));
        rep.check(&format!("[{k},{m},{gr}] tokens={ntok} (exact)"), &got, &want, 0.0, 0.0);
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
            for &n in &[1usize, 3, 64, 300, 600] {
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

/// `cache_copy` (a shared prompt prefix copied from one slot into another) on an f32 cache and
/// on the f16 MLA latent cache: the copied rows equal the source's bit for bit, every other
/// row is untouched, the CPU's copy gives the same values, and ranges that leave the cache or
/// overlap are refused.
#[test]
fn cache_copy_exact() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(61);
    let (slots, slot_len) = (3usize, 96u32);
    let rows = slots * slot_len as usize;
    let toks: Vec<TokenMeta> =
        (0..slots as u32).flat_map(|sl| (0..slot_len).map(move |p| TokenMeta { token: 0, pos: p, slot: sl })).collect();
    for (w, f16) in [(576usize, true), (576, false), (96, false)] {
        let fill: Vec<f32> = randn(&mut r, rows * w, 1.0).into_iter().map(f16_round).collect();
        let gc = if f16 { g.alloc_latent_cache(rows, w, 512, 16).unwrap() } else { g.alloc_cache(rows, w).unwrap() };
        let cc = c.alloc_cache(rows, w).unwrap();
        fill_cache(g, &gc, &fill, w, &toks, slot_len);
        fill_cache(c, &cc, &fill, w, &toks, slot_len);
        let n = r.random_range(1..slot_len as usize);
        let (src, dst) = (0usize, 2 * slot_len as usize);
        g.cache_copy(&gc, w, src, dst, n).unwrap();
        c.cache_copy(&cc, w, src, dst, n).unwrap();
        let mut got = vec![0f32; rows * w];
        g.read_cache(&gc, &mut got).unwrap();
        let mut want = fill.clone();
        want.copy_within(src * w..(src + n) * w, dst * w);
        assert!(got == want, "f16 {f16} width {w}: {n} rows copied from row {src} to row {dst}");
        // (the CPU's cache is one of its buffers)
        assert!(get(c, &cc, Rows::packed(1, rows * w)) == want, "the CPU's copy, width {w}");
        assert!(g.cache_copy(&gc, w, 0, rows - 2, 3).is_err(), "past the end");
        assert!(g.cache_copy(&gc, w, 0, 1, 3).is_err(), "overlapping");
        assert!(g.cache_copy(&gc, w + 1, 0, 10, 3).is_err(), "another width");
        eprintln!("cache_copy f16 {f16} width {w}: {n} rows exact");
    }
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
    type Case = (usize, usize, usize, usize, Option<u32>, Option<f32>);
    let cases: &[Case] = &[
        (8, 2, 64, 64, None, None),
        (4, 4, 128, 128, None, None),
        (6, 1, 256, 256, Some(16), Some(30.0)),
        (8, 4, 80, 48, Some(100), None),
        (2, 1, 192, 128, None, Some(50.0)),
    ];
    for &(nh, nkv, hd, vd, window, softcap) in cases {
        for &n in &[1usize, 3, 64, 300, 600] {
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

/// A batch of n tokens over two sequences for the MLA tests: the first ceil(n/2) (all n when
/// `one`) continue slot 1 after a history of `long` positions, the rest slot 0 after a short
/// one. Returns the batch, every token the cache holds (histories, then the batch) and the two
/// history lengths.
fn mla_tokens(n: usize, long: u32, one: bool, r: &mut StdRng) -> (Vec<TokenMeta>, Vec<TokenMeta>, [u32; 2]) {
    let hist = [long, r.random_range(0..20u32)];
    let n0 = if one { n } else { n.div_ceil(2) };
    let mut toks = seq_meta(n0, hist[0], 1, 100, r);
    toks.extend(seq_meta(n - n0, hist[1], 0, 100, r));
    let mut all: Vec<TokenMeta> = (0..hist[0]).map(|p| TokenMeta { token: 0, pos: p, slot: 1 }).collect();
    all.extend((0..hist[1]).map(|p| TokenMeta { token: 0, pos: p, slot: 0 }));
    all.extend(toks.iter().copied());
    (toks, all, hist)
}

/// One MLA attention case on both backends: a cache of `slots * slot_len` rows holding random
/// rows for `all` (history and batch tokens), random queries in `qr`; returns (GPU, CPU) outputs.
#[allow(clippy::too_many_arguments)]
fn mla_case(
    g: &CudaBackend,
    c: &CpuBackend,
    r: &mut StdRng,
    p: &MlaParams,
    toks: Vec<TokenMeta>,
    all: &[TokenMeta],
    slots: usize,
    slot_len: u32,
    qr: Rows,
    o: Rows,
) -> (Vec<f32>, Vec<f32>) {
    let w = p.kv_lora + p.rope_dim;
    let rows_data = randn(r, all.len() * w, 1.0);
    let rows = slots * slot_len as usize;
    let (gc, cc) = (g.alloc_cache(rows, w).unwrap(), c.alloc_cache(rows, w).unwrap());
    fill_cache(g, &gc, &rows_data, w, all, slot_len);
    fill_cache(c, &cc, &rows_data, w, all, slot_len);
    let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len };
    let (gb, cb) = (batch(g, &meta), batch(c, &meta));
    let q = randn(r, qr.end(), 0.5);
    let (gq, cq) = (buf(g, &q), buf(c, &q));
    let (go, co) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
    poison(g, &go, o.end());
    poison(c, &co, o.end());
    g.mla_attention(&gq, qr, &gc, &gb, p, &go, o);
    c.mla_attention(&cq, qr, &cc, &cb, p, &co, o);
    (get(g, &go, o), get(c, &co, o))
}

#[test]
fn mla_attention_latent_cache() {
    let Some(g) = gpu() else { return };
    // The SIMT kernels at f32 tolerance on a backend of their own that never takes the tensor
    // cores for decode (by default batches take them from position 32 and single tokens from
    // 192: TS_CUDA_MLA_LONG_BATCH / TS_CUDA_MLA_LONG); the same cases on the shared backend,
    // as its defaults choose, at the tensor cores' f16 tolerance (mla_split_tensor_cores
    // checks that kernel on its own).
    let simt = &CudaBackend::new(0).expect("second backend");
    simt.set_mla_tensor_cores(Some(false));
    let c = cpu();
    let mut r = rng(7);
    let mut rep = Report::new("mla_attention");
    let slot_len = 4096u32;
    for &(nh, kl, rd) in &[(16usize, 512usize, 64usize), (4, 128, 32)] {
        let w = kl + rd;
        for &n in &[1usize, 3, 64, 300, 600] {
            // Decode sizes also with long histories: the split kernel then runs several tiles per split.
            let long = if n <= 3 { r.random_range(2000..2500u32) } else { r.random_range(0..700u32) };
            let (toks, all, hist) = mla_tokens(n, long, false, &mut r);
            let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
            let qr = Rows { off: 0, n: n * nh, width: w, stride: w + 8 };
            let name = format!("heads={nh} kv_lora={kl} rope={rd} n={n} hist={hist:?}");
            let (got, want) = mla_case(simt, c, &mut r, &p, toks.clone(), &all, 2, slot_len, qr, Rows::packed(n * nh, kl));
            rep.check(&format!("{name} SIMT"), &got, &want, 2e-5, 1e-4);
            let (got, want) = mla_case(g, c, &mut r, &p, toks, &all, 2, slot_len, qr, Rows::packed(n * nh, kl));
            rep.check(&format!("{name} defaults"), &got, &want, 1e-2, 1e-2);
        }
    }
    // Prefill of one sequence (one slot, consecutive positions after a history): the f16
    // tensor-core kernel when it is on (queries, keys and probabilities rounded to f16).
    for &(nh, n, hist) in &[(16usize, 9usize, 0u32), (16, 64, 37), (16, 300, 0), (16, 257, 611), (32, 40, 5)] {
        let (kl, rd) = (512usize, 64usize);
        let w = kl + rd;
        let toks = seq_meta(n, hist, 2, 100, &mut r);
        let mut all: Vec<TokenMeta> = (0..hist).map(|p| TokenMeta { token: 0, pos: p, slot: 2 }).collect();
        all.extend(toks.iter().copied());
        let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
        let qr = Rows { off: 4, n: n * nh, width: w, stride: w + 8 };
        let o = Rows { off: 1, n: n * nh, width: kl, stride: kl + 3 };
        let (got, want) = mla_case(g, c, &mut r, &p, toks, &all, 3, slot_len, qr, o);
        let tc = g.tensor_cores() && n > ts_cuda::GEMV_MAX_TOKENS;
        let (atol, rtol) = if tc { (1e-2, 1e-2) } else { (2e-5, 1e-4) };
        rep.check(&format!("one slot: heads={nh} n={n} hist={hist} (tensor cores: {tc})"), &got, &want, atol, rtol);
    }
    rep.finish();
}

/// The split MLA decode on the f16 tensor cores (`mla_split_tc`, forced on a backend of its own):
/// decode and batched-decode sizes over long and short histories in two slots, 16, 32 and 128
/// heads, against the CPU's f32 attention (queries, keys and probabilities in f16, as the
/// prefill kernel: within 1e-2 of the rms).
#[test]
fn mla_split_tensor_cores() {
    if tc_gpu("mla_split_tc").is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("second backend");
    g.set_mla_tensor_cores(Some(true));
    let c = cpu();
    let mut r = rng(27);
    let mut rep = Report::new("mla_split_tc");
    let slot_len = 4096u32;
    for &(nh, n) in &[(16usize, 1usize), (16, 3), (16, 8), (16, 64), (16, 100), (32, 2), (128, 1)] {
        let (kl, rd) = (512usize, 64usize);
        let w = kl + rd;
        let long = if n <= 8 { r.random_range(2000..4000u32) } else { r.random_range(0..700u32) };
        let (toks, all, hist) = mla_tokens(n, long, false, &mut r);
        let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
        let qr = Rows { off: 4, n: n * nh, width: w, stride: w + 8 };
        let o = Rows { off: 1, n: n * nh, width: kl, stride: kl + 3 };
        let (got, want) = mla_case(g, c, &mut r, &p, toks, &all, 2, slot_len, qr, o);
        rep.check(&format!("heads={nh} n={n} hist={hist:?}"), &got, &want, 1e-2, 1e-2);
    }
    rep.finish();
}

/// One batch MLA attention (16 heads, V2's 512 + 64, `n` tokens over two sequences, the first
/// with `long` keys of history; an f16 cache when `half`) with `path` off, then on: the path is
/// taken exactly when on, and the outputs are the same bits.
#[allow(clippy::too_many_arguments)]
fn mla_path_exact(g: &CudaBackend, r: &mut StdRng, rep: &mut Report, path: Path, n: usize, long: u32, half: bool, label: &str) {
    let slot_len = 4096u32;
    let (toks, all, hist) = mla_tokens(n, long, false, r);
    let (nh, kl, rd) = (16usize, 512usize, 64usize);
    let w = kl + rd;
    let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
    let qr = Rows { off: 4, n: n * nh, width: w, stride: w + 8 };
    let o = Rows { off: 1, n: n * nh, width: kl, stride: kl + 3 };
    let rows_data = randn(r, all.len() * w, 1.0);
    let rows = 2 * slot_len as usize;
    let gc = if half { g.alloc_latent_cache(rows, w, kl, nh) } else { g.alloc_cache(rows, w) }.unwrap();
    assert_eq!(gc.is_f16(), half, "{label}: the cache's type");
    fill_cache(g, &gc, &rows_data, w, &all, slot_len);
    let gb = batch(g, &BatchMeta { tokens: toks, outputs: vec![], slot_len });
    let gq = buf(g, &randn(r, qr.end(), 0.5));
    let out = g.alloc(o.end()).unwrap();
    let mut res = Vec::new();
    for on in [false, true] {
        g.set_path(path, on);
        poison(g, &out, o.end());
        let before = g.path_launches(path);
        g.mla_attention(&gq, qr, &gc, &gb, &p, &out, o);
        res.push(get(g, &out, o));
        assert_eq!(g.path_launches(path) > before, on, "{label} n={n}: {path:?} taken with it {}", if on { "on" } else { "off" });
    }
    rep.check(&format!("{label} n={n} hist={hist:?} (exact)"), &res[1], &res[0], 0.0, 0.0);
}

/// `mla_combine_few` (Path::CombineFew: a batch's merge of at most 8 context splits a token)
/// gives the same bits as `mla_combine`, after the SIMT and the tensor-core split kernels, over
/// short and long histories (splits that saw no keys included), and a mixed batch's rows.
#[test]
fn mla_combine_few_exact() {
    if gpu().is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("own backend");
    let mut r = rng(41);
    let mut rep = Report::new("mla_combine_few");
    // (tensor cores, tokens, the first sequence's history): 2..8 splits a token, as the host
    // picks them (SIMT: one wave over the tokens, a split per 256 keys at most; tensor cores:
    // 2 x 132 / n on the H200).
    let cases: &[(bool, usize, u32)] = &[
        (false, 2, 1500),
        (false, 16, 900),
        (false, 64, 300),
        (false, 24, 700),
        (true, 40, 2000),
        (true, 64, 150),
        (true, 100, 600),
        (true, 33, 40),
    ];
    for &(tc, n, long) in cases {
        if tc && !g.tensor_cores() {
            continue;
        }
        g.set_mla_tensor_cores(Some(tc));
        mla_path_exact(g, &mut r, &mut rep, Path::CombineFew, n, long, false, &format!("tensor cores {tc}"));
    }
    rep.finish();
}

/// `mla_split_tc_hb` (Path::SplitBatch: a batch's split over an f16 cache, two ring buffers,
/// its first key tiles issued before the query's loads) gives the same bits as
/// `mla_split_tc_h`, over short and long histories (splits with no keys, and splits of several
/// tiles: more than the ring holds), with and without the merge's few-splits kernel.
#[test]
fn mla_split_batch_exact() {
    if tc_gpu("mla_split_batch_exact").is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("own backend");
    g.set_mla_tensor_cores(Some(true));
    let mut r = rng(43);
    let mut rep = Report::new("mla_split_batch");
    for &(n, long) in &[(2usize, 1500u32), (16, 900), (64, 150), (64, 20), (33, 40), (100, 600), (7, 3000)] {
        mla_path_exact(g, &mut r, &mut rep, Path::SplitBatch, n, long, true, "f16 cache");
    }
    rep.finish();
}

/// `v` as the f16 latent cache stores it (clamped to the f16 range, rounded to nearest even).
fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v.clamp(-65504.0, 65504.0)).to_f32()
}

/// The f16 MLA latent cache (`alloc_latent_cache`, V2's 576 = 512 + 64 shapes on the tensor-core
/// path): its writes store exactly the f16 rounding of what the f32 cache gets (norm_rope_cache_h,
/// mla_rope_absorb_1_h, cache_write_h), and attention over it (mla_split_18_16_h, mla_split_tc_h,
/// mla_prefill_h) gives bit for bit what the f32 kernels give over an f32 cache holding those
/// f16 values; and, as every MLA kernel, agrees with the CPU within 1e-2.
#[test]
fn mla_f16_latent_cache() {
    let Some(g) = gpu() else { return };
    if !g.tensor_cores() {
        eprintln!("mla_f16_latent_cache: no tensor cores (the cache stays f32), skipped");
        return;
    }
    let c = cpu();
    let mut r = rng(29);
    let mut rep = Report::new("mla_f16_cache");
    let (kl, rd) = (512usize, 64usize);
    let w = kl + rd;
    // Reads: (heads, tokens, one sequence): decode (SIMT split at 16 heads, tensor cores at 32 and
    // 128), a batch of 64 over two sequences (split) and a 64-token prompt (mla_prefill_h).
    let slot_len = 4096u32;
    let rows = 2 * slot_len as usize;
    for &(nh, n, one) in &[(16usize, 1usize, false), (16, 3, false), (16, 64, false), (16, 64, true), (32, 2, false), (128, 1, false)] {
        let gh = g.alloc_latent_cache(rows, w, kl, nh).unwrap();
        if !gh.is_f16() {
            rep.failures.push(format!("heads={nh}: alloc_latent_cache gave an f32 cache on a tensor-core GPU"));
            continue;
        }
        let long = if n <= 3 { r.random_range(2000..4000u32) } else { r.random_range(0..700u32) };
        let (toks, all, hist) = mla_tokens(n, long, one, &mut r);
        // Rows already f16 values: the f32 caches then hold exactly what the f16 cache holds.
        let data: Vec<f32> = randn(&mut r, all.len() * w, 1.0).into_iter().map(f16_round).collect();
        let (gf, cf) = (g.alloc_cache(rows, w).unwrap(), c.alloc_cache(rows, w).unwrap());
        fill_cache(g, &gh, &data, w, &all, slot_len);
        fill_cache(g, &gf, &data, w, &all, slot_len);
        fill_cache(c, &cf, &data, w, &all, slot_len);
        let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
        let qr = Rows { off: 4, n: n * nh, width: w, stride: w + 8 };
        let o = Rows { off: 1, n: n * nh, width: kl, stride: kl + 3 };
        let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len };
        let (gb, cb) = (batch(g, &meta), batch(c, &meta));
        let q = randn(&mut r, qr.end(), 0.5);
        let (gq, cq) = (buf(g, &q), buf(c, &q));
        let (oh, of, oc) = (g.alloc(o.end()).unwrap(), g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap());
        poison(g, &oh, o.end());
        poison(g, &of, o.end());
        g.mla_attention(&gq, qr, &gh, &gb, &p, &oh, o);
        g.mla_attention(&gq, qr, &gf, &gb, &p, &of, o);
        c.mla_attention(&cq, qr, &cf, &cb, &p, &oc, o);
        let lab = format!("heads={nh} n={n} one sequence={one} hist={hist:?}");
        let got = get(g, &oh, o);
        rep.check(&format!("{lab} f16 vs f32 cache (exact)"), &got, &get(g, &of, o), 0.0, 0.0);
        rep.check(&format!("{lab} vs cpu"), &got, &get(c, &oc, o), 1e-2, 1e-2);
        if one {
            // The prompt kernel with its key tiles loaded between two barriers (mla_prefill_h)
            // against the default cp.async buffers (mla_prefill_ha): the same bits.
            let oa = g.alloc(o.end()).unwrap();
            poison(g, &oa, o.end());
            g.set_mla_prefill_async(false);
            g.mla_attention(&gq, qr, &gh, &gb, &p, &oa, o);
            g.set_mla_prefill_async(true);
            rep.check(&format!("{lab} key tiles between barriers (exact)"), &get(g, &oa, o), &got, 0.0, 0.0);
        }
    }
    // Writes: mla_rope_cache_write (1 token: with the absorbed product, mla_rope_absorb_1_h; 3:
    // norm_rope_cache_h then the product) into an f16 and an f32 cache.
    let (slots, slot_len) = (2usize, 64u32);
    let rows = slots * slot_len as usize;
    let (nope, heads) = (128usize, 16usize);
    let freqs: Vec<f32> = (0..rd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / rd as f32)).collect();
    let grope = g.upload_rope(&RopeSpec { mode: RopeMode::Normal, dim: rd, freqs, mscale: 1.0 }).unwrap();
    let gw = norm_weight(g, &randn(&mut r, kl, 1.0));
    let wk = absorb_weight(g, &mut r, nope, kl, heads);
    let prior: Vec<TokenMeta> =
        (0..slots as u32).flat_map(|sl| (0..slot_len).map(move |p| TokenMeta { token: 0, pos: p, slot: sl })).collect();
    for &n in &[1usize, 3] {
        let meta = BatchMeta { tokens: seq_meta(n, r.random_range(0..slot_len - n as u32), 1, 100, &mut r), outputs: vec![], slot_len };
        let gb = batch(g, &meta);
        let xr = Rows::packed(n, w);
        let x = randn(&mut r, xr.end(), 1.0);
        let qr = Rows::packed(n * heads, nope + rd);
        let qdr = Rows::packed(n * heads, kl + rd);
        let q = randn(&mut r, qr.end(), 1.0);
        let fill: Vec<f32> = randn(&mut r, rows * w, 1.0).into_iter().map(f16_round).collect();
        let mut outs = Vec::new();
        for f16 in [true, false] {
            let (gx, gq, gqd) = (buf(g, &x), buf(g, &q), g.alloc(qdr.end()).unwrap());
            poison(g, &gqd, qdr.end());
            let gc = if f16 { g.alloc_latent_cache(rows, w, kl, heads).unwrap() } else { g.alloc_cache(rows, w).unwrap() };
            fill_cache(g, &gc, &fill, w, &prior, slot_len);
            let qt = (&gq, qr.cols(nope, rd), &gqd, qdr.cols(kl, rd), heads);
            g.mla_rope_cache_write(&gx, xr, kl, Some(&gw), 1e-6, qt, Some((&wk, qr.cols(0, nope), qdr.cols(0, kl))), &gb, &grope, &gc);
            let mut cv = vec![0f32; rows * w];
            g.read_cache(&gc, &mut cv).unwrap();
            if !f16 {
                cv.iter_mut().for_each(|v| *v = f16_round(*v));
            }
            outs.push(vec![get(g, &gx, xr), get(g, &gqd, qdr), cv]);
        }
        exact(&mut rep, &format!("write n={n}: f16 cache vs f32 cache rounded"), &["x", "q rows", "cache"], &outs[0], &outs[1]);
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
        let gw = [
            g.upload_weight(&tg, WeightUse::Matmul).unwrap(),
            g.upload_weight(&tu, WeightUse::Matmul).unwrap(),
            g.upload_weight(&tdn, WeightUse::Matmul).unwrap(),
        ];
        let cw = [
            c.upload_weight(&tg, WeightUse::Matmul).unwrap(),
            c.upload_weight(&tu, WeightUse::Matmul).unwrap(),
            c.upload_weight(&tdn, WeightUse::Matmul).unwrap(),
        ];
        for (ci, &(gating, norm_topk, scale, n_group, topk_group, k, glu)) in configs.iter().enumerate() {
            let p = MoeParams { n_experts: ne, k, gating, norm_topk, scale, n_group, topk_group, glu };
            for &n in &[1usize, 3, 64, 300, 600] {
                // Decode sizes with 16-byte aligned input rows (f16/bf16 experts then take the
                // vector GEMV, moe_gemv_h16), the others misaligned.
                let xr = if n <= 3 {
                    Rows { off: 4, n, width: hdim, stride: hdim + 4 }
                } else {
                    Rows { off: 2, n, width: hdim, stride: hdim + 2 }
                };
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
                // Q8_0 above GEMV_MAX_TOKENS on the tensor cores quantises exactly as the CPU does.
                let tc_q8 = ty == GgmlType::Q8_0 && n > ts_cuda::GEMV_MAX_TOKENS && g.tensor_cores();
                // Prompt-size Q8_0 MoEs take the f16 tensor cores (f16 activations, no 8-bit
                // rounding): as far from the CPU as the CPU is from f64, and close to f64.
                let f16_q8 = tc_q8 && g.moe_q8_runs_f16(n, k, ne, 0, hdim, ff);
                let atol = if is_float(ty) {
                    1e-4
                } else if f16_q8 {
                    0.25
                } else if tc_q8 {
                    2e-2
                } else {
                    0.25
                };
                let label = format!("{} cfg{ci} ({gating:?} k={k} groups={n_group}/{topk_group}) n={n}", ty.name());
                rep.check(&format!("{label} vs cpu"), &got, &get(c, &co, o), atol, 1e-3);
                let exact = moe_f64(&x, xr, &lg, lr, [&gdq, &udq, &ddq], hdim, ff, &p);
                // Q8_0 decode (fast path) quantises the input and the GLU output to Q8_0.
                // (with the tensor cores, the heavy-tailed GLU output's 8-bit rounding alone moves
                // outputs by up to ~9% of their rms, as on the CPU).
                let q8_fast = ty == GgmlType::Q8_0 && n <= ts_cuda::GEMV_MAX_TOKENS;
                let tol = if f16_q8 {
                    1e-2
                } else if tc_q8 {
                    0.15
                } else if q8_fast {
                    8e-2
                } else {
                    1e-4
                };
                rep.check(&format!("{label} vs f64"), &got, &exact, tol, 1e-4);
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
#[ignore = "benchmark, not a test: run with `--ignored bench_matmul --nocapture` on a GPU"]
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
                eprintln!(
                    "  bench matmul {:<5} {k}x{m} n={n:<4} {us:>9.1} us  {gbs:>7.0} GB/s of weights  {tflops:>6.1} TFLOP/s",
                    ty.name()
                );
            }
        }
    }
}

// ---- fused decode ops (kernels/fused.cu; TS_CUDA_FUSED=0 turns them off) -----------------------
// Each is checked against the CPU backend (whose defaults are the plain op chains) and against
// the same chain of plain ops on the GPU. With TS_CUDA_FUSED=0 the same tests check the fallbacks.

/// The absorbed query product's weight of an MLA test (W_uk: `heads` matrices of `nope` x `kl`,
/// Q8_0), uploaded for a matmul.
fn absorb_weight(g: &CudaBackend, r: &mut StdRng, nope: usize, kl: usize, heads: usize) -> CudaWeight {
    absorb_weight_of(g, r, GgmlType::Q8_0, nope, kl, heads)
}

fn absorb_weight_of(g: &CudaBackend, r: &mut StdRng, ty: GgmlType, nope: usize, kl: usize, heads: usize) -> CudaWeight {
    let wshape = [nope, kl, heads];
    let (wb, _) = weight(r, ty, &wshape, 0.5);
    g.upload_weight(&td("w_uk", ty, &wshape, &wb), WeightUse::Matmul).unwrap()
}

fn norm_weight<B: Backend>(b: &B, v: &[f32]) -> B::Weight {
    let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
    let shape = [v.len()];
    b.upload_weight(&td("norm", GgmlType::F32, &shape, &bytes), WeightUse::Vector).unwrap()
}

fn fused_banner(g: &CudaBackend) {
    eprintln!("fused kernels {}", if g.fused() { "on" } else { "OFF (TS_CUDA_FUSED=0): checking the fallbacks" });
}

/// add_rms_norm on one backend; case 0: out packed, 1: out == delta, 2: out == x (no weight).
/// Returns (x, delta) whole buffers and the packed out (case 0).
fn run_add_rms_norm<B: Backend>(
    b: &B,
    a: &[f32],
    d: &[f32],
    w: &B::Weight,
    view: Rows,
    case: usize,
    fused: bool,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let x = buf(b, a);
    let dl = buf(b, d);
    let packed = Rows::packed(view.n, view.width);
    let out = b.alloc(packed.end().max(1)).unwrap();
    poison(b, &out, packed.end().max(1));
    let (ow, eps) = if case == 2 { (None, 1e-5) } else { (Some(w), 1e-6) };
    let (ob, or) = match case {
        0 => (&out, packed),
        1 => (&dl, view),
        _ => (&x, view),
    };
    if fused {
        b.add_rms_norm(&x, view, &dl, view, ow, eps, ob, or);
    } else {
        b.add(&x, view, &dl, view, &x, view);
        b.rms_norm(&x, view, ow, eps, ob, or);
    }
    let full = Rows::packed(1, a.len());
    (get(b, &x, full), get(b, &dl, full), if case == 0 { get(b, &out, packed) } else { Vec::new() })
}

#[test]
fn fused_add_rms_norm() {
    let Some(g) = gpu() else { return };
    fused_banner(g);
    let c = cpu();
    let mut r = rng(11);
    let mut rep = Report::new("add_rms_norm");
    for &n in &[1usize, 3, 8, 64, 300] {
        for &w in &[7usize, 64, 576, 2048, 2053] {
            let stride = w + 5;
            let len = n * stride + 8;
            let a = randn(&mut r, len, 2.0);
            let d = randn(&mut r, len, 1.0);
            let nw = randn(&mut r, w, 1.0);
            let (gw, cw) = (norm_weight(g, &nw), norm_weight(c, &nw));
            let view = Rows { off: 2, n, width: w, stride };
            for case in 0..3 {
                let (gx, gd, go) = run_add_rms_norm(g, &a, &d, &gw, view, case, true);
                let (cx, cd, co) = run_add_rms_norm(c, &a, &d, &cw, view, case, true);
                let (px, pd, po) = run_add_rms_norm(g, &a, &d, &gw, view, case, false);
                let lab = format!("case {case} n={n} w={w}");
                rep.check(&format!("{lab} x vs cpu"), &gx, &cx, 1e-5, 1e-5);
                rep.check(&format!("{lab} delta vs cpu"), &gd, &cd, 1e-5, 1e-5);
                rep.check(&format!("{lab} x vs gpu add+rms_norm"), &gx, &px, 1e-6, 1e-6);
                rep.check(&format!("{lab} delta vs gpu add+rms_norm"), &gd, &pd, 1e-6, 1e-6);
                if case == 0 {
                    rep.check(&format!("{lab} out vs cpu"), &go, &co, 1e-5, 1e-5);
                    rep.check(&format!("{lab} out vs gpu add+rms_norm"), &go, &po, 1e-6, 1e-6);
                }
            }
        }
    }
    rep.finish();
}

/// rope_copy on one backend: (dst view, src whole buffer).
#[allow(clippy::too_many_arguments)]
fn run_rope_copy<B: Backend>(
    b: &B,
    src: &[f32],
    sr: Rows,
    dr: Rows,
    heads: usize,
    meta: &BatchMeta,
    spec: &RopeSpec,
    fused: bool,
) -> (Vec<f32>, Vec<f32>) {
    let s = buf(b, src);
    let dlen = dr.end() + 4;
    let d = b.alloc(dlen).unwrap();
    poison(b, &d, dlen);
    let bt = batch(b, meta);
    let rope = b.upload_rope(spec).unwrap();
    if fused {
        b.rope_copy(&s, sr, &d, dr, heads, &bt, &rope);
    } else {
        b.copy(&s, sr, &d, dr);
        b.rope(&d, dr, heads, &bt, &rope);
    }
    (get(b, &d, dr), get(b, &s, Rows::packed(1, src.len())))
}

#[test]
fn fused_rope_copy() {
    let Some(g) = gpu() else { return };
    fused_banner(g);
    let c = cpu();
    let mut r = rng(12);
    let mut rep = Report::new("rope_copy");
    for mode in [RopeMode::Normal, RopeMode::Neox] {
        // (rotated dims, row width, heads per token): the MLA q_pe, a partial rotation with copied
        // columns, one head.
        for &(dim, width, heads) in &[(64usize, 64usize, 16usize), (32, 80, 4), (16, 16, 1)] {
            let freqs: Vec<f32> = (0..dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / dim as f32)).collect();
            let spec = RopeSpec { mode, dim, freqs, mscale: 0.93 };
            for &n in &[1usize, 3, 8, 64] {
                let mut toks = seq_meta(n / 2, r.random_range(0..3000), 0, 100, &mut r);
                toks.extend(seq_meta(n - n / 2, r.random_range(0..3000), 1, 100, &mut r));
                let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len: 8192 };
                let sr = Rows { off: 3, n: n * heads, width, stride: width + 7 };
                let dr = Rows { off: 5, n: n * heads, width, stride: width + 11 };
                let src = randn(&mut r, sr.end() + 2, 1.0);
                let (gd, gs) = run_rope_copy(g, &src, sr, dr, heads, &meta, &spec, true);
                let (cd, cs) = run_rope_copy(c, &src, sr, dr, heads, &meta, &spec, true);
                let (pd, _) = run_rope_copy(g, &src, sr, dr, heads, &meta, &spec, false);
                let lab = format!("{mode:?} dim={dim} width={width} heads={heads} n={n}");
                rep.check(&format!("{lab} vs cpu"), &gd, &cd, 1e-5, 1e-4);
                rep.check(&format!("{lab} vs gpu copy+rope"), &gd, &pd, 1e-6, 1e-6);
                rep.check(&format!("{lab} src unchanged"), &gs, &src, 0.0, 0.0);
                rep.check(&format!("{lab} src unchanged (cpu)"), &cs, &src, 0.0, 0.0);
            }
        }
    }
    rep.finish();
}

#[test]
fn fused_norm_rope_cache_write() {
    let Some(g) = gpu() else { return };
    fused_banner(g);
    let c = cpu();
    let mut r = rng(13);
    let mut rep = Report::new("norm_rope_cache_write");
    let (slots, slot_len) = (3usize, 64u32);
    let rows = slots * slot_len as usize;
    // (normed width, rope dims, extra copied columns): V2-Lite's 512 + 64, a small MLA, an odd one.
    for &(nw, rd, extra) in &[(512usize, 64usize, 0usize), (128, 32, 0), (100, 16, 4)] {
        let width = nw + rd + extra;
        for mode in [RopeMode::Normal, RopeMode::Neox] {
            let freqs: Vec<f32> = (0..rd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / rd as f32)).collect();
            let spec = RopeSpec { mode, dim: rd, freqs, mscale: 1.07 };
            let nwt = randn(&mut r, nw, 1.0);
            let (gw, cw) = (norm_weight(g, &nwt), norm_weight(c, &nwt));
            let (grope, crope) = (g.upload_rope(&spec).unwrap(), c.upload_rope(&spec).unwrap());
            for &n in &[1usize, 3, 8, 40] {
                // Every cache row filled first (slot-major, so row i of `prior` is cache row i).
                let prior: Vec<TokenMeta> =
                    (0..slots as u32).flat_map(|sl| (0..slot_len).map(move |p| TokenMeta { token: 0, pos: p, slot: sl })).collect();
                let fill = randn(&mut r, rows * width, 1.0);
                let (gc, cc, pc) =
                    (g.alloc_cache(rows, width).unwrap(), c.alloc_cache(rows, width).unwrap(), g.alloc_cache(rows, width).unwrap());
                fill_cache(g, &gc, &fill, width, &prior, slot_len);
                fill_cache(c, &cc, &fill, width, &prior, slot_len);
                fill_cache(g, &pc, &fill, width, &prior, slot_len);
                let n0 = n.div_ceil(2);
                let mut toks = seq_meta(n0, r.random_range(0..slot_len - n0 as u32), 2, 100, &mut r);
                toks.extend(seq_meta(n - n0, r.random_range(0..slot_len - (n - n0) as u32), 0, 100, &mut r));
                let meta = BatchMeta { tokens: toks.clone(), outputs: vec![], slot_len };
                let (gb, cb) = (batch(g, &meta), batch(c, &meta));
                let xr = Rows { off: 2, n, width, stride: width + 3 };
                let x = randn(&mut r, xr.end() + 1, 1.0);
                let (gx, cx, px) = (buf(g, &x), buf(c, &x), buf(g, &x));
                g.norm_rope_cache_write(&gx, xr, nw, Some(&gw), 1e-6, &gb, &grope, &gc);
                c.norm_rope_cache_write(&cx, xr, nw, Some(&cw), 1e-6, &cb, &crope, &cc);
                // The plain chain on the GPU.
                let lat = xr.cols(0, nw);
                g.rms_norm(&px, lat, Some(&gw), 1e-6, &px, lat);
                g.rope(&px, xr.cols(nw, width - nw), 1, &gb, &grope);
                g.cache_write(&pc, &px, xr, &gb);
                let lab = format!("{nw}+{rd}+{extra} {mode:?} n={n}");
                let full = Rows::packed(1, x.len());
                let cxv = get(c, &cx, full);
                rep.check(&format!("{lab} x vs cpu"), &get(g, &gx, full), &cxv, 1e-5, 1e-5);
                rep.check(&format!("{lab} x vs gpu plain"), &get(g, &gx, full), &get(g, &px, full), 1e-6, 1e-6);
                // Expected cache: the fill, with the batch's rows = the CPU's rows after the op.
                let mut want = fill.clone();
                for (t, tm) in toks.iter().enumerate() {
                    let row = tm.slot as usize * slot_len as usize + tm.pos as usize;
                    let src = xr.off + t * xr.stride;
                    want[row * width..(row + 1) * width].copy_from_slice(&cxv[src..src + width]);
                }
                let (mut gcv, mut pcv) = (vec![0f32; rows * width], vec![0f32; rows * width]);
                g.read_cache(&gc, &mut gcv).unwrap();
                g.read_cache(&pc, &mut pcv).unwrap();
                rep.check(&format!("{lab} cache vs cpu rows"), &gcv, &want, 1e-5, 1e-5);
                rep.check(&format!("{lab} cache vs gpu plain"), &gcv, &pcv, 1e-6, 1e-6);
                // mla_rope_cache_write: the same, plus the query's rope part (3 heads per token,
                // the rope dims and `extra` copied columns) in the same launch. Its latent rows
                // and cache equal norm_rope_cache_write's, its q rows rope_copy's, bit for bit.
                let heads = 3;
                let qw = rd + extra;
                let qr = Rows { off: 1, n: n * heads, width: qw, stride: qw + 5 };
                let qdr = Rows { off: 2, n: n * heads, width: qw, stride: qw + 4 };
                let q = randn(&mut r, qr.end(), 1.0);
                let (gq, cq) = (buf(g, &q), buf(c, &q));
                let (gqd, cqd, pqd) = (g.alloc(qdr.end()).unwrap(), c.alloc(qdr.end()).unwrap(), g.alloc(qdr.end()).unwrap());
                poison(g, &gqd, qdr.end());
                poison(c, &cqd, qdr.end());
                poison(g, &pqd, qdr.end());
                let (mx, mcx) = (buf(g, &x), buf(c, &x));
                let (mc, mcc) = (g.alloc_cache(rows, width).unwrap(), c.alloc_cache(rows, width).unwrap());
                fill_cache(g, &mc, &fill, width, &prior, slot_len);
                fill_cache(c, &mcc, &fill, width, &prior, slot_len);
                g.mla_rope_cache_write(&mx, xr, nw, Some(&gw), 1e-6, (&gq, qr, &gqd, qdr, heads), None, &gb, &grope, &mc);
                c.mla_rope_cache_write(&mcx, xr, nw, Some(&cw), 1e-6, (&cq, qr, &cqd, qdr, heads), None, &cb, &crope, &mcc);
                g.rope_copy(&gq, qr, &pqd, qdr, heads, &gb, &grope);
                rep.check(&format!("{lab} mla q vs cpu"), &get(g, &gqd, qdr), &get(c, &cqd, qdr), 1e-5, 1e-5);
                rep.check(&format!("{lab} mla q vs gpu rope_copy (exact)"), &get(g, &gqd, qdr), &get(g, &pqd, qdr), 0.0, 0.0);
                rep.check(&format!("{lab} mla x (exact)"), &get(g, &mx, full), &get(g, &gx, full), 0.0, 0.0);
                let mut mcv = vec![0f32; rows * width];
                g.read_cache(&mc, &mut mcv).unwrap();
                rep.check(&format!("{lab} mla cache (exact)"), &mcv, &gcv, 0.0, 0.0);
            }
        }
    }
    rep.finish();
}

/// mla_rope_cache_write with the absorbed query product (one decode token: one launch,
/// mla_rope_absorb_1, or mla_rope_absorb_<t>_1 for a bf16 / f16 W_uk) gives the same bits as the
/// op without it followed by matmul_grouped on the GPU: latent rows, cache, the roped query
/// columns and the absorbed ones. Several tokens take the two ops (same check); a decode batch
/// of 24 with Q8_0 W_uk takes cuBLAS with q_nope's f16 rows from the first op's launch
/// (`Path::QnopeH`, same check). A backend of its own, for the 16-bit switch
/// (`set_path(Path::Absorb16, ..)`).
#[test]
fn fused_mla_rope_absorb() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    g.set_path(Path::Absorb16, true);
    let mut r = rng(26);
    let mut rep = Report::new("mla_rope_absorb");
    let (slots, slot_len) = (2usize, 64u32);
    let rows = slots * slot_len as usize;
    // (latent width, rope dims, heads, nope, kv_lora): V2-Lite's, and fewer heads / a short latent.
    let cases = [(512usize, 64usize, 16usize, 128usize, 512usize), (256, 32, 4, 64, 256)];
    let typed = [GgmlType::Q8_0, GgmlType::BF16, GgmlType::F16].into_iter().flat_map(|ty| cases.iter().map(move |c| (ty, c)));
    for (ty, &(nw, rd, heads, nope, kl)) in typed {
        let width = nw + rd;
        let freqs: Vec<f32> = (0..rd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / rd as f32)).collect();
        let spec = RopeSpec { mode: RopeMode::Normal, dim: rd, freqs, mscale: 1.0 };
        let grope = g.upload_rope(&spec).unwrap();
        let gw = norm_weight(g, &randn(&mut r, nw, 1.0));
        let wk = absorb_weight_of(g, &mut r, ty, nope, kl, heads);
        for &n in &[1usize, 3, 24] {
            let meta = BatchMeta { tokens: seq_meta(n, r.random_range(0..slot_len - n as u32), 1, 100, &mut r), outputs: vec![], slot_len };
            let gb = batch(g, &meta);
            let xr = Rows::packed(n, width);
            let x = randn(&mut r, xr.end(), 1.0);
            // q rows [nope | rope], qd rows [kl | rope], as deepseek2 lays them out.
            let qr = Rows::packed(n * heads, nope + rd);
            let qdr = Rows::packed(n * heads, kl + rd);
            let q = randn(&mut r, qr.end(), 1.0);
            let fill = randn(&mut r, rows * width, 1.0);
            let prior: Vec<TokenMeta> =
                (0..slots as u32).flat_map(|sl| (0..slot_len).map(move |p| TokenMeta { token: 0, pos: p, slot: sl })).collect();
            let mut outs = Vec::new();
            let before = g.path_launches(Path::Absorb16);
            let qh_before = g.path_launches(Path::QnopeH);
            for fused in [true, false] {
                let (gx, gq, gqd) = (buf(g, &x), buf(g, &q), g.alloc(qdr.end()).unwrap());
                poison(g, &gqd, qdr.end());
                let gc = g.alloc_cache(rows, width).unwrap();
                fill_cache(g, &gc, &fill, width, &prior, slot_len);
                let qt = (&gq, qr.cols(nope, rd), &gqd, qdr.cols(kl, rd), heads);
                if fused {
                    g.mla_rope_cache_write(
                        &gx,
                        xr,
                        nw,
                        Some(&gw),
                        1e-6,
                        qt,
                        Some((&wk, qr.cols(0, nope), qdr.cols(0, kl))),
                        &gb,
                        &grope,
                        &gc,
                    );
                } else {
                    g.mla_rope_cache_write(&gx, xr, nw, Some(&gw), 1e-6, qt, None, &gb, &grope, &gc);
                    g.matmul_grouped(&gq, qr.cols(0, nope), &wk, &gqd, qdr.cols(0, kl));
                }
                let mut cv = vec![0f32; rows * width];
                g.read_cache(&gc, &mut cv).unwrap();
                outs.push(vec![get(g, &gx, xr), get(g, &gqd, qdr), cv]);
            }
            let lab = format!("{ty:?} {nw}+{rd} heads={heads} {nope}->{kl} n={n}");
            // One token of 16-bit W_uk must have taken the one launch (the fused kernels on).
            let took = g.path_launches(Path::Absorb16) - before;
            assert_eq!(took, u64::from(g.fused() && n == 1 && ty != GgmlType::Q8_0), "{lab}: mla_rope_absorb_<t>_1 launches");
            // A batch with W_uk's f16 copy (Q8_0 rows of whole 128-value groups get one at
            // upload) takes Path::QnopeH.
            let qh = g.path_launches(Path::QnopeH) - qh_before;
            let copy = ty == GgmlType::Q8_0 && nope % 128 == 0;
            assert_eq!(qh, u64::from(g.fused() && n == 24 && copy), "{lab}: Path::QnopeH launches");
            exact(&mut rep, &lab, &["x", "q rows", "cache"], &outs[0], &outs[1]);
        }
    }
    rep.finish();
}

/// `norm_qkv_rope_cache` (V2-Lite's shapes: hidden 2048, 16 heads of 128 + 64, kv_lora 512)
/// with q and kv_a as one cuBLAS product into the op's own rows (`Path::QkvJoint`, their f16
/// copies side by side after `join_products`) against the same op with the two products
/// (`QkvJoint` off): the residual and the normed rows the same bits, the cache rows and the
/// absorbed query within 1e-5 of their rms (one product of 3,648 rows may sum in another order
/// than two). A 24-token batch takes the joint path, 3 tokens (the GEMVs) do not; both with and
/// without the residual add. Then the joint op in recorded steps (eager, captured, replayed,
/// new inputs each step) against it run eagerly on a second backend: the same bits.
#[test]
fn qkv_joint_batch() {
    if gpu_tc_fused("qkv_joint_batch").is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("second backend");
    let e = &CudaBackend::new(0).expect("third backend");
    let mut r = rng(61);
    let mut rep = Report::new("qkv_joint_batch");
    let (h, nh, nope, rd, kl) = (2048usize, 16usize, 128usize, 64usize, 512usize);
    let (qk, cw) = (nope + rd, kl + rd);
    let (slots, slot_len) = (2usize, 64u32);
    let rows = slots * slot_len as usize;
    let freqs: Vec<f32> = (0..rd / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / rd as f32)).collect();
    let spec = RopeSpec { mode: RopeMode::Normal, dim: rd, freqs, mscale: 1.0 };
    let (qs, kvs, uks) = ([h, nh * qk], [h, cw], [nope, kl, nh]);
    let (qb, _) = weight(&mut r, GgmlType::Q8_0, &qs, 0.5);
    let (kb, _) = weight(&mut r, GgmlType::Q8_0, &kvs, 0.5);
    let (ub, _) = weight(&mut r, GgmlType::Q8_0, &uks, 0.5);
    let (anv, knv) = (randn(&mut r, h, 1.0), randn(&mut r, kl, 1.0));
    // Each backend's weights: q and kv_a joined, W_uk, the two norms, the rope table.
    let setup = |b: &CudaBackend| {
        let mut wq = b.upload_weight(&td("wq", GgmlType::Q8_0, &qs, &qb), WeightUse::Matmul).unwrap();
        let mut wkv = b.upload_weight(&td("wkv_a", GgmlType::Q8_0, &kvs, &kb), WeightUse::Matmul).unwrap();
        b.join_products(&mut [&mut wq, &mut wkv]);
        let wk = b.upload_weight(&td("w_uk", GgmlType::Q8_0, &uks, &ub), WeightUse::Matmul).unwrap();
        (wq, wkv, wk, norm_weight(b, &anv), norm_weight(b, &knv), b.upload_rope(&spec).unwrap())
    };
    let (gw, ew) = (setup(g), setup(e));
    let prior: Vec<TokenMeta> =
        (0..slots as u32).flat_map(|sl| (0..slot_len).map(move |p| TokenMeta { token: 0, pos: p, slot: sl })).collect();
    let fill = randn(&mut r, rows * cw, 1.0);
    // The op on `b` with `w`'s weights into fresh buffers: x, h, the absorbed query, the cache.
    let run = |b: &CudaBackend,
               w: &(CudaWeight, CudaWeight, CudaWeight, CudaWeight, CudaWeight, CudaRope),
               gb: &CudaBatch,
               n: usize,
               x: &[f32],
               d: Option<&[f32]>| {
        let (rx, rq, rkv, rqm) = (Rows::packed(n, h), Rows::packed(n, nh * qk), Rows::packed(n, cw), Rows::packed(n * nh, cw));
        let heads = rq.split(nh);
        let (gx, gd, gh) = (buf(b, x), buf(b, d.unwrap_or(x)), b.alloc(rx.end()).unwrap());
        let (gq, gkv, gqm) = (b.alloc(rq.end()).unwrap(), b.alloc(rkv.end()).unwrap(), b.alloc(rqm.end()).unwrap());
        poison(b, &gqm, rqm.end());
        let gc = b.alloc_cache(rows, cw).unwrap();
        fill_cache(b, &gc, &fill, cw, &prior, slot_len);
        let q_rope = (&gq, heads.cols(nope, rd), &gqm, rqm.cols(kl, rd), nh);
        let absorb = Some((&w.2, heads.cols(0, nope), rqm.cols(0, kl)));
        let jobs = [(&w.0, &gq, rq), (&w.1, &gkv, rkv)];
        let delta = d.map(|_| (&gd, rx));
        b.norm_qkv_rope_cache((&gx, rx), delta, Some(&w.3), 1e-6, (&gh, rx), jobs, (kl, Some(&w.4)), q_rope, absorb, gb, &w.5, &gc);
        let mut cv = vec![0f32; rows * cw];
        b.read_cache(&gc, &mut cv).unwrap();
        [get(b, &gx, rx), get(b, &gh, rx), get(b, &gqm, rqm), cv]
    };
    for (n, with_delta) in [(24usize, true), (24, false), (3, true), (40, true), (9, false)] {
        let meta = BatchMeta { tokens: seq_meta(n, r.random_range(0..slot_len - n as u32), 1, 100, &mut r), outputs: vec![], slot_len };
        let gb = batch(g, &meta);
        let (x, d) = (randn(&mut r, n * h, 1.0), randn(&mut r, n * h, 1.0));
        let before = g.path_launches(Path::QkvJoint);
        let mut outs = Vec::new();
        for joint in [true, false] {
            g.set_path(Path::QkvJoint, joint);
            outs.push(run(g, &gw, &gb, n, &x, with_delta.then_some(&d[..])));
        }
        g.set_path(Path::QkvJoint, true);
        let lab = format!("n={n} delta={with_delta}");
        assert_eq!(g.path_launches(Path::QkvJoint) - before, u64::from(n > 8), "{lab}: Path::QkvJoint launches");
        exact(&mut rep, &lab, &["x", "h"], &outs[0][..2], &outs[1][..2]);
        rep.check(&format!("{lab} absorbed query"), &outs[0][2], &outs[1][2], 1e-5, 0.0);
        rep.check(&format!("{lab} cache"), &outs[0][3], &outs[1][3], 1e-5, 0.0);
    }
    // Recorded steps: the step's buffers fixed (a recording holds their pointers), new rows in
    // them each step.
    let n = 24;
    let meta = BatchMeta { tokens: seq_meta(n, 5, 1, 100, &mut r), outputs: vec![], slot_len };
    let (gb, eb) = (batch(g, &meta), batch(e, &meta));
    let (rx, rq, rkv, rqm) = (Rows::packed(n, h), Rows::packed(n, nh * qk), Rows::packed(n, cw), Rows::packed(n * nh, cw));
    let heads = rq.split(nh);
    let (gx, gd, gh) = (g.alloc(rx.end()).unwrap(), g.alloc(rx.end()).unwrap(), g.alloc(rx.end()).unwrap());
    let (gq, gkv, gqm) = (g.alloc(rq.end()).unwrap(), g.alloc(rkv.end()).unwrap(), g.alloc(rqm.end()).unwrap());
    let gc = g.alloc_cache(rows, cw).unwrap();
    let key = 0x9c_4a_u64 ^ r.random::<u64>();
    let before = g.path_launches(Path::QkvJoint);
    for step in 0..4 {
        let (x, d) = (randn(&mut r, rx.end(), 1.0), randn(&mut r, rx.end(), 1.0));
        g.write(&gx, 0, &x).unwrap();
        g.write(&gd, 0, &d).unwrap();
        fill_cache(g, &gc, &fill, cw, &prior, slot_len);
        let q_rope = (&gq, heads.cols(nope, rd), &gqm, rqm.cols(kl, rd), nh);
        let absorb = Some((&gw.2, heads.cols(0, nope), rqm.cols(0, kl)));
        let jobs = [(&gw.0, &gq, rq), (&gw.1, &gkv, rkv)];
        let op = || {
            g.norm_qkv_rope_cache(
                (&gx, rx),
                Some((&gd, rx)),
                Some(&gw.3),
                1e-6,
                (&gh, rx),
                jobs,
                (kl, Some(&gw.4)),
                q_rope,
                absorb,
                &gb,
                &gw.5,
                &gc,
            )
        };
        if !g.graph_begin(key, n) {
            op();
            if !g.graph_end() {
                op();
            }
        }
        let mut cv = vec![0f32; rows * cw];
        g.read_cache(&gc, &mut cv).unwrap();
        let got = [get(g, &gx, rx), get(g, &gh, rx), get(g, &gqm, rqm), cv];
        let want = run(e, &ew, &eb, n, &x, Some(&d));
        exact(&mut rep, &format!("recorded step {step}"), &["x", "h", "absorbed query", "cache"], &got, &want);
    }
    // (the first step eager, the second captured, then replays: the path ran in the first two)
    if g.path_launches(Path::QkvJoint) < before + 2 {
        rep.failures.push("the recorded steps did not take Path::QkvJoint".into());
    }
    rep.finish();
}

/// `mla_attention_out` on one backend for one decode token at position `hist` of slot 1 (a cache
/// of random rows up to it; the backend's latent cache with `latent`, else an f32 one), W_uv
/// and W_o of type `wty` (their bytes `uvb`, `wob`), with a 64-row f32 `next` product (a router) when `rw` is given, and then with `moe` = (its six Q8_0
/// weights' shapes and bytes as `moe_pair_exact` lays them out, its parameters) `moe_shared` of
/// the normed row and those logits: returns (x after the residual add, the normed rows, the
/// router's logits, the MoE's output).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn run_mla_out_of<B: Backend>(
    b: &B,
    wty: GgmlType,
    latent: bool,
    p: &MlaParams,
    hist: u32,
    cache_rows: &[f32],
    (uvb, wob): (&[u8], &[u8]),
    (q, x, nw): (&[f32], &[f32], &[f32]),
    rw: Option<&[u8]>,
    moe: Option<(&[Vec<usize>], &[Vec<u8>], &MoeParams, bool)>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, kl) = (p.n_heads, p.kv_lora);
    let (w, hd, slot_len) = (kl + p.rope_dim, x.len(), 4096u32);
    let all: Vec<TokenMeta> = (0..=hist).map(|pos| TokenMeta { token: 0, pos, slot: 1 }).collect();
    let cache = if latent { b.alloc_latent_cache(2 * slot_len as usize, w, kl, nh) } else { b.alloc_cache(2 * slot_len as usize, w) };
    let cache = cache.unwrap();
    fill_cache(b, &cache, cache_rows, w, &all, slot_len);
    let bt = batch(b, &BatchMeta { tokens: vec![TokenMeta { token: 1, pos: hist, slot: 1 }], outputs: vec![], slot_len });
    let (uvs, wos) = ([kl, 128, nh], [nh * 128, hd]);
    let uv = b.upload_weight(&td("w_uv", wty, &uvs, uvb), WeightUse::Matmul).unwrap();
    let wo = b.upload_weight(&td("wo", wty, &wos, wob), WeightUse::Matmul).unwrap();
    let norm = norm_weight(b, nw);
    let (gq, gx) = (buf(b, q), buf(b, x));
    let (lr, avr) = (Rows::packed(nh, kl), Rows::packed(nh, 128));
    let (lat, av, y, out) = (b.alloc(lr.end()).unwrap(), b.alloc(avr.end()).unwrap(), b.alloc(hd).unwrap(), b.alloc(hd).unwrap());
    poison(b, &out, hd);
    let xr = Rows::packed(1, hd);
    let rs = [hd, 64];
    let router = rw.map(|rw| b.upload_weight(&td("router", GgmlType::F32, &rs, rw), WeightUse::Matmul).unwrap());
    let (lg, lgr) = (b.alloc(64).unwrap(), Rows::packed(1, 64));
    poison(b, &lg, 64);
    let plain = MoeParams::top_k(64, 6);
    b.mla_attention_out(
        (&gq, Rows::packed(nh, w)),
        &cache,
        &bt,
        p,
        (&uv, &wo),
        (&lat, lr, &av, avr, Rows::packed(1, nh * 128)),
        (&gx, xr, &y),
        Some(&norm),
        1e-6,
        &out,
        xr,
        router.as_ref().map(|r| MoeNext { router: r, logits: (&lg, lgr), params: moe.map_or(&plain, |m| m.2) }),
    );
    let mut mo = Vec::new();
    if let Some((shapes, bytes, mp, residual)) = moe {
        let up = |i: usize| b.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &bytes[i]), WeightUse::Matmul).unwrap();
        let (ex, sh) = ([up(0), up(1), up(2)], [up(3), up(4), up(5)]);
        if residual {
            // The MoE added into x: the fourth result is x after it.
            let (e, s) = (experts3(&ex), experts3(&sh));
            assert!(b.moe_shared_residual(&out, xr, &lg, lgr, e, s, mp, &gx, xr), "moe_shared_residual declined");
            mo = get(b, &gx, xr);
        } else {
            let bo = b.alloc(hd).unwrap();
            poison(b, &bo, hd);
            run_moe_shared(b, &out, xr, &lg, lgr, &ex, &sh, mp, &bo, xr, true);
            mo = get(b, &bo, xr);
        }
    }
    (get(b, &gx, xr), get(b, &out, xr), if router.is_some() { get(b, &lg, lgr) } else { Vec::new() }, mo)
}

/// The gate, up and down of an expert stack or shared FFN as [`Experts`].
fn experts3<W>(w: &[W; 3]) -> Experts<'_, W> {
    Experts { gate: &w[0], up: &w[1], down: &w[2] }
}

/// The MLA decode's output side in one op (`mla_attention_out`; on the GPU for one token
/// `mla_out_q8`, the merge of the context splits and the W_uv and W_o products in one kernel,
/// then `add_rms_norm_parts`) against the same GPU's plain chain (merge, the two Q8_0 GEMVs,
/// add_rms_norm: `set_mla_out(0)`) and the CPU's: V2-Lite's shapes at short and long histories
/// (16 heads from 192 positions take the tensor-core split), other W_o row tiles, and a small
/// shape (4 heads, kv_lora 128, a W_o of 1,000 rows).
#[test]
fn fused_mla_attention_out() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    let c = cpu();
    let mut r = rng(31);
    let mut rep = Report::new("mla_attention_out");
    // (heads, kv_lora, rope, hidden, W_o rows a block, position)
    let cases: [(usize, usize, usize, usize, usize, u32); 7] = [
        (16, 512, 64, 2048, 256, 0),
        (16, 512, 64, 2048, 256, 5),
        (16, 512, 64, 2048, 128, 130),
        (16, 512, 64, 2048, 256, 700),
        (16, 512, 64, 2048, 256, 3000),
        (16, 512, 64, 1536, 96, 300),
        (4, 128, 32, 1000, 256, 40),
    ];
    for (nh, kl, rd, hd, rows, hist) in cases {
        let w = kl + rd;
        let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
        let cache_rows = randn(&mut r, (hist as usize + 1) * w, 1.0);
        let (uvb, _) = weight(&mut r, GgmlType::Q8_0, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
        let (wob, _) = weight(&mut r, GgmlType::Q8_0, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
        let (q, x, nw) = (randn(&mut r, nh * w, 0.5), randn(&mut r, hd, 1.0), randn(&mut r, hd, 1.0));
        let args = (&q[..], &x[..], &nw[..]);
        // A router of 64 f32 rows (the next product): in the norm's launch where it can be
        // (add_rms_norm_parts_router), which must give the bits of the norm then the product.
        let (rb, _) = weight(&mut r, GgmlType::F32, &[hd, 64], 1.0 / (hd as f32).sqrt());
        g.set_mla_out(rows);
        g.set_norm_router(true);
        let (fx, fo, fl, _) = run_mla_out_of(g, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
        g.set_norm_router(false);
        let (nx, no, nl, _) = run_mla_out_of(g, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
        exact(
            &mut rep,
            &format!("heads={nh} H={hd} pos={hist} router in the norm's launch"),
            &["x", "out", "logits"],
            &[fx.clone(), fo.clone(), fl.clone()],
            &[nx, no, nl],
        );
        g.set_mla_out(0);
        let (px, po, pl, _) = run_mla_out_of(g, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
        let (cx, co, cl, _) = run_mla_out_of(c, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
        // The tensor-core split rounds queries, keys and probabilities to f16.
        let tol = if nh == 16 && hist >= MLA_LONG_DEFAULT { 2e-2 } else { 5e-3 };
        let lab = format!("heads={nh} kv_lora={kl} H={hd} rows={rows} pos={hist}");
        rep.check(&format!("{lab} x vs gpu chain"), &fx, &px, 2e-3, 1e-3);
        rep.check(&format!("{lab} out vs gpu chain"), &fo, &po, 2e-3, 1e-3);
        rep.check(&format!("{lab} x vs cpu"), &fx, &cx, tol, tol);
        rep.check(&format!("{lab} out vs cpu"), &fo, &co, tol, tol);
        rep.check(&format!("{lab} router logits vs gpu chain"), &fl, &pl, 2e-3, 1e-3);
        rep.check(&format!("{lab} router logits vs cpu"), &fl, &cl, tol, tol);
    }
    rep.finish();
}

/// One token's attention output after the early tensor-core split with its partial rows divided
/// by their softmax sums and stored as f16 (`Path::HalfParts`: `mla_split_tc_hep`, merged by
/// `mla_out_q8p`) against the f32 rows (`mla_split_tc_he`, `mla_out_q8`) on the same backend:
/// the rows rounded to f16 (within 5e-3 of the rms; measured on an H100 at most 1.2e-3 for x
/// and 3.0e-3 for the normed output), taken exactly when on, at contexts past the tensor-core
/// split's threshold (192, `TS_CUDA_MLA_LONG`).
#[test]
fn mla_out_half_parts() {
    if tc_gpu("mla_out_half_parts").is_none() {
        return;
    }
    let g = &CudaBackend::new(0).expect("second backend");
    g.set_mla_out(256);
    g.set_path(Path::SplitEarly, true);
    let mut r = rng(61);
    let mut rep = Report::new("mla_out_half_parts");
    let (nh, kl, rd, hd) = (16usize, 512usize, 64usize, 2048usize);
    let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
    for hist in [300u32, 2600, 4000] {
        let cache_rows = randn(&mut r, (hist as usize + 1) * (kl + rd), 1.0);
        let (uvb, _) = weight(&mut r, GgmlType::Q8_0, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
        let (wob, _) = weight(&mut r, GgmlType::Q8_0, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
        let (q, x, nw) = (randn(&mut r, nh * (kl + rd), 0.5), randn(&mut r, hd, 1.0), randn(&mut r, hd, 1.0));
        let mut res = Vec::new();
        for on in [false, true] {
            g.set_path(Path::HalfParts, on);
            let before = g.path_launches(Path::HalfParts);
            let (fx, fo, _, _) =
                run_mla_out_of(g, GgmlType::Q8_0, true, &p, hist, &cache_rows, (&uvb, &wob), (&q[..], &x[..], &nw[..]), None, None);
            let took = g.path_launches(Path::HalfParts) - before;
            if took != u64::from(on) {
                rep.failures.push(format!("pos={hist}: the f16 partial rows were taken {took} times with the path {on}"));
            }
            res.push((fx, fo));
        }
        rep.check(&format!("pos={hist} x: f16 partial rows vs f32"), &res[1].0, &res[0].0, 5e-3, 5e-3);
        rep.check(&format!("pos={hist} out: f16 partial rows vs f32"), &res[1].1, &res[0].1, 5e-3, 5e-3);
    }
    g.set_path(Path::HalfParts, false);
    rep.finish();
}

/// The same op with f16 / bf16 W_uv and W_o: on the GPU for one token `mla_out_<t>` (clusters of
/// 8 blocks a head: the merge, the value rows with gemv_h16's arithmetic, the output's per-head
/// rows; `set_path(Path::Out16, true)`), then the norm with the router and the routing in one launch, against
/// the same GPU's plain chain (merge, the two 16-bit GEMVs, add_rms_norm, the router's product)
/// and the CPU's. V2-Lite's shapes at short and long histories (the tensor-core split from 192)
/// and a small shape (4 heads, kv_lora 128, a W_o of 1,000 rows).
#[test]
fn fused_mla_attention_out_h16() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    let c = cpu();
    let mut r = rng(32);
    let mut rep = Report::new("mla_attention_out_h16");
    // (heads, kv_lora, rope, hidden, position)
    let cases: [(usize, usize, usize, usize, u32); 5] =
        [(16, 512, 64, 2048, 0), (16, 512, 64, 2048, 5), (16, 512, 64, 2048, 700), (16, 512, 64, 2048, 3000), (4, 128, 32, 1000, 40)];
    for ty in [GgmlType::BF16, GgmlType::F16] {
        for (nh, kl, rd, hd, hist) in cases {
            let w = kl + rd;
            let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
            let cache_rows = randn(&mut r, (hist as usize + 1) * w, 1.0);
            let (uvb, _) = weight(&mut r, ty, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
            let (wob, _) = weight(&mut r, ty, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
            let (q, x, nw) = (randn(&mut r, nh * w, 0.5), randn(&mut r, hd, 1.0), randn(&mut r, hd, 1.0));
            let args = (&q[..], &x[..], &nw[..]);
            let (rb, _) = weight(&mut r, GgmlType::F32, &[hd, 64], 1.0 / (hd as f32).sqrt());
            let lab = format!("{ty:?} heads={nh} kv_lora={kl} H={hd} pos={hist}");
            g.set_path(Path::Out16, true);
            let before = g.path_launches(Path::Out16);
            let (fx, fo, fl, _) = run_mla_out_of(g, ty, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            assert_eq!(g.path_launches(Path::Out16) - before, u64::from(g.fused()), "{lab}: mla_out_<t> launches");
            g.set_path(Path::Out16, false);
            let (px, po, pl, _) = run_mla_out_of(g, ty, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            let (cx, co, cl, _) = run_mla_out_of(c, ty, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            let tol = if nh == 16 && hist >= MLA_LONG_DEFAULT { 2e-2 } else { 5e-3 };
            rep.check(&format!("{lab} x vs gpu chain"), &fx, &px, 2e-3, 1e-3);
            rep.check(&format!("{lab} out vs gpu chain"), &fo, &po, 2e-3, 1e-3);
            rep.check(&format!("{lab} router logits vs gpu chain"), &fl, &pl, 2e-3, 1e-3);
            rep.check(&format!("{lab} x vs cpu"), &fx, &cx, tol, tol);
            rep.check(&format!("{lab} out vs cpu"), &fo, &co, tol, tol);
            rep.check(&format!("{lab} router logits vs cpu"), &fl, &cl, tol, tol);
        }
    }
    rep.finish();
}

/// Random `[k, m]` weights of the given types, uploaded to the GPU and the CPU.
fn job_weights(g: &CudaBackend, c: &CpuBackend, r: &mut StdRng, k: usize, jobs: &[(GgmlType, usize)]) -> (Vec<CudaWeight>, Vec<CpuWeight>) {
    jobs.iter()
        .map(|&(ty, m)| {
            let shape = [k, m];
            let (bytes, _) = weight(r, ty, &shape, 0.5);
            let t = td("w", ty, &shape, &bytes);
            (g.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap())
        })
        .unzip()
}

/// The jobs' output views for `n` rows, all in one buffer: job j at its own columns of rows of
/// (the jobs' widths + 1), from offset 2; and the buffer's length.
fn job_views(jobs: &[(GgmlType, usize)], n: usize) -> (Vec<Rows>, usize) {
    let widths: Vec<usize> = jobs.iter().map(|j| j.1).collect();
    job_views_at(&widths, n, 2, 1)
}

/// `matmul_many` of `x` (rows `xr`) into the jobs' `views` of one fresh NaN-poisoned buffer of
/// `olen` floats on `b`: the whole buffer after (the columns between the views too).
fn many_into<B: Backend>(b: &B, w: &[B::Weight], views: &[Rows], x: &[f32], xr: Rows, olen: usize) -> Vec<f32> {
    let (xb, ob) = (buf(b, x), b.alloc(olen).unwrap());
    poison(b, &ob, olen);
    let jobs: Vec<(&B::Weight, &B::Buf, Rows)> = w.iter().zip(views).map(|(w, &v)| (w, &ob, v)).collect();
    b.matmul_many(&xb, xr, &jobs);
    get(b, &ob, Rows::packed(1, olen))
}

/// [`job_views`] for jobs of these widths, from offset `base`, rows of (the widths + `pad`).
fn job_views_at(widths: &[usize], n: usize, base: usize, pad: usize) -> (Vec<Rows>, usize) {
    let ostride = widths.iter().sum::<usize>() + pad;
    let mut col = 0;
    let views = widths
        .iter()
        .map(|&m| {
            col += m;
            Rows { off: base + col - m, n, width: m, stride: ostride }
        })
        .collect();
    (views, base + n * ostride)
}

#[test]
fn fused_matmul_many() {
    let Some(g) = gpu() else { return };
    fused_banner(g);
    let c = cpu();
    let mut r = rng(14);
    let mut rep = Report::new("matmul_many");
    use GgmlType::{F16, Q8_0};
    // (k, [(type, m)]): q + kv_a of V2-Lite, 3 jobs, 4 and 5 jobs (chunks of 3 plus 1 or 2), short
    // rows (lpr 8), widths that are not whole 4-block groups, 1-row matrices, a mixed-type set
    // (the plain fallback).
    let sets: Vec<(usize, Vec<(GgmlType, usize)>)> = vec![
        (2048, vec![(Q8_0, 3072), (Q8_0, 576)]),
        (1408, vec![(Q8_0, 97), (Q8_0, 576), (Q8_0, 40)]),
        (96, vec![(Q8_0, 64), (Q8_0, 64), (Q8_0, 64), (Q8_0, 64)]),
        (128, vec![(Q8_0, 33), (Q8_0, 7), (Q8_0, 200), (Q8_0, 512), (Q8_0, 1)]),
        (512, vec![(Q8_0, 97), (F16, 64)]),
        // Quantised once for all jobs (k >= 1024), a width that is not whole groups, a lone 4th job.
        (1056, vec![(Q8_0, 97), (Q8_0, 64), (Q8_0, 33), (Q8_0, 5)]),
    ];
    for (k, jobs) in &sets {
        let k = *k;
        let (gws, cws) = job_weights(g, c, &mut r, k, jobs);
        for &n in &[1usize, 2, 3, 5, 8, 64] {
            let xr = Rows { off: 1, n, width: k, stride: k + 3 };
            let x = randn(&mut r, xr.end(), 1.0);
            let (views, olen) = job_views(jobs, n);
            let (gx, cx) = (buf(g, &x), buf(c, &x));
            let (go, co, po) = (g.alloc(olen).unwrap(), c.alloc(olen).unwrap(), g.alloc(olen).unwrap());
            poison(g, &go, olen);
            poison(c, &co, olen);
            poison(g, &po, olen);
            let gj: Vec<(&CudaWeight, &CudaBuf, Rows)> = gws.iter().zip(&views).map(|(w, &v)| (w, &go, v)).collect();
            let cj: Vec<_> = cws.iter().zip(&views).map(|(w, &v)| (w, &co, v)).collect();
            g.matmul_many(&gx, xr, &gj);
            c.matmul_many(&cx, xr, &cj);
            for (w, &v) in gws.iter().zip(&views) {
                g.matmul(&gx, xr, w, &po, v);
            }
            for (j, (&(ty, m), &v)) in jobs.iter().zip(&views).enumerate() {
                let lab = format!("k={k} jobs={} job {j} {}x{m} n={n}", jobs.len(), ty.name());
                let got = get(g, &go, v);
                let (tc, _) = matmul_tol(ty, n);
                rep.check(&format!("{lab} vs cpu"), &got, &get(c, &co, v), tc, 1e-3);
                rep.check(&format!("{lab} vs gpu matmul"), &got, &get(g, &po, v), 1e-6, 1e-5);
            }
        }
    }
    rep.finish();
}

/// matmul_many of decode batches on the 64-token int8 tiles with the jobs in one launch
/// (`Path::DenseJobs`: `mmq_q8_64_jobs`, `mmq_sum_splits_jobs`) and the weight copies before the
/// PDL wait (`Path::DenseEarly`: `mmq_q8_64e`, `mmq_q8_64_jobse`), alone and together, against
/// one launch a job (both off), bit for bit, and against the CPU: V2-Lite's q + kv_a at 64, 80
/// and 128 rows (two token tiles, a short last one), three jobs with odd widths, narrow jobs (16
/// splits each), a job wide enough to go without splits beside one with them; output views at
/// 16-byte boundaries and off them.
#[test]
fn dense_jobs_exact() {
    if gpu_tc_fused("dense_jobs_exact").is_none() {
        return;
    }
    // (DenseJobs, DenseEarly) for each backend; the last is the reference.
    let modes = [(true, false), (false, true), (true, true), (false, false)];
    let bs: Vec<CudaBackend> = modes
        .iter()
        .map(|&(jobs, early)| {
            let b = CudaBackend::new(0).expect("another backend");
            b.set_path(Path::DenseJobs, jobs);
            b.set_path(Path::DenseEarly, early);
            // (the int8 tiles: decode batches otherwise take cuBLAS, dense_blas_batch's test)
            b.set_path(Path::DenseBlasBatch, false);
            b
        })
        .collect();
    let c = cpu();
    let mut r = rng(49);
    let mut rep = Report::new("dense jobs");
    // (k, the jobs' rows, batch sizes)
    let sets: Vec<(usize, Vec<usize>, Vec<usize>)> = vec![
        (2048, vec![3072, 576], vec![64, 80, 128]),
        (1536, vec![200, 576, 97], vec![64, 100]),
        (2048, vec![64, 32], vec![64]),
        (2048, vec![8192, 576], vec![128]),
    ];
    let mut cases = 0u64;
    for (k, ms, ns) in &sets {
        let k = *k;
        let bytes: Vec<Vec<u8>> = ms.iter().map(|&m| weight(&mut r, GgmlType::Q8_0, &[k, m], 0.5).0).collect();
        let shapes: Vec<[usize; 2]> = ms.iter().map(|&m| [k, m]).collect();
        let tds: Vec<TensorData> = shapes.iter().zip(&bytes).map(|(sh, b)| td("w", GgmlType::Q8_0, sh, b)).collect();
        let ws: Vec<Vec<CudaWeight>> =
            bs.iter().map(|b| tds.iter().map(|t| b.upload_weight(t, WeightUse::Matmul).unwrap()).collect()).collect();
        let wc: Vec<CpuWeight> = tds.iter().map(|t| c.upload_weight(t, WeightUse::Matmul).unwrap()).collect();
        for &n in ns {
            for aligned in [true, false] {
                // The jobs' columns side by side from offset `base`, rows of their widths + `pad`.
                let (base, pad) = if aligned { (4, 4) } else { (2, 1) };
                let (views, olen) = job_views_at(ms, n, base, pad);
                let xr = Rows { off: 1, n, width: k, stride: k + 3 };
                let x = randn(&mut r, xr.end(), 1.0);
                let lab = format!("k={k} m={ms:?} n={n} aligned={aligned}");
                let got: Vec<Vec<f32>> = bs.iter().zip(&ws).map(|(b, w)| many_into(b, w, &views, &x, xr, olen)).collect();
                let cpu_out = many_into(c, &wc, &views, &x, xr, olen);
                // Every element of the buffer, the columns between the views (untouched) too.
                let reference = got.last().unwrap();
                for (mode, g) in modes.iter().zip(&got) {
                    let same = g.iter().zip(reference).all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
                    if !same {
                        rep.failures.push(format!("{lab}: (DenseJobs, DenseEarly) = {mode:?} differs from one launch a job"));
                    }
                }
                let (tc, _) = matmul_tol(GgmlType::Q8_0, n);
                for (j, (&m, &v)) in ms.iter().zip(&views).enumerate() {
                    let view: Vec<f32> = (0..n).flat_map(|i| got[2][v.off + i * v.stride..][..m].to_vec()).collect();
                    let want: Vec<f32> = (0..n).flat_map(|i| cpu_out[v.off + i * v.stride..][..m].to_vec()).collect();
                    rep.check(&format!("{lab} job {j} ({m} rows) vs cpu"), &view, &want, tc, 1e-3);
                }
                cases += 1;
            }
        }
    }
    // Each switch ran where it was on (the jobs' launch on every case) and nowhere else.
    for (&(jobs, early), b) in modes.iter().zip(&bs) {
        let n = [Path::DenseJobs, Path::DenseEarly].map(|p| b.path_launches(p));
        let ok = (n[0] == if jobs { cases } else { 0 }) && (n[1] > 0) == early;
        if !ok {
            rep.failures.push(format!("(DenseJobs, DenseEarly) = {:?}: launches {n:?} ({cases} cases)", (jobs, early)));
        }
    }
    rep.finish();
}

/// A decode batch's output head on the Hopper MoE kernel ([`Path::HeadMmh`]): Q8_0 products of
/// more than 8,192 rows, in tiles of 256 (`mmh8_dn`: 8,448 and 12,288 rows) and of 200
/// (`mmh8_dn200`: 12,800 rows, 64 tiles of 200 against 50 of 256 on a card of 64 or more SMs,
/// one wave either way), for 9 to 128 rows of x (with a stride of their own) against the
/// default path (cuBLAS on the f16 copy: the same f16 operands summed in another order), the
/// CPU and f64; that the path ran where the Hopper kernels are, and that it declined (the
/// default path's figures) where they are not.
#[test]
fn head_mmh() {
    let Some(g) = gpu_tc_fused("head_mmh") else { return };
    let on = &CudaBackend::new(0).expect("second backend");
    on.set_path(Path::HeadMmh, true);
    let c = cpu();
    let mut r = rng(59);
    let mut rep = Report::new("head_mmh");
    for &(k, m) in &[(2048usize, 8448usize), (256, 12288), (512, 12800)] {
        let shape = [k, m];
        let (bytes, deq) = weight(&mut r, GgmlType::Q8_0, &shape, 0.5);
        let t = td("w", GgmlType::Q8_0, &shape, &bytes);
        let (wn, wd, wc) = (
            on.upload_weight(&t, WeightUse::Matmul).unwrap(),
            g.upload_weight(&t, WeightUse::Matmul).unwrap(),
            c.upload_weight(&t, WeightUse::Matmul).unwrap(),
        );
        for n in [9usize, 40, 64, 128] {
            let xr = Rows { off: 3, n, width: k, stride: k + 5 };
            let o = Rows::packed(n, m);
            let x = randn(&mut r, xr.end(), 1.0);
            let run = |b: &CudaBackend, w: &CudaWeight| {
                let (xb, ob) = (buf(b, &x), b.alloc(o.end()).unwrap());
                poison(b, &ob, o.end());
                b.matmul(&xb, xr, w, &ob, o);
                get(b, &ob, o)
            };
            let before = on.path_launches(Path::HeadMmh);
            let (got, blas) = (run(on, &wn), run(g, &wd));
            let took = on.path_launches(Path::HeadMmh) > before;
            let cpu_out = {
                let (xb, ob) = (buf(c, &x), c.alloc(o.end()).unwrap());
                c.matmul(&xb, xr, &wc, &ob, o);
                get(c, &ob, o)
            };
            let exact = matmul_f64(&deq, m, k, &x, xr);
            let lab = format!("k={k} m={m} n={n}");
            eprintln!("  {lab}: HeadMmh {}", if took { "taken" } else { "declined" });
            if took != on.hopper_kernels() {
                rep.failures.push(format!("{lab}: HeadMmh taken {took}, Hopper kernels {}", on.hopper_kernels()));
            }
            rep.check(&format!("{lab} vs the default path"), &got, &blas, 1e-4, 1e-4);
            rep.check(&format!("{lab} vs cpu"), &got, &cpu_out, 6e-2, 1e-3);
            rep.check(&format!("{lab} vs f64"), &got, &exact, 5e-3, 1e-3);
        }
    }
    rep.finish();
}

/// Decode batches' dense Q8_0 products on cuBLAS in f16 ([`Path::DenseBlasBatch`], from the
/// row-major f16 copies made at upload): `matmul`, the per-head `matmul_grouped` and
/// `matmul_many` of 9 to 128 rows (rows of x with a stride of their own) against the CPU, and
/// closer to f64 of the dequantised weights than the int8 tiles (which round the activations to
/// 8 bits), so the f16 path is known to have run; the path's counter says so too.
#[test]
fn dense_blas_batch() {
    if gpu_tc_fused("dense_blas_batch").is_none() {
        return;
    }
    let on = &CudaBackend::new(0).expect("second backend");
    let off = &CudaBackend::new(0).expect("third backend");
    on.set_path(Path::DenseBlasBatch, true);
    off.set_path(Path::DenseBlasBatch, false);
    let c = cpu();
    let mut r = rng(53);
    let mut rep = Report::new("dense_blas_batch");
    // (k, m, matrices): V2-Lite's kv_a, W_o, W_uk (16 heads of 512 x 128) and W_uv (16 of 128 x 512).
    for &(k, m, g) in &[(2048usize, 576usize, 1usize), (2048, 2048, 1), (128, 512, 16), (512, 128, 16)] {
        let shape: Vec<usize> = if g == 1 { vec![k, m] } else { vec![k, m, g] };
        let (bytes, deq) = weight(&mut r, GgmlType::Q8_0, &shape, 0.5);
        let t = td("w", GgmlType::Q8_0, &shape, &bytes);
        let (wn, wf, wc) = (
            on.upload_weight(&t, WeightUse::Matmul).unwrap(),
            off.upload_weight(&t, WeightUse::Matmul).unwrap(),
            c.upload_weight(&t, WeightUse::Matmul).unwrap(),
        );
        for n in [9usize, 17, 40, 64, 128] {
            let rows = n * g;
            let xr = Rows { off: 3, n: rows, width: k, stride: k + 5 };
            let o = Rows { off: 1, n: rows, width: m, stride: m + 2 };
            let x = randn(&mut r, xr.end(), 1.0);
            let run = |b: &CudaBackend, w: &CudaWeight| {
                let (xb, ob) = (buf(b, &x), b.alloc(o.end()).unwrap());
                poison(b, &ob, o.end());
                if g == 1 {
                    b.matmul(&xb, xr, w, &ob, o);
                } else {
                    b.matmul_grouped(&xb, xr, w, &ob, o);
                }
                get(b, &ob, o)
            };
            let before = on.path_launches(Path::DenseBlasBatch);
            let (got, int8) = (run(on, &wn), run(off, &wf));
            let cpu_out = {
                let (xb, ob) = (buf(c, &x), c.alloc(o.end()).unwrap());
                if g == 1 {
                    c.matmul(&xb, xr, &wc, &ob, o);
                } else {
                    c.matmul_grouped(&xb, xr, &wc, &ob, o);
                }
                get(c, &ob, o)
            };
            // f64 of the dequantised weights, row j by matrix j % g.
            let mut exact = vec![0f32; rows * m];
            for h in 0..g {
                let xs: Vec<f32> = (0..n).flat_map(|i| x[xr.off + (i * g + h) * xr.stride..][..k].to_vec()).collect();
                let e = matmul_f64(&deq[h * m * k..(h + 1) * m * k], m, k, &xs, Rows::packed(n, k));
                for i in 0..n {
                    exact[(i * g + h) * m..][..m].copy_from_slice(&e[i * m..(i + 1) * m]);
                }
            }
            let lab = format!("k={k} m={m} g={g} n={n}");
            if on.path_launches(Path::DenseBlasBatch) == before {
                rep.failures.push(format!("{lab}: the product did not take Path::DenseBlasBatch"));
            }
            rep.check(&format!("{lab} vs cpu"), &got, &cpu_out, 6e-2, 1e-3);
            rep.check(&format!("{lab} vs f64"), &got, &exact, 5e-3, 1e-3);
            let err = |v: &[f32]| v.iter().zip(&exact).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
            if err(&got) >= err(&int8) {
                rep.failures.push(format!(
                    "{lab}: cuBLAS f16 {:.3e} from f64, not closer than the int8 tiles' {:.3e}",
                    err(&got),
                    err(&int8)
                ));
            }
        }
    }
    // matmul_many (q and kv_a of V2-Lite) from one f16 input; and after add_rms_norm in its
    // launch (add_rms_norm_h), whose x and out are add_rms_norm's bits.
    let ms = [3072usize, 576];
    let tds_bytes: Vec<Vec<u8>> = ms.iter().map(|&m| weight(&mut r, GgmlType::Q8_0, &[2048, m], 0.5).0).collect();
    let shapes: Vec<[usize; 2]> = ms.iter().map(|&m| [2048, m]).collect();
    let tds: Vec<TensorData> = shapes.iter().zip(&tds_bytes).map(|(sh, b)| td("w", GgmlType::Q8_0, sh, b)).collect();
    let wn: Vec<CudaWeight> = tds.iter().map(|t| on.upload_weight(t, WeightUse::Matmul).unwrap()).collect();
    let wc: Vec<CpuWeight> = tds.iter().map(|t| c.upload_weight(t, WeightUse::Matmul).unwrap()).collect();
    for n in [9usize, 33, 64, 128] {
        let (views, olen) = job_views_at(&ms, n, 2, 1);
        let xr = Rows { off: 1, n, width: 2048, stride: 2048 + 3 };
        let x = randn(&mut r, xr.end(), 1.0);
        let before = on.path_launches(Path::DenseBlasBatch);
        let got = many_into(on, &wn, &views, &x, xr, olen);
        let cpu_out = many_into(c, &wc, &views, &x, xr, olen);
        if on.path_launches(Path::DenseBlasBatch) == before {
            rep.failures.push(format!("matmul_many n={n}: did not take Path::DenseBlasBatch"));
        }
        for (j, (&m, &v)) in ms.iter().zip(&views).enumerate() {
            let view: Vec<f32> = (0..n).flat_map(|i| got[v.off + i * v.stride..][..m].to_vec()).collect();
            let want: Vec<f32> = (0..n).flat_map(|i| cpu_out[v.off + i * v.stride..][..m].to_vec()).collect();
            rep.check(&format!("matmul_many n={n} job {j} ({m} rows) vs cpu"), &view, &want, 6e-2, 1e-3);
        }
        // The norm's launch with the f16 input: on (add_rms_norm_h, then the jobs from its
        // f16 rows) against the matmul_many above of the plain norm's output.
        let hr = Rows { off: 2, n, width: 2048, stride: 2048 + 1 };
        let (hx, hd) = (randn(&mut r, hr.end(), 1.0), randn(&mut r, hr.end(), 1.0));
        let nw = randn(&mut r, 2048, 1.0);
        let runs: Vec<[Vec<f32>; 3]> = [(on, true), (on, false)]
            .iter()
            .map(|&(b, fused)| {
                let (bx, bd, bo) = (buf(b, &hx), buf(b, &hd), b.alloc(hr.end()).unwrap());
                // (zeros, not NaN: the columns between the views stay as written, and the
                // exact check counts NaN against NaN as a difference)
                let ob = buf(b, &vec![0f32; olen]);
                let norm = norm_weight(b, &nw);
                let jobs: Vec<(&CudaWeight, &CudaBuf, Rows)> = wn.iter().zip(&views).map(|(w, &v)| (w, &ob, v)).collect();
                if fused {
                    b.add_rms_norm_matmul_many((&bx, hr), (&bd, hr), Some(&norm), 1e-6, (&bo, hr), &jobs);
                } else {
                    b.add_rms_norm(&bx, hr, &bd, hr, Some(&norm), 1e-6, &bo, hr);
                    b.matmul_many(&bo, hr, &jobs);
                }
                [get(b, &bx, hr), get(b, &bo, hr), get(b, &ob, Rows::packed(1, olen))]
            })
            .collect();
        exact(&mut rep, &format!("add_rms_norm_matmul_many n={n}"), &["x", "out", "jobs"], &runs[0], &runs[1]);
    }
    // The value and output products of a batch's attention (mla_attention_out's W_uv into f16,
    // then W_o) are checked in norm_q8_batch_exact.
    rep.finish();
}

/// Decode batches' f32 routers on `gemv_f32_split` ([`Path::RouterSplit`]: 8 tokens a block row):
/// each token's logits bit for bit as when it is alone (one token, the same kernel), and against
/// the CPU. V2-Lite's router (64 x 2048) and V2's (160 x 5120) at 9 to 128 tokens; rows of x with
/// a stride of their own.
#[test]
fn router_split_exact() {
    if gpu().is_none() {
        return;
    }
    let b = &CudaBackend::new(0).expect("second backend");
    b.set_path(Path::RouterSplit, true);
    let c = cpu();
    let mut r = rng(52);
    let mut rep = Report::new("router_split");
    for &(k, m) in &[(2048usize, 64usize), (5120, 160)] {
        let shape = [k, m];
        let (bytes, _) = weight(&mut r, GgmlType::F32, &shape, 0.5);
        let t = td("router", GgmlType::F32, &shape, &bytes);
        let (wb, wc) = (b.upload_weight(&t, WeightUse::Matmul).unwrap(), c.upload_weight(&t, WeightUse::Matmul).unwrap());
        for n in [9usize, 16, 64, 100, 128] {
            let xr = Rows { off: 4, n, width: k, stride: k + 8 };
            let o = Rows { off: 2, n, width: m, stride: m + 3 };
            let x = randn(&mut r, xr.end(), 1.0);
            let (xb, ob) = (buf(b, &x), b.alloc(o.end()).unwrap());
            poison(b, &ob, o.end());
            let before = b.path_launches(Path::RouterSplit);
            b.matmul(&xb, xr, &wb, &ob, o);
            if b.path_launches(Path::RouterSplit) == before {
                rep.failures.push(format!("[{k},{m}] n={n}: the split kernel was not taken"));
            }
            let got = get(b, &ob, o);
            // Each token alone (the one-token launch of the same kernel).
            let mut alone = Vec::with_capacity(n * m);
            for j in 0..n {
                let (xj, oj) = (Rows { off: xr.off + j * xr.stride, n: 1, ..xr }, Rows::packed(1, m));
                let o1 = b.alloc(m).unwrap();
                b.matmul(&xb, xj, &wb, &o1, oj);
                alone.extend(get(b, &o1, oj));
            }
            rep.check(&format!("[{k},{m}] n={n} against each token alone (exact)"), &got, &alone, 0.0, 0.0);
            let (xc, oc) = (buf(c, &x), c.alloc(o.end()).unwrap());
            c.matmul(&xc, xr, &wc, &oc, o);
            rep.check(&format!("[{k},{m}] n={n} vs cpu"), &got, &get(c, &oc, o), 1e-4, 1e-4);
        }
    }
    rep.finish();
}

/// add_rms_norm_matmul_many (a decode layer's first norm and its q / kv_a products; CUDA, one
/// token: `gemv_q8_multi_norm_1`, every block normalising the row itself) against the two ops on
/// the same GPU, bit for bit (x, the normed row, every product), and against the CPU. Three
/// rounds on the same shapes: the kernel's block counter must be back at zero after each. Then
/// rms_norm_matmul_many on the same x, the norm without the add (the first norm after a MoE that
/// added its output into x: `gemv_q8_multi_norm_1` without a delta, `set_moe_residual(true)`),
/// against its two ops (the switch off), bit for bit, x untouched. 16-bit products take
/// `gemv_h16_multi_norm_<t>_1` (`set_norm_mm16(true)`). A backend of its own, for the switches.
#[test]
fn fused_add_rms_norm_matmul_many() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    g.set_norm_mm16(true);
    // Batches on the int8 products: the norm and the quantisation in one launch (Path::NormQ8).
    g.set_path(Path::NormQ8, true);
    g.set_path(Path::DenseBlasBatch, false);
    let c = cpu();
    let mut r = rng(21);
    let mut rep = Report::new("add_rms_norm_matmul_many");
    use GgmlType::{BF16, F16, Q8_0};
    // (k, n, [(type, m)]): V2-Lite's q + kv_a, three jobs, the narrowest fused width, a width
    // past the fused kernel's (5120: V2's; the two ops), two rows (the two ops), a mixed set.
    type Set = (usize, usize, Vec<(GgmlType, usize)>);
    let sets: Vec<Set> = vec![
        (2048, 1, vec![(Q8_0, 3072), (Q8_0, 576)]),
        (2048, 1, vec![(Q8_0, 1536), (Q8_0, 576), (Q8_0, 97)]),
        (256, 1, vec![(Q8_0, 64), (Q8_0, 33)]),
        (1536, 1, vec![(Q8_0, 200), (Q8_0, 576)]),
        (5120, 1, vec![(Q8_0, 128), (Q8_0, 64)]),
        (2048, 2, vec![(Q8_0, 96), (Q8_0, 64)]),
        (2048, 1, vec![(Q8_0, 96), (F16, 64)]),
        // Decode batches on the int8 products (add_rms_norm_q8, Path::NormQ8): V2-Lite's q + kv_a
        // at 64 rows, three jobs at 24, a narrow row (fewer groups than warps).
        (2048, 64, vec![(Q8_0, 3072), (Q8_0, 576)]),
        (2048, 24, vec![(Q8_0, 1536), (Q8_0, 576), (Q8_0, 97)]),
        (256, 64, vec![(Q8_0, 64), (Q8_0, 33)]),
        // 16-bit products (gemv_h16_multi_norm_<t>_1, set_norm_mm16): V2-Lite's bf16 q + kv_a,
        // three f16 jobs.
        (2048, 1, vec![(BF16, 3072), (BF16, 576)]),
        (1536, 1, vec![(F16, 200), (F16, 576), (F16, 33)]),
    ];
    for (k, n, jobs) in &sets {
        let (k, n) = (*k, *n);
        let (gws, cws) = job_weights(g, c, &mut r, k, jobs);
        let nw = randn(&mut r, k, 1.0);
        let (gnw, cnw) = (norm_weight(g, &nw), norm_weight(c, &nw));
        let xr = Rows { off: 3, n, width: k, stride: k + 1 };
        let hr = Rows::packed(n, k);
        let (views, olen) = job_views(jobs, n);
        for round in 0..3 {
            let x = randn(&mut r, xr.end(), 2.0);
            let d = randn(&mut r, xr.end(), 1.0);
            let lab = format!("k={k} n={n} jobs={} round {round}", jobs.len());
            // The fused op on the GPU and the CPU; the two ops on the GPU.
            let (gx, gd, px, pd, cx, cd) = (buf(g, &x), buf(g, &d), buf(g, &x), buf(g, &d), buf(c, &x), buf(c, &d));
            let (gh, ph, ch) = (g.alloc(hr.end()).unwrap(), g.alloc(hr.end()).unwrap(), c.alloc(hr.end()).unwrap());
            let (go, po, co) = (g.alloc(olen).unwrap(), g.alloc(olen).unwrap(), c.alloc(olen).unwrap());
            for (b, len) in [(&gh, hr.end()), (&ph, hr.end()), (&go, olen), (&po, olen)] {
                poison(g, b, len);
            }
            poison(c, &co, olen);
            let gj: Vec<(&CudaWeight, &CudaBuf, Rows)> = gws.iter().zip(&views).map(|(w, &v)| (w, &go, v)).collect();
            let pj: Vec<(&CudaWeight, &CudaBuf, Rows)> = gws.iter().zip(&views).map(|(w, &v)| (w, &po, v)).collect();
            let cj: Vec<_> = cws.iter().zip(&views).map(|(w, &v)| (w, &co, v)).collect();
            g.add_rms_norm_matmul_many((&gx, xr), (&gd, xr), Some(&gnw), 1e-6, (&gh, hr), &gj);
            g.add_rms_norm(&px, xr, &pd, xr, Some(&gnw), 1e-6, &ph, hr);
            g.matmul_many(&ph, hr, &pj);
            c.add_rms_norm_matmul_many((&cx, xr), (&cd, xr), Some(&cnw), 1e-6, (&ch, hr), &cj);
            let full = Rows::packed(1, xr.end());
            rep.check(&format!("{lab} x (exact)"), &get(g, &gx, full), &get(g, &px, full), 0.0, 0.0);
            rep.check(&format!("{lab} delta (exact)"), &get(g, &gd, full), &get(g, &pd, full), 0.0, 0.0);
            rep.check(&format!("{lab} h (exact)"), &get(g, &gh, hr), &get(g, &ph, hr), 0.0, 0.0);
            rep.check(&format!("{lab} x vs cpu"), &get(g, &gx, full), &get(c, &cx, full), 1e-5, 1e-5);
            rep.check(&format!("{lab} h vs cpu"), &get(g, &gh, hr), &get(c, &ch, hr), 1e-5, 1e-5);
            for (j, (&(ty, m), &v)) in jobs.iter().zip(&views).enumerate() {
                let got = get(g, &go, v);
                rep.check(&format!("{lab} job {j} {}x{m} (exact)", ty.name()), &got, &get(g, &po, v), 0.0, 0.0);
                let (tc, _) = matmul_tol(ty, n);
                rep.check(&format!("{lab} job {j} {}x{m} vs cpu", ty.name()), &got, &get(c, &co, v), tc, 1e-3);
            }
            // The norm only, on the x the add left (gx, px: the same bits), fused and as two ops.
            let xs = get(g, &gx, full);
            g.set_moe_residual(true);
            g.rms_norm_matmul_many((&gx, xr), Some(&gnw), 1e-6, (&gh, hr), &gj);
            g.set_moe_residual(false);
            g.set_norm_mm16(false);
            g.set_path(Path::NormQ8, false);
            g.rms_norm_matmul_many((&px, xr), Some(&gnw), 1e-6, (&ph, hr), &pj);
            g.set_path(Path::NormQ8, true);
            g.set_norm_mm16(true);
            rep.check(&format!("{lab} norm only: x untouched"), &get(g, &gx, full), &xs, 0.0, 0.0);
            rep.check(&format!("{lab} norm only: h (exact)"), &get(g, &gh, hr), &get(g, &ph, hr), 0.0, 0.0);
            for (j, &v) in views.iter().enumerate() {
                rep.check(&format!("{lab} norm only: job {j} (exact)"), &get(g, &go, v), &get(g, &po, v), 0.0, 0.0);
            }
        }
    }
    // 3 batch sets x 3 rounds x (the add's op and the norm's): the fused launch each time.
    if g.path_launches(Path::NormQ8) != 18 {
        rep.failures.push(format!("the batches' norm and quantisation in one launch ran {} times, not 18", g.path_launches(Path::NormQ8)));
    }
    rep.finish();
}

/// `moe_shared_residual` (one token, V2-Lite's expert shapes and a small one; `set_moe_residual`
/// on a backend of its own): x + moe bit for bit against `moe_shared` into a buffer then `add` on
/// the same backend with the switch off (where `moe_shared_residual` must decline), and within the
/// Q8 bars of the CPU (which declines too: moe_shared's chain, then add).
#[test]
fn moe_residual_exact() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    let c = cpu();
    let mut r = rng(29);
    let mut rep = Report::new("moe_shared_residual");
    for &(hdim, ff, ne, k, nsh) in &[(2048usize, 1408usize, 64usize, 6usize, 2usize), (512, 256, 16, 4, 1)] {
        let sf = nsh * ff;
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<Vec<u8>> = shapes.iter().map(|s| weight(&mut r, GgmlType::Q8_0, s, 0.3).0).collect();
        let gu = |i: usize| g.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &ws[i]), WeightUse::Matmul).unwrap();
        let cu = |i: usize| c.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &ws[i]), WeightUse::Matmul).unwrap();
        let (ge, gs) = ([gu(0), gu(1), gu(2)], [gu(3), gu(4), gu(5)]);
        let (ce, cs) = ([cu(0), cu(1), cu(2)], [cu(3), cu(4), cu(5)]);
        let p = MoeParams::top_k(ne, k);
        for round in 0..3 {
            let hr = Rows::packed(1, hdim);
            let xr = Rows { off: 1, n: 1, width: hdim, stride: hdim + 1 };
            let lr = Rows::packed(1, ne);
            let (h, x, lg) = (randn(&mut r, hdim, 1.0), randn(&mut r, xr.end(), 1.0), randn(&mut r, ne, 2.0));
            let lab = format!("H={hdim} ff={ff} E={ne} k={k} shared={nsh} round {round}");
            // Into x, the switch on.
            let (gh, gl, gx) = (buf(g, &h), buf(g, &lg), buf(g, &x));
            g.set_moe_residual(true);
            if !g.moe_shared_residual(&gh, hr, &gl, lr, experts3(&ge), experts3(&gs), &p, &gx, xr) {
                rep.failures.push(format!("{lab}: moe_shared_residual declined with the switch on"));
            }
            // Into a buffer, then add, the switch off.
            g.set_moe_residual(false);
            let (ph, pl, px, py) = (buf(g, &h), buf(g, &lg), buf(g, &x), g.alloc(xr.end()).unwrap());
            if g.moe_shared_residual(&ph, hr, &pl, lr, experts3(&ge), experts3(&gs), &p, &px, xr) {
                rep.failures.push(format!("{lab}: moe_shared_residual ran with the switch off"));
            }
            if !g.moe_shared(&ph, hr, &pl, lr, experts3(&ge), experts3(&gs), &p, &py, xr) {
                rep.failures.push(format!("{lab}: moe_shared declined"));
            }
            g.add(&px, xr, &py, xr, &px, xr);
            // The CPU: its chain, then add.
            let (ch, cl, cx, cy) = (buf(c, &h), buf(c, &lg), buf(c, &x), c.alloc(xr.end()).unwrap());
            if c.moe_shared_residual(&ch, hr, &cl, lr, experts3(&ce), experts3(&cs), &p, &cx, xr) {
                rep.failures.push(format!("{lab}: the CPU took moe_shared_residual"));
            }
            run_moe_shared(c, &ch, hr, &cl, lr, &ce, &cs, &p, &cy, xr, true);
            c.add(&cx, xr, &cy, xr, &cx, xr);
            let full = Rows::packed(1, xr.end());
            let got = get(g, &gx, full);
            rep.check(&format!("{lab} x + moe (exact)"), &got, &get(g, &px, full), 0.0, 0.0);
            rep.check(&format!("{lab} x + moe vs cpu"), &got, &get(c, &cx, full), 2e-2, 2e-2);
        }
    }
    rep.finish();
}

/// Routed experts plus a shared FFN on one backend: `moe_shared` when `try_fused` and the backend
/// takes it, else moe + the shared FFN with plain ops + add. Returns whether moe_shared ran.
#[allow(clippy::too_many_arguments)]
fn run_moe_shared<B: Backend>(
    b: &B,
    x: &B::Buf,
    xr: Rows,
    lg: &B::Buf,
    lr: Rows,
    ex: &[B::Weight; 3],
    sh: &[B::Weight; 3],
    p: &MoeParams,
    out: &B::Buf,
    o: Rows,
    try_fused: bool,
) -> bool {
    let experts = || Experts { gate: &ex[0], up: &ex[1], down: &ex[2] };
    if try_fused && b.moe_shared(x, xr, lg, lr, experts(), Experts { gate: &sh[0], up: &sh[1], down: &sh[2] }, p, out, o) {
        return true;
    }
    let (n, hdim, sf) = (xr.n, xr.width, sh[0].shape()[1]);
    b.moe(x, xr, lg, lr, experts(), p, out, o);
    let rf = Rows::packed(n, sf);
    let (gb, ub, yb) = (b.alloc(n * sf).unwrap(), b.alloc(n * sf).unwrap(), b.alloc(n * hdim).unwrap());
    b.matmul(x, xr, &sh[0], &gb, rf);
    b.matmul(x, xr, &sh[1], &ub, rf);
    b.glu(p.glu, &gb, rf, &ub, rf, &gb, rf);
    let ry = Rows::packed(n, hdim);
    b.matmul(&gb, rf, &sh[2], &yb, ry);
    b.add(out, o, &yb, ry, out, o);
    false
}

/// V2-Lite's routing (softmax top-k with no renormalisation, one group) and SwiGLU experts,
/// for `ne` experts and `k` slots a token.
fn softmax_moe(ne: usize, k: usize) -> MoeParams {
    MoeParams { n_experts: ne, k, gating: Gating::Softmax, norm_topk: false, scale: 1.0, n_group: 1, topk_group: 1, glu: Glu::SwiGlu }
}

/// The weight shapes of a MoE with a shared FFN and two dense products after it: the routed
/// gate, up and down stacks (`ne` experts of `ff`), the shared gate, up and down (width `sf`),
/// then `[hdim, jobs[0]]` and `[hdim, jobs[1]]`.
fn moe_shared_shapes(hdim: usize, ff: usize, ne: usize, sf: usize, jobs: [usize; 2]) -> [Vec<usize>; 8] {
    [
        vec![hdim, ff, ne],
        vec![hdim, ff, ne],
        vec![ff, hdim, ne],
        vec![hdim, sf],
        vec![hdim, sf],
        vec![sf, hdim],
        vec![hdim, jobs[0]],
        vec![hdim, jobs[1]],
    ]
}

/// The one-token Q8_0 decode MoE in one launch (`moe_sh_q8_one`: down warps that wait on
/// per-slot counters) against the two launches (`set_moe_one(false)` on a second backend): bit
/// for bit, on several launches in a row (the counters must be back at zero after each), and
/// within the Q8 bars of the CPU.
#[test]
fn moe_one_launch_exact() {
    let Some(g) = gpu() else { return };
    let g2 = &CudaBackend::new(0).expect("second backend");
    if !g.set_moe_one(true) || !g2.set_moe_one(false) {
        eprintln!("moe_sh_q8_one: not available here, skipped");
        return;
    }
    let mut rep = Report::new("moe_one");
    // V2-Lite's shapes and a small one.
    let cases = [(2048, 1408, 16, 6, 2, Gating::Softmax, false, 1.0), (256, 128, 16, 4, 1, Gating::Softmax, false, 1.0)];
    moe_pair_exact(&mut rep, (g, g2), &cases, "one launch vs two", 33, 0.0);
    g.set_moe_one(false);
    rep.finish();
}

/// The one-token Q8_0 decode MoE's gate/up with its routed units claimed from a counter
/// (`Path::GuDyn`, `moe_gateup_sh_q8d`) against a block a unit (`moe_gateup_sh_q8q`, the path off
/// on a second backend): bit for bit, three launches a case in a row (the counter must be back
/// at zero after each), and within the Q8 bars of the CPU. V2-Lite's shapes (352 units on fewer
/// blocks, so blocks claim more than one), a small one (a block a unit), and a wide one (~4 a
/// block).
#[test]
fn gu_dyn_exact() {
    let small = (256, 128, 16, 4, 1, Gating::Softmax, false, 1.0);
    moe_path_pair(Path::GuDyn, "gu_dyn", small, "claimed units vs a block a unit", 41, 0.0);
}

/// The one-token Q8_0 decode MoE's gate/up reading its routed slots from the experts' tiled
/// copies (`Path::GuTile`, `moe_gateup_sh_q8t`) against the row-major rows (the path off on a
/// second backend): another summation order, so within 1e-2 of the rms (a GLU value at a
/// rounding boundary of its Q8_0 block may move by a quant step), and within the Q8 bars of the
/// CPU. V2-Lite's shapes, a small one (one group of 128, so one half of the warps has none) and
/// a wide one; the path must be taken for every launch.
#[test]
fn gu_tile_close() {
    let small = (128, 128, 16, 4, 1, Gating::Softmax, false, 1.0);
    moe_path_pair(Path::GuTile, "gu_tile", small, "tiled rows vs row-major", 43, 1e-2);
}

/// `moe_pair_exact` of V2-Lite's shapes, `small` and a wide one with `path` on (first backend)
/// and off (a second), which must be taken for each of the 9 launches on the first and none on
/// the second.
fn moe_path_pair(
    path: Path,
    name: &'static str,
    small: (usize, usize, usize, usize, usize, Gating, bool, f32),
    what: &str,
    seed: u64,
    close: f64,
) {
    let Some(g) = gpu() else { return };
    let g2 = &CudaBackend::new(0).expect("second backend");
    g.set_path(path, true);
    g2.set_path(path, false);
    let mut rep = Report::new(name);
    let cases = [(2048, 1408, 16, 6, 2, Gating::Softmax, false, 1.0), small, (256, 4096, 8, 6, 2, Gating::Softmax, false, 1.0)];
    let before = (g.path_launches(path), g2.path_launches(path));
    moe_pair_exact(&mut rep, (g, g2), &cases, what, seed, close);
    let took = (g.path_launches(path) - before.0, g2.path_launches(path) - before.1);
    if took != (9, 0) {
        rep.failures.push(format!("{path:?} taken {} / {} times, not 9 / 0", took.0, took.1));
    }
    g.set_path(path, false);
    rep.finish();
}

/// One decode token's attention inside `mla_out_q8`'s blocks, or `mla_out_bf16`'s (`mo_attend`,
/// short contexts: no split kernel) against the split kernels over the same f16 latent cache
/// (`set_mo_att(0)`) and against the CPU's chain over an f32 one: V2-Lite's shapes, positions
/// around the warps' rows (4 a warp, 32 a block pass) and past the default threshold. The two
/// orders of the same sums give lat's Q8_0 quants the same values but for a rare flip of one
/// quant at a rounding boundary, which moves outputs by up to a quant step (1/127 of its block's
/// largest): on the H200, 4.5e-3 of the rms in 6 of 2,048 outputs at position 1.
#[test]
fn short_attention_in_mla_out() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let g = &CudaBackend::new(0).expect("second backend");
    let c = cpu();
    let mut r = rng(53);
    let mut rep = Report::new("attention in mla_out");
    let (nh, kl, rd, hd) = (16, 512, 64, 2048);
    let w = kl + rd;
    let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
    for ty in [GgmlType::Q8_0, GgmlType::BF16] {
        let (uvb, _) = weight(&mut r, ty, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
        let (wob, _) = weight(&mut r, ty, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
        let (rb, _) = weight(&mut r, GgmlType::F32, &[hd, 64], 1.0 / (hd as f32).sqrt());
        for hist in [0u32, 1, 3, 4, 31, 32, 33, 100, 191, 300, 700] {
            let cache_rows = randn(&mut r, (hist as usize + 1) * w, 1.0);
            let (q, x, nw) = (randn(&mut r, nh * w, 0.5), randn(&mut r, hd, 1.0), randn(&mut r, hd, 1.0));
            let args = (&q[..], &x[..], &nw[..]);
            g.set_mo_att(u32::MAX);
            let (done, out16) = (g.short_attentions(), g.path_launches(Path::Out16));
            let (ax, ao, al, _) = run_mla_out_of(g, ty, true, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            if g.short_attentions() != done + 1 {
                rep.failures.push(format!("{ty:?} pos={hist}: mla_out did not attend itself"));
            }
            if ty == GgmlType::BF16 && g.path_launches(Path::Out16) != out16 + 1 {
                rep.failures.push(format!("{ty:?} pos={hist}: mla_out_bf16 not taken"));
            }
            g.set_mo_att(0);
            let (bx, bo, bl, _) = run_mla_out_of(g, ty, true, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            if g.short_attentions() != done + 1 {
                rep.failures.push(format!("{ty:?} pos={hist}: set_mo_att(0) still attended in mla_out"));
            }
            let (cx, co, _, _) = run_mla_out_of(c, ty, false, &p, hist, &cache_rows, (&uvb, &wob), args, Some(&rb), None);
            let lab = format!("{ty:?} pos={hist}");
            rep.check(&format!("{lab} x vs split"), &ax, &bx, 1e-2, 1e-3);
            rep.check(&format!("{lab} out vs split"), &ao, &bo, 1e-2, 1e-3);
            rep.check(&format!("{lab} logits vs split"), &al, &bl, 1e-2, 1e-3);
            // The f16 cache rounds the keys, and a rounding that moves one of lat's Q8_0 quants
            // moves outputs by up to a quant step (1/127 of its block's largest): 2.4e-2 of the
            // rms at positions 0-4 on the H200, the split kernels' figure too.
            rep.check(&format!("{lab} x vs cpu"), &ax, &cx, 3e-2, 1e-2);
            rep.check(&format!("{lab} out vs cpu"), &ao, &co, 3e-2, 1e-2);
        }
    }
    g.set_mo_att(192);
    rep.finish();
}

/// The tensor-core split MLA decode over an f16 cache issuing its first key tiles before its PDL
/// wait (`Path::SplitEarly`, `mla_split_tc_he`) against `mla_split_tc_h` on another backend: the
/// same copies, so bit for bit. Decode and batched-decode sizes, 16 and 128 heads, histories
/// from 5 positions (no split issues early: each holds the token's own row in its first tiles)
/// to 9,000; the early kernel must have run for each single token and for no batch.
#[test]
fn mla_split_early_exact() {
    if tc_gpu("mla_split_early_exact").is_none() {
        return;
    }
    let ge = &CudaBackend::new(0).expect("second backend");
    let gd = &CudaBackend::new(0).expect("third backend");
    for g in [ge, gd] {
        g.set_mla_tensor_cores(Some(true));
    }
    ge.set_path(Path::SplitEarly, true);
    gd.set_path(Path::SplitEarly, false);
    let mut r = rng(53);
    let mut rep = Report::new("mla_split_early");
    let (kl, rd) = (512usize, 64usize);
    let w = kl + rd;
    let slot_len = 9216u32;
    let rows = 2 * slot_len as usize;
    for &(nh, n, long) in &[(16usize, 1usize, 5u32), (16, 1, 3000), (16, 1, 9000), (16, 3, 2500), (16, 64, 500), (128, 1, 2100)] {
        let (toks, all, hist) = mla_tokens(n, long, false, &mut r);
        let data = randn(&mut r, all.len() * w, 1.0);
        let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
        let qr = Rows { off: 4, n: n * nh, width: w, stride: w + 8 };
        let o = Rows { off: 1, n: n * nh, width: kl, stride: kl + 3 };
        let meta = BatchMeta { tokens: toks, outputs: vec![], slot_len };
        let q = randn(&mut r, qr.end(), 0.5);
        let lab = format!("heads={nh} n={n} hist={hist:?}");
        let mut outs = Vec::new();
        for g in [ge, gd] {
            let gh = g.alloc_latent_cache(rows, w, kl, nh).unwrap();
            if !gh.is_f16() {
                rep.failures.push(format!("{lab}: alloc_latent_cache gave an f32 cache on a tensor-core GPU"));
                continue;
            }
            fill_cache(g, &gh, &data, w, &all, slot_len);
            let (gb, gq) = (batch(g, &meta), buf(g, &q));
            let go = g.alloc(o.end()).unwrap();
            poison(g, &go, o.end());
            g.synchronize().unwrap();
            let before = g.path_launches(Path::SplitEarly);
            g.mla_attention(&gq, qr, &gh, &gb, &p, &go, o);
            let took = g.path_launches(Path::SplitEarly) - before;
            // (One token only: in a batch, other tokens' rows come from the previous kernel.)
            let want = u64::from(std::ptr::eq(g, ge) && n == 1);
            if took != want {
                rep.failures.push(format!("{lab}: the early split ran {took} times, not {want}"));
            }
            outs.push(get(g, &go, o));
        }
        if outs.len() == 2 {
            rep.check(&format!("{lab} early vs after the wait (exact)"), &outs[0], &outs[1], 0.0, 0.0);
        }
    }
    rep.finish();
}

/// A decode token's attention output side, then its MoE (`moe_shared`, 64 Q8_0 experts, top 6,
/// two shared chunks), with the MoE routed ahead in the router's launch (`pre_route`: that
/// kernel also quantises the normed row and routes the logits; the MoE skips moe_route_quant)
/// against a second backend that routes in the MoE (`set_pre_route(false)`): bit for bit, three
/// positions a gating (the kernel's counter must be back at zero after each), and the first
/// backend must have taken the routing made ahead every time.
#[test]
fn pre_routed_moe_exact() {
    let Some(shared) = gpu() else { return };
    fused_banner(shared);
    let ga = &CudaBackend::new(0).expect("second backend");
    let gb = &CudaBackend::new(0).expect("third backend");
    let gc = &CudaBackend::new(0).expect("fourth backend");
    gb.set_pre_route(false);
    gc.set_moe_residual(true);
    let mut r = rng(47);
    let mut rep = Report::new("pre-routed moe");
    let (nh, kl, rd, hd, ff, ne, nsh) = (16, 512, 64, 2048, 1408, 64, 2);
    let (w, sf) = (kl + rd, nsh * ff);
    let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
    let shapes: [Vec<usize>; 6] = [vec![hd, ff, ne], vec![hd, ff, ne], vec![ff, hd, ne], vec![hd, sf], vec![hd, sf], vec![sf, hd]];
    let bytes: Vec<Vec<u8>> = shapes.iter().map(|s| weight(&mut r, GgmlType::Q8_0, s, 0.3).0).collect();
    let (uvb, _) = weight(&mut r, GgmlType::Q8_0, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
    let (wob, _) = weight(&mut r, GgmlType::Q8_0, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
    let (rb, _) = weight(&mut r, GgmlType::F32, &[hd, ne], 2.0 / (hd as f32).sqrt());
    let mut taken = 0;
    for (gating, norm_topk, scale) in [(Gating::Softmax, false, 1.0), (Gating::Sigmoid, true, 2.5)] {
        let mp = MoeParams { gating, norm_topk, scale, ..MoeParams::top_k(ne, 6) };
        for hist in [3u32, 40, 300] {
            let cache_rows = randn(&mut r, (hist as usize + 1) * w, 1.0);
            let (q, x, nw) = (randn(&mut r, nh * w, 0.5), randn(&mut r, hd, 1.0), randn(&mut r, hd, 1.0));
            let moe = Some((&shapes[..], &bytes[..], &mp, false));
            let (ax, ao, al, am) =
                run_mla_out_of(ga, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), (&q, &x, &nw), Some(&rb), moe);
            let (bx, bo, bl, bm) =
                run_mla_out_of(gb, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), (&q, &x, &nw), Some(&rb), moe);
            // The MoE added into x by its down kernel (moe_shared_residual), routed ahead too:
            // x + moe, the add the next layer's norm makes.
            let res = Some((&shapes[..], &bytes[..], &mp, true));
            let (_, co, cl, cm) =
                run_mla_out_of(gc, GgmlType::Q8_0, false, &p, hist, &cache_rows, (&uvb, &wob), (&q, &x, &nw), Some(&rb), res);
            let sum: Vec<f32> = bx.iter().zip(&bm).map(|(a, b)| a + b).collect();
            taken += 1;
            if ga.pre_routes() != taken || gc.pre_routes() != taken {
                rep.failures.push(format!("{gating:?} pos={hist}: the MoE did not take the routing made ahead"));
            }
            let lab = format!("{gating:?} norm={norm_topk} pos={hist}");
            exact(&mut rep, &format!("{lab} into x"), &["out", "logits", "x + moe"], &[co, cl, cm], &[bo.clone(), bl.clone(), sum]);
            exact(&mut rep, &lab, &["x", "out", "logits", "moe"], &[ax, ao, al, am], &[bx, bo, bl, bm]);
        }
    }
    if gb.pre_routes() != 0 {
        rep.failures.push("set_pre_route(false) still routed ahead".into());
    }
    rep.finish();
}

/// A decode batch's `mla_attention_out` on `b` (16-row packed buffers fresh for it: lat, av, y,
/// out, the last two poisoned first, as lat): q's rows `q` (`n * heads` rows of `kl + rope`), x's
/// rows `x` (`n` of `hd`), the norm's weight, W_uv and W_o, `next` the MoE's router if any.
/// Returns (lat, x, out) as buffers with their rows.
#[allow(clippy::too_many_arguments)]
fn batch_attention_out<'a, B: Backend>(
    b: &B,
    (cache, bt, p): (&B::Cache, &B::Batch, &MlaParams),
    (uv, wo, norm): (&B::Weight, &B::Weight, &B::Weight),
    (q, x): (&[f32], &[f32]),
    n: usize,
    next: Option<MoeNext<'a, B::Weight, B::Buf>>,
) -> ([B::Buf; 3], Rows, Rows) {
    let (nh, kl) = (p.n_heads, p.kv_lora);
    let (w, hd) = (kl + p.rope_dim, x.len() / n);
    let (gq, gx) = (buf(b, q), buf(b, x));
    let (lr, avr, xr) = (Rows::packed(n * nh, kl), Rows::packed(n * nh, 128), Rows::packed(n, hd));
    let (lat, av, y, out) =
        (b.alloc(lr.end()).unwrap(), b.alloc(avr.end()).unwrap(), b.alloc(xr.end()).unwrap(), b.alloc(xr.end()).unwrap());
    poison(b, &out, xr.end());
    poison(b, &lat, lr.end());
    b.mla_attention_out(
        (&gq, Rows::packed(n * nh, w)),
        cache,
        bt,
        p,
        (uv, wo),
        (&lat, lr, &av, avr, Rows::packed(n, nh * 128)),
        (&gx, xr, &y),
        Some(norm),
        1e-6,
        &out,
        xr,
        next,
    );
    ([lat, gx, out], lr, xr)
}

/// A decode batch's rows quantised by the launch that writes them, in `mla_attention_out`'s batch
/// chain: the FFN norm writing the MoE's quantised input too (`Path::NormQ8`: `add_rms_norm_q8`,
/// taken by the grouped MoE instead of its own quantisation) and W_uv's split sum writing W_o's
/// (`Path::SumQ8`: `mmq_sum_splits_q8`), against the same ops with both switches off, bit for
/// bit: V2-Lite's attention output side and MoE shapes, batches of 24 and 64 sequences (one slot
/// each), short and longer histories. Also, bit for bit against the cuBLAS chain: the merge
/// writing W_uv's f16 input (Path::LatH) or not. And the MoE's shared FFN on a second stream
/// (Path::SharedFork, on in the int8 chains), forked from the point the FFN norm records ahead.
#[test]
fn norm_q8_batch_exact() {
    if gpu_tc_fused("norm_q8_batch_exact").is_none() {
        return;
    }
    // A backend of its own with the paths set so (the rest at their defaults).
    let backend = |paths: &[(Path, bool)]| {
        let b = CudaBackend::new(0).expect("another backend");
        for &(path, on) in paths {
            b.set_path(path, on);
        }
        b
    };
    use Path::{DenseBlasBatch as Blas, LatH, NormQ8, SharedFork, SumQ8};
    // (both on the int8 products, which NormQ8 and SumQ8 fuse)
    let ga = &backend(&[(NormQ8, true), (SumQ8, true), (Blas, false)]);
    // (gb: the MoE's shared FFN forked as by default, from the FFN norm's point ahead)
    let gb = &backend(&[(NormQ8, false), (SumQ8, false), (Blas, false), (SharedFork, true)]);
    // And the chain with W_uv and W_o on cuBLAS in f16 (Path::DenseBlasBatch: av in f16 straight
    // from the W_uv product), within the int8 activations' distance of gb's.
    let cublas = [(NormQ8, false), (SumQ8, false), (Blas, true), (SharedFork, false)];
    let gc = &backend(&cublas);
    // And gc's chain with W_uv's f16 input made by f16_rows, not by the attention's merge
    // (Path::LatH off): the same bits.
    let gd = &backend(&[&cublas[..], &[(LatH, false)]].concat());
    let mut r = rng(48);
    let mut rep = Report::new("norm_q8 batch");
    let (nh, kl, rd, hd, ff, ne, nsh) = (16, 512, 64, 2048, 1408, 64, 2);
    let (w, sf, slot_len) = (kl + rd, nsh * ff, 512u32);
    let p = MlaParams { n_heads: nh, kv_lora: kl, rope_dim: rd, scale: 0.1147 };
    let shapes: [Vec<usize>; 6] = [vec![hd, ff, ne], vec![hd, ff, ne], vec![ff, hd, ne], vec![hd, sf], vec![hd, sf], vec![sf, hd]];
    let bytes: Vec<Vec<u8>> = shapes.iter().map(|s| weight(&mut r, GgmlType::Q8_0, s, 0.3).0).collect();
    let (uvb, _) = weight(&mut r, GgmlType::Q8_0, &[kl, 128, nh], 1.0 / (kl as f32).sqrt());
    let (wob, _) = weight(&mut r, GgmlType::Q8_0, &[nh * 128, hd], 1.0 / ((nh * 128) as f32).sqrt());
    let (rb, _) = weight(&mut r, GgmlType::F32, &[hd, ne], 2.0 / (hd as f32).sqrt());
    let mp = MoeParams::top_k(ne, 6);
    let (mut cases, mut long) = (0, 0u64);
    for n in [24usize, 64] {
        // (from 32 keys a batch's attention takes the tensor-core split and its merge, which
        // writes the f16 rows of Path::LatH; below, the one-split SIMT kernel writes lat itself)
        for hist in [3u32, 40, 100, 300] {
            let toks: Vec<TokenMeta> =
                (0..n).flat_map(|s| (0..=hist).map(move |pos| TokenMeta { token: 0, pos, slot: s as u32 })).collect();
            let cache_rows = randn(&mut r, toks.len() * w, 1.0);
            let (q, x, nw) = (randn(&mut r, n * nh * w, 0.5), randn(&mut r, n * hd, 1.0), randn(&mut r, hd, 1.0));
            let mut outs = Vec::new();
            for b in [ga, gb, gc, gd] {
                let cache = b.alloc_latent_cache(n * slot_len as usize, w, kl, nh).unwrap();
                fill_cache(b, &cache, &cache_rows, w, &toks, slot_len);
                let step: Vec<TokenMeta> = (0..n).map(|s| TokenMeta { token: 1, pos: hist, slot: s as u32 }).collect();
                let bt = batch(b, &BatchMeta { tokens: step, outputs: vec![], slot_len });
                let uv = b.upload_weight(&td("w_uv", GgmlType::Q8_0, &[kl, 128, nh], &uvb), WeightUse::Matmul).unwrap();
                let wo = b.upload_weight(&td("wo", GgmlType::Q8_0, &[nh * 128, hd], &wob), WeightUse::Matmul).unwrap();
                let router = b.upload_weight(&td("router", GgmlType::F32, &[hd, ne], &rb), WeightUse::Matmul).unwrap();
                let up = |i: usize| b.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &bytes[i]), WeightUse::Matmul).unwrap();
                let (ex, sh) = ([up(0), up(1), up(2)], [up(3), up(4), up(5)]);
                let norm = norm_weight(b, &nw);
                let xr = Rows::packed(n, hd);
                let (lg, lgr) = (b.alloc(n * ne).unwrap(), Rows::packed(n, ne));
                let mo = b.alloc(xr.end()).unwrap();
                for (t, len) in [(&lg, n * ne), (&mo, xr.end())] {
                    poison(b, t, len);
                }
                let next = Some(MoeNext { router: &router, logits: (&lg, lgr), params: &mp });
                let ([_, gx, out], _, _) = batch_attention_out(b, (&cache, &bt, &p), (&uv, &wo, &norm), (&q, &x), n, next);
                if !run_moe_shared(b, &out, xr, &lg, lgr, &ex, &sh, &mp, &mo, xr, true) {
                    rep.failures.push(format!("n={n}: moe_shared declined"));
                }
                outs.push([get(b, &gx, xr), get(b, &out, xr), get(b, &lg, lgr), get(b, &mo, xr)]);
            }
            cases += 1;
            let [a, bb, cc, dd] = [&outs[0], &outs[1], &outs[2], &outs[3]];
            exact(&mut rep, &format!("n={n} pos={hist}"), &["x", "out", "logits", "moe"], a, bb);
            // (not the MoE's output: a router near-tie that the other rounding flips moves a
            // token's whole row)
            for (i, what) in ["x", "out", "logits"].iter().enumerate() {
                rep.check(&format!("n={n} pos={hist} {what}, W_uv and W_o on cuBLAS"), &cc[i], &bb[i], 5e-2, 1e-3);
            }
            exact(&mut rep, &format!("n={n} pos={hist} lat in f16 by the merge"), &["x", "out", "logits", "moe"], cc, dd);
            long += u64::from(hist >= 32);
        }
    }
    // (gb: every case forked, from the norm's fork point but perhaps where the side's scratch
    // grew first, the first case of each batch size)
    let (forks, ahead) = (gb.path_launches(Path::SharedFork), gb.forks_ahead());
    if forks != cases || !(cases - 2..=cases).contains(&ahead) || gc.path_launches(Path::SharedFork) != 0 {
        rep.failures.push(format!(
            "SharedFork ran {forks} times ({ahead} from the point ahead) in {cases} cases, {} times while off",
            gc.path_launches(Path::SharedFork)
        ));
    }
    if gc.path_launches(Path::LatH) != long || gd.path_launches(Path::LatH) != 0 {
        rep.failures.push(format!(
            "LatH ran {} / {} times in {long} long cases (on / off)",
            gc.path_launches(Path::LatH),
            gd.path_launches(Path::LatH)
        ));
    }
    if gc.path_launches(Path::DenseBlasBatch) < cases {
        rep.failures.push(format!("DenseBlasBatch ran {} times in {cases} cases", gc.path_launches(Path::DenseBlasBatch)));
    }
    for path in [Path::NormQ8, Path::SumQ8] {
        if ga.path_launches(path) != cases {
            rep.failures.push(format!("{path:?} ran {} times, not {cases}", ga.path_launches(path)));
        }
        if gb.path_launches(path) != 0 {
            rep.failures.push(format!("{path:?} off still ran"));
        }
    }
    rep.finish();
}

/// One-token `moe_shared` on two GPU backends set up two ways, three rounds a case
/// ((hdim, ff, experts, k, shared chunks, gating, norm_topk, scale)): bit for bit against each
/// other (`close` 0; the launches' counters and flags must be back at zero after each), or
/// within `close` of the rms (another summation order), and within the Q8 bars of the CPU.
#[allow(clippy::type_complexity)]
fn moe_pair_exact(
    rep: &mut Report,
    (ga, gb): (&CudaBackend, &CudaBackend),
    cases: &[(usize, usize, usize, usize, usize, Gating, bool, f32)],
    what: &str,
    seed: u64,
    close: f64,
) {
    let c = cpu();
    let mut r = rng(seed);
    for &(hdim, ff, ne, k, nsh, gating, norm_topk, scale) in cases {
        let sf = nsh * ff;
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<(Vec<u8>, Vec<f32>)> = shapes.iter().map(|s| weight(&mut r, GgmlType::Q8_0, s, 0.3)).collect();
        let up = |b: &CudaBackend, i: usize| b.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let cu = |i: usize| c.upload_weight(&td("w", GgmlType::Q8_0, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let (ae, ash) = ([up(ga, 0), up(ga, 1), up(ga, 2)], [up(ga, 3), up(ga, 4), up(ga, 5)]);
        let (be, bsh) = ([up(gb, 0), up(gb, 1), up(gb, 2)], [up(gb, 3), up(gb, 4), up(gb, 5)]);
        let (ce, cs) = ([cu(0), cu(1), cu(2)], [cu(3), cu(4), cu(5)]);
        let p = MoeParams { gating, norm_topk, scale, ..MoeParams::top_k(ne, k) };
        for round in 0..3 {
            let xr = Rows { off: 2, n: 1, width: hdim, stride: hdim + 2 };
            let lr = Rows { off: 1, n: 1, width: ne, stride: ne + 3 };
            let o = Rows { off: 1, n: 1, width: hdim, stride: hdim + 1 };
            let (x, lg) = (randn(&mut r, xr.end(), 1.0), randn(&mut r, lr.end(), 2.0));
            let mut outs = Vec::new();
            for (b, e, sh) in [(ga, &ae, &ash), (gb, &be, &bsh)] {
                let (bx, bl, bo) = (buf(b, &x), buf(b, &lg), b.alloc(o.end()).unwrap());
                poison(b, &bo, o.end());
                if !run_moe_shared(b, &bx, xr, &bl, lr, e, sh, &p, &bo, o, true) {
                    rep.failures.push(format!("H={hdim}: moe_shared declined"));
                }
                outs.push(get(b, &bo, o));
            }
            let (cx, cl, co) = (buf(c, &x), buf(c, &lg), c.alloc(o.end()).unwrap());
            run_moe_shared(c, &cx, xr, &cl, lr, &ce, &cs, &p, &co, o, true);
            let lab = format!("H={hdim} ff={ff} E={ne} k={k} shared={nsh} {gating:?} norm={norm_topk} round {round}");
            if close == 0.0 {
                exact(rep, &lab, &[what], &[outs[0].clone()], &[outs[1].clone()]);
            } else {
                rep.check(&format!("{lab} {what}"), &outs[0], &outs[1], close, 1e-3);
            }
            // (The CPU's chain rounds to 8 bits at other points: fused_moe_shared's bar.)
            rep.check(&format!("{lab} vs cpu"), &outs[0], &get(c, &co, o), 0.25, 1e-3);
        }
    }
}

/// f64 shared FFN of the dequantised weights, added to `out` (`[n, hdim]` packed).
fn add_shared_f64(out: &mut [f32], x: &[f32], xr: Rows, w: [&[f32]; 3], hdim: usize, sf: usize, glu: Glu) {
    for t in 0..xr.n {
        let xv = &x[xr.off + t * xr.stride..][..hdim];
        let h: Vec<f64> = (0..sf)
            .map(|i| {
                let gv: f64 = w[0][i * hdim..(i + 1) * hdim].iter().zip(xv).map(|(&a, &b)| a as f64 * b as f64).sum();
                let uv: f64 = w[1][i * hdim..(i + 1) * hdim].iter().zip(xv).map(|(&a, &b)| a as f64 * b as f64).sum();
                let act = match glu {
                    Glu::SwiGlu => gv / (1.0 + (-gv).exp()),
                    Glu::GeGluTanh => 0.5 * gv * (1.0 + (0.7978845608028654 * (gv + 0.044715 * gv * gv * gv)).tanh()),
                };
                act * uv
            })
            .collect();
        for j in 0..hdim {
            let y: f64 = w[2][j * sf..(j + 1) * sf].iter().zip(&h).map(|(&a, &b)| a as f64 * b).sum();
            out[t * hdim + j] += y as f32;
        }
    }
}

#[test]
fn fused_moe_shared() {
    let Some(g) = gpu() else { return };
    fused_banner(g);
    let c = cpu();
    let mut r = rng(15);
    let mut rep = Report::new("moe_shared");
    // (hdim, ff, experts, k, gating, norm, scale, groups, topk groups, shared chunks, glu, fused
    // path expected): V2-Lite's shapes (fewer experts), 1 and 3 shared chunks, sigmoid with
    // groups that all stay eligible, and two the fused path must decline (group-limited routing,
    // ff not a multiple of 128).
    let cases = [
        (2048usize, 1408usize, 8usize, 6usize, Gating::Softmax, false, 1.0f32, 1usize, 1usize, 2usize, Glu::SwiGlu, true),
        (256, 128, 16, 4, Gating::Softmax, false, 1.0, 1, 1, 2, Glu::SwiGlu, true),
        (256, 256, 16, 3, Gating::Sigmoid, true, 2.5, 4, 4, 1, Glu::GeGluTanh, true),
        (512, 128, 32, 5, Gating::Softmax, true, 1.0, 1, 1, 3, Glu::SwiGlu, true),
        (256, 128, 16, 6, Gating::Softmax, true, 1.0, 8, 3, 2, Glu::SwiGlu, false),
        (256, 96, 16, 2, Gating::Softmax, false, 1.0, 1, 1, 2, Glu::SwiGlu, false),
    ];
    // Q8_0 experts on every case; f16/bf16 experts (the 16-bit float kernels, f32 activations) on
    // three: they take ff = 96 too (their rows only need whole 16-byte pieces).
    let runs = cases
        .iter()
        .enumerate()
        .map(|(ci, c)| (ci, c, GgmlType::Q8_0))
        .chain([(1usize, GgmlType::BF16), (3, GgmlType::F16), (5, GgmlType::BF16)].into_iter().map(|(ci, ty)| (ci, &cases[ci], ty)));
    for (ci, &(hdim, ff, ne, k, gating, norm_topk, scale, n_group, topk_group, nsh, glu, fast), ty) in runs {
        let sf = nsh * ff;
        let q8 = ty == GgmlType::Q8_0;
        let fast = if q8 { fast } else { n_group == 1 || topk_group >= n_group };
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<(Vec<u8>, Vec<f32>)> = shapes.iter().map(|s| weight(&mut r, ty, s, 0.3)).collect();
        let gu = |i: usize| g.upload_weight(&td("w", ty, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let cu = |i: usize| c.upload_weight(&td("w", ty, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let gex = [gu(0), gu(1), gu(2)];
        let gsh = [gu(3), gu(4), gu(5)];
        let cex = [cu(0), cu(1), cu(2)];
        let csh = [cu(3), cu(4), cu(5)];
        let p = MoeParams { n_experts: ne, k, gating, norm_topk, scale, n_group, topk_group, glu };
        let ns: &[usize] = if hdim >= 2048 { &[1, 2] } else { &[1, 3, 8, 64] };
        for &n in ns {
            // The 16-bit kernels read the input as float4: a 16-byte aligned view.
            let xr = if q8 { Rows { off: 2, n, width: hdim, stride: hdim + 2 } } else { Rows { off: 4, n, width: hdim, stride: hdim + 4 } };
            let x = randn(&mut r, xr.end(), 1.0);
            let lr = Rows { off: 1, n, width: ne, stride: ne + 3 };
            let lg = randn(&mut r, lr.end(), 2.0);
            let o = Rows { off: 1, n, width: hdim, stride: hdim + 1 };
            let (gx, cx, gl, cl) = (buf(g, &x), buf(c, &x), buf(g, &lg), buf(c, &lg));
            let (go, co, po) = (g.alloc(o.end()).unwrap(), c.alloc(o.end()).unwrap(), g.alloc(o.end()).unwrap());
            poison(g, &go, o.end());
            poison(c, &co, o.end());
            poison(g, &po, o.end());
            let ran = run_moe_shared(g, &gx, xr, &gl, lr, &gex, &gsh, &p, &go, o, true);
            let cran = run_moe_shared(c, &cx, xr, &cl, lr, &cex, &csh, &p, &co, o, true);
            run_moe_shared(g, &gx, xr, &gl, lr, &gex, &gsh, &p, &po, o, false);
            let lab = format!(
                "case {ci} {} H={hdim} ff={ff} E={ne} k={k} shared={nsh}x{ff} {gating:?} groups={n_group}/{topk_group} n={n}",
                ty.name()
            );
            // Above the decode size, Q8_0 experts with ff a multiple of 128 take the grouped
            // tensor-core products with the shared FFN folded in (TS_CUDA_MOE_SH=0: declined).
            let batched = q8
                && n > ts_cuda::GEMV_MAX_TOKENS
                && g.fused()
                && g.tensor_cores()
                && ff % 128 == 0
                && std::env::var("TS_CUDA_MOE_SH").map_or(true, |v| v != "0");
            let want_fast = (fast && g.fused() && n <= ts_cuda::GEMV_MAX_TOKENS) || batched;
            eprintln!("  {lab}: fused path {}", if ran { "taken" } else { "declined" });
            if ran != want_fast {
                rep.failures.push(format!("{lab}: moe_shared returned {ran}, expected {want_fast}"));
            }
            if cran {
                rep.failures.push(format!("{lab}: the CPU's moe_shared returned true (its default declines)"));
            }
            let got = get(g, &go, o);
            // vs the same op chain on the GPU: the fused kernels sum in another order, which can move
            // an activation across a Q8_0 rounding boundary (one quantum of one element).
            // (f16/bf16: f32 activations on both sides, only the summation order differs.)
            // Above GEMV_MAX_TOKENS the 16-bit chain's dense shared FFN runs on cuBLAS in bf16
            // (activations rounded to bf16, as matmul_tol says), three products deep.
            let bf16_chain = !q8 && n > ts_cuda::GEMV_MAX_TOKENS;
            // Prompt-size batches on the f16 tensor cores straight from Q8_0 (no 8-bit rounding of
            // the activations) against the chain's dense shared FFN on the int8 ones: as far
            // apart as the CPU is from f64; the f64 check is the tight one.
            let f16_q8 = batched && ran && g.moe_q8_runs_f16(n, k, ne, nsh, hdim, ff);
            // The chain's dense shared FFN of a decode batch on cuBLAS in f16
            // (Path::DenseBlasBatch: no 8-bit rounding of its activations) against the fused
            // kernels on the int8 ones: likewise as far apart as the CPU is.
            let blas_chain = q8 && n > ts_cuda::GEMV_MAX_TOKENS && g.dense_blas_rows(n);
            let (tol_gpu, tol_cpu) = if f16_q8 || blas_chain {
                (0.25, 0.25)
            } else if q8 {
                (5e-3, 0.25)
            } else if bf16_chain {
                (1e-4, 4e-2)
            } else {
                (1e-4, 1e-4)
            };
            rep.check(&format!("{lab} vs gpu moe+ffn"), &got, &get(g, &po, o), tol_gpu, 1e-3);
            rep.check(&format!("{lab} vs cpu"), &got, &get(c, &co, o), tol_cpu, 1e-3);
            let mut exact = moe_f64(&x, xr, &lg, lr, [&ws[0].1, &ws[1].1, &ws[2].1], hdim, ff, &p);
            add_shared_f64(&mut exact, &x, xr, [&ws[3].1, &ws[4].1, &ws[5].1], hdim, sf, glu);
            // The plain chain (fused path declined or off) also re-quantises the GLU output to 8
            // bits per 32 values for its down GEMV: one more rounding than the fused kernel. The
            // fused bar: 5.19e-2 was seen once (seed-dependent, case 2's GeGLU at scale 2.5).
            let tol64 = if bf16_chain {
                4e-2
            } else if f16_q8 {
                1e-2
            } else if !q8 {
                1e-4
            } else if ran {
                6.5e-2
            } else {
                8e-2
            };
            rep.check(&format!("{lab} vs f64"), &got, &exact, tol64, 1e-3);
        }
    }
    rep.finish();
}

/// A decode batch's cuBLAS products with each shape's algorithm picked by timing
/// (`Path::BlasTune`, cuBLASLt's candidates and cuBLAS's own call, `lt.rs`): V2-Lite's dense
/// decode shapes (q and kv_a side by side, W_o, W_uk and W_uv per head, a slice of the output
/// head) at 9-128 rows, within f32 summation order (3e-5 of the rms) of the same products
/// without the path; that the shapes were timed; then, the choices made, a recorded step of
/// them (eager, captured, replayed, new inputs each time) gives the eager op's bits.
#[test]
fn blas_tune() {
    if gpu_tc_fused("blas_tune").is_none() {
        return;
    }
    let on = &CudaBackend::new(0).expect("second backend");
    on.set_path(Path::BlasTune, true);
    on.set_path(Path::DenseBlasBatch, true);
    let off = &CudaBackend::new(0).expect("third backend");
    off.set_path(Path::BlasTune, false);
    off.set_path(Path::DenseBlasBatch, true);
    let mut r = rng(59);
    let mut rep = Report::new("blas_tune");
    let shapes = [(2048usize, 3648usize, 1usize), (2048, 2048, 1), (128, 512, 16), (512, 128, 16), (2048, 12_800, 1)];
    let mut ws = Vec::new();
    for &(k, m, g) in &shapes {
        let shape: Vec<usize> = if g == 1 { vec![k, m] } else { vec![k, m, g] };
        let (bytes, _) = weight(&mut r, GgmlType::Q8_0, &shape, 0.5);
        let t = td("w", GgmlType::Q8_0, &shape, &bytes);
        ws.push((on.upload_weight(&t, WeightUse::Matmul).unwrap(), off.upload_weight(&t, WeightUse::Matmul).unwrap()));
    }
    let prod = |b: &CudaBackend, w: &CudaWeight, g: usize, xb: &CudaBuf, xr: Rows, ob: &CudaBuf, o: Rows| {
        if g == 1 {
            b.matmul(xb, xr, w, ob, o);
        } else {
            b.matmul_grouped(xb, xr, w, ob, o);
        }
    };
    for n in [9usize, 33, 64, 128] {
        for (&(k, m, g), (wn, wf)) in shapes.iter().zip(&ws) {
            let rows = n * g;
            let xr = Rows::packed(rows, k);
            let o = Rows::packed(rows, m);
            let x = randn(&mut r, xr.end(), 1.0);
            let run = |b: &CudaBackend, w: &CudaWeight| {
                let (xb, ob) = (buf(b, &x), b.alloc(o.end()).unwrap());
                poison(b, &ob, o.end());
                prod(b, w, g, &xb, xr, &ob, o);
                get(b, &ob, o)
            };
            let lab = format!("k={k} m={m} g={g} n={n}");
            rep.check(&format!("{lab} tuned vs cuBLAS"), &run(on, wn), &run(off, wf), 3e-5, 0.0);
        }
    }
    let (tuned, won) = on.blas_tuned();
    eprintln!("  shapes timed: {tuned}, won by a cuBLASLt algorithm: {won}");
    if tuned == 0 || on.path_launches(Path::BlasTune) == 0 && won > 0 {
        rep.failures.push(format!("BlasTune: {tuned} shapes timed, {won} won, {} products on it", on.path_launches(Path::BlasTune)));
    }
    // The chosen algorithms inside a recorded step: W_o's shape at 64 rows, eager, captured,
    // replayed, each against the same product run eagerly.
    let (k, m) = (2048, 2048);
    let (xr, o) = (Rows::packed(64, k), Rows::packed(64, m));
    let (xb, ob, eb) = (on.alloc(xr.end()).unwrap(), on.alloc(o.end()).unwrap(), on.alloc(o.end()).unwrap());
    let key = 0xb1a5_u64 ^ r.random::<u64>();
    for step in 0..4 {
        on.write(&xb, 0, &randn(&mut r, xr.end(), 1.0)).unwrap();
        if !on.graph_begin(key, 64) {
            on.matmul(&xb, xr, &ws[1].0, &ob, o);
            if !on.graph_end() {
                on.matmul(&xb, xr, &ws[1].0, &ob, o);
            }
        }
        on.matmul(&xb, xr, &ws[1].0, &eb, o);
        exact(&mut rep, &format!("W_o at 64 rows, recorded step {step}"), &["out"], &[get(on, &ob, o)], &[get(on, &eb, o)]);
    }
    rep.finish();
}

/// A decode batch's MoE with the shared FFN on a second stream (`Path::SharedFork`), forked
/// beside the routing and the routed experts' int8 launches and joined before the combine, on
/// cuBLAS from the f16 copies: within 1e-4 of the same backend's chain (the routed experts by
/// `moe`, the shared FFN as dense products on cuBLAS: the same f16 operands), and within the
/// fused path's bars of the CPU and of f64.
///
/// At V2-Lite's widths (16 experts) and a small shape with 64 experts; that the fork ran; and
/// in recorded steps (eager, captured, replayed, new inputs each step) the same bits as the op
/// run eagerly on the same backend, step after step, with one recording and two replays.
#[test]
fn moe_shared_fork() {
    if gpu_tc_fused("moe_shared_fork").is_none() {
        return;
    }
    let fb = &CudaBackend::new(0).expect("second backend");
    fb.set_path(Path::SharedFork, true);
    let c = cpu();
    let mut r = rng(47);
    let mut rep = Report::new("moe_shared_fork");
    // (hdim, ff, experts, k, shared chunks, token counts: 16-token tiles with the chunks among
    // the experts too, so that the fork's launches are the same kernels)
    type Case = (usize, usize, usize, usize, usize, &'static [usize]);
    let cases: [Case; 2] = [(2048, 1408, 16, 6, 2, &[9, 32]), (256, 128, 64, 6, 2, &[16, 64, 128])];
    for (hdim, ff, ne, k, nsh, ns) in cases {
        let sf = nsh * ff;
        let ty = GgmlType::Q8_0;
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<(Vec<u8>, Vec<f32>)> = shapes.iter().map(|s| weight(&mut r, ty, s, 0.3)).collect();
        let up = |b: &CudaBackend, i: usize| b.upload_weight(&td("w", ty, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let six = |b: &CudaBackend| ([up(b, 0), up(b, 1), up(b, 2)], [up(b, 3), up(b, 4), up(b, 5)]);
        let (bex, bsh) = six(fb);
        let cu = |i: usize| c.upload_weight(&td("w", ty, &shapes[i], &ws[i].0), WeightUse::Matmul).unwrap();
        let (cex, csh) = ([cu(0), cu(1), cu(2)], [cu(3), cu(4), cu(5)]);
        let p = softmax_moe(ne, k);
        for &n in ns {
            let xr = Rows { off: 2, n, width: hdim, stride: hdim + 2 };
            let lr = Rows { off: 1, n, width: ne, stride: ne + 3 };
            let o = Rows { off: 1, n, width: hdim, stride: hdim + 1 };
            let lab = format!("H={hdim} ff={ff} E={ne} k={k} shared={nsh}x{ff} n={n}");
            let x = randn(&mut r, xr.end(), 1.0);
            let lg = randn(&mut r, lr.end(), 2.0);
            // (b, fused: the op, else the chain; the output)
            let run = |b: &CudaBackend, (ex, sh): (&[CudaWeight; 3], &[CudaWeight; 3]), fused: bool| {
                let (bx, bl, bo) = (buf(b, &x), buf(b, &lg), b.alloc(o.end()).unwrap());
                poison(b, &bo, o.end());
                let before = b.path_launches(Path::SharedFork);
                let ran = run_moe_shared(b, &bx, xr, &bl, lr, ex, sh, &p, &bo, o, fused);
                (ran, b.path_launches(Path::SharedFork) > before, get(b, &bo, o))
            };
            let (ran, forked, gotb) = run(fb, (&bex, &bsh), true);
            let (_, _, chain) = run(fb, (&bex, &bsh), false);
            eprintln!(
                "  {lab}: fused path {}, fork {}",
                if ran { "taken" } else { "declined" },
                if forked { "taken" } else { "not taken" }
            );
            if !ran || !forked {
                rep.failures.push(format!("{lab}: moe_shared returned {ran}, fork taken: {forked} (both expected)"));
            }
            let (cx, cl, co) = (buf(c, &x), buf(c, &lg), c.alloc(o.end()).unwrap());
            poison(c, &co, o.end());
            run_moe_shared(c, &cx, xr, &cl, lr, &cex, &csh, &p, &co, o, true);
            rep.check(&format!("{lab} cuBLAS fork vs the chain (cuBLAS)"), &gotb, &chain, 1e-4, 1e-4);
            rep.check(&format!("{lab} cuBLAS fork vs cpu"), &gotb, &get(c, &co, o), 0.25, 1e-3);
            let mut f64_out = moe_f64(&x, xr, &lg, lr, [&ws[0].1, &ws[1].1, &ws[2].1], hdim, ff, &p);
            add_shared_f64(&mut f64_out, &x, xr, [&ws[3].1, &ws[4].1, &ws[5].1], hdim, sf, Glu::SwiGlu);
            rep.check(&format!("{lab} cuBLAS fork vs f64"), &gotb, &f64_out, 6.5e-2, 1e-3);
        }
        // Recorded steps: the fork and its join inside a graph.
        let n = *ns.last().unwrap();
        let xr = Rows::packed(n, hdim);
        let lr = Rows::packed(n, ne);
        let (b, ex, sh) = (fb, &bex, &bsh);
        let (bx, bl, bo, eo) =
            (b.alloc(xr.end()).unwrap(), b.alloc(lr.end()).unwrap(), b.alloc(xr.end()).unwrap(), b.alloc(xr.end()).unwrap());
        let key = 0x5f_f0_u64 ^ r.random::<u64>();
        let before = b.path_launches(Path::SharedFork);
        let (rec0, rep0) = (b.step_counts().recorded, b.step_counts().replayed);
        for step in 0..4 {
            b.write(&bx, 0, &randn(&mut r, xr.end(), 1.0)).unwrap();
            b.write(&bl, 0, &randn(&mut r, lr.end(), 2.0)).unwrap();
            let run = |out: &CudaBuf| run_moe_shared(b, &bx, xr, &bl, lr, ex, sh, &p, out, xr, true);
            if !b.graph_begin(key, n) {
                run(&bo);
                if !b.graph_end() {
                    run(&bo);
                }
            }
            run(&eo);
            exact(&mut rep, &format!("H={hdim} n={n}: recorded step {step}"), &["out"], &[get(b, &bo, xr)], &[get(b, &eo, xr)]);
        }
        // (the first step eager, the second captured: both took the fork, and every eager op)
        if b.path_launches(Path::SharedFork) < before + 6 {
            rep.failures.push(format!("H={hdim}: the recorded steps did not take Path::SharedFork"));
        }
        // (and the capture with the fork worked: one recording, two replays)
        let (rec, rpl) = (b.step_counts().recorded - rec0, b.step_counts().replayed - rep0);
        if (rec, rpl) != (1, 2) {
            rep.failures.push(format!("H={hdim}: {rec} recordings and {rpl} replays of the forked step (1 and 2 expected)"));
        }
    }
    rep.finish();
}

/// Prompt-size MoEs with f16 copies of the Q8_0 weights (`set_f16_copy`):
/// - the copies made on the device (`q8_to_f16`) equal the host's f16 of each dequantised value
///   in 64 x 64 tiles, bit for bit;
/// - the grouped products on the f16 tensor cores (`f16_rows`, the `mmf16_*` tile `TS_CUDA_MMF`
///   picks), with and without a shared FFN folded in, against f64 of the dequantised weights,
///   and closer to it than the int8 path (which rounds the activations to 8 bits), so the f16
///   path is known to have run;
/// - gate, up and the GLU in one launch (`mmf16_gu`) give bit for bit what the three give;
/// - the same products straight from the Q8_0 weights (`mmfq8_*`, by default where there are no
///   copies): the same f16 weights, the 16 products of each mma paired differently, so within
///   1e-4 of the copies' result; and with copies present but `set_mmf_q8(1)`, the same bits as
///   without copies;
/// - the shared FFN on cuBLAS (`set_moe_blas`, the default; its row-major copies checked byte
///   for byte, the routed experts without copies on `mmfq8_*`): within 1e-4 of `mmfq8_*` with
///   the shared chunks in the grouped kernels (the same f16 operands, summed in another order);
/// - the routed experts on wgmma fed by TMA (sm_90a builds only; the default there), from
///   row-major f16 copies of the stacks (`mmh_*`, `set_mmh(1)`; the copies checked byte for
///   byte): within 1e-4 of `mmfq8_*` and near f64; straight from Q8_0 (`mmh8_*`, `set_mmh(2)`):
///   the same bits as from the copies; and that they ran where they should.
#[test]
fn moe_f16_prompt() {
    if gpu_tc_fused("moe_f16_prompt").is_none() {
        return;
    }
    // The three launches (gate, up, f16_rows) on this one; the default, one launch, on `fu`.
    let f = &CudaBackend::new(0).expect("second backend");
    f.set_f16_copy(true);
    f.set_moe_blas(false);
    f.set_mmf_gu(false);
    // The int8 path for comparison: a backend that makes no f16 copies and does not take the
    // products from Q8_0 on the f16 tensor cores either.
    let g = &CudaBackend::new(0).expect("third backend");
    g.set_f16_copy(false);
    g.set_mmf_q8(0);
    g.set_mmh(0);
    // Gate, up and the GLU in one launch (mmf16_gu): the same bits as the three.
    let fu = &CudaBackend::new(0).expect("fourth backend");
    fu.set_f16_copy(true);
    fu.set_moe_blas(false);
    fu.set_mmf_gu(true);
    // The shared FFN on cuBLAS from row-major copies, the routed experts on mmfq8 (the default
    // off sm_90a).
    let fb = &CudaBackend::new(0).expect("sixth backend");
    fb.set_f16_copy(true);
    fb.set_moe_blas(true);
    fb.set_mmh(0);
    // The shared FFN on cuBLAS, the routed experts on wgmma fed by TMA (sm_90a) from row-major
    // f16 copies of the stacks (mmh_*), and straight from Q8_0 (mmh8_*, the default there).
    let fh = &CudaBackend::new(0).expect("seventh backend");
    fh.set_f16_copy(true);
    fh.set_moe_blas(true);
    let have_mmh = fh.set_mmh(1);
    let f8 = &CudaBackend::new(0).expect("eighth backend");
    f8.set_moe_blas(true);
    f8.set_mmh(2);
    if !have_mmh {
        eprintln!("moe_f16_prompt: no mmh kernels here (not an sm_90a build); their checks skipped");
    }
    // Straight from the Q8_0 weights: no copies (the default then).
    let fq = &CudaBackend::new(0).expect("fifth backend");
    fq.set_f16_copy(false);
    let have_mmfq8 = fq.set_mmf_q8(2);
    if !have_mmfq8 {
        eprintln!("moe_f16_prompt: the device lacks mmfq8's shared memory; its checks skipped");
    }
    let mut r = rng(36);
    let mut rep = Report::new("moe_f16");
    // (hdim, ff, experts, k, shared chunks, glu, tokens): V2-Lite's widths with fewer experts.
    let cases = [
        (256usize, 256usize, 16usize, 4usize, 2usize, Glu::SwiGlu, 300usize),
        (512, 384, 16, 6, 0, Glu::GeGluTanh, 100),
        (256, 128, 32, 6, 1, Glu::SwiGlu, 600),
        (2048, 1408, 8, 6, 2, Glu::SwiGlu, 96),
        (2048, 1408, 16, 6, 2, Glu::SwiGlu, 200),
    ];
    for (ci, &(hdim, ff, ne, k, nsh, glu, n)) in cases.iter().enumerate() {
        let sf = nsh.max(1) * ff;
        let ty = GgmlType::Q8_0;
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<(Vec<u8>, Vec<f32>)> = shapes.iter().map(|s| weight(&mut r, ty, s, 0.3)).collect();
        let up = |b: &CudaBackend, i: usize| b.upload_weight(&td("w", ty, &shapes[i], &ws[i].0), WeightUse::Expert).unwrap();
        let fw: Vec<CudaWeight> = (0..6).map(|i| up(f, i)).collect();
        let uw: Vec<CudaWeight> = (0..6).map(|i| up(fu, i)).collect();
        let gw: Vec<CudaWeight> = (0..6).map(|i| up(g, i)).collect();
        let qw: Vec<CudaWeight> = (0..6).map(|i| up(fq, i)).collect();
        let bw: Vec<CudaWeight> = (0..6).map(|i| up(fb, i)).collect();
        let hw: Vec<CudaWeight> = (0..6).map(|i| up(fh, i)).collect();
        let h8: Vec<CudaWeight> = (0..6).map(|i| up(f8, i)).collect();
        if have_mmh {
            // Every matrix gets a row-major copy: f16(q * d) of each value, as the host rounds it.
            for (i, w) in hw.iter().enumerate() {
                let want: Vec<u8> = ws[i].1.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
                if fh.half_bytes(w).unwrap().as_deref() != Some(&want[..]) {
                    rep.failures.push(format!("case {ci}: row-major q8_to_f16 of weight {i} (mmh) differs from the host's f16"));
                }
            }
        }
        if have_mmfq8 {
            for (i, w) in bw.iter().enumerate() {
                let want: Vec<u8> = ws[i].1.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
                let got = fb.half_bytes(w).unwrap();
                if i < 3 && got.is_some() {
                    rep.failures.push(format!("case {ci}: routed weight {i} got an f16 copy with the shared FFN on cuBLAS"));
                }
                if i >= 3 && got.as_deref() != Some(&want[..]) {
                    rep.failures.push(format!("case {ci}: row-major q8_to_f16 of shared weight {i} differs from the host's f16"));
                }
            }
        }
        for (i, w) in fw.iter().enumerate().take(3) {
            let mut want: Vec<u8> = ws[i].1.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
            // In 8 KB chunks of 64 rows x 64 values, chunk (r/64, c/64) at (r/64 * K/64 + c/64).
            let kk = shapes[i][0];
            let rm = std::mem::take(&mut want);
            want = vec![0u8; rm.len()];
            for (row, src) in rm.chunks(2 * kk).enumerate() {
                for (s, piece) in src.chunks(128).enumerate() {
                    let at = ((row / 64 * (kk / 64) + s) * 64 + row % 64) * 128;
                    want[at..at + 128].copy_from_slice(piece);
                }
            }
            if f.half_bytes(w).unwrap().as_deref() != Some(&want[..]) {
                rep.failures.push(format!("case {ci}: q8_to_f16 of weight {i} differs from the host's f16"));
            }
        }
        let p = MoeParams { glu, ..MoeParams::top_k(ne, k) };
        let xr = Rows { off: 3, n, width: hdim, stride: hdim + 5 };
        let x = randn(&mut r, xr.end(), 1.0);
        let lr = Rows::packed(n, ne);
        let lg = randn(&mut r, lr.end(), 2.0);
        let o = Rows { off: 1, n, width: hdim, stride: hdim + 1 };
        let run = |b: &CudaBackend, w: &[CudaWeight]| -> Vec<f32> {
            let (bx, bl, bo) = (buf(b, &x), buf(b, &lg), b.alloc(o.end()).unwrap());
            poison(b, &bo, o.end());
            let experts = Experts { gate: &w[0], up: &w[1], down: &w[2] };
            if nsh == 0 {
                b.moe(&bx, xr, &bl, lr, experts, &p, &bo, o);
            } else {
                assert!(b.moe_shared(&bx, xr, &bl, lr, experts, Experts { gate: &w[3], up: &w[4], down: &w[5] }, &p, &bo, o));
            }
            get(b, &bo, o)
        };
        let (got, int8, fused, direct) = (run(f, &fw), run(g, &gw), run(fu, &uw), run(fq, &qw));
        let blas = run(fb, &bw);
        let (runs0, runs8) = (fh.mmh_runs(), f8.mmh_runs());
        let mmh = run(fh, &hw);
        let mmh8 = run(f8, &h8);
        let mmh_ran = fh.mmh_runs() > runs0 && f8.mmh_runs() > runs8;
        // mmfq8 forced where the copies exist (the copies' backend, one launch): the same bits.
        fu.set_mmf_q8(1);
        let forced = run(fu, &uw);
        fu.set_mmf_q8(2);
        let mut exact = moe_f64(&x, xr, &lg, lr, [&ws[0].1, &ws[1].1, &ws[2].1], hdim, ff, &p);
        if nsh > 0 {
            add_shared_f64(&mut exact, &x, xr, [&ws[3].1, &ws[4].1, &ws[5].1], hdim, sf, glu);
        }
        let lab = format!("case {ci} H={hdim} ff={ff} E={ne} k={k} shared={nsh} {glu:?} n={n}");
        let e16 = rep.check(&format!("{lab} f16 vs f64"), &got, &exact, 1e-2, 1e-3);
        rep.check(&format!("{lab} mmf16_gu vs gate, up, f16_rows (exact)"), &fused, &got, 0.0, 0.0);
        if have_mmfq8 {
            rep.check(&format!("{lab} mmfq8 (Q8_0 weights) vs the f16 copies"), &direct, &fused, 1e-4, 1e-4);
            rep.check(&format!("{lab} mmfq8 forced past the copies (exact)"), &forced, &direct, 0.0, 0.0);
            // (the shared FFN goes to cuBLAS past 128 tokens: cases 0 and 2)
            rep.check(&format!("{lab} shared FFN on cuBLAS vs mmfq8"), &blas, &direct, 1e-4, 1e-4);
        }
        if have_mmh {
            // (the routed experts go to mmh_* where the shared FFN went to cuBLAS or there is
            // none: every case but the 96-token one)
            let want_ran = nsh == 0 || n > ts_cuda::GRAPH_MAX_TOKENS;
            if mmh_ran != want_ran {
                rep.failures.push(format!("{lab}: mmh ran: {mmh_ran}, expected {want_ran}"));
            }
            rep.check(&format!("{lab} mmh (wgmma + TMA) vs mmfq8"), &mmh, &direct, 1e-4, 1e-4);
            rep.check(&format!("{lab} mmh vs f64"), &mmh, &exact, 1e-2, 1e-3);
            // (the same f16 weights, made in shared memory: the same bits)
            rep.check(&format!("{lab} mmh8 (from Q8_0) vs mmh (f16 copies) (exact)"), &mmh8, &mmh, 0.0, 0.0);
        }
        let e8 = rep.check(&format!("{lab} int8 vs f64"), &int8, &exact, 0.15, 1e-4);
        if !(e16 < e8 / 3.0) {
            rep.failures.push(format!("{lab}: f16 path error {e16:.2e} is not well under the int8 path's {e8:.2e} (did it run?)"));
        }
    }
    rep.finish();
}

/// The grouped expert products on 16-token tiles (batched decode) read their weights straight
/// into the mma fragments (`mmq_q8_rows`): bit for bit what `mmq_q8_16` gives (a second backend
/// with it off), at V2-Lite's shapes (64 experts, 2 shared chunks; 16 groups in, 11 out), with
/// routing skewed so some experts see more than one tile, and at a width that ends inside a
/// 64-row block and inside a 128-group; and from a 16-row tiled copy of the experts (made on the
/// device by `tile16_q8`, checked byte for byte against the host's `tile16`); and with every
/// block's tile found from the counts first (`set_rows_early(false)`; by default the experts'
/// first tiles go by block index, their first loads before the PDL wait). (With
/// `TS_CUDA_MOE_ROWS=0` all of them run `mmq_q8_16`.)
#[test]
fn moe_rows_exact() {
    if gpu_tc_fused("moe_rows_exact").is_none() {
        return;
    }
    let plain = &CudaBackend::new(0).expect("second backend");
    plain.set_moe_rows(false);
    // The experts also in 16-row tiles (TS_CUDA_MOE_TILED), read by mmq_q8_rows: the same bits.
    let tiled = &CudaBackend::new(0).expect("third backend");
    tiled.set_moe_tiled(true);
    // (The default, TS_CUDA_MOE_TILED unset, tiles when memory allows: the row-major reads on
    // a backend of their own.)
    let rowmaj = &CudaBackend::new(0).expect("fourth backend");
    rowmaj.set_moe_tiled(false);
    // (the shared chunks inside the grouped launches, which these variants order and split:
    // the decode batch's fork would take them out)
    for b in [plain, tiled, rowmaj] {
        b.set_path(Path::SharedFork, false);
    }
    // One row set a warp on both (mmq_q8_rows); two below (the default picks by pairs an expert).
    tiled.set_rows_r(1);
    rowmaj.set_rows_r(1);
    let mut r = rng(33);
    let mut rep = Report::new("moe_rows");
    // (hdim, ff, experts, k, shared chunks, tokens, logit bias on the first 4 experts)
    let cases = [
        (2048usize, 1408usize, 64usize, 6usize, 2usize, 64usize, 0.0f32),
        (2048, 1408, 64, 6, 2, 24, 0.0),
        (2048, 1408, 64, 6, 2, 64, 6.0),
        (224, 384, 16, 4, 1, 24, 0.0),
        (224, 384, 16, 4, 1, 40, 3.0),
    ];
    let ty = GgmlType::Q8_0;
    for &(hdim, ff, ne, k, nsh, n, bias) in &cases {
        let sf = nsh * ff;
        let shapes: [Vec<usize>; 6] =
            [vec![hdim, ff, ne], vec![hdim, ff, ne], vec![ff, hdim, ne], vec![hdim, sf], vec![hdim, sf], vec![sf, hdim]];
        let ws: Vec<Vec<u8>> = shapes.iter().map(|s| weight(&mut r, ty, s, 0.3).0).collect();
        let up = |b: &CudaBackend| -> [CudaWeight; 6] {
            std::array::from_fn(|i| b.upload_weight(&td("w", ty, &shapes[i], &ws[i]), WeightUse::Matmul).unwrap())
        };
        let (gw, pw, tw) = (up(rowmaj), up(plain), up(tiled));
        // The tiled copies made on the device (tile16_q8) against the host reference.
        for (j, rows) in [(0usize, ff), (2, hdim)] {
            let (rm, tl) = tiled.weight_bytes(&tw[j]).unwrap();
            let want = ts_cuda::backend::tile16(&rm, rm.len() / (rows * ne), rows);
            if tl.as_deref() != Some(&want[..]) {
                rep.failures.push(format!("H={hdim} ff={ff} E={ne}: tile16_q8 of weight {j} differs from tile16"));
            }
        }
        let p = MoeParams::top_k(ne, k);
        let xr = Rows { off: 2, n, width: hdim, stride: hdim + 2 };
        let x = randn(&mut r, xr.end(), 1.0);
        let lr = Rows { off: 1, n, width: ne, stride: ne + 3 };
        let mut lg = randn(&mut r, lr.end(), 2.0);
        for t in 0..n {
            for e in 0..4 {
                lg[lr.off + t * lr.stride + e] += bias;
            }
        }
        let o = Rows { off: 1, n, width: hdim, stride: hdim + 1 };
        let lab = format!("H={hdim} ff={ff} E={ne} k={k} shared={nsh} n={n} bias={bias}");
        let mut declined = 0;
        let mut run = |b: &CudaBackend, w: &[CudaWeight; 6], o: Rows| {
            let (bx, bl, bo) = (buf(b, &x), buf(b, &lg), b.alloc(o.end()).unwrap());
            poison(b, &bo, o.end());
            let ex = Experts { gate: &w[0], up: &w[1], down: &w[2] };
            let sh = Experts { gate: &w[3], up: &w[4], down: &w[5] };
            if !b.moe_shared(&bx, xr, &bl, lr, ex, sh, &p, &bo, o) {
                declined += 1;
            }
            // The routed experts alone (no shared chunks in the grouped products).
            let (ro, rr) = (b.alloc(o.end()).unwrap(), o);
            poison(b, &ro, o.end());
            b.moe(&bx, xr, &bl, lr, Experts { gate: &w[0], up: &w[1], down: &w[2] }, &p, &ro, rr);
            (get(b, &bo, o), get(b, &ro, o))
        };
        let mut outs = Vec::new();
        for (b, w) in [(rowmaj, &gw), (plain, &pw), (tiled, &tw)] {
            outs.push(run(b, w, o));
        }
        // Two row sets a warp (mmq_q8_rows_r2), from the tiles and from row-major stacks: the
        // same bits.
        let mut sets = Vec::new();
        for (b, w, kind) in [(tiled, &tw, "tiled"), (rowmaj, &gw, "row-major")] {
            b.set_rows_r(2);
            sets.push((format!("2 row sets {kind}"), run(b, w, o)));
            b.set_rows_r(1);
        }
        // Every block's tile from the counts first (no loads before the PDL wait), one and two
        // row sets: the same bits.
        for (b, w, kind) in [(tiled, &tw, "tiled"), (rowmaj, &gw, "row-major")] {
            b.set_rows_early(false);
            sets.push((format!("tiles from the counts, {kind}"), run(b, w, o)));
            b.set_rows_r(2);
            sets.push((format!("tiles from the counts, 2 row sets {kind}"), run(b, w, o)));
            b.set_rows_r(1);
            b.set_rows_early(true);
        }
        // The shared chunks' tiles after the routed experts' first tiles instead of first (the
        // default; TS_CUDA_ROWS_SH_FIRST=0), one and two row sets: the same bits.
        for (b, w, kind) in [(tiled, &tw, "tiled"), (rowmaj, &gw, "row-major")] {
            b.set_rows_shared_first(false);
            sets.push((format!("shared chunks last, {kind}"), run(b, w, o)));
            b.set_rows_r(2);
            sets.push((format!("shared chunks last, 2 row sets {kind}"), run(b, w, o)));
            b.set_rows_r(1);
            b.set_rows_shared_first(true);
        }
        // Two row sets with the first tiles' last 1, 7 or all of them (tail halves, 1000 is
        // clamped to the range; the default is 16) or none as one-row-set blocks
        // (TS_CUDA_ROWS_TAIL), the later tiles' blocks halved too (the default) or not, shared
        // chunks first and last: the same bits.
        for (b, w, kind) in [(tiled, &tw, "tiled"), (rowmaj, &gw, "row-major")] {
            b.set_rows_r(2);
            for later in [true, false] {
                b.set_rows_tail_later(later);
                for tail in [0usize, 1, 7, 1000] {
                    b.set_rows_tail(tail);
                    sets.push((format!("tail halves {tail} later {later}, {kind}"), run(b, w, o)));
                    b.set_rows_shared_first(false);
                    sets.push((format!("tail halves {tail} later {later}, shared chunks last, {kind}"), run(b, w, o)));
                    b.set_rows_shared_first(true);
                }
            }
            b.set_rows_tail_later(true);
            b.set_rows_tail(16);
            b.set_rows_r(1);
        }
        if declined > 0 {
            rep.failures.push(format!("{lab}: moe_shared declined {declined} times"));
        }
        for (what, (sh_out, moe_out)) in &sets {
            rep.check(&format!("{lab} moe_shared, {what} (exact)"), sh_out, &outs[1].0, 0.0, 0.0);
            rep.check(&format!("{lab} moe, {what} (exact)"), moe_out, &outs[1].1, 0.0, 0.0);
        }
        rep.check(&format!("{lab} moe_shared (exact)"), &outs[0].0, &outs[1].0, 0.0, 0.0);
        rep.check(&format!("{lab} moe (exact)"), &outs[0].1, &outs[1].1, 0.0, 0.0);
        rep.check(&format!("{lab} moe_shared, tiled experts (exact)"), &outs[2].0, &outs[1].0, 0.0, 0.0);
        rep.check(&format!("{lab} moe, tiled experts (exact)"), &outs[2].1, &outs[1].1, 0.0, 0.0);
    }
    rep.finish();
}

/// Bit-for-bit checks of a fused op's named outputs `a` against its chain's `b` (atol 0: any
/// difference, or a NaN left by an unwritten element, fails).
fn exact(rep: &mut Report, lab: &str, names: &[&str], a: &[Vec<f32>], b: &[Vec<f32>]) {
    for ((name, x), y) in names.iter().zip(a).zip(b) {
        rep.check(&format!("{lab} {name} (exact)"), x, y, 0.0, 0.0);
    }
}

/// Fused ops inside a recorded step (graph_begin / graph_end): eager, captured, then replayed
/// with new inputs, against the same ops run eagerly on the shared test backend.
#[test]
fn fused_recorded_steps_replay() {
    let Some(e) = gpu() else { return };
    // A backend of its own (its own stream): a capture must not see other tests' work.
    let g = &CudaBackend::new(0).expect("second backend");
    fused_banner(g);
    let mut r = rng(16);
    let mut rep = Report::new("fused_graph");
    let (hdim, ff, ne, k, nsh) = (256usize, 128usize, 16usize, 4usize, 2usize);
    let sf = nsh * ff;
    let ty = GgmlType::Q8_0;
    let shapes = moe_shared_shapes(hdim, ff, ne, sf, [96, 40]);
    let ws: Vec<Vec<u8>> = shapes.iter().map(|s| weight(&mut r, ty, s, 0.3).0).collect();
    let upl = |b: &CudaBackend| -> Vec<CudaWeight> {
        shapes.iter().zip(&ws).map(|(s, w)| b.upload_weight(&td("w", ty, s, w), WeightUse::Matmul).unwrap()).collect()
    };
    let (gw, ew) = (upl(g), upl(e));
    let nw = randn(&mut r, hdim, 1.0);
    let (gn, en) = (norm_weight(g, &nw), norm_weight(e, &nw));
    let p = MoeParams { norm_topk: true, ..MoeParams::top_k(ne, k) };
    for &n in &[1usize, 3] {
        let rx = Rows::packed(n, hdim);
        let key = 0xf05e_u64 ^ r.random::<u64>();
        // Buffers per backend: x, delta, h, router logits, out, q (96), kv (40).
        let mk =
            |b: &CudaBackend| -> Vec<CudaBuf> { [hdim, hdim, hdim, ne, hdim, 96, 40].iter().map(|&w| b.alloc(n * w).unwrap()).collect() };
        let (gb, eb) = (mk(g), mk(e));
        let step = |b: &CudaBackend, w: &[CudaWeight], nw: &CudaWeight, bf: &[CudaBuf]| {
            b.add_rms_norm(&bf[0], rx, &bf[1], rx, Some(nw), 1e-6, &bf[2], rx);
            b.matmul_many(&bf[2], rx, &[(&w[6], &bf[5], Rows::packed(n, 96)), (&w[7], &bf[6], Rows::packed(n, 40))]);
            let rr = Rows::packed(n, ne);
            let ex = Experts { gate: &w[0], up: &w[1], down: &w[2] };
            if !b.moe_shared(&bf[2], rx, &bf[3], rr, ex, Experts { gate: &w[3], up: &w[4], down: &w[5] }, &p, &bf[4], rx) {
                b.moe(&bf[2], rx, &bf[3], rr, Experts { gate: &w[0], up: &w[1], down: &w[2] }, &p, &bf[4], rx);
            }
        };
        for s in 0..4 {
            let x = randn(&mut r, n * hdim, 1.0);
            let d = randn(&mut r, n * hdim, 1.0);
            let lg = randn(&mut r, n * ne, 2.0);
            for (b, bf) in [(g, &gb), (e, &eb)] {
                b.write(&bf[0], 0, &x).unwrap();
                b.write(&bf[1], 0, &d).unwrap();
                b.write(&bf[3], 0, &lg).unwrap();
                for (i, w) in [(2usize, hdim), (4, hdim), (5, 96), (6, 40)] {
                    poison(b, &bf[i], n * w);
                }
            }
            if !g.graph_begin(key, n) {
                step(g, &gw, &gn, &gb);
                if !g.graph_end() {
                    step(g, &gw, &gn, &gb);
                }
            }
            step(e, &ew, &en, &eb);
            for (i, w, what) in [(0usize, hdim, "x"), (2, hdim, "h"), (4, hdim, "moe out"), (5, 96, "q"), (6, 40, "kv")] {
                let rw = Rows::packed(n, w);
                rep.check(&format!("n={n} step {s} {what}"), &get(g, &gb[i], rw), &get(e, &eb[i], rw), 1e-6, 1e-6);
            }
        }
    }
    rep.finish();
}
