//! Choosing the compute backend at run time. The binary always builds with both; CUDA libraries
//! are loaded dynamically, so a machine without a GPU runs the CPU path.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use ts_cpu::CpuBackend;
use ts_cuda::CudaBackend;
use ts_formats::TensorSource;
use ts_models::{Model, RuntimeOptions};

use crate::BackendKind;

pub enum AnyBackend {
    Cpu(Arc<CpuBackend>),
    Cuda(Arc<CudaBackend>),
}

impl AnyBackend {
    /// `Auto` takes CUDA device 0 when one opens, else the CPU; `Cuda` without a GPU is an error.
    /// `exact` selects the CPU's f32-activation referee mode, `no_mmap` copies the CPU's weights
    /// instead of reading them from the file's memory map (the GPU copies them to the device
    /// either way), `invariant` the CPU's batch-invariant products for every quantised type
    /// (`CpuBackend::invariant`, for the server).
    pub fn new(kind: BackendKind, threads: Option<usize>, exact: bool, no_mmap: bool, invariant: bool) -> Result<Self> {
        let cpu = || -> Result<Self> {
            let mut b = CpuBackend::new(threads)?;
            if exact {
                b = b.exact();
            }
            if invariant {
                b = b.invariant();
            }
            if no_mmap {
                b = b.copy_weights();
            }
            Ok(AnyBackend::Cpu(Arc::new(b)))
        };
        match kind {
            BackendKind::Cpu => cpu(),
            BackendKind::Cuda => {
                let b = CudaBackend::new(0).map_err(|e| anyhow!("--backend cuda: {e}"))?;
                Ok(AnyBackend::Cuda(Arc::new(b)))
            }
            BackendKind::Auto => match CudaBackend::new(0) {
                Ok(b) => Ok(AnyBackend::Cuda(Arc::new(b))),
                Err(_) => cpu(),
            },
        }
    }

    pub fn name(&self) -> String {
        match self {
            AnyBackend::Cpu(b) => ts_core::Backend::name(b.as_ref()),
            AnyBackend::Cuda(b) => ts_core::Backend::name(b.as_ref()),
        }
    }

    /// Free and total device memory, where the backend has its own.
    pub fn device_memory(&self) -> Option<(usize, usize)> {
        match self {
            AnyBackend::Cpu(_) => None,
            AnyBackend::Cuda(b) => b.memory_info().ok(),
        }
    }

    pub fn load(
        &self,
        src: &dyn TensorSource,
        opts: RuntimeOptions,
        requant: Option<ts_formats::GgmlType>,
        progress: Box<dyn FnMut(u64, u64)>,
    ) -> Result<Box<dyn Model>> {
        Ok(match self {
            AnyBackend::Cpu(b) => ts_models::load_with_progress(src, b.clone(), opts, requant, progress)?,
            AnyBackend::Cuda(b) => ts_models::load_with_progress(src, b.clone(), opts, requant, progress)?,
        })
    }
}
