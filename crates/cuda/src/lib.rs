//! # ts-cuda — the CUDA backend
//!
//! [`CudaBackend`] implements [`ts_core::Backend`] on one NVIDIA GPU. libcuda, NVRTC and cuBLAS
//! are loaded at run time (cudarc, dynamic loading), so this crate builds and links on machines
//! without CUDA; [`CudaBackend::new`] then fails with a one-line error.
//!
//! Kernels are CUDA C (`kernels/*.cu`), compiled by NVRTC for the device's own compute capability
//! and cached on disk ([`kernels`]). Every op is checked against the CPU reference in
//! `tests/ops_vs_cpu.rs`; `docs/GPU.md` says how to run those tests on a GPU machine.

pub mod backend;
pub mod kernels;

pub use backend::{
    CudaBackend, CudaBatch, CudaBuf, CudaCache, CudaRope, CudaWeight, Path, GEMV_MAX_TOKENS, GRAPH_MAX_TOKENS, MLA_LONG_DEFAULT,
};
