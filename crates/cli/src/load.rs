//! Resolving `-m`, opening the source, and loading the model on the chosen backend with a
//! progress bar.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use ts_engine::hub;
use ts_formats::TensorSource;
use ts_models::{Model, RuntimeOptions};

use crate::backend::AnyBackend;
use crate::ModelOpts;

const GIB: f64 = (1u64 << 30) as f64;

/// The path for `-m` (fetching a known model if needed); `default` when `-m` is absent.
pub fn resolve(model: Option<&str>, default: Option<&hub::KnownModel>) -> Result<PathBuf> {
    let name = match model {
        Some(m) => m,
        None => match default {
            Some(k) => return fetch(k),
            None => bail!("no model given: pass -m MODEL (a .gguf file, an HF folder, or a name from `turbospark models`)"),
        },
    };
    let p = PathBuf::from(name);
    if p.exists() {
        return Ok(p);
    }
    if let Some(k) = hub::find(name) {
        return fetch(k);
    }
    bail!("{name}: no such file or folder, and not a known model name (see `turbospark models`)")
}

fn fetch(k: &hub::KnownModel) -> Result<PathBuf> {
    let cached = hub::cached_path(k);
    if cached.is_file() {
        return Ok(cached);
    }
    eprintln!("turbospark: {} is not cached yet; fetching it once ({})", k.file, k.about);
    let p = hub::ensure(k, &mut |msg| eprintln!("turbospark: {msg}"))?;
    Ok(p)
}

pub fn open_source(path: &std::path::Path) -> Result<Box<dyn TensorSource>> {
    Ok(ts_formats::open_model(path)?)
}

/// A loaded model plus what the commands need beside it.
pub struct Loaded {
    pub path: PathBuf,
    pub src: Box<dyn TensorSource>,
    pub model: Box<dyn Model>,
    pub backend_name: String,
}

/// Default context: the model's training context, capped at 4096. Default batch (`-b`): 2048
/// tokens on a GPU, 512 on the CPU.
pub fn runtime_options(o: &ModelOpts, src: &dyn TensorSource, n_slots: usize, gpu: bool) -> RuntimeOptions {
    let train = train_ctx(src).unwrap_or(4096);
    let ctx = o.ctx_size.unwrap_or(train.min(4096)).max(1);
    let batch = o.batch_size.unwrap_or(if gpu { 2048 } else { 512 });
    RuntimeOptions { ctx, n_slots, max_batch: batch.clamp(1, 65536) }
}

fn train_ctx(src: &dyn TensorSource) -> Option<usize> {
    let m = src.metadata();
    let arch = m.get("general.architecture")?.as_str()?;
    m.get(&format!("{arch}.context_length")).or_else(|| m.get("hf.max_position_embeddings")).and_then(|v| v.as_u64()).map(|v| v as usize)
}

/// Resolve, open and load. `default` is used when `-m` is absent.
pub fn load(o: &ModelOpts, default: Option<&hub::KnownModel>, n_slots: usize) -> Result<Loaded> {
    let path = resolve(o.model.as_deref(), default)?;
    let src = open_source(&path)?;
    if o.exact && o.backend == crate::BackendKind::Cuda {
        bail!("--exact is a CPU mode; use it with --backend cpu");
    }
    let be = AnyBackend::new(o.backend, o.threads, o.exact, o.no_mmap, o.invariant)?;
    let opts = runtime_options(o, src.as_ref(), n_slots, matches!(be, AnyBackend::Cuda(_)));
    let free_before = be.device_memory();
    let requant = o.quant.map(|q| q.ggml());
    if let Some((free, total)) = free_before {
        // Bytes on the device: a tensor --quant converts takes its new type's size (an estimate:
        // which matrices the model binds as such is the family's business).
        let need: u64 = src
            .tensor_names()
            .iter()
            .filter_map(|n| src.tensor(n))
            .map(|t| match ts_models::bind::requant_target(&t, ts_core::WeightUse::Matmul, requant) {
                Some(ty) if t.shape.len() >= 2 => ty.row_bytes(t.shape[0]).map_or(t.data.len(), |rb| rb * (t.numel() / t.shape[0])) as u64,
                _ => t.data.len() as u64,
            })
            .sum();
        if need > free as u64 {
            bail!(
                "{}: the weights need {:.2} GiB but {} has {:.2} GiB free of {:.2} GiB",
                path.display(),
                need as f64 / GIB,
                be.name(),
                free as f64 / GIB,
                total as f64 / GIB
            );
        }
    }
    let t0 = Instant::now();
    let pb = ProgressBar::new(1);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(format!("loading {}", path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default()));
    let pb2 = pb.clone();
    let model = be.load(
        src.as_ref(),
        opts,
        requant,
        Box::new(move |done, total| {
            pb2.set_length(total.max(1));
            pb2.set_position(done);
        }),
    )?;
    pb.finish_and_clear();
    let info = model.info();
    eprintln!(
        "turbospark: {} ({}, {:.1}M params, {:.1} MiB) on {} in {:.2}s; ctx {} ({:.1} MiB cache)",
        if info.name.is_empty() { &info.arch } else { &info.name },
        info.arch,
        info.n_params as f64 / 1e6,
        info.weight_bytes as f64 / (1 << 20) as f64,
        be.name(),
        t0.elapsed().as_secs_f64(),
        opts.ctx,
        (info.cache_bytes_per_token * (opts.ctx * opts.n_slots) as u64) as f64 / (1 << 20) as f64
    );
    if let (Some((free0, _)), Some((free1, total))) = (free_before, be.device_memory()) {
        let cache = info.cache_bytes_per_token * (opts.ctx * opts.n_slots) as u64;
        let used = free0.saturating_sub(free1) as u64;
        let copies = if info.weight_copy_bytes > 0 {
            format!(
                " (+{:.2} GiB second layouts of the MoE weights: 16-row tiles for batched decode, f16 for prompts; \
                 TS_CUDA_MOE_TILED=0 / TS_CUDA_F16=0 go without)",
                info.weight_copy_bytes as f64 / GIB
            )
        } else {
            String::new()
        };
        eprintln!(
            "turbospark: GPU memory: weights {:.2} GiB{copies}, KV cache {:.2} GiB, scratch and other {:.2} GiB; {:.2} GiB of {:.2} GiB free",
            info.weight_bytes as f64 / GIB,
            cache as f64 / GIB,
            used.saturating_sub(info.weight_bytes + info.weight_copy_bytes + cache) as f64 / GIB,
            free1 as f64 / GIB,
            total as f64 / GIB
        );
    }
    Ok(Loaded { path, src, model, backend_name: be.name() })
}
