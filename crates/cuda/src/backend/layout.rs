//! The device layouts of weights: Q8_0 and other blocks regrouped for 16-byte loads at upload
//! (`repack`), the 16-row tiled copy of expert stacks (`tile16`), and their byte sizes.

use super::*;

/// The kernel-name suffix of a weight type, `None` when it has no kernels.
pub(super) fn tname(t: GgmlType) -> Option<&'static str> {
    use GgmlType::*;
    Some(match t {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q4K => "q4_k",
        Q5K => "q5_k",
        Q6K => "q6_k",
        _ => return None,
    })
}

/// Bytes of one block on the device (see [`repack`]); Q8_0 is laid out in groups of 4 blocks,
/// see [`dev_row_bytes`].
pub(super) fn dev_block_bytes(t: GgmlType) -> usize {
    use GgmlType::*;
    match t {
        Q4_0 => 20,
        Q5_0 => 24,
        Q8_0 => 36,
        Q6K => 212,
        _ => t.type_size(),
    }
}

/// Device bytes of one row of `ne0` elements.
pub(super) fn dev_row_bytes(t: GgmlType, ne0: usize) -> usize {
    let nb = ne0 / t.block_size();
    if t == GgmlType::Q8_0 {
        nb.div_ceil(4) * 144
    } else {
        nb * dev_block_bytes(t)
    }
}

/// Bytes of one matrix of `rows` rows of `rb` device bytes in the tiled copy.
pub(super) fn tile16_mat_bytes(rb: usize, rows: usize) -> usize {
    rows.div_ceil(16) * (rb / 144) * TILE_GROUP
}

/// The tiled copy of a stack of Q8_0 matrices in the device layout (`rows` rows of `rb` bytes
/// each; [`CudaWeight::tiled`]): per matrix, per tile of 16 rows, per 144-byte group,
/// [`TILE_GROUP`] bytes in the order `mmq_q8_rows`' lanes load them: 16-byte chunk `c < 8` holds
/// the 4 f16 scales of rows `c` and `c + 8` of the tile; chunk `8 + 32*bl + 4*g + t` holds bytes
/// `8t..8t+8` of block `bl` of rows `g` and `g + 8` word by word (4 bytes of row `g`, 4 of row
/// `g + 8`, the next 4 of each: the int8 mma's A fragment in register order); the 8 pad bytes of
/// each row's group are left out. Rows past `rows` are zeros. The CPU reference of the
/// `tile16_q8` kernel, which makes the copy on the device at load.
pub fn tile16(data: &[u8], rb: usize, rows: usize) -> Vec<u8> {
    let ng = rb / 144;
    let mats = data.len() / (rb * rows).max(1);
    let tiles = rows.div_ceil(16);
    let mut out = vec![0u8; mats * tile16_mat_bytes(rb, rows)];
    let piece = |e: usize, r: usize, at: usize| -> [u8; 8] {
        if r < rows {
            data[(e * rows + r) * rb + at..][..8].try_into().expect("8 bytes")
        } else {
            [0; 8]
        }
    };
    for e in 0..mats {
        for tile in 0..tiles {
            for gi in 0..ng {
                let grp = ((e * tiles + tile) * ng + gi) * TILE_GROUP;
                for c in 0..TILE_GROUP / 16 {
                    let (r, o) = if c < 8 { (c, 0) } else { ((c - 8) % 32 / 4, 16 + 32 * ((c - 8) / 32) + 8 * ((c - 8) % 4)) };
                    let ra = tile * 16 + r;
                    let (a, b) = (piece(e, ra, gi * 144 + o), piece(e, ra + 8, gi * 144 + o));
                    let chunk = &mut out[grp + 16 * c..][..16];
                    if c < 8 {
                        chunk[..8].copy_from_slice(&a);
                        chunk[8..].copy_from_slice(&b);
                    } else {
                        // Words a0, b0, a1, b1.
                        for (w, src) in [&a[..4], &b[..4], &a[4..], &b[4..]].into_iter().enumerate() {
                            chunk[4 * w..][..4].copy_from_slice(src);
                        }
                    }
                }
            }
        }
    }
    out
}

/// The file's blocks -> the device layout (see `kernels/common.cuh`): 4-byte aligned blocks, and
/// Q8_0 regrouped so that each group of 4 blocks is `[4 f16 scales, 8 pad bytes, 128 quants]`
/// (144 bytes, 16-byte aligned; each row padded with zero blocks to a whole group).
pub(super) fn repack(t: GgmlType, data: &[u8], ne0: usize) -> Vec<u8> {
    use GgmlType::*;
    let ts = t.type_size();
    match t {
        Q8_0 => {
            let nb = ne0 / 32;
            let rows = data.len() / (nb * ts).max(1);
            let rb = dev_row_bytes(t, ne0);
            let mut out = vec![0u8; rows * rb];
            for (r, row) in data.chunks_exact(nb * ts).enumerate() {
                let o = &mut out[r * rb..(r + 1) * rb];
                for (b, blk) in row.chunks_exact(ts).enumerate() {
                    let g = (b / 4) * 144;
                    let j = b % 4;
                    o[g + 2 * j..g + 2 * j + 2].copy_from_slice(&blk[..2]);
                    o[g + 16 + 32 * j..g + 48 + 32 * j].copy_from_slice(&blk[2..34]);
                }
            }
            out
        }
        Q4_0 | Q5_0 => {
            let mut out = Vec::with_capacity(data.len() / ts * (ts + 2));
            for b in data.chunks_exact(ts) {
                out.extend_from_slice(&b[..2]);
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&b[2..]);
            }
            out
        }
        Q6K => {
            let mut out = Vec::with_capacity(data.len() / ts * (ts + 2));
            for b in data.chunks_exact(ts) {
                out.extend_from_slice(b);
                out.extend_from_slice(&[0, 0]);
            }
            out
        }
        _ => data.to_vec(),
    }
}
