//! GGML block formats: sizes, reference dequantisation and quantisation.
//!
//! These are the *reference* implementations (plain scalar Rust, the referee for every SIMD and
//! GPU kernel). Layouts follow ggml exactly so GGUF files from llama.cpp load bit for bit.

// Block codecs index several parallel arrays by position; iterator chains would obscure the layouts.
#![allow(clippy::needless_range_loop)]

use crate::{FormatError, Result};
use half::{bf16, f16};

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
        if !n.is_multiple_of(self.block_size()) {
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

/// Elements per block of the "legacy" formats (Q4_0 … Q8_1).
pub const QK: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// f16 bits (little-endian IEEE half) to f32, exactly as ggml's `GGML_FP16_TO_FP32`.
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// f32 to f16 bits, round-to-nearest-even like ggml's `GGML_FP32_TO_FP16`.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// Read the little-endian f16 at `b[off..off + 2]` as f32.
#[inline]
pub fn read_f16(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

#[inline]
fn write_f16(b: &mut [u8], off: usize, x: f32) {
    b[off..off + 2].copy_from_slice(&f32_to_f16(x).to_le_bytes());
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2^23 magic constant.
/// Valid for |x| < 2^22 (always true here: callers pass at most a few hundred).
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    debug_assert!(x.abs() <= 4194303.0);
    let v = x + 12582912.0;
    ((v.to_bits() & 0x007f_ffff) as i32) - 0x0040_0000
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and 6-bit min of sub-block `j` (0..8) of a Q4_K /
/// Q5_K super-block, unpacked from the 12-byte `scales` field.
///
/// Packing: for j < 4, `scales[j]` low 6 bits = scale j, `scales[j+4]` low 6 bits = min j.
/// For j >= 4, `scales[j+4]` low nibble = low 4 bits of scale j, its high nibble = low 4 bits of
/// min j, and the top 2 bits of scale/min j sit in bits 6..7 of `scales[j-4]` / `scales[j]`.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Inverse of [`get_scale_min_k4`]: pack eight 6-bit (scale, min) pairs into 12 bytes.
pub fn pack_scale_min_k4(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (sc[j] & 63, mn[j] & 63);
        if j < 4 {
            q[j] |= ls;
            q[j + 4] |= lm;
        } else {
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            q[j - 4] |= (ls >> 4) << 6;
            q[j] |= (lm >> 4) << 6;
        }
    }
    q
}

/// Dequantise `dst.len()` elements (a whole number of blocks) from `src`.
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q4_K, Q5_K, Q6_K, Q8_K.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let need = ty
        .row_bytes(dst.len())
        .ok_or_else(|| FormatError::Other(format!("{}: {} elements is not a whole number of blocks", ty.name(), dst.len())))?;
    if src.len() < need {
        return Err(FormatError::Other(format!("{}: need {need} bytes, have {}", ty.name(), src.len())));
    }
    let src = &src[..need];
    use GgmlType::*;
    let f: fn(&[u8], &mut [f32]) = match ty {
        F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        F16 => |b, y| y[0] = f16::from_le_bytes([b[0], b[1]]).to_f32(),
        BF16 => |b, y| y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        Q4_0 => reference::dequant_q4_0,
        Q4_1 => reference::dequant_q4_1,
        Q5_0 => reference::dequant_q5_0,
        Q5_1 => reference::dequant_q5_1,
        Q8_0 => reference::dequant_q8_0,
        Q8_1 => reference::dequant_q8_1,
        Q4K => reference::dequant_q4_k,
        Q5K => reference::dequant_q5_k,
        Q6K => reference::dequant_q6_k,
        Q8K => reference::dequant_q8_k,
        _ => return Err(FormatError::Other(format!("dequantisation of {} is not supported", ty.name()))),
    };
    for (b, y) in src.chunks_exact(ty.type_size()).zip(dst.chunks_exact_mut(ty.block_size())) {
        f(b, y);
    }
    Ok(())
}

/// Quantise `src` (a whole number of blocks) into `dst` (exactly `row_bytes(src.len())` bytes).
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K (all bit-identical to
/// ggml's `quantize_row_*_ref`), and Q4_K, Q5_K, Q6_K (a simpler, non-iterative quantiser whose
/// output is a valid block of that format but not byte-identical to ggml's).
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let need = ty
        .row_bytes(src.len())
        .ok_or_else(|| FormatError::Other(format!("{}: {} elements is not a whole number of blocks", ty.name(), src.len())))?;
    if dst.len() != need {
        return Err(FormatError::Other(format!("{}: need {need} bytes, have {}", ty.name(), dst.len())));
    }
    use GgmlType::*;
    let f: fn(&[f32], &mut [u8]) = match ty {
        F32 => |x, b| b.copy_from_slice(&x[0].to_le_bytes()),
        F16 => |x, b| b.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()),
        BF16 => |x, b| b.copy_from_slice(&bf16::from_f32(x[0]).to_le_bytes()),
        Q4_0 => reference::quant_q4_0,
        Q4_1 => reference::quant_q4_1,
        Q5_0 => reference::quant_q5_0,
        Q5_1 => reference::quant_q5_1,
        Q8_0 => reference::quant_q8_0,
        Q8_1 => reference::quant_q8_1,
        Q4K => reference::quant_q4_k,
        Q5K => reference::quant_q5_k,
        Q6K => reference::quant_q6_k,
        Q8K => reference::quant_q8_k,
        _ => return Err(FormatError::Other(format!("quantisation to {} is not supported", ty.name()))),
    };
    for (x, b) in src.chunks_exact(ty.block_size()).zip(dst.chunks_exact_mut(ty.type_size())) {
        f(x, b);
    }
    Ok(())
}

/// Per-block reference codecs. Every function takes exactly one block: `b.len() == type_size`,
/// `x.len()`/`y.len() == block_size`. Byte offsets below are the ggml struct layouts
/// (`ggml-common.h`); all multi-byte fields are little-endian.
mod reference {
    use super::*;

    // ---------------------------------------------------------------- legacy 32-element blocks

    /// block_q4_0 { f16 d @0; u8 qs[16] @2 }: x[j] = d·(lo(qs[j]) − 8), x[j+16] = d·(hi(qs[j]) − 8).
    pub fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
        let d = read_f16(b, 0);
        let qs = &b[2..18];
        for j in 0..16 {
            y[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
            y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }

    /// block_q4_1 { f16 d @0; f16 m @2; u8 qs[16] @4 }: x = d·q + m, q in 0..15.
    pub fn dequant_q4_1(b: &[u8], y: &mut [f32]) {
        let (d, m) = (read_f16(b, 0), read_f16(b, 2));
        let qs = &b[4..20];
        for j in 0..16 {
            y[j] = (qs[j] & 0xF) as f32 * d + m;
            y[j + 16] = (qs[j] >> 4) as f32 * d + m;
        }
    }

    /// block_q5_0 { f16 d @0; u8 qh[4] @2 (bit j = 5th bit of element j); u8 qs[16] @6 }:
    /// x = d·(q − 16), q in 0..31.
    pub fn dequant_q5_0(b: &[u8], y: &mut [f32]) {
        let d = read_f16(b, 0);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..22];
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (((qs[j] & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
            y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
        }
    }

    /// block_q5_1 { f16 d @0; f16 m @2; u8 qh[4] @4; u8 qs[16] @8 }: x = d·q + m, q in 0..31.
    pub fn dequant_q5_1(b: &[u8], y: &mut [f32]) {
        let (d, m) = (read_f16(b, 0), read_f16(b, 2));
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let qs = &b[8..24];
        for j in 0..16 {
            let h0 = ((qh >> j) << 4) & 0x10;
            let h1 = (qh >> (j + 12)) & 0x10;
            y[j] = ((qs[j] & 0xF) as u32 | h0) as f32 * d + m;
            y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
        }
    }

    /// block_q8_0 { f16 d @0; i8 qs[32] @2 }: x = d·q.
    pub fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
        let d = read_f16(b, 0);
        for j in 0..32 {
            y[j] = b[2 + j] as i8 as f32 * d;
        }
    }

    /// block_q8_1 { f16 d @0; f16 s @2 (= d·Σq); i8 qs[32] @4 }: x = d·q.
    pub fn dequant_q8_1(b: &[u8], y: &mut [f32]) {
        let d = read_f16(b, 0);
        for j in 0..32 {
            y[j] = b[4 + j] as i8 as f32 * d;
        }
    }

    /// Index and value of the element with the largest magnitude (first one on ties), like ggml.
    fn signed_absmax(x: &[f32]) -> (f32, f32) {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        (amax, max)
    }

    fn min_max(x: &[f32]) -> (f32, f32) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            min = min.min(v);
            max = max.max(v);
        }
        (min, max)
    }

    /// `quantize_row_q4_0_ref`: d = max/−8 (max = the signed value of largest magnitude).
    pub fn quant_q4_0(x: &[f32], b: &mut [u8]) {
        let (_, max) = signed_absmax(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(b, 0, d);
        for j in 0..16 {
            let x0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let x1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
            b[2 + j] = x0 | (x1 << 4);
        }
    }

    /// `quantize_row_q4_1_ref`: d = (max − min)/15, m = min.
    pub fn quant_q4_1(x: &[f32], b: &mut [u8]) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(b, 0, d);
        write_f16(b, 2, min);
        for j in 0..16 {
            let x0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let x1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
            b[4 + j] = x0 | (x1 << 4);
        }
    }

    /// `quantize_row_q5_0_ref`: d = max/−16.
    pub fn quant_q5_0(x: &[f32], b: &mut [u8]) {
        let (_, max) = signed_absmax(x);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(b, 0, d);
        let mut qh = 0u32;
        for j in 0..16 {
            let x0 = ((x[j] * id + 16.5) as i8).min(31) as u32;
            let x1 = ((x[j + 16] * id + 16.5) as i8).min(31) as u32;
            b[6 + j] = ((x0 & 0xF) | ((x1 & 0xF) << 4)) as u8;
            qh |= ((x0 & 0x10) >> 4) << j;
            qh |= ((x1 & 0x10) >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    }

    /// `quantize_row_q5_1_ref`: d = (max − min)/31, m = min.
    pub fn quant_q5_1(x: &[f32], b: &mut [u8]) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(b, 0, d);
        write_f16(b, 2, min);
        let mut qh = 0u32;
        for j in 0..16 {
            // ggml casts to uint8_t without a clamp; the min() only matters for NaN/overflow.
            let x0 = (((x[j] - min) * id + 0.5) as u8).min(31) as u32;
            let x1 = (((x[j + 16] - min) * id + 0.5) as u8).min(31) as u32;
            b[8 + j] = ((x0 & 0xF) | ((x1 & 0xF) << 4)) as u8;
            qh |= ((x0 & 0x10) >> 4) << j;
            qh |= ((x1 & 0x10) >> 4) << (j + 16);
        }
        b[4..8].copy_from_slice(&qh.to_le_bytes());
    }

    /// `quantize_row_q8_0_ref`: d = amax/127, q = roundf(x/d) (ties away from zero).
    pub fn quant_q8_0(x: &[f32], b: &mut [u8]) {
        let (amax, _) = signed_absmax(x);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        write_f16(b, 0, d);
        for j in 0..32 {
            b[2 + j] = (x[j] * id).round() as i8 as u8;
        }
    }

    /// `quantize_row_q8_1_ref`: as Q8_0, plus s = d·Σq (d in f32, s stored as f16).
    pub fn quant_q8_1(x: &[f32], b: &mut [u8]) {
        let (amax, _) = signed_absmax(x);
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for j in 0..32 {
            let q = (x[j] * id).round() as i8;
            b[4 + j] = q as u8;
            sum += q as i32;
        }
        write_f16(b, 0, d);
        write_f16(b, 2, sum as f32 * d);
    }

    // ---------------------------------------------------------------- K-quants (256 elements)

    /// block_q4_K { f16 d @0; f16 dmin @2; u8 scales[12] @4; u8 qs[128] @16 }.
    /// Eight sub-blocks of 32 with 6-bit scale sc and min m ([`get_scale_min_k4`]):
    /// x = d·sc·q − dmin·m. Each 32-byte run of qs holds sub-block 2i in its low nibbles and
    /// sub-block 2i+1 in its high nibbles.
    pub fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
        let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
        let scales = &b[4..16];
        let qs = &b[16..144];
        for j in 0..4 {
            let (sc1, m1) = get_scale_min_k4(2 * j, scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let q = &qs[32 * j..32 * j + 32];
            let y = &mut y[64 * j..64 * j + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }

    /// block_q5_K { f16 d @0; f16 dmin @2; u8 scales[12] @4; u8 qh[32] @16; u8 qs[128] @48 }.
    /// As Q4_K with a 5th bit: element 64j+l takes bit 2j of qh[l], element 64j+32+l bit 2j+1.
    pub fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
        let (d, dmin) = (read_f16(b, 0), read_f16(b, 2));
        let scales = &b[4..16];
        let qh = &b[16..48];
        let qs = &b[48..176];
        for j in 0..4 {
            let (sc1, m1) = get_scale_min_k4(2 * j, scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, scales);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            let q = &qs[32 * j..32 * j + 32];
            let y = &mut y[64 * j..64 * j + 64];
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
                y[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
            }
        }
    }

    /// block_q6_K { u8 ql[128] @0; u8 qh[64] @128; i8 scales[16] @192; f16 d @208 }.
    /// Sixteen sub-blocks of 16, x = d·scales[i]·(q − 32), q 6-bit. For half n (128 elements,
    /// ql += 64n, qh += 32n, scales += 8n) and l in 0..32:
    /// q[l]    = lo(ql[l])    | (qh[l] bits 0..1) << 4,  q[l+32] = lo(ql[l+32]) | (bits 2..3) << 4,
    /// q[l+64] = hi(ql[l])    | (bits 4..5) << 4,        q[l+96] = hi(ql[l+32]) | (bits 6..7) << 4.
    pub fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
        let d = read_f16(b, 208);
        for n in 0..2 {
            let ql = &b[64 * n..64 * n + 64];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            let sc = &b[192 + 8 * n..192 + 8 * n + 8];
            let y = &mut y[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }

    /// block_q8_K { f32 d @0; i8 qs[256] @4; i16 bsums[16] @260 (Σ of each run of 16 qs) }: x = d·q.
    pub fn dequant_q8_k(b: &[u8], y: &mut [f32]) {
        let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        for j in 0..256 {
            y[j] = d * (b[4 + j] as i8) as f32;
        }
    }

    /// `quantize_row_q8_K_ref`: iscale = −127/max (max = signed value of largest magnitude),
    /// q = min(127, nearest_int(iscale·x)), d = 1/iscale, plus the 16 partial sums.
    pub fn quant_q8_k(x: &[f32], b: &mut [u8]) {
        b.fill(0);
        let (amax, max) = signed_absmax(x);
        if amax == 0.0 {
            return; // d = 0, all qs and bsums 0
        }
        let iscale = -127.0 / max;
        for j in 0..256 {
            b[4 + j] = nearest_int(iscale * x[j]).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let s: i32 = b[4 + 16 * j..4 + 16 * j + 16].iter().map(|&q| q as i8 as i32).sum();
            b[260 + 2 * j..262 + 2 * j].copy_from_slice(&(s as i16).to_le_bytes());
        }
        b[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
    }

    /// Shared Q4_K / Q5_K quantiser (`nmax` = 15 or 31). Per sub-block of 32: scale = (max −
    /// min)/nmax and min clamped to ≤ 0 (so the stored min is ≥ 0), both then quantised to 6
    /// bits against the super-block's largest; elements are finally rounded against the
    /// *quantised* scale and min, so the block decodes to the nearest representable values.
    /// Returns (d, dmin, packed scales, levels L in 0..=nmax).
    fn quant_k_asym(x: &[f32], nmax: i32) -> (u16, u16, [u8; 12], [u8; 256]) {
        let mut scales = [0f32; 8];
        let mut mins = [0f32; 8];
        for j in 0..8 {
            let (mn, mx) = min_max(&x[32 * j..32 * j + 32]);
            let mn = mn.min(0.0);
            scales[j] = (mx - mn) / nmax as f32;
            mins[j] = -mn;
        }
        let max_scale = scales.iter().fold(0f32, |a, &b| a.max(b));
        let max_min = mins.iter().fold(0f32, |a, &b| a.max(b));
        let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        let mut ls = [0u8; 8];
        let mut lm = [0u8; 8];
        for j in 0..8 {
            ls[j] = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
            lm[j] = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        }
        let packed = pack_scale_min_k4(&ls, &lm);
        let d16 = f32_to_f16(max_scale / 63.0);
        let dmin16 = f32_to_f16(max_min / 63.0);
        let (d, dmin) = (f16_to_f32(d16), f16_to_f32(dmin16));
        let mut l = [0u8; 256];
        for j in 0..8 {
            let (sc, m) = get_scale_min_k4(j, &packed);
            let dd = d * sc as f32;
            if dd == 0.0 {
                continue;
            }
            let dm = dmin * m as f32;
            for i in 0..32 {
                l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dd).clamp(0, nmax) as u8;
            }
        }
        (d16, dmin16, packed, l)
    }

    /// Q4_K quantiser (see [`quant_k_asym`]); valid block_q4_K, not byte-identical to ggml's.
    pub fn quant_q4_k(x: &[f32], b: &mut [u8]) {
        let (d, dmin, scales, l) = quant_k_asym(x, 15);
        b[0..2].copy_from_slice(&d.to_le_bytes());
        b[2..4].copy_from_slice(&dmin.to_le_bytes());
        b[4..16].copy_from_slice(&scales);
        for j in 0..4 {
            for i in 0..32 {
                b[16 + 32 * j + i] = l[64 * j + i] | (l[64 * j + 32 + i] << 4);
            }
        }
    }

    /// Q5_K quantiser (see [`quant_k_asym`]); valid block_q5_K, not byte-identical to ggml's.
    pub fn quant_q5_k(x: &[f32], b: &mut [u8]) {
        let (d, dmin, scales, l) = quant_k_asym(x, 31);
        b[0..2].copy_from_slice(&d.to_le_bytes());
        b[2..4].copy_from_slice(&dmin.to_le_bytes());
        b[4..16].copy_from_slice(&scales);
        b[16..48].fill(0);
        for j in 0..4 {
            for i in 0..32 {
                let (l1, l2) = (l[64 * j + i], l[64 * j + 32 + i]);
                b[16 + i] |= ((l1 >> 4) << (2 * j)) | ((l2 >> 4) << (2 * j + 1));
                b[48 + 32 * j + i] = (l1 & 0xF) | ((l2 & 0xF) << 4);
            }
        }
    }

    /// Q6_K quantiser: per sub-block of 16, scale = max/−32 (max = signed value of largest
    /// magnitude); the 16 scales are quantised to i8 against the largest (d = max_scale/−128),
    /// then elements are rounded against the quantised scales and clamped to −32..31.
    /// Valid block_q6_K, not byte-identical to ggml's iterative `make_qx_quants`.
    pub fn quant_q6_k(x: &[f32], b: &mut [u8]) {
        b.fill(0);
        let mut scales = [0f32; 16];
        let (mut max_abs, mut max_scale) = (0f32, 0f32);
        for ib in 0..16 {
            let (_, max) = signed_absmax(&x[16 * ib..16 * ib + 16]);
            scales[ib] = max / -32.0;
            if scales[ib].abs() > max_abs {
                max_abs = scales[ib].abs();
                max_scale = scales[ib];
            }
        }
        if max_abs == 0.0 {
            return;
        }
        let iscale = -128.0 / max_scale;
        let d16 = f32_to_f16(1.0 / iscale);
        b[208..210].copy_from_slice(&d16.to_le_bytes());
        let d = f16_to_f32(d16);
        let mut l = [32u8; 256];
        for ib in 0..16 {
            let sc = nearest_int(iscale * scales[ib]).clamp(-128, 127) as i8;
            b[192 + ib] = sc as u8;
            let dd = d * sc as f32;
            if dd == 0.0 {
                continue;
            }
            for i in 0..16 {
                l[16 * ib + i] = (nearest_int(x[16 * ib + i] / dd).clamp(-32, 31) + 32) as u8;
            }
        }
        for n in 0..2 {
            let l = &l[128 * n..128 * n + 128];
            for i in 0..32 {
                b[64 * n + i] = (l[i] & 0xF) | ((l[i + 64] & 0xF) << 4);
                b[64 * n + 32 + i] = (l[i + 32] & 0xF) | ((l[i + 96] & 0xF) << 4);
                b[128 + 32 * n + i] = (l[i] >> 4) | ((l[i + 32] >> 4) << 2) | ((l[i + 64] >> 4) << 4) | ((l[i + 96] >> 4) << 6);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    /// Small deterministic PRNG (splitmix64) so tests need no extra dependency.
    struct Rng(u64);
    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn f(&mut self) -> f32 {
            (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    fn deq(ty: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n];
        dequantize(ty, b, &mut y).unwrap();
        y
    }

    fn h(x: f32) -> [u8; 2] {
        f32_to_f16(x).to_le_bytes()
    }

    #[test]
    fn sizes_match_ggml_structs() {
        // 2 + 16, 4 + 16, 2 + 4 + 16, 4 + 4 + 16, 2 + 32, 4 + 32, 4 + 12 + 128, 4 + 12 + 32 + 128, 128 + 64 + 16 + 2, 4 + 256 + 32
        for (t, s) in
            [(Q4_0, 18), (Q4_1, 20), (Q5_0, 22), (Q5_1, 24), (Q8_0, 34), (Q8_1, 36), (Q4K, 144), (Q5K, 176), (Q6K, 210), (Q8K, 292)]
        {
            assert_eq!(t.type_size(), s, "{}", t.name());
        }
        assert_eq!(Q4_0.row_bytes(64), Some(36));
        assert_eq!(Q4K.row_bytes(100), None);
    }

    #[test]
    fn plain_floats() {
        let b: Vec<u8> = [1.5f32, -2.25].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(deq(F32, &b, 2), vec![1.5, -2.25]);
        assert_eq!(deq(F16, &[0x00, 0x3C, 0x00, 0xC0], 2), vec![1.0, -2.0]);
        assert_eq!(deq(BF16, &[0x80, 0x3F, 0x49, 0x40], 2), vec![1.0, 3.140625]);
        let mut out = [0u8; 4];
        quantize(F16, &[1.0, -2.0], &mut out).unwrap();
        assert_eq!(out, [0x00, 0x3C, 0x00, 0xC0]);
        quantize(BF16, &[1.0, 3.140625], &mut out).unwrap();
        assert_eq!(out, [0x80, 0x3F, 0x49, 0x40]);
        let mut out = [0u8; 8];
        quantize(F32, &[1.5, -2.25], &mut out).unwrap();
        assert_eq!(&out[..], &b[..]);
        // f16 rounds to nearest even: 1 + 2^-11 is exactly halfway between 1 and 1 + 2^-10.
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3C00);
    }

    #[test]
    fn q4_0_known_block() {
        let mut b = vec![0x00, 0x38]; // d = 0.5
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], (7.0 - j as f32) * 0.5);
        }
        // Quantise: x = −8..7 twice → max (first of largest magnitude) = −8, d = 1, q = x + 8.
        let x: Vec<f32> = (0..32).map(|i| (i % 16) as f32 - 8.0).collect();
        let mut q = [0u8; 18];
        quantize(Q4_0, &x, &mut q).unwrap();
        assert_eq!(&q[0..2], &h(1.0));
        for j in 0..16 {
            assert_eq!(q[2 + j], (j as u8) | ((j as u8) << 4));
        }
        assert_eq!(deq(Q4_0, &q, 32), x);
    }

    #[test]
    fn q4_1_known_block() {
        let mut b = vec![0x00, 0x34, 0x00, 0xBC]; // d = 0.25, m = −1
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], 0.25 * j as f32 - 1.0);
            assert_eq!(y[j + 16], 0.25 * (15 - j) as f32 - 1.0);
        }
        let mut q = [0u8; 20];
        quantize(Q4_1, &y, &mut q).unwrap();
        assert_eq!(&q[..], &b[..]);
    }

    #[test]
    fn q5_0_known_block() {
        let qh: u32 = 0xA5C3_0F96;
        let mut b = vec![0x00, 0x3C]; // d = 1
        b.extend(qh.to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let y = deq(Q5_0, &b, 32);
        for e in 0..32 {
            let nib = if e < 16 { e as u32 } else { 15 - (e as u32 - 16) };
            let q = nib + 16 * ((qh >> e) & 1);
            assert_eq!(y[e], q as f32 - 16.0, "element {e}");
        }
        let mut q = [0u8; 22];
        quantize(Q5_0, &y, &mut q).unwrap();
        // Re-quantising reproduces the values (d may differ: it is derived from the data).
        assert_eq!(deq(Q5_0, &q, 32), y);
    }

    #[test]
    fn q5_1_known_block() {
        let qh: u32 = 0x1234_FEDC;
        let mut b = vec![0x00, 0x38, 0x00, 0x40]; // d = 0.5, m = 2
        b.extend(qh.to_le_bytes());
        b.extend((0..16u8).map(|j| (j * 7 % 16) | ((j * 3 % 16) << 4)));
        let y = deq(Q5_1, &b, 32);
        for e in 0..32 {
            let nib = if e < 16 { (e as u32 * 7) % 16 } else { ((e as u32 - 16) * 3) % 16 };
            let q = nib + 16 * ((qh >> e) & 1);
            assert_eq!(y[e], 0.5 * q as f32 + 2.0, "element {e}");
        }
        let mut q = [0u8; 24];
        quantize(Q5_1, &y, &mut q).unwrap();
        assert_eq!(deq(Q5_1, &q, 32), y);
    }

    #[test]
    fn q8_0_and_q8_1_known_blocks() {
        let mut b = vec![0x00, 0x40]; // d = 2
        b.extend((0..32i32).map(|i| (i * 8 - 128) as i8 as u8));
        let y = deq(Q8_0, &b, 32);
        for i in 0..32 {
            assert_eq!(y[i], 2.0 * (i as f32 * 8.0 - 128.0));
        }
        let mut b1 = vec![0x00, 0x38, 0x00, 0x00]; // d = 0.5, s (unused by dequantisation)
        b1.extend_from_slice(&b[2..]);
        let y1 = deq(Q8_1, &b1, 32);
        for i in 0..32 {
            assert_eq!(y1[i], 0.5 * (i as f32 * 8.0 - 128.0));
        }
        // Quantise x = j − 16: amax = 16, q = roundf(x·127/16) (ties away from zero).
        let x: Vec<f32> = (0..32).map(|j| j as f32 - 16.0).collect();
        let mut q = [0u8; 34];
        quantize(Q8_0, &x, &mut q).unwrap();
        assert_eq!(&q[0..2], &h(16.0 / 127.0));
        let id = 1.0 / (16.0f32 / 127.0);
        for j in 0..32 {
            assert_eq!(q[2 + j] as i8, (x[j] * id).round() as i8);
        }
        assert_eq!(q[2] as i8, -127);
        let mut q1 = [0u8; 36];
        quantize(Q8_1, &x, &mut q1).unwrap();
        assert_eq!(&q1[4..], &q[2..]);
        let sum: i32 = q[2..].iter().map(|&v| v as i8 as i32).sum();
        assert_eq!(&q1[2..4], &h(sum as f32 * (16.0 / 127.0)));
    }

    /// Scales (8 × 6 bit) and mins for the K-quant tests, with their ggml packing done by hand.
    const SC: [u8; 8] = [1, 2, 3, 4, 17, 40, 63, 5];
    const MN: [u8; 8] = [0, 1, 2, 3, 33, 9, 50, 63];
    fn hand_packed() -> [u8; 12] {
        let mut s = [0u8; 12];
        s[..4].copy_from_slice(&SC[..4]);
        s[4..8].copy_from_slice(&MN[..4]);
        for j in 4..8 {
            s[j + 4] = (SC[j] & 0xF) | ((MN[j] & 0xF) << 4);
            s[j - 4] |= (SC[j] >> 4) << 6;
            s[j] |= (MN[j] >> 4) << 6;
        }
        s
    }

    #[test]
    fn k4_scale_packing() {
        let s = hand_packed();
        // Byte-level check of one high-index entry: scale 4 = 17 = 0b01_0001, min 4 = 33 = 0b10_0001.
        assert_eq!(s[8], 0x11);
        assert_eq!(s[0] >> 6, 1);
        assert_eq!(s[4] >> 6, 2);
        for j in 0..8 {
            assert_eq!(get_scale_min_k4(j, &s), (SC[j], MN[j]), "sub-block {j}");
        }
        assert_eq!(pack_scale_min_k4(&SC, &MN), s);
    }

    #[test]
    fn q4_k_known_block() {
        let mut b = vec![0x00, 0x3C, 0x00, 0x38]; // d = 1, dmin = 0.5
        b.extend(hand_packed());
        b.extend((0..128).map(|i| ((i % 16) as u8) | ((15 - (i % 16) as u8) << 4)));
        let y = deq(Q4K, &b, 256);
        for e in 0..256 {
            let (chunk, within) = (e / 64, e % 64);
            let sub = 2 * chunk + within / 32;
            let byte = b[16 + 32 * chunk + within % 32];
            let q = if within < 32 { byte & 0xF } else { byte >> 4 };
            assert_eq!(y[e], SC[sub] as f32 * q as f32 - 0.5 * MN[sub] as f32, "element {e}");
        }
    }

    #[test]
    fn q5_k_known_block() {
        let mut b = vec![0x00, 0x38, 0x00, 0x3C]; // d = 0.5, dmin = 1
        b.extend(hand_packed());
        b.extend((0..32).map(|i| (i as u8).wrapping_mul(37) ^ 0x5A)); // qh
        b.extend((0..128).map(|i| (i as u8).wrapping_mul(11)));
        let y = deq(Q5K, &b, 256);
        for e in 0..256 {
            let (chunk, within) = (e / 64, e % 64);
            let sub = 2 * chunk + within / 32;
            let l = within % 32;
            let byte = b[48 + 32 * chunk + l];
            let lo = if within < 32 { byte & 0xF } else { byte >> 4 };
            let hi = (b[16 + l] >> sub) & 1; // element in sub-block s takes bit s of qh[l]
            let q = lo + 16 * hi;
            assert_eq!(y[e], 0.5 * SC[sub] as f32 * q as f32 - MN[sub] as f32, "element {e}");
        }
    }

    #[test]
    fn q6_k_known_block() {
        let mut b = vec![0x21u8; 128]; // ql: low nibble 1, high nibble 2
        b.extend([0b1110_0100u8; 64]); // qh: 2-bit fields 0, 1, 2, 3
        b.extend((0..16).map(|i| (i as i8 - 8) as u8)); // scales −8..7
        b.extend(h(0.5));
        let y = deq(Q6K, &b, 256);
        // Within each 128 half: elements 0..32 → q=1|0<<4, 32..64 → 1|1<<4, 64..96 → 2|2<<4, 96..128 → 2|3<<4.
        let qv = [1 - 32, 17 - 32, 34 - 32, 50 - 32];
        for e in 0..256 {
            let sub = e / 16; // the scale index of element e
            let q = qv[(e % 128) / 32];
            assert_eq!(y[e], 0.5 * (sub as f32 - 8.0) * q as f32, "element {e}");
        }
    }

    #[test]
    fn q8_k_known_block() {
        let mut b = 0.25f32.to_le_bytes().to_vec();
        b.extend((0..256).map(|i| (i - 128) as i8 as u8));
        b.extend([0u8; 32]);
        let y = deq(Q8K, &b, 256);
        for i in 0..256 {
            assert_eq!(y[i], 0.25 * (i as f32 - 128.0));
        }
        // Quantise: bsums and the −127/max convention.
        let x: Vec<f32> = (0..256).map(|i| (i as f32 - 100.0) / 50.0).collect(); // max is +3.1 (last)
        let mut q = [0u8; 292];
        quantize(Q8K, &x, &mut q).unwrap();
        let d = f32::from_le_bytes(q[0..4].try_into().unwrap());
        assert_eq!(d, 1.0 / (-127.0 / 3.1f32));
        assert_eq!(q[4 + 255] as i8, -127);
        for j in 0..16 {
            let s: i32 = q[4 + 16 * j..20 + 16 * j].iter().map(|&v| v as i8 as i32).sum();
            assert_eq!(i16::from_le_bytes([q[260 + 2 * j], q[261 + 2 * j]]) as i32, s);
        }
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-3.5), -4);
        assert_eq!(nearest_int(-0.4), 0);
    }

    #[test]
    fn zero_blocks_quantise_to_zero() {
        for &t in &[Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q4K, Q5K, Q6K, Q8K] {
            let n = t.block_size();
            let mut q = vec![0xAAu8; t.type_size()];
            quantize(t, &vec![0.0; n], &mut q).unwrap();
            assert!(deq(t, &q, n).iter().all(|&v| v == 0.0), "{}", t.name());
        }
    }

    /// quantise → dequantise of random data (with varied per-block magnitudes and offsets); the
    /// max error in every block must be within `tol` × (largest |x| of that block).
    #[test]
    fn round_trips() {
        let cases: &[(GgmlType, f32)] = &[
            (F32, 0.0),
            (F16, 1.0 / 1024.0),
            (BF16, 1.0 / 128.0),
            (Q4_0, 1.0 / 8.0 + 1e-3),
            (Q4_1, 2.0 / 30.0 + 2e-3),
            (Q5_0, 1.0 / 16.0 + 1e-3),
            (Q5_1, 2.0 / 62.0 + 2e-3),
            (Q8_0, 1.0 / 254.0 + 1e-3),
            (Q8_1, 1.0 / 254.0 + 1e-3),
            (Q8K, 1.0 / 254.0 + 1e-5),
            (Q4K, 0.12),
            (Q5K, 0.06),
            (Q6K, 0.035),
        ];
        let mut rng = Rng(42);
        let n = 1024;
        for &(t, tol) in cases {
            for trial in 0..20 {
                let x: Vec<f32> = (0..n)
                    .map(|i| {
                        let scale = 1.0 + ((i / 32 + trial) % 7) as f32 * 3.0;
                        let off = if trial % 3 == 0 { 0.5 * scale } else { 0.0 };
                        rng.f() * scale + off
                    })
                    .collect();
                let mut q = vec![0u8; t.row_bytes(n).unwrap()];
                quantize(t, &x, &mut q).unwrap();
                let y = deq(t, &q, n);
                let bs = t.block_size().max(32);
                let mut se = 0f64;
                let mut sx = 0f64;
                for (xb, yb) in x.chunks(bs).zip(y.chunks(bs)) {
                    let amax = xb.iter().fold(0f32, |a, &v| a.max(v.abs()));
                    for (&a, &b) in xb.iter().zip(yb) {
                        assert!((a - b).abs() <= tol * amax, "{} trial {trial}: {a} -> {b} (block amax {amax})", t.name());
                        se += ((a - b) as f64).powi(2);
                        sx += (amax as f64).powi(2);
                    }
                }
                if trial == 0 {
                    eprintln!("{}: rms error / block amax = {:.5} (max-error bound {tol})", t.name(), (se / sx).sqrt());
                }
                // RMS error (relative to the block maxima) well inside the max bound: a quality sanity check.
                assert!((se / sx).sqrt() < tol as f64 * 0.6 + 1e-9, "{}: rms rel {}", t.name(), (se / sx).sqrt());
            }
        }
    }

    #[test]
    fn rejects_bad_sizes_and_types() {
        let mut y = vec![0f32; 31];
        assert!(dequantize(Q4_0, &[0u8; 18], &mut y).is_err());
        let mut y = vec![0f32; 32];
        assert!(dequantize(Q4_0, &[0u8; 17], &mut y).is_err());
        assert!(dequantize(Q2K, &[0u8; 84], &mut vec![0f32; 256]).is_err());
        assert!(quantize(Q4_0, &[0f32; 32], &mut [0u8; 17]).is_err());
    }
}
