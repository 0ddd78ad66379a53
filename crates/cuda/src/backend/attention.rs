//! MLA attention: the absorbed decode kernels (split over the context, merged), the prompt
//! kernels, the batch split rule, and the latent norm + rope + cache write.

use super::*;

/// One `norm_rope_cache_write` / `mla_rope_cache_write` as the backend's ops receive it: the
/// latent rows `x` (`xr`; the first `norm_width` values normalised by `w`, then `rope.dim` roped),
/// the query's rope part `q` when there is one (rows in, rows out, heads per token), the batch
/// and the cache the rows go to.
#[derive(Clone, Copy)]
pub(super) struct Nrc<'a> {
    pub(super) x: &'a CudaBuf,
    pub(super) xr: Rows,
    pub(super) norm_width: usize,
    pub(super) w: Option<&'a CudaWeight>,
    pub(super) eps: f32,
    pub(super) q: Option<(&'a CudaBuf, Rows, &'a CudaBuf, Rows, usize)>,
    pub(super) batch: &'a CudaBatch,
    pub(super) rope: &'a CudaRope,
    pub(super) cache: &'a CudaCache,
    /// Where `x` and `q` really are (Path::QkvJoint): both in the joint product's rows.
    pub(super) joint: Option<JointRows>,
}

/// The rows of q and kv_a's joint product (Path::QkvJoint): token t's row at `ptr + 4 * t * ld`
/// bytes, q's `nh * qk` values first, then kv_a's from value `kv_off`; they stand in for the
/// model's packed `q` (`[n, nh * qk]`) and `kv` (`[n, kv_lora + rope]`) rows.
#[derive(Clone, Copy)]
pub(super) struct JointRows {
    pub(super) ptr: u64,
    /// Values a row (q's width plus kv_a's).
    pub(super) ld: usize,
    /// kv_a's first value in a row (q's width).
    pub(super) kv_off: usize,
}

impl Nrc<'_> {
    /// The launch's block size, query-rope block count and arguments (kernels/fused.cu).
    pub(super) fn args(&self) -> (u32, usize, [A; 24]) {
        let &Nrc { x, xr, norm_width, w, eps, q, batch, rope, cache, joint } = self;
        let mode = rope_mode(rope);
        let block = norm_width.next_power_of_two().clamp(32, 256) as u32;
        // The query's rope items (heads x (width - half) per token) in blocks of about two per
        // thread, beside the latent row's block.
        let qblocks = q.map_or(0, |q| (q.4 * (q.1.width - rope.dim / 2)).div_ceil(2 * block as usize).clamp(1, 64));
        // The latent rows and the query's source: the model's buffers, or the joint rows.
        let (xp, xoff, xstride) = joint.map_or((x.0.ptr, xr.off, xr.stride), |j| (j.ptr, j.kv_off + xr.off, j.ld));
        let qp = joint.map_or(q.map_or(0, |q| q.0 .0.ptr), |j| j.ptr);
        let args = [
            A::P(xp),
            l(xoff),
            l(xstride),
            i(xr.width),
            i(norm_width),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(batch.pos_ptr()),
            A::P(batch.slot_ptr()),
            A::I(batch.slot_len as i32),
            A::P(rope.freqs.ptr),
            i(rope.dim / 2),
            A::I(mode),
            A::F(rope.mscale),
            A::P(cache.mem.ptr),
            A::P(qp),
            l(q.map_or(0, |q| q.1.off)),
            l(q.map_or(0, |q| q.1.stride)),
            A::P(q.map_or(0, |q| q.2 .0.ptr)),
            l(q.map_or(0, |q| q.3.off)),
            l(q.map_or(0, |q| q.3.stride)),
            i(q.map_or(0, |q| q.1.width)),
            i(q.map_or(0, |q| q.4)),
        ];
        (block, qblocks, args)
    }
}

impl CudaBackend {
    /// [`Backend::mla_attention`]; with `defer`, a one-token step on the split kernels leaves
    /// the merge of its splits to the caller and returns (the partial rows, the split count,
    /// whether they are f16 rows divided by l: `half`, asked by a caller that can merge them,
    /// and taken by the early tensor-core kernel, [`Path::HalfParts`]) (`mla_out_q8` /
    /// `mla_out_q8p` merge them). None: `out` is written (or the backend failed). Then whether
    /// every token's rows also went out in f16 at `lat_h` (non-zero: the merge's).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention_run(
        &self,
        q: &CudaBuf,
        qr: Rows,
        cache: &CudaCache,
        batch: &CudaBatch,
        p: &MlaParams,
        out: &CudaBuf,
        o: Rows,
        defer: bool,
        half: bool,
        lat_h: u64,
    ) -> (Option<(u64, usize, bool)>, bool) {
        // Backend::prefetch_hint's regions go with a one-token step's split kernel, and with no
        // other launch (they are taken either way).
        let hint = self.take_hint(batch.tokens.len() == 1);
        let (nh, kl, rd) = (p.n_heads, p.kv_lora, p.rope_dim);
        let w = kl + rd;
        assert_eq!(qr.width, w);
        assert_eq!(o.width, kl);
        assert_eq!(qr.n, batch.tokens.len() * nh);
        assert_eq!(cache.width, w, "mla_attention: cache width");
        q.check(qr);
        out.check(o);
        if !self.check_cache_rows(batch, cache.rows, "mla_attention") {
            return (None, false);
        }
        let n = batch.tokens.len();
        let simt = match (w, kl, nh, cache.half) {
            (576, 512, 16, false) => Some(("mla_split_18_16", 256u32)),
            (576, 512, 16, true) => Some(("mla_split_18_16_h", 256u32)),
            (160, 128, 4, false) => Some(("mla_split_5_4", 64u32)),
            _ => None,
        };
        // The tensor-core split (kernels/mla_prefill.cu): 16-head row groups, V2's shapes; an f16
        // cache's kernel streams its key tiles through a cp.async ring.
        // (8 warps a block, a score's dims in four parts, measured slower on the H200: tg64 at
        // 16k 471.0 against 483.2; docs/PERF.md, session 27.)
        let ms_smem = if cache.half { ms_smem_h(self.ms_nb) } else { MS_SMEM };
        let tc_ok = self.tc
            && (w, kl) == (576, 512)
            && nh % 16 == 0
            && qr.off.is_multiple_of(4)
            && qr.stride.is_multiple_of(4)
            && ms_smem <= self.smem_max;
        let use_tc = tc_ok
            && match self.mla_tc.load(Ordering::Relaxed) {
                1 => true,
                2 => simt.is_none() && cache.half, // an f16 cache has no per-(token, head) kernel
                _ => simt.is_none() || self.long_context(n, batch.tokens.iter().map(|t| t.pos)),
            };
        // One token only: its split blocks skip just its own row, and in a batch another token
        // of the same sequence has its row written by the same previous kernel.
        let early = use_tc && cache.half && n == 1 && self.path_on(Path::SplitEarly);
        if early {
            self.took(Path::SplitEarly);
        }
        let in_batch = use_tc && cache.half && n > 1 && self.path_on(Path::SplitBatch);
        let ms_smem = if in_batch { ms_smem_h(self.ms_nb_b) } else { ms_smem };
        // f16 partial rows for a caller that merges them (one token, deferred).
        let hp = early && defer && half && n == 1 && self.path_on(Path::HalfParts);
        let split = match (use_tc, cache.half, early) {
            (true, true, true) if hp => Some(("mla_split_tc_hep", 128u32)),
            (true, true, true) => Some(("mla_split_tc_he", 128u32)),
            (true, true, false) if in_batch => Some(("mla_split_tc_hb", 128u32)),
            (true, true, false) => Some(("mla_split_tc_h", 128u32)),
            (true, false, _) => Some(("mla_split_tc", 128u32)),
            (false, _, _) => simt,
        };
        // Prefill of one sequence: f16 tensor cores, 4 row groups of 16 heads per block
        // (kernels/mla_prefill.cu); other batches take the split kernel, or the
        // per-(token, head) kernel for shapes the split kernel is not built for.
        let one_slot = batch.tokens.iter().all(|t| t.slot == batch.tokens[0].slot);
        if self.tc
            && n > GEMV_MAX_TOKENS
            && (w, kl) == (576, 512)
            && nh % 16 == 0
            && one_slot
            && qr.off.is_multiple_of(4)
            && qr.stride.is_multiple_of(4)
            && MP_SMEM <= self.smem_max
        {
            let groups = n * nh / 16;
            let (name, smem) = match (cache.half, self.mla_pfa.load(Ordering::Relaxed) && MP_SMEM_A <= self.smem_max) {
                (true, true) => ("mla_prefill_ha", MP_SMEM_A),
                (true, false) => ("mla_prefill_h", MP_SMEM),
                (false, _) => ("mla_prefill", MP_SMEM),
            };
            self.launch(
                name,
                (groups.div_ceil(4) as u32, 1, 1),
                256,
                smem as u32,
                &[
                    A::P(q.0.ptr),
                    l(qr.off),
                    l(nh * qr.stride),
                    l(qr.stride),
                    A::P(cache.mem.ptr),
                    A::P(batch.pos_ptr()),
                    A::P(batch.slot_ptr()),
                    A::I(batch.slot_len as i32),
                    i(n),
                    i(nh),
                    A::F(p.scale),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(nh * o.stride),
                    l(o.stride),
                ],
            );
            return (None, false);
        }
        if let Some((kname, threads)) = split {
            // Decode steps, and batches of several sequences (the server's steps): split over
            // the context, all heads of a token per block, then merge (kernels/fast.cu). The
            // tokens go in chunks whose partial results fit the fixed `Part` scratch.
            // Two blocks per SM over the batch's tokens, except the 16-head SIMT kernel (it holds
            // an SM alone at 255 registers) for batches: one wave, sm_count / n. Measured on the
            // H200: 64 sequences 5,648 tok/s with 2 splits each (the merge then 2 warps); one
            // token: one wave gave tg64 at 16k 358 vs 340 but tg128 568 vs 582, so 2 per SM there
            // (TS_CUDA_MLA_SPLITS to measure). The tensor-core kernel on one long-context token
            // (16 heads: one row group): one wave, tg64 at 16k 410 vs 382 with 2 per SM; on a
            // batch: one or two blocks an SM by its longest context (tc_batch_splits).
            let simt16 = kname.starts_with("mla_split_18_16");
            // Batches on the SIMT kernel: also no more splits than runs of `mla_keys` keys in the
            // longest context (64 sequences of short contexts: one split each, written without
            // the merge, 6,171 vs 6,069 tok/s with 2; docs/PERF.md).
            let auto = if simt16 && n > 1 {
                self.batch_mla_splits(n, batch.tokens.iter().map(|t| t.pos))
            } else if use_tc && n > 1 {
                self.tc_batch_splits(n, batch.tokens.iter().map(|t| t.pos))
            } else {
                (if use_tc && n * nh == 16 { self.sm_count } else { 2 * self.sm_count }) / n
            };
            let nsp = if self.mla_splits > 0 { self.mla_splits } else { auto }.clamp(1, MLA_MAX_SPLITS);
            let per_tok = 4 * nsp * nh * (kl + 2);
            let chunk = (PART_MIN_BYTES / per_tok).clamp(1, n);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(part) = self.scratch(S::Part, (per_tok * chunk).max(PART_MIN_BYTES)) else { return (None, false) };
            // Whether every token's output rows also went out in f16 (`lat_h`, the merge's).
            let mut all_h = lat_h != 0;
            for t0 in (0..n).step_by(chunk) {
                let nc = chunk.min(n - t0);
                let (pos, slot) = (batch.pos_ptr() + 4 * t0 as u64, batch.slot_ptr() + 4 * t0 as u64);
                // The tensor-core kernel takes a block per 16-head row group of a token. The SIMT
                // kernels with one split write the output themselves (no merge to do).
                let (gy, smem) = if use_tc { (nc * nh / 16, ms_smem) } else { (nc, 0) };
                let direct = !use_tc && nsp == 1;
                let ooff = o.off + t0 * nh * o.stride;
                let args = [
                    A::P(q.0.ptr),
                    l(qr.off + t0 * nh * qr.stride),
                    l(nh * qr.stride),
                    l(qr.stride),
                    A::P(cache.mem.ptr),
                    A::P(pos),
                    A::P(slot),
                    A::I(batch.slot_len as i32),
                    i(nh),
                    A::F(p.scale),
                    A::P(part),
                    A::P(if direct { out.0.ptr } else { 0 }),
                    l(ooff),
                    l(nh * o.stride),
                    l(o.stride),
                ];
                if in_batch {
                    self.took(Path::SplitBatch);
                }
                let all: [A; 23] = cat(args, hint);
                self.launch(kname, (nsp as u32, gy as u32, 1), threads, smem as u32, &all[..if use_tc { 11 } else { 23 }]);
                if direct {
                    all_h = false;
                    continue;
                }
                if defer && n == 1 {
                    if hp {
                        self.took(Path::HalfParts);
                    }
                    return (Some((part, nsp, hp)), false);
                }
                let cargs = [A::P(part), i(nsp), i(nh), i(kl), A::P(pos), A::P(out.0.ptr), l(ooff), l(nh * o.stride), l(o.stride)];
                if nsp <= 8 && kl % 4 == 0 && kl <= 512 && self.path_on(Path::CombineFew) {
                    // A block per (token, head), a thread per 4 outputs (the same bits); with
                    // `lat_h`, the rows in f16 too (packed [n * nh, kl] halves, f16_rows' bits).
                    self.took(Path::CombineFew);
                    let hargs = [A::P(lat_h), l(t0 * nh * kl)];
                    let args: [A; 11] = cat(cargs, hargs);
                    let args: [A; 19] = cat(args, self.take_xpf(2, n));
                    self.launch("mla_combine_few", ((nc * nh) as u32, 1, 1), (kl / 4) as u32, 0, &args);
                    continue;
                }
                all_h = false;
                self.launch(
                    "mla_combine",
                    ((nc * nh) as u32, kl.div_ceil(64) as u32, 1),
                    32 * nsp.min(8) as u32, // a warp per split, up to 8 (MC_WARPS); float2 rows: kl (512, 128) is even
                    0,
                    &cargs,
                );
            }
            return (None, all_h);
        }
        if cache.half {
            // alloc_latent_cache gives f16 only where the kernels above cover every batch.
            self.fail(format!("mla_attention: no kernel reads this f16 cache (queries at offset {} stride {})", qr.off, qr.stride));
            return (None, false);
        }
        self.attention_launch(
            (q, qr.off, nh * qr.stride, qr.stride),
            (cache.mem.ptr, w, 0),
            (cache.mem.ptr, w, 0),
            (out, o.off, nh * o.stride, o.stride),
            batch,
            nh,
            nh,
            w,
            kl,
            p.scale,
            0,
            0.0,
        );
        (None, false)
    }

    /// Host-side check that every token's cache rows `[slot*slot_len, slot*slot_len + pos]` lie in
    /// a cache of `rows` rows.
    pub(super) fn check_cache_rows(&self, batch: &CudaBatch, rows: usize, what: &str) -> bool {
        let sl = batch.slot_len as usize;
        for tm in &batch.tokens {
            if tm.pos as usize >= sl || (tm.slot as usize * sl + tm.pos as usize) >= rows {
                self.fail(format!("{what}: position {} of slot {} is outside the cache ({rows} rows, {sl} per slot)", tm.pos, tm.slot));
                return false;
            }
        }
        true
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_launch(
        &self,
        q: (&CudaBuf, usize, usize, usize),
        k: (u64, usize, usize),
        v: (u64, usize, usize),
        out: (&CudaBuf, usize, usize, usize),
        batch: &CudaBatch,
        nh: usize,
        group: usize,
        hd: usize,
        vd: usize,
        scale: f32,
        window: u32,
        softcap: f32,
    ) {
        let vpl = if vd <= 128 {
            4
        } else if vd <= 256 {
            8
        } else if vd <= 512 {
            16
        } else {
            self.fail(format!("attention: value width {vd} > 512 is not supported"));
            return;
        };
        let smem = ((hd + 4 * vd + 8) * 4) as u32;
        if smem > 48 * 1024 {
            self.fail(format!("attention: head width {hd} needs {smem} bytes of shared memory"));
            return;
        }
        let n = batch.tokens.len();
        self.launch(
            KName::of(format_args!("attention_{vpl}")).as_str(),
            ((n * nh) as u32, 1, 1),
            128,
            smem,
            &[
                A::P(q.0 .0.ptr),
                l(q.1),
                l(q.2),
                l(q.3),
                A::P(k.0),
                l(k.1),
                l(k.2),
                A::P(v.0),
                l(v.1),
                l(v.2),
                A::P(out.0 .0.ptr),
                l(out.1),
                l(out.2),
                l(out.3),
                A::P(batch.pos_ptr()),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
                i(nh),
                i(group),
                i(hd),
                i(vd),
                A::F(scale),
                A::I(window as i32),
                A::F(softcap),
            ],
        );
    }

    /// Splits a token of a batch of `n` (> 1) gets on the tensor-core MLA decode: one block an
    /// SM over the batch (`sm_count / n`) while those splits take at most
    /// [`CudaBackend::mla_kps_b`] keys of the longest context each, else two (`2 * sm_count /
    /// n`); part of the step's graph key. Fewer, longer splits write and merge fewer partial
    /// rows. H200, 64 sequences (gpu-next117, tok/s): `-d 96` 2 splits 8,414 against 4's 8,377
    /// (1: 8,266, 3: 8,370); `-d 200` 2 splits 8,262 against 8,242 (3: 8,211); `-d 400` 4
    /// splits 8,082 against 2's 8,049.
    pub(super) fn tc_batch_splits(&self, n: usize, pos: impl Iterator<Item = u32>) -> usize {
        tc_batch_splits(self.sm_count, n, self.mla_kps_b, pos.max())
    }

    /// Splits a token of a batch of `n` (> 1) gets on the 16-head SIMT MLA decode: one wave
    /// (`sm_count / n`, the kernel holds an SM alone), and no more than the runs of
    /// [`CudaBackend::mla_keys`] keys in the longest context; part of the step's graph key.
    pub(super) fn batch_mla_splits(&self, n: usize, pos: impl Iterator<Item = u32>) -> usize {
        let wave = (self.sm_count / n).max(1);
        match (self.mla_keys, pos.max()) {
            (0, _) | (_, None) => wave,
            (k, Some(p)) => wave.min((p as usize + 1).div_ceil(k)),
        }
    }

    /// Whether a step of `n` tokens at these positions counts as long-context (`mla_long`, or
    /// `mla_long_batch` for several tokens), part of the step's graph key
    /// ([`Backend::graph_class`]).
    pub(super) fn long_context(&self, n: usize, pos: impl Iterator<Item = u32>) -> bool {
        let from = if n > 1 { self.mla_long_batch } else { self.mla_long };
        from > 0 && pos.max().is_some_and(|p| p >= from)
    }

    /// `norm_rope_cache_write`, and with `q` also `rope_copy` of the query's rope part, in one
    /// `norm_rope_cache` launch (kernels/fused.cu). With `nope` = (the query's no-rope rows:
    /// buffer, rows `[tokens * heads, w]`; where their f16 copy goes): that copy too, packed,
    /// as `f16_rows` would make it, in a block row of the same launch; true when it was made.
    pub(super) fn norm_rope_cache(&self, op: &Nrc<'_>, nope: Option<(&CudaBuf, Rows, u64)>) -> bool {
        let &Nrc { x, xr, norm_width, w, eps, q, batch, rope, cache, joint } = op;
        if !self.fused {
            assert!(joint.is_none(), "norm_rope_cache: the joint q / kv_a rows need the fused kernel");
            let nr = xr.cols(0, norm_width);
            self.rms_norm(x, nr, w, eps, x, nr);
            self.rope(x, xr.cols(norm_width, xr.width - norm_width), 1, batch, rope);
            self.cache_write(cache, x, xr, batch);
            if let Some((qs, qr, qd, qdr, heads)) = q {
                self.rope_copy(qs, qr, qd, qdr, heads, batch, rope);
            }
            return false;
        }
        assert!(
            norm_width > 0 && norm_width + rope.dim <= xr.width && rope.dim % 2 == 0,
            "norm_rope_cache_write: {norm_width} + rope {} > width {}",
            rope.dim,
            xr.width
        );
        assert_eq!(xr.n, batch.tokens.len());
        assert_eq!(xr.width, cache.width, "norm_rope_cache_write: row width {} != cache width {}", xr.width, cache.width);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), norm_width, "norm weight length != norm width {norm_width}");
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        x.check(xr);
        if !self.check_cache_rows(batch, cache.rows, "norm_rope_cache_write") {
            return false;
        }
        let (block, qblocks, args) = op.args();
        let heads = q.map_or(0, |q| q.4);
        let nope = nope.filter(|(_, r, _)| heads > 0 && r.n == xr.n * heads && r.width % 8 == 0 && r.width > 0);
        if let Some((b, r, _)) = nope {
            b.check(r);
        }
        // A token's first q row: `heads` packed head rows on, or the joint row's stride.
        let qt = |stride: usize| joint.map_or(heads * stride, |j| j.ld);
        let nargs = match nope {
            Some((b, r, dst)) => {
                let qn = joint.map_or(b.0.ptr, |j| j.ptr);
                [A::P(qn), l(r.off), l(r.stride), i(r.width), A::P(dst), l(q.map_or(0, |q| qt(q.1.stride))), l(qt(r.stride))]
            }
            None => [A::P(0), l(0), l(0), i(0), A::P(0), l(q.map_or(0, |q| qt(q.1.stride))), l(0)],
        };
        let all: [A; 31] = cat(args, nargs);
        let rows = 1 + qblocks + usize::from(nope.is_some());
        self.launch(cache.kernel("norm_rope_cache").as_str(), (xr.n as u32, rows as u32, 1), block, 0, &all);
        nope.is_some()
    }
}
