//! # ts-cpu — the CPU backend
//!
//! [`CpuBackend`] implements [`ts_core::Backend`] for any CPU; its ops are the reference that
//! the CUDA backend is tested against. [`quant_dot`] holds the SIMD dot-product kernels
//! (AVX2 chosen at run time, scalar fallback) that its matmuls stream weights through.

pub mod backend;
pub mod pool;
pub mod quant_dot;
pub mod simd;

pub use backend::{route, CpuBackend, CpuBuf, CpuWeight};
