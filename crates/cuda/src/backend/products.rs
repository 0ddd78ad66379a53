//! Dense and grouped quantised products: the int8 tensor-core tiles (`mmq_*`), the rows kernels'
//! launch (`mmq_launch`), split-K sums, activation quantisation, the f16 / cuBLAS / TMA paths.

use super::*;

impl CudaBackend {
    /// A dense int8 product's tiles and splits: (tokens a tile, 16 or 64; K splits) for `m` rows
    /// of `ngroups` groups and `n` rows of input, `ng` tokens per matrix over `g` matrices.
    /// Too few tiles to fill the device (small matrices, decode-size batches): split K over
    /// blocks (at least mmq_split.0 groups each) into partial outputs, summed in order after.
    pub(super) fn dense_plan(&self, m: usize, ngroups: usize, (n, ng, g): (usize, usize, usize)) -> (usize, usize) {
        let bn = if ng <= self.mmq_bn16.load(Ordering::Relaxed).max(self.mmq_rows_dense.load(Ordering::Relaxed)) { 16 } else { 64 };
        let tiles = m.div_ceil(64) * ng.div_ceil(bn) * g;
        // The partial outputs fit the part scratch's fixed size, so that it never grows after
        // the warm-up at open (the decode step there allocates it, see the MLA decode).
        let fit = PART_MIN_BYTES / (4 * n * m).max(1);
        let (smin, socc) = self.mmq_split;
        let nsplit =
            if tiles >= self.sm_count { 1 } else { (socc * self.sm_count).div_ceil(tiles).min(ngroups / smin).min(fit).clamp(1, 16) };
        (bn, nsplit)
    }

    /// `mmq_jobs` in one product launch and at most one sum launch ([`Path::DenseJobs`]:
    /// `mmq_q8_64_jobs`, `mmq_sum_splits_jobs`): each job with the tiles and splits
    /// [`Self::dense_plan`] gives it alone, so the same bits. False (nothing launched) where a
    /// job would not take the 64-token tiles alone or the partials do not fit the part scratch.
    pub(super) fn mmq_dense_jobs(&self, ngroups: usize, xq: u64, n: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) -> bool {
        if !self.path_on(Path::DenseJobs) || !(2..=3).contains(&jobs.len()) || self.mmq_ws {
            return false;
        }
        let mut plan = [(0usize, 0usize, 0usize); 3]; // (m, splits, part offset in floats)
        let mut part_floats = 0;
        for (p, (w, _, _)) in plan.iter_mut().zip(jobs) {
            let m = w.ne(1);
            let (bn, nsplit) = self.dense_plan(m, ngroups, (n, n, 1));
            if bn != 64 {
                return false;
            }
            *p = (m, nsplit, part_floats);
            if nsplit > 1 {
                part_floats += nsplit * n * m;
            }
        }
        // (The sums' 32-bit indices: every job's rows * m together below 2^31.)
        if 4 * part_floats > PART_MIN_BYTES || plan.iter().map(|p| n * p.0).sum::<usize>() >= 1 << 31 {
            return false;
        }
        let Some(part) = self.scratch(S::Part, PART_MIN_BYTES) else { return true };
        self.took(Path::DenseJobs);
        let mut args = [A::I(0); 31];
        let mut sum = [A::I(0); 22];
        let mut blocks = 0;
        for (j, (&(m, nsplit, poff), &(w, out, o))) in plan.iter().zip(jobs).enumerate() {
            out.check(o);
            let nb = m.div_ceil(64) * n.div_ceil(64) * nsplit;
            blocks += nb;
            let pp = part + 4 * poff as u64;
            let dst = if nsplit > 1 { (pp, 0, m) } else { (out.0.ptr, o.off, o.stride) };
            let job = [A::P(w.mem.ptr), l(w.row_bytes), i(m), A::P(dst.0), l(dst.1), l(dst.2), i(nsplit), l(n * m), i(nb)];
            args[9 * j..9 * j + 9].copy_from_slice(&job);
            let sj = [A::P(pp), i(nsplit), l(n * m), i(if nsplit > 1 { m } else { 0 }), A::P(out.0.ptr), l(o.off), l(o.stride)];
            sum[7 * j..7 * j + 7].copy_from_slice(&sj);
        }
        args[27..].copy_from_slice(&[i(ngroups), A::P(xq), l(ngroups * 144), i(n)]);
        let early = self.path_on(Path::DenseEarly);
        if early {
            self.took(Path::DenseEarly);
        }
        let name = if early { "mmq_q8_64_jobse" } else { "mmq_q8_64_jobs" };
        self.launch(name, (blocks as u32, 1, 1), 128, MMQ_SMEM as u32, &args);
        sum[21] = i(n);
        let total: usize = plan.iter().filter(|p| p.1 > 1).map(|p| n * p.0).sum();
        if total > 0 {
            self.launch("mmq_sum_splits_jobs", Self::grid1(total), 256, 0, &sum);
        }
        true
    }

    /// The int8 tensor-core product of quantised activations `xq` (`n` rows of `ngroups` groups,
    /// `ng` tokens per matrix over `g` matrices of `w`) into `out`/`o`; split K where the tiles
    /// would not fill the device. The caller holds `scratch_op`.
    /// `sum`: what becomes of split K's partial outputs ([`SplitSum`]); the partials (pointer,
    /// splits; split `s` at `s * n * m` floats, rows of `m`) when they are left, else None.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mmq_dense(
        &self,
        w: &CudaWeight,
        ngroups: usize,
        xq: u64,
        (n, ng, g): (usize, usize, usize),
        out: &CudaBuf,
        o: Rows,
        sum: SplitSum,
    ) -> Option<(u64, usize)> {
        let q8out = match sum {
            SplitSum::Q8(q) => Some(q),
            _ => None,
        };
        let m = w.ne(1);
        let (bn, nsplit) = self.dense_plan(m, ngroups, (n, ng, g));
        let grid = (m.div_ceil(64) as u32, ng.div_ceil(bn) as u32, (g * nsplit) as u32);
        if nsplit == 1 {
            self.mmq_launch(w, m, ngroups, xq, grid, ng, None, 1, (out.0.ptr, o.off, o.stride), (1, 0), bn);
            if let Some(q) = q8out {
                self.quant_groups(out.0.ptr, 0, o.off, o.stride, n, m, 0, q);
            }
            return None;
        }
        let part = self.scratch(S::Part, (4 * nsplit * n * m).max(PART_MIN_BYTES))?;
        self.mmq_launch(w, m, ngroups, xq, grid, ng, None, 1, (part, 0, m), (nsplit, n * m), bn);
        if let SplitSum::Leave = sum {
            return Some((part, nsplit));
        }
        let sum = [A::P(part), i(nsplit), l(n * m), i(n), i(m), A::P(out.0.ptr), l(o.off), l(o.stride)];
        match q8out {
            Some(q) if m.is_multiple_of(128) => {
                let args: [A; 9] = cat(sum, [A::P(q)]);
                self.launch("mmq_sum_splits_q8", ((n * m / 128).div_ceil(8) as u32, 1, 1), 256, 0, &args);
            }
            _ => {
                self.launch("mmq_sum_splits", Self::grid1(n * m), 256, 0, &sum);
                if let Some(q) = q8out {
                    self.quant_groups(out.0.ptr, 0, o.off, o.stride, n, m, 0, q);
                }
            }
        }
        None
    }

    /// `out = W x` per group: `g` matrices of `w`, row `r` of `xr` uses matrix `r % g`.
    pub(super) fn matmul_groups(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, g: usize, out: &CudaBuf, o: Rows) {
        let (k, m) = (w.ne(0), w.ne(1));
        assert_eq!(xr.width, k, "matmul: activation width {} != weight input {k}", xr.width);
        assert_eq!(o.width, m, "matmul: output width {} != weight rows {m}", o.width);
        assert_eq!(xr.n, o.n);
        assert_eq!(xr.n % g, 0, "grouped matmul: {} rows is not a multiple of {g} groups", xr.n);
        x.check(xr);
        out.check(o);
        let ng = xr.n / g;
        if ng == 0 || m == 0 {
            return;
        }
        let Some(tn) = tname(w.dtype) else {
            self.fail(format!("matmul: no kernels for {}", w.dtype.name()));
            return;
        };
        if ng <= GEMV_MAX_TOKENS && w.dtype == GgmlType::Q8_0 && !self.exact {
            // dp4a GEMV (kernels/fast.cu): activations quantised to Q8_0 in shared memory.
            let nt = if ng == 1 {
                1
            } else if ng == 2 {
                2
            } else if ng <= 4 {
                4
            } else {
                8
            };
            let smem = nt * k * 9 / 8;
            if smem <= self.smem_max {
                let lpr = (k / 16).next_power_of_two().min(32);
                let tiles = m.div_ceil(8 * (32 / lpr));
                self.launch(
                    KName::of(format_args!("gemv_q8_{nt}")).as_str(),
                    (tiles.min(self.sm_count * 8) as u32, ng.div_ceil(nt) as u32, g as u32),
                    256,
                    smem as u32,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(k),
                        A::P(x.0.ptr),
                        l(xr.off),
                        l(xr.stride * g),
                        l(xr.stride),
                        A::P(out.0.ptr),
                        l(o.off),
                        l(o.stride * g),
                        l(o.stride),
                        i(ng),
                        i(lpr),
                    ],
                );
                return;
            }
        }
        // (Path::RouterSplit: decode batches' routers too, in chunks of 8 tokens.)
        let split_rows = ng <= GEMV_MAX_TOKENS || (ng <= GRAPH_MAX_TOKENS && m <= 512 && self.path_on(Path::RouterSplit));
        if split_rows
            && g == 1
            && w.dtype == GgmlType::F32
            && k % 128 == 0
            && xr.off.is_multiple_of(4)
            && (ng == 1 || xr.stride.is_multiple_of(4))
        {
            // Few-row f32 matrices (the MoE router): split-K GEMV (kernels/fast.cu), 8 tokens a
            // block row.
            if ng > GEMV_MAX_TOKENS {
                self.took(Path::RouterSplit);
            }
            self.launch(
                "gemv_f32_split",
                (m.div_ceil(2) as u32, ng.div_ceil(8) as u32, 1),
                256,
                0,
                &[A::P(w.mem.ptr), i(m), i(k), A::P(x.0.ptr), l(xr.off), l(xr.stride), A::P(out.0.ptr), l(o.off), l(o.stride), i(ng)],
            );
            return;
        }
        if ng <= GEMV_MAX_TOKENS {
            let nn = if ng == 1 {
                1
            } else if ng <= 4 {
                4
            } else {
                8
            };
            let h16 = if h16_vector_ok(w, k, xr.off, xr.stride) { "h16_" } else { "" };
            self.launch(
                KName::of(format_args!("gemv_{h16}{tn}_{nn}")).as_str(),
                (m.div_ceil(4) as u32, ng.div_ceil(nn) as u32, g as u32),
                128,
                0,
                &[
                    A::P(w.mem.ptr),
                    l(w.row_bytes),
                    l(w.mat_bytes()),
                    i(m),
                    i(k),
                    A::P(x.0.ptr),
                    l(xr.off),
                    l(xr.stride * g),
                    l(xr.stride),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(o.stride * g),
                    l(o.stride),
                    i(ng),
                ],
            );
            return;
        }
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        // (Path::HeadBlas off: a decode batch's products of more than 8,192 rows, the output
        // head, keep the int8 tiles, which read the Q8_0 bytes, half the f16 copy's.)
        let head = g == 1 && m > HEAD_ROWS && ng <= GRAPH_MAX_TOKENS;
        let head_int8 = head && !self.path_on(Path::HeadBlas);
        if head && self.path_on(Path::HeadMmh) && self.head_mmh(x, xr, w, out, o) {
            return;
        }
        if w.half_rm().is_some() && !head_int8 && self.dense_blas_take(ng) {
            // Prompts and decode batches (Path::DenseBlasBatch) from the row-major f16 copy on
            // cuBLAS, the activation rows in f16.
            let Some(xh) = self.f16_input(x, xr) else { return };
            self.grouped_h16(xh, w, g, ng, out, o);
            return;
        }
        if self.tc && w.dtype == GgmlType::Q8_0 && MMQ_SMEM <= self.smem_max {
            // Int8 tensor cores (kernels/mmq.cu): quantise the activation rows once, then one
            // launch for all `g` matrices.
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, xr.n * ngroups * 144) else { return };
            self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, xr.n, k, 0, xq);
            self.mmq_dense(w, ngroups, xq, (xr.n, ng, g), out, o, SplitSum::Plain);
            return;
        }
        // cuBLAS, column-major view: C[m, ng] (ldc = o.stride*g) = op(A)^T[m, k] * B[k, ng],
        // A = weight rows (k contiguous), B = activation rows.
        let (a_ptr, a_type, b_ptr, b_type, ldb, stride_b) = if w.dtype == GgmlType::F32 {
            (
                w.mem.ptr,
                blas_sys::cudaDataType::CUDA_R_32F,
                x.0.ptr + 4 * xr.off as u64,
                blas_sys::cudaDataType::CUDA_R_32F,
                xr.stride * g,
                xr.stride,
            )
        } else {
            let Some(wb) = self.scratch(S::WBf16, 2 * k * m * g) else { return };
            let Some(xb) = self.scratch(S::XBf16, 2 * k * xr.n) else { return };
            let rows = m * g;
            self.launch(
                KName::of(format_args!("dequant_bf16_{tn}")).as_str(),
                Self::grid1(rows * k.div_ceil(32)),
                256,
                0,
                &[A::P(w.mem.ptr), l(w.row_bytes), l(rows), i(k), A::P(wb)],
            );
            self.launch(
                "rows_to_bf16",
                Self::grid1(xr.n * k),
                256,
                0,
                &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(k), l(xr.n * k), A::P(xb)],
            );
            (wb, blas_sys::cudaDataType::CUDA_R_16BF, xb, blas_sys::cudaDataType::CUDA_R_16BF, k * g, k)
        };
        // cuBLAS runs on whichever context is current on this thread.
        if !self.bind_ctx() {
            return;
        }
        let c = out.0.ptr + 4 * o.off as u64;
        self.gemm_ex(
            (a_ptr, a_type, k, (m * k) as i64),
            (b_ptr, b_type, ldb, stride_b as i64),
            (c, o.stride * g, o.stride as i64),
            (m, ng, k),
            g as i32,
        );
    }

    /// Quantise `n` rows of `k` values (row j at `src + off + j*stride`, f32) into Q8_0 groups at
    /// `dst` (`ceil(k/128)*144` bytes per row). `act` 1/2: the rows are SiLU/GELU(src) * src2.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quant_groups(&self, src: u64, src2: u64, off: usize, stride: usize, n: usize, k: usize, act: i32, dst: u64) {
        self.quant_groups_w(src, src2, off, stride, n, k, act, (0, 0, 1), dst);
    }

    /// [`Self::quant_groups`] with router weights `rw = (sel_w, k, slots per token)`: row r is
    /// multiplied by `sel_w[(r / slots) * k + r % slots]` (1 for slots past k) first.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn quant_groups_w(
        &self,
        src: u64,
        src2: u64,
        off: usize,
        stride: usize,
        n: usize,
        k: usize,
        act: i32,
        rw: (u64, usize, usize),
        dst: u64,
    ) {
        let ngroups = k.div_ceil(128);
        let pf = self.xpf_glu_hint.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or((0, 0));
        self.launch(
            "quant_q8_groups",
            ((n * ngroups).div_ceil(8) as u32, 1, 1),
            256,
            0,
            &[
                A::P(src),
                A::P(src2),
                l(off),
                l(stride),
                i(n),
                i(k),
                A::I(act),
                A::P(rw.0),
                i(rw.1),
                i(rw.2),
                A::P(dst),
                l(ngroups * 144),
                A::P(pf.0),
                l(pf.1),
            ],
        );
    }

    /// One `mmq_q8` launch (see kernels/mmq.cu): `experts` the grouped expert product's lists
    /// ([`MmqGroups`]), `None` for the dense one (`grid.2 / nsplit` matrices of `n` tokens);
    /// `out` = (pointer, offset, row stride); `split` = (nsplit, elements between the splits'
    /// partial outputs); `bn` the tokens per tile (64 or 16; `grid.1` counts such tiles).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mmq_launch(
        &self,
        w: &CudaWeight,
        m: usize,
        ngroups: usize,
        xq: u64,
        grid: (u32, u32, u32),
        n: usize,
        experts: Option<MmqGroups>,
        in_div: usize,
        (out, ooff, ostride): (u64, usize, usize),
        (nsplit, split_stride): (usize, usize),
        bn: usize,
    ) {
        let MmqGroups { cnt, off, perm, n_exp: ne, sh, pair, pair_tiled, pairs, tokens } = experts.unwrap_or(MmqGroups::NONE);
        let (sh_ptr, sh_row_bytes, sh_stride, e_sh) = sh.unwrap_or((0, 0, 0, i32::MAX as usize));
        let (w2, sh2, out2) = pair.unwrap_or((0, 0, 0));
        // Grouped 16-token tiles: the weights straight into the fragments (`mmq_q8_rows`), the
        // tile's activation rows whole in shared memory.
        // (Rows padded to a stride of 8 words mod 32: at most 124 bytes more.)
        let rows_smem = 16 * (ngroups * 144 + (4 * ((8 + 32 * 4 - 4 * ngroups % 32) % 32)).max(16));
        let rows = bn == 16
            && rows_smem <= self.smem_max
            && if cnt != 0 { self.moe_rows.load(Ordering::Relaxed) } else { n <= self.mmq_rows_dense.load(Ordering::Relaxed) };
        // Grouped rows with R row sets a warp: 64*R rows a block, so fewer blocks along x.
        // (The down launch with its own count, TS_CUDA_ROWS_R_DN=1: 64 sequences 9,775 / 9,772
        // against 9,882 / 9,885, 128 16,687 against 16,780 on the H200, gpu-next151; removed.)
        let rr = match self.rows_r.load(Ordering::Relaxed) {
            _ if !rows || cnt == 0 => 1,
            0 if pairs >= 5 * ne => 2,
            0 => 1,
            r => r,
        };
        let grid = match rr {
            2.. => ((if w2 != 0 { 2 } else { 1 }) * m.div_ceil(64 * rr) as u32, grid.1, grid.2),
            _ => grid,
        };
        let (name, smem) = match (bn, self.mmq16) {
            _ if rows && cnt != 0 => (if rr == 2 { "mmq_q8_rows_r2" } else { "mmq_q8_rows" }, rows_smem),
            _ if rows => ("mmq_q8_rows_d", rows_smem),
            (16, 1) => ("mmq_q8_16g1", mmq_smem(16, 1, 3)),
            (16, _) => ("mmq_q8_16", mmq_smem(16, 2, 2)),
            _ if self.mmq_ws => ("mmq_q8_64ws", MMQ_SMEM),
            _ if cnt == 0 && self.path_on(Path::DenseEarly) => ("mmq_q8_64e", MMQ_SMEM),
            _ => ("mmq_q8_64", MMQ_SMEM),
        };
        if name == "mmq_q8_64e" {
            self.took(Path::DenseEarly);
        }
        // The rows kernels' `early` (see the argument below): 0, 1, or 1 + the shared chunks'
        // tiles when they go first (rows_sh_first).
        let early = match sh {
            _ if cnt == 0 || !self.rows_early.load(Ordering::Relaxed) || pairs < 2 * ne => 0,
            Some((.., e_sh)) if self.rows_sh_first.load(Ordering::Relaxed) && e_sh < ne && tokens > 0 => {
                1 + (ne - e_sh) * tokens.div_ceil(16)
            }
            _ => 1,
        };
        // Tail halves (two row sets only): logical tiles [tail0, tail1), each as two
        // one-row-set blocks, so the grid has tail1 - tail0 more along y. The first tiles'
        // last `rows_tail` only while the routed experts average at most 8 pairs: then the
        // first tiles are nearly all of the work and their end is the launch's end (with more,
        // later tiles follow and those halves would sit mid-launch: 128 sequences -2.1%); and
        // with `rows_tail_later` every later tile's block, which end the launch past that.
        let (routed, re) = match sh {
            Some((.., e_sh)) if e_sh < ne => (pairs.saturating_sub((ne - e_sh) * tokens), e_sh),
            _ => (pairs, ne),
        };
        let (tail0, tail1) = match (rr, early) {
            (2.., 1..) => {
                let end = if early > 1 { early - 1 + e_sh } else { ne }.min(grid.1 as usize);
                let tail = if w2 != 0 { &self.rows_tail } else { &self.rows_tail_dn };
                let t0 = if routed <= 8 * re { end - tail.load(Ordering::Relaxed).min(end) } else { end };
                (t0, if self.rows_tail_later.load(Ordering::Relaxed) { grid.1 as usize } else { end })
            }
            _ => (0, 0),
        };
        let grid = (grid.0, grid.1 + (tail1 - tail0) as u32, grid.2);
        let args = [
            A::P(w.mem.ptr),
            l(w.row_bytes),
            l(w.mat_bytes()),
            i(m),
            i(ngroups),
            A::P(xq),
            l(ngroups * 144),
            i(n),
            A::P(cnt),
            A::P(off),
            A::P(perm),
            i(ne),
            i(in_div),
            A::P(out),
            l(ooff),
            l(ostride),
            i(nsplit),
            l(split_stride),
            A::P(sh_ptr),
            l(sh_row_bytes),
            l(sh_stride),
            i(e_sh),
            A::P(w2),
            A::P(sh2),
            A::P(out2),
            // mmq_q8_rows only: the 16-row tiled copies (or 0), and whether each block y < n_exp
            // takes expert y's first tile and issues its first weight loads before the PDL wait
            // (see mmq_rows_impl): only where few experts go without tokens (an idle expert's
            // blocks load their first groups for nothing).
            A::P(if cnt != 0 { w.tiled_ptr() } else { 0 }),
            A::P(pair_tiled),
            l(w.tiled_mat_bytes()),
            i(early),
            i(tail0),
            i(tail1),
        ];
        // (The mmq_q8 tiles take the common arguments only.)
        let na = if rows { args.len() } else { 25 };
        // (mmq_q8_64ws: the 4 multiplying warps and a producer warp)
        self.launch(name, grid, if name == "mmq_q8_64ws" { 160 } else { 128 }, smem as u32, &args[..na]);
    }

    /// A TMA descriptor (`TmaMap`, kernels/mmh.cu) of `rows` row-major rows of `cols` f16 values
    /// at `ptr`, read in boxes of 64 values (128 bytes, with the 128-byte swizzle) by
    /// `box_rows` rows; rows past the end read as zeros. None after a failure (reported).
    pub(super) fn tma_f16(&self, ptr: u64, cols: usize, rows: usize, box_rows: u32) -> Option<drv_sys::CUtensorMap> {
        self.tma_2d(ptr, (cols, 2, rows), (64, box_rows), true)
    }

    /// A 2-D TMA descriptor: `rows` rows of `cols` elements of `size` bytes (2: f16, 1: bytes)
    /// at `ptr`, boxes of `box_x` elements by `box_rows` rows, with the 128-byte swizzle or none.
    pub(super) fn tma_2d(
        &self,
        ptr: u64,
        (cols, size, rows): (usize, usize, usize),
        (box_x, box_rows): (u32, u32),
        swizzle: bool,
    ) -> Option<drv_sys::CUtensorMap> {
        use drv_sys::{
            CUtensorMapDataType_enum as Ty, CUtensorMapFloatOOBfill_enum as Oob, CUtensorMapInterleave_enum as Il,
            CUtensorMapL2promotion_enum as L2, CUtensorMapSwizzle_enum as Sw,
        };
        let mut map = drv_sys::CUtensorMap { opaque: [0; 16] };
        let (dims, strides, boxd, es) = ([cols as u64, rows as u64], [(size * cols) as u64], [box_x, box_rows], [1u32, 1]);
        let ty = if size == 2 { Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16 } else { Ty::CU_TENSOR_MAP_DATA_TYPE_UINT8 };
        let sw = if swizzle { Sw::CU_TENSOR_MAP_SWIZZLE_128B } else { Sw::CU_TENSOR_MAP_SWIZZLE_NONE };
        let r = unsafe {
            drv_sys::cuTensorMapEncodeTiled(
                &mut map,
                ty,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxd.as_ptr(),
                es.as_ptr(),
                Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sw,
                L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result();
        match r {
            Ok(()) => Some(map),
            Err(e) => {
                self.fail(format!("cuTensorMapEncodeTiled ({rows} rows of {cols} x {size} bytes, boxes of {box_x} x {box_rows}): {e:?}"));
                None
            }
        }
    }

    /// A TMA descriptor of `rows` rows of `row_bytes` bytes at `ptr`, read in boxes of `box_x`
    /// bytes by `box_rows` rows, unswizzled (the Q8_0 rows of `mmh8_*`). None after a failure
    /// (reported).
    pub(super) fn tma_u8(&self, ptr: u64, row_bytes: usize, rows: usize, box_x: u32, box_rows: u32) -> Option<drv_sys::CUtensorMap> {
        self.tma_2d(ptr, (row_bytes, 1, rows), (box_x, box_rows), false)
    }

    /// A decode batch's output head on `mmh8_dn` or `mmh8_dn200` ([`Path::HeadMmh`]): `out`
    /// rows = `w` times the rows `xr` (in f16), its `m` rows in tiles of `head_tile` rows, the
    /// batch as one expert's list of at most 128 tokens (`head_list` into the MoE's `Cnt`, `Off`
    /// and `Perm` scratch, unused between layers' MoEs). False (nothing launched) where the
    /// shapes or the output's layout do not fit. The caller holds `scratch_op`. (A tiled copy of
    /// the head read one bulk copy a stage, seventieth session: the launch 159 -> 145 us on an
    /// H100, the 64-sequence step level like for like, +223 MB; removed.)
    pub(super) fn head_mmh(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, out: &CudaBuf, o: Rows) -> bool {
        let (n, k, m) = (xr.n, xr.width, w.ne(1));
        let bn = self.head_tile_rows(m);
        if !self.mmh || w.dtype != GgmlType::Q8_0 || bn == 0 || !k.is_multiple_of(128) || n > MMH_BM || o.stride != m || o.n != n {
            return false;
        }
        out.check(o);
        let (Some(cnt), Some(off), Some(perm)) = (self.scratch(S::Cnt, 4), self.scratch(S::Off, 4), self.scratch(S::Perm, 4 * n)) else {
            return false;
        };
        let Some(xh) = self.f16_input(x, xr) else { return false };
        let (Some(th), Some(dq), Some(ds)) = (
            self.tma_f16(xh, k, n, MMH_BM as u32),
            self.tma_u8(w.mem.ptr, w.row_bytes, m, 64, bn as u32),
            self.tma_u8(w.mem.ptr, w.row_bytes, m, 16, bn as u32),
        ) else {
            return false;
        };
        self.launch("head_list", (1, 1, 1), 128, 0, &[i(n), A::P(cnt), A::P(off), A::P(perm)]);
        let y = out.0.ptr + 4 * o.off as u64;
        let args = [A::T(&th), A::T(&dq), A::T(&ds), A::P(cnt), A::P(off), A::P(perm), i(1), i(m), i(k), A::P(y)];
        let kernel = if bn == 200 { "mmh8_dn200" } else { "mmh8_dn" };
        self.launch(kernel, ((m / bn) as u32, 1, 1), 384, MMH8_SMEM as u32, &args);
        self.took(Path::HeadMmh);
        true
    }

    /// The activation rows `xr` of `x` in f16 (`f16_rows`, packed rows, the `XBf16` scratch) for
    /// the dense products on cuBLAS, with the context current on this thread; None after a
    /// failure (reported). The caller holds `scratch_op`.
    pub(super) fn f16_input(&self, x: &CudaBuf, xr: Rows) -> Option<u64> {
        let xh = self.scratch(S::XBf16, 2 * xr.width * xr.n)?;
        self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), xr.n, xr.width, 0, xh);
        if !self.bind_ctx() {
            return None;
        }
        Some(xh)
    }

    /// [`CudaBackend::gemm_ex`] with f16 weights and activations (activation rows `ldx` halves
    /// apart, product b's from `x` + b * `stride_x` halves).
    pub(super) fn gemm_h16(
        &self,
        (w, lda, stride_w): (u64, usize, i64),
        (x, ldx, stride_x): (u64, usize, i64),
        c: (u64, usize, i64),
        mnk: (usize, usize, usize),
        batch: i32,
    ) {
        let h = blas_sys::cudaDataType::CUDA_R_16F;
        self.gemm_ex((w, h, lda, stride_w), (x, h, ldx, stride_x), c, mnk, batch);
    }

    /// cuBLAS with f32 out and f32 accumulation, `batch` products (column-major view: C_b[m, n]
    /// = W_b^T[m, k] X_b[k, n]): C_b[j][r] = sum_i W_b[r][i] X_b[j][i] for r < m, j < n, i < k,
    /// with W_b at `w` + b * `stride_w` elements (rows of `lda` elements of `wt`), X_b likewise
    /// (rows of `ldx`), C_b at `c` + b * `stride_c` floats (rows of `ldc`). The context must be
    /// current on this thread.
    #[allow(clippy::type_complexity)]
    pub(super) fn gemm_ex(
        &self,
        (w, wt, lda, stride_w): (u64, blas_sys::cudaDataType, usize, i64),
        (x, xt, ldx, stride_x): (u64, blas_sys::cudaDataType, usize, i64),
        (c, ldc, stride_c): (u64, usize, i64),
        (m, n, k): (usize, usize, usize),
        batch: i32,
    ) {
        self.gemm_ex_c(
            (w, wt, lda, stride_w),
            (x, xt, ldx, stride_x),
            (c, blas_sys::cudaDataType::CUDA_R_32F, ldc, stride_c),
            (m, n, k),
            batch,
        );
    }

    /// [`CudaBackend::gemm_ex`] with the output's type `ct` (f32 sums rounded to it).
    #[allow(clippy::type_complexity)]
    pub(super) fn gemm_ex_c(
        &self,
        (w, wt, lda, stride_w): (u64, blas_sys::cudaDataType, usize, i64),
        (x, xt, ldx, stride_x): (u64, blas_sys::cudaDataType, usize, i64),
        (c, ct, ldc, stride_c): (u64, blas_sys::cudaDataType, usize, i64),
        (m, n, k): (usize, usize, usize),
        batch: i32,
    ) {
        let blas = match self.side_now() {
            Some(fk) => &fk.blas,
            None => &self.blas,
        };
        let run = || self.gemm_ex_on(blas, (w, wt, lda, stride_w), (x, xt, ldx, stride_x), (c, ct, ldc, stride_c), (m, n, k), batch);
        // A decode batch's product on the main stream with its timed algorithm (Path::BlasTune).
        if std::ptr::eq(blas, &self.blas) && self.path_on(Path::BlasTune) && (GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS).contains(&n) {
            let key = lt::LtKey {
                mnk: (m, n, k),
                lds: (lda, ldx, ldc),
                strides: (stride_w, stride_x, stride_c, batch),
                types: (wt as u32, xt as u32, ct as u32),
                align: (lt::lt_align(w), lt::lt_align(x), lt::lt_align(c)),
            };
            if self.lt_gemm(key, (w, x, c), &run) {
                self.took(Path::BlasTune);
                return;
            }
        }
        run();
    }

    /// [`CudaBackend::gemm_ex_c`] on the cuBLAS handle `blas`, and so on its stream (the main
    /// one's, or inside a side section [`Path::SharedFork`]'s side stream's).
    #[allow(clippy::type_complexity)]
    pub(super) fn gemm_ex_on(
        &self,
        blas: &Mutex<CudaBlas>,
        (w, wt, lda, stride_w): (u64, blas_sys::cudaDataType, usize, i64),
        (x, xt, ldx, stride_x): (u64, blas_sys::cudaDataType, usize, i64),
        (c, ct, ldc, stride_c): (u64, blas_sys::cudaDataType, usize, i64),
        (m, n, k): (usize, usize, usize),
        batch: i32,
    ) {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let blas = blas.lock().unwrap_or_else(|e| e.into_inner());
        let r = unsafe {
            blas_result::gemm_strided_batched_ex(
                *blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                wt,
                lda as i32,
                stride_w,
                x as *const _,
                xt,
                ldx as i32,
                stride_x,
                &beta as *const f32 as *const _,
                c as *mut _,
                ct,
                ldc as i32,
                stride_c,
                batch,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if let Err(e) = r {
            self.fail(format!("cublasGemmStridedBatchedEx ({m}x{k} by {n} rows, batch {batch}): {e:?}"));
        }
    }

    /// `n` rows of `k` values (`k % 8 == 0`) from `src` at (offset, row stride) to f16 rows at
    /// `dst`; with `act` (1 SiLU, 2 GELU-tanh) `act(src) * src2` (`f16_rows`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn f16_rows(&self, src: u64, src2: u64, (off, stride): (usize, usize), n: usize, k: usize, act: i32, dst: u64) {
        let total = n * k / 8;
        self.launch(
            "f16_rows",
            (total.div_ceil(256).min(65_536) as u32, 1, 1),
            256,
            0,
            &[A::P(src), A::P(src2), l(off), l(stride), i(n), i(k), A::I(act), A::P(dst)],
        );
    }

    /// One grouped f16 product (`mmf16_*`, kernels/mmq.cu; the tile from [`CudaBackend::mmf`]):
    /// the experts' f16 copies `(pointer, row bytes, matrix bytes)` of `m` rows of `k` values
    /// times the f16 rows `xh` gathered by the expert lists `(cnt, off, perm, experts, shared
    /// chunks (pointer, row bytes, chunk stride, first chunk's expert index))` over `tiles` token
    /// tiles, pair p reading row p / in_div and writing row p of `out` = (pointer, offset, row
    /// stride). With `glu` = (the up copy, its shared FFN's, the activation): gate and up in one
    /// launch (`mmf16_gu`, `w` the gate), writing f16 GLU rows to `out`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(super) fn mmf_launch(
        &self,
        (w, row_bytes, mat_bytes): (u64, usize, usize),
        m: usize,
        k: usize,
        xh: u64,
        tiles: u32,
        (cnt, off, perm, ne, sh): (u64, u64, u64, usize, Option<(u64, usize, usize, usize)>),
        in_div: usize,
        (out, ooff, ostride): (u64, usize, usize),
        glu: Option<(u64, u64, i32)>,
        q8: bool,
    ) {
        let (sp, srb, sst, e_sh) = sh.unwrap_or((0, 0, 0, i32::MAX as usize));
        // mmf16_gu* / mmfq8_gu: the plain tile, 128 ff rows each of gate and up a block. The
        // mmfq8 kernels take every argument; the plain mmf16 ones the first 20.
        let ((plain, gu, smem), threads) = match (q8, self.mmf, self.mmfq8) {
            (true, _, Some(t)) => (t, 256),
            (false, Some(t), _) => (t, 256),
            _ => return,
        };
        let (name, rows) = if glu.is_some() { (gu, 128) } else { (plain, 256) };
        let (w2, ws2, act) = glu.unwrap_or((0, 0, 0));
        let args = [
            A::P(w),
            l(row_bytes),
            l(mat_bytes),
            i(m),
            i(k),
            A::P(xh),
            l(2 * k),
            i(0),
            A::P(cnt),
            A::P(off),
            A::P(perm),
            i(ne),
            i(in_div),
            A::P(out),
            l(ooff),
            l(ostride),
            A::P(sp),
            l(srb),
            l(sst),
            i(e_sh),
            A::P(w2),
            A::P(ws2),
            A::I(act),
        ];
        self.launch(name, (m.div_ceil(rows) as u32, tiles, 1), threads, smem as u32, if glu.is_some() || q8 { &args } else { &args[..20] });
    }

    /// `add_rms_norm_matmul_many` (`delta` Some) and `rms_norm_matmul_many` (None).
    /// Whether `matmul_many` of `n` rows of width `k` runs `jobs` as int8 tensor-core products
    /// of one quantised input (above the GEMV sizes; Q8_0 matrices of `k` columns).
    pub(super) fn mmq_many(&self, n: usize, k: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) -> bool {
        self.tc
            && jobs.len() >= 2
            && n > GEMV_MAX_TOKENS
            && MMQ_SMEM <= self.smem_max
            && jobs.iter().all(|(w, _, o)| {
                w.dtype == GgmlType::Q8_0 && w.shape.len() <= 3 && w.ne(2) == 1 && w.ne(0) == k && o.n == n && o.width == w.ne(1)
            })
    }

    /// Whether a batch of `n` rows of width `k` (output rows `o`, norm weights `w`) takes the
    /// norm-and-quantise launch ([`Path::NormQ8`]): decode batches on the int8 products.
    pub(super) fn norm_q8_ok(&self, n: usize, k: usize, o: (usize, usize), w: Option<&CudaWeight>) -> bool {
        self.fused
            && self.tc
            && self.path_on(Path::NormQ8)
            && n > GEMV_MAX_TOKENS
            && n <= GRAPH_MAX_TOKENS
            && o == (n, k)
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == k)
    }

    /// `add_rms_norm_q8`: rows `x` (+= the delta), normed into `out`, and `out`'s Q8_0 groups
    /// into `xq` (kernels/fused.cu; the same bits as add_rms_norm then quant_q8_groups). The
    /// delta (pointer, rows, splits): rows of a buffer (splits 0, checked by the caller), or a
    /// product's split-K partials left by `mmq_dense` (splits > 0, split `s` at `s * n * width`
    /// floats; rows of at most 8 * 256 values), summed in split order as `mmq_sum_splits` would.
    pub(super) fn add_rms_norm_q8(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(u64, Rows, usize)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        xq: u64,
    ) {
        x.check(xr);
        out.check(o);
        let (n, k) = (xr.n, xr.width);
        let (dp, dr, nsplit) = delta.unwrap_or((0, Rows::packed(0, 0), 0));
        let q = [i(n), A::P(xq), l(k.div_ceil(128) * 144), i(nsplit), l(dr.n * dr.width)];
        let args: [A; 18] = cat(add_norm_args((x, xr), (dp, dr), w, eps, (out, o)), q);
        self.launch("add_rms_norm_q8", (n as u32, 1, 1), k.next_power_of_two().clamp(32, 256) as u32, 0, &args);
    }

    /// Whether `matmul_many`'s jobs (two or more, each one 2-D matrix of `k` inputs with its
    /// row-major f16 copy, writing `n` rows of its width) can run on cuBLAS in f16.
    pub(super) fn blas_jobs(&self, n: usize, k: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) -> bool {
        jobs.len() >= 2
            && jobs.iter().all(|(w, _, o)| w.half_rm().is_some() && w.ne(2) == 1 && w.ne(0) == k && o.n == n && o.width == w.ne(1))
    }

    /// `g` matrices of `w` (its row-major f16 copy) times the packed f16 rows `xh` of `ng`
    /// tokens (row `t * g + j` for matrix j) on cuBLAS, one strided-batched product, into `o`'s
    /// rows of `out` (row `t * g + j`). The context must be current on this thread.
    /// The absorbed query (W_uk's product of `ng` tokens x `g` heads) from q_nope's f16 rows
    /// `xh` on cuBLAS ([`CudaBackend::grouped_h16`]). (A tensor-core kernel of its own,
    /// `mla_absorb_h`, measured −1.3% and −1.5% at 64 sequences on an H100 and was removed in the
    /// forty-ninth session: docs/PERF.md.)
    pub(super) fn absorb_h16(&self, xh: u64, w: &CudaWeight, g: usize, ng: usize, out: &CudaBuf, o: Rows) {
        if self.bind_ctx() {
            self.grouped_h16(xh, w, g, ng, out, o);
        }
    }

    pub(super) fn grouped_h16(&self, xh: u64, w: &CudaWeight, g: usize, ng: usize, out: &CudaBuf, o: Rows) {
        let (k, m) = (w.ne(0), w.ne(1));
        let Some(wh) = w.half_rm() else { return };
        let c = out.0.ptr + 4 * o.off as u64;
        self.gemm_h16((wh, k, (m * k) as i64), (xh, k * g, k as i64), (c, o.stride * g, o.stride as i64), (m, ng, k), g as i32);
    }

    /// The jobs of [`CudaBackend::blas_jobs`], one cuBLAS f16 product each, from the f16 input
    /// rows `xh` (`n` packed rows of `k`; the context current on this thread).
    pub(super) fn gemm_jobs_h16(&self, xh: u64, n: usize, k: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) {
        let h = blas_sys::cudaDataType::CUDA_R_16F;
        let f = blas_sys::cudaDataType::CUDA_R_32F;
        for &(w, out, o) in jobs {
            out.check(o);
            if let (Some(wh), m) = (w.half_rm(), w.ne(1)) {
                self.gemm_ex_c((wh, h, k, 0), (xh, h, k, 0), (out.0.ptr + 4 * o.off as u64, f, o.stride, 0), (m, n, k), 1);
            }
        }
    }

    /// Whether a decode batch's first norm of `n` rows of `k` can write the f16 input of the
    /// cuBLAS products after it in its own launch ([`CudaBackend::add_rms_norm_h`]; `o` the
    /// normed rows).
    fn norm_h_ok(&self, (n, k): (usize, usize), delta: Option<(&CudaBuf, Rows)>, w: Option<&CudaWeight>, o: Rows) -> bool {
        self.fused
            && n <= GRAPH_MAX_TOKENS
            && (o.n, o.width) == (n, k)
            && k % 8 == 0
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == k)
            && delta.is_none_or(|(_, dr)| (dr.n, dr.width) == (n, k))
            && self.path_on(Path::DenseBlasFused)
    }

    /// `add_rms_norm_h`: rows `x` (+= `delta`), normed into `out` and into the packed f16 rows
    /// at `xh` (the same bits as the norm, then `f16_rows`).
    fn add_rms_norm_h(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(&CudaBuf, Rows)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        xh: u64,
    ) {
        x.check(xr);
        out.check(o);
        let d = delta.map_or((0, Rows::packed(0, 0)), |(d, dr)| {
            d.check(dr);
            (d.0.ptr, dr)
        });
        let k = xr.width;
        let block = k.next_power_of_two().clamp(32, 256);
        let norm: [A; 14] = cat(add_norm_args((x, xr), d, w, eps, (out, o)), [A::P(xh)]);
        let args: [A; 22] = cat(norm, self.take_xpf(0, xr.n));
        self.launch("add_rms_norm_h", (xr.n as u32, 1, 1), block as u32, 0, &args);
    }

    /// Whether a decode batch's absorbed query (`absorb` = W_uk with its rows of q and of the
    /// absorbed query) takes cuBLAS with q_nope's f16 rows written by `norm_rope_cache`
    /// ([`Path::QnopeH`]).
    pub(super) fn qnope_h_ok(&self, wk: &CudaWeight, heads: usize, src: Rows, dst: Rows) -> bool {
        let (k, m) = (wk.ne(0), wk.ne(1));
        let ng = src.n / heads.max(1);
        self.path_on(Path::QnopeH)
            && self.path_on(Path::DenseBlasFused)
            && ng > GEMV_MAX_TOKENS
            && self.dense_blas_rows(ng)
            && wk.half_rm().is_some()
            && wk.shape.len() == 3
            && wk.ne(2) == heads
            && (src.n, src.width, dst.n, dst.width) == (ng * heads, k, ng * heads, m)
            && k % 8 == 0
    }

    /// `Backend::join_products`: the row-major f16 copies of 2-D matrices of one input width,
    /// moved into one allocation in order (each weight keeps a view of its part), so that
    /// [`CudaBackend::qkv_joint`] can multiply them as one matrix. Anything else (or no memory
    /// for the move) leaves them as they are: the same results either way.
    pub(super) fn join_half_copies(&self, weights: &mut [&mut CudaWeight]) {
        let k = weights.first().map_or(0, |w| w.ne(0));
        let ok = weights.len() >= 2
            && weights.iter().all(|w| {
                w.half_rm().is_some() && w.shape.len() == 2 && w.ne(0) == k && w.half.as_ref().is_some_and(|h| h.bytes == 2 * k * w.ne(1))
            });
        if !ok {
            return;
        }
        let total: usize = weights.iter().map(|w| w.half.as_ref().map_or(0, |h| h.bytes)).sum();
        let Ok(joint) = self.alloc_mem(total, "f16 copies side by side") else { return };
        let mut off = 0;
        for w in weights.iter_mut() {
            let Some(h) = w.half.as_ref() else { return };
            let bytes = h.bytes;
            // Stream-ordered: the old copy is freed (on the stream) after this copy of it.
            if let Err(e) = unsafe { drv::memcpy_dtod_async(joint.ptr + off as u64, h.ptr, bytes, self.stream.cu_stream()) } {
                self.fail(format!("joining f16 copies: {e:?}"));
                return;
            }
            w.half = Some(joint.view(off, bytes));
            off += bytes;
        }
    }

    /// `Backend::norm_qkv_rope_cache` of a decode batch as one product ([`Path::QkvJoint`]): the
    /// norm writes its f16 rows (`add_rms_norm_h`), one cuBLAS product of q's and kv_a's f16
    /// copies side by side (`Backend::join_products`) writes both rows of each token into
    /// scratch `Qkv`, and `norm_rope_cache` (`op`, with q's no-rope part in f16 for W_uk,
    /// [`Path::QnopeH`]) reads them there; then W_uk's product on cuBLAS. The model's `q` and
    /// `kv` buffers are left unwritten (the op's scratch). False (nothing done) where the batch,
    /// the shapes or the weights do not fit it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_joint(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(&CudaBuf, Rows)>,
        w: Option<&CudaWeight>,
        (out, o): (&CudaBuf, Rows),
        jobs: [(&CudaWeight, &CudaBuf, Rows); 2],
        op: &Nrc<'_>,
        absorb: Option<(&CudaWeight, Rows, Rows)>,
    ) -> bool {
        let (n, k) = (xr.n, xr.width);
        let [(wq, q, qo), (wkv, kv, kvo)] = jobs;
        let (m0, m1) = (wq.ne(1), wkv.ne(1));
        let (Some(hq), Some(hkv)) = (wq.half_rm(), wkv.half_rm()) else { return false };
        let Some((qs, qr, qd, qdr, heads)) = op.q else { return false };
        let Some((wk, src, dst)) = absorb else { return false };
        // Rows of q's heads inside a token's packed q row (stride * heads == q's width).
        let head_rows = |r: Rows| heads > 0 && r.n == n * heads && r.stride * heads == m0 && r.off + r.width <= r.stride;
        let ok = self.path_on(Path::QkvJoint)
            && n > GEMV_MAX_TOKENS
            && self.norm_h_ok((n, k), delta, w, o)
            && self.blas_jobs(n, k, &jobs)
            && self.dense_blas_rows(n)
            && hq + (2 * m0 * k) as u64 == hkv
            && qo == Rows::packed(n, m0)
            && kvo == Rows::packed(n, m1)
            && (op.x.0.ptr, op.xr) == (kv.0.ptr, kvo)
            && qs.0.ptr == q.0.ptr
            && head_rows(qr)
            && (qr.n, qr.width) == (qdr.n, qdr.width)
            && op.rope.dim <= qr.width
            && head_rows(src)
            && src.width % 8 == 0
            && self.qnope_h_ok(wk, heads, src, dst);
        if !ok {
            return false;
        }
        self.took(Path::QkvJoint);
        self.took(Path::DenseBlasFused);
        self.took(Path::DenseBlasBatch);
        self.took(Path::QnopeH);
        qd.check(qdr);
        let ld = m0 + m1;
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let (Some(xh), Some(rows)) = (self.scratch(S::XBf16, 2 * k * n), self.scratch(S::Qkv, 4 * ld * n)) else { return true };
        self.add_rms_norm_h((x, xr), delta, w, op.eps, (out, o), xh);
        if !self.bind_ctx() {
            return true;
        }
        let (h, f) = (blas_sys::cudaDataType::CUDA_R_16F, blas_sys::cudaDataType::CUDA_R_32F);
        self.gemm_ex_c((hq, h, k, 0), (xh, h, k, 0), (rows, f, ld, 0), (ld, n, k), 1);
        // q_nope's f16 rows for W_uk (the norm's f16 rows are read by now: the same stream).
        let Some(nh) = self.scratch(S::XBf16, 2 * src.width * src.n) else { return true };
        let jop = Nrc { joint: Some(JointRows { ptr: rows, ld, kv_off: m0 }), ..*op };
        if self.norm_rope_cache(&jop, Some((qs, src, nh))) {
            self.absorb_h16(nh, wk, heads, n, qd, dst);
        }
        true
    }

    /// Whether [`CudaBackend::values_out_blas`] takes this chain: both weights have their f16
    /// copies and the rows are the plain chain's shapes, in a decode batch (no side effects).
    pub(super) fn values_out_blas_ok(
        &self,
        (_, lr): (&CudaBuf, Rows),
        (w_uv, wo): (&CudaWeight, &CudaWeight),
        (avr, avo): (Rows, Rows),
        xr: Rows,
    ) -> bool {
        let (kl, v, nh, n) = (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2), xr.n);
        w_uv.half_rm().is_some()
            && wo.half_rm().is_some()
            && n > GEMV_MAX_TOKENS
            && n <= GRAPH_MAX_TOKENS
            && w_uv.shape.len() == 3
            && (lr.n, lr.width) == (n * nh, kl)
            && (avr.n, avr.width) == (n * nh, v)
            && (avo.n, avo.width) == (n, nh * v)
            && (wo.ne(0), wo.ne(2)) == (nh * v, 1)
            && wo.ne(1) == xr.width
            && (nh * v) % 8 == 0
            && self.path_on(Path::DenseBlasFused)
            && self.dense_blas_rows(n)
    }

    /// A decode batch's value and output products on cuBLAS in f16 (Path::DenseBlasBatch):
    /// `av = lat · W_uv` per head written in f16 (scratch `AvH`, packed `[n, heads * v]`, as
    /// f16_rows would round `av`), then `y = av · W_o` from it; `av` itself is left unwritten
    /// (the chain's scratch, Backend::mla_attention_out). `lat_h`: `lat` already in f16 (packed
    /// rows, f16_rows' bits; the attention's merge wrote them), else converted here. False
    /// (nothing done) unless [`CudaBackend::values_out_blas_ok`].
    pub(super) fn values_out_blas(
        &self,
        (lat, lr): (&CudaBuf, Rows),
        (w_uv, wo): (&CudaWeight, &CudaWeight),
        (avr, avo): (Rows, Rows),
        (y, xr): (&CudaBuf, Rows),
        lat_h: Option<u64>,
    ) -> bool {
        if !self.values_out_blas_ok((lat, lr), (w_uv, wo), (avr, avo), xr) {
            return false;
        }
        let (Some(uh), Some(oh)) = (w_uv.half_rm(), wo.half_rm()) else { return false };
        let (kl, v, nh, n) = (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2), xr.n);
        self.took(Path::DenseBlasBatch);
        self.took(Path::DenseBlasFused);
        lat.check(lr);
        y.check(xr);
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let xh = match lat_h {
            Some(p) => {
                self.took(Path::LatH);
                if !self.bind_ctx() {
                    return true;
                }
                p
            }
            None => match self.f16_input(lat, lr) {
                Some(p) => p,
                None => return true,
            },
        };
        let Some(avh) = self.scratch(S::AvH, 2 * n * nh * v) else { return true };
        // Head h: C_h[v, n] at avh + h * v halves, rows nh * v apart; lat row j * nh + h.
        let h = blas_sys::cudaDataType::CUDA_R_16F;
        self.gemm_ex_c((uh, h, kl, (v * kl) as i64), (xh, h, kl * nh, kl as i64), (avh, h, nh * v, v as i64), (v, n, kl), nh as i32);
        self.wo_h16(oh, avh, (y, xr), nh * v);
        true
    }

    /// W_o's product of a decode batch from the value rows' f16 copy `avh` (`xr.n` packed rows
    /// of `k` halves) into `y` on cuBLAS.
    fn wo_h16(&self, oh: u64, avh: u64, (y, xr): (&CudaBuf, Rows), k: usize) {
        let c = y.0.ptr + 4 * xr.off as u64;
        self.gemm_h16((oh, k, 0), (avh, k, 0), (c, xr.stride, 0), (xr.width, xr.n, k), 1);
    }

    /// `mmq_many`'s products from the quantised input `xq` (`ngroups` groups a row).
    pub(super) fn mmq_jobs(&self, ngroups: usize, xq: u64, n: usize, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) {
        if self.mmq_dense_jobs(ngroups, xq, n, jobs) {
            return;
        }
        for &(w, out, o) in jobs {
            out.check(o);
            self.mmq_dense(w, ngroups, xq, (n, n, 1), out, o, SplitSum::Plain);
        }
    }

    pub(super) fn norm_matmul_many(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(&CudaBuf, Rows)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        let k = xr.width;
        // One token, 2 or 3 products of the row, the norm in the product kernels' blocks
        // (kernels/fused.cu: add_rms_norm's block of 256 threads, its register path), else the
        // two ops. The preconditions both kernels share, with each job's shape:
        let common = self.fused
            && xr.n == 1
            && delta.is_none_or(|(d, dr)| dr.n == 1 && dr.width == k && out.0.ptr != d.0.ptr)
            && o.n == 1
            && o.width == k
            && k > 128
            && k <= 8 * 256
            && k % 128 == 0
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == k)
            && (2..=3).contains(&jobs.len())
            && jobs.iter().all(|(jw, _, jo)| {
                jw.shape.len() <= 3 && jw.ne(2) == 1 && jw.ne(0) == k && jo.n == 1 && jo.width == jw.ne(1) && jw.ne(1) > 0
            });
        // Q8_0 jobs: gemv_q8_multi_norm_1; without a delta only while `moe_residual` is on (it
        // was measured with it).
        let one = common
            && self.norm_mm.load(Ordering::Relaxed)
            && (delta.is_some() || self.moe_residual.load(Ordering::Relaxed))
            && k * 9 / 8 + 4 * k <= self.smem_max
            && jobs.iter().all(|(jw, _, _)| jw.dtype == GgmlType::Q8_0);
        // All f16 or all bf16 jobs, rows of whole 16-byte pieces: gemv_h16_multi_norm_<t>_1,
        // while `norm_mm16` is on.
        let t16 = jobs.first().map(|(jw, _, _)| jw.dtype).filter(|t| matches!(t, GgmlType::F16 | GgmlType::BF16));
        let one16 = common
            && !one
            && self.norm_mm16.load(Ordering::Relaxed)
            && 4 * k <= self.smem_max
            && t16.is_some()
            && jobs.iter().all(|(jw, _, _)| Some(jw.dtype) == t16 && jw.mem.ptr % 16 == 0 && jw.row_bytes % 16 == 0);
        // A decode batch on the int8 products (matmul_many's mmq_many, below its cuBLAS sizes):
        // the norm and the input's quantisation in one launch (Path::NormQ8).
        let n = xr.n;
        let q8 = !one
            && !one16
            && self.norm_q8_ok(n, k, (o.n, o.width), w)
            && !(self.blas_jobs(n, k, jobs) && self.dense_blas_rows(n))
            && self.mmq_many(n, k, jobs)
            && delta.is_none_or(|(_, dr)| (dr.n, dr.width) == (n, k));
        if q8 {
            self.took(Path::NormQ8);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, n * ngroups * 144) else { return };
            let delta = delta.map(|(d, dr)| {
                d.check(dr);
                (d.0.ptr, dr, 0)
            });
            self.add_rms_norm_q8((x, xr), delta, w, eps, (out, o), xq);
            self.mmq_jobs(ngroups, xq, n, jobs);
            return;
        }
        // A decode batch whose products take cuBLAS (Path::DenseBlasBatch): the norm's launch
        // writes their f16 input too (add_rms_norm_h; the same bits as the norm, then f16_rows).
        let blas = !one && !one16 && self.norm_h_ok((n, k), delta, w, o);
        let blas = blas && self.blas_jobs(n, k, jobs) && self.dense_blas_take(n);
        if blas {
            self.took(Path::DenseBlasFused);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(xh) = self.scratch(S::XBf16, 2 * k * n) else { return };
            self.add_rms_norm_h((x, xr), delta, w, eps, (out, o), xh);
            if !self.bind_ctx() {
                return;
            }
            self.gemm_jobs_h16(xh, n, k, jobs);
            return;
        }
        if !one && !one16 {
            match delta {
                Some((d, dr)) => self.add_rms_norm(x, xr, d, dr, w, eps, out, o),
                None => self.rms_norm(x, xr, w, eps, out, o),
            }
            self.matmul_many(out, o, jobs);
            return;
        }
        x.check(xr);
        if let Some((d, dr)) = delta {
            d.check(dr);
        }
        out.check(o);
        let Some(done) = self.scratch(S::NormSync, 16) else { return };
        // x, delta, the norm's weights and eps, h, the counter (gemv_*_multi_norm_1's tail).
        let norm = [
            A::P(x.0.ptr),
            l(xr.off),
            A::P(delta.map_or(0, |(d, _)| d.0.ptr)),
            l(delta.map_or(0, |(_, dr)| dr.off)),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(out.0.ptr),
            l(o.off),
            // Word 1 of NormSync (word 0 is add_rms_norm_parts_router's).
            A::P(done + 4),
        ];
        if one16 {
            let (table, total) = multi_job_table(jobs, 8);
            let args: [A; 32] = cat(cat::<21, 1, 22>(table, [i(k)]), norm);
            let name = if t16 == Some(GgmlType::BF16) { "gemv_h16_multi_norm_bf16_1" } else { "gemv_h16_multi_norm_f16_1" };
            self.launch(name, (total.min(self.sm_count * 8) as u32, 1, 1), 256, (4 * k) as u32, &args);
            return;
        }
        let (table, lpr, total) = multi_jobs(jobs, k);
        let args: [A; 33] = cat(cat::<21, 2, 23>(table, [i(k), i(lpr)]), norm);
        self.launch("gemv_q8_multi_norm_1", (total.min(self.sm_count * 8) as u32, 1, 1), 256, (k * 9 / 8 + 4 * k) as u32, &args);
    }
}
