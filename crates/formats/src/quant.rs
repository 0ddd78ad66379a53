//! GGML block formats: sizes, reference dequantisation and quantisation.
//!
//! These are the *reference* implementations (plain scalar Rust, the referee for every SIMD and
//! GPU kernel). Layouts follow ggml exactly so GGUF files from llama.cpp load bit for bit.

use crate::{FormatError, Result};

/// GGML tensor element types (the numeric values are the GGUF on-disk ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            _ => return None,
        })
    }
    /// Elements per block.
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K => 256,
        }
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2K => 84,
            Q3K => 110,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            Q8K => 292,
        }
    }
    /// Bytes of one row of `n` elements; `None` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if n % self.block_size() != 0 {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
        }
    }
    /// Parse a user-facing name (`q8_0`, `Q4_K`, `bf16` …), case-insensitive.
    pub fn parse(s: &str) -> Option<Self> {
        let u = s.to_ascii_uppercase().replace('-', "_");
        ALL.iter().copied().find(|t| t.name() == u || t.name().replace('_', "") == u.replace('_', ""))
    }
    /// True for the types the CPU and model code can compute with (dequantise and dot).
    pub fn is_supported_weight(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4K | Q5K | Q6K)
    }
}

pub const ALL: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::Q8K,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::BF16,
];

/// Dequantise `dst.len()` elements (a whole number of blocks) from `src`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = ty
        .row_bytes(dst.len())
        .ok_or_else(|| FormatError::Other(format!("{}: {} elements is not a whole number of blocks", ty.name(), dst.len())))?;
    if src.len() < need {
        return Err(FormatError::Other(format!("{}: need {need} bytes, have {}", ty.name(), src.len())));
    }
    let _ = &src[..need];
    todo_impl::dequantize(ty, &src[..need], dst)
}

/// Quantise `src` (a whole number of blocks) into `dst` (exactly `row_bytes(src.len())` bytes).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let need = ty
        .row_bytes(src.len())
        .ok_or_else(|| FormatError::Other(format!("{}: {} elements is not a whole number of blocks", ty.name(), src.len())))?;
    if dst.len() != need {
        return Err(FormatError::Other(format!("{}: need {need} bytes, have {}", ty.name(), dst.len())));
    }
    todo_impl::quantize(ty, src, dst)
}

mod todo_impl {
    use super::*;
    pub fn dequantize(ty: GgmlType, _src: &[u8], _dst: &mut [f32]) -> Result<()> {
        Err(FormatError::Other(format!("dequantisation of {} is not implemented yet", ty.name())))
    }
    pub fn quantize(ty: GgmlType, _src: &[f32], _dst: &mut [u8]) -> Result<()> {
        Err(FormatError::Other(format!("quantisation to {} is not implemented yet", ty.name())))
    }
}
