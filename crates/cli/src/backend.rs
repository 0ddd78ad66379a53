//! Choosing the compute backend at run time. The binary always builds with both; CUDA libraries
//! are loaded dynamically, so a machine without a GPU runs the CPU path.

use std::sync::Arc;

use anyhow::{bail, Result};
use ts_cpu::CpuBackend;
use ts_formats::TensorSource;
use ts_models::{Model, RuntimeOptions};

use crate::BackendKind;

pub enum AnyBackend {
    Cpu(Arc<CpuBackend>),
}

impl AnyBackend {
    pub fn new(kind: BackendKind, threads: Option<usize>) -> Result<Self> {
        match kind {
            BackendKind::Cpu | BackendKind::Auto => Ok(AnyBackend::Cpu(Arc::new(CpuBackend::new(threads)?))),
            BackendKind::Cuda => bail!("--backend cuda: this build has no CUDA backend yet"),
        }
    }
    pub fn name(&self) -> String {
        match self {
            AnyBackend::Cpu(b) => ts_core::Backend::name(b.as_ref()),
        }
    }
    pub fn load(&self, src: &dyn TensorSource, opts: RuntimeOptions, progress: Box<dyn FnMut(u64, u64)>) -> Result<Box<dyn Model>> {
        Ok(match self {
            AnyBackend::Cpu(b) => ts_models::load_with_progress(src, b.clone(), opts, progress)?,
        })
    }
}
