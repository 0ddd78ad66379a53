//! The mixture-of-experts ops: routing, grouping the (token, slot) pairs by expert, the grouped
//! expert products (int8 and f16), the shared FFN, and the weighted combine.

use super::*;

impl CudaBackend {
    /// Prompt-size MoE on the int8 tensor cores: route, group the (token, slot) pairs by expert,
    /// then gate, up (one grouped `mmq_q8` each over the experts' token lists), GLU fused into the
    /// quantisation of the down projection's input, down, and the router-weighted sum. With
    /// `shared` (2-D weights whose `ff_s` is a multiple of the experts' `ff`, checked by the
    /// caller), every token also gets `ff_s / ff` shared slots, experts `E ..` whose matrices are
    /// the shared FFN's blocks of `ff` rows (gate, up) or columns (down), summed unweighted: the
    /// shared FFN rides in the same launches. Scratch: `g`, `u` `pairs * ff` floats, `y` `pairs *
    /// hdim`, pairs = tokens x (k + shared slots).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_mmq(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: &Experts<'_, CudaWeight>,
        shared: Option<&Experts<'_, CudaWeight>>,
        p: &MoeParams,
        warp_route: bool,
        (sel_e, sel_w, g, u, y): (u64, u64, u64, u64, u64),
        out: &CudaBuf,
        o: Rows,
    ) {
        let n = xr.n;
        let (hdim, ff, ne, k) = (xr.width, experts.gate.ne(1), p.n_experts, p.k);
        let act = match p.glu {
            Glu::SwiGlu => 1,
            Glu::GeGluTanh => 2,
        };
        // The shared FFN on cuBLAS (its row-major copies exist only with moe_blas), added by
        // the combine; the routed experts then as without a shared FFN (prompts).
        let (mut add, mut add_n) = (0, 0);
        let mut joiner = None;
        let blas = self.moe_blas.load(Ordering::Relaxed);
        let copies = |s: &Experts<'_, CudaWeight>| match [s.gate.half_rm(), s.up.half_rm(), s.down.half_rm()] {
            [Some(cg), Some(cu), Some(cd)] => Some((cg, cu, cd, s.gate.ne(1))),
            _ => None,
        };
        // Decode batches whose routed experts take the 16-token int8 tiles, with
        // Path::SharedFork: the shared FFN on the side stream, beside the routing and the routed
        // products (which use none of its scratch), joined before the combine (`joiner`;
        // dropped on an early return, it joins there), on cuBLAS from the f16 copies. Its
        // scratch is sized before the fork (a slot that grows is zeroed on the main stream).
        // (and only where the launches with the shared chunks would take those tiles too: with
        // few experts the chunks can tip the tile choice to the prompt paths, which the routed
        // experts alone would then leave; the fork keeps each path's kernels)
        let nsh_all = shared.map_or(0, |s| s.gate.ne(1) / ff.max(1));
        let fork = n <= GRAPH_MAX_TOKENS
            && self.moe_tile_tokens(n * k, ne) == 16
            && self.moe_tile_tokens(n * (k + nsh_all), ne + nsh_all) == 16
            && self.path_on(Path::SharedFork);
        // (the input rows' address: a fork point recorded ahead for them serves, fork_open)
        let x_rows = x.0.ptr + 4 * xr.off as u64;
        let shared = match shared {
            Some(s) if blas && n > GRAPH_MAX_TOKENS && copies(s).is_some() => {
                let Some(ys) = copies(s).and_then(|c| self.shared_blas(x, xr, c, act)) else { return };
                (add, add_n) = (ys, 1);
                None
            }
            Some(s) if fork && blas && copies(s).is_some() => {
                let ahead = self.scratch_holds(&Self::shared_blas_sizes(n, hdim, s.gate.ne(1))).then_some(x_rows);
                if self.shared_blas_scratch(n, hdim, s.gate.ne(1)).is_none() {
                    return;
                }
                // (a fork that fails, recorded, leaves the shared FFN on the main stream)
                let side = self.fork_open(ahead).map(|(_, j)| {
                    joiner = Some(j);
                    self.side_section()
                });
                let Some(ys) = copies(s).and_then(|c| self.shared_blas(x, xr, c, act)) else { return };
                if side.is_some() {
                    self.took(Path::SharedFork);
                }
                (add, add_n) = (ys, 1);
                None
            }
            other => other,
        };
        let nsh = shared.map_or(0, |s| s.gate.ne(1) / ff);
        let ks = k + nsh;
        let pairs = n * ks;
        let ne_all = ne + nsh;
        let (Some(cnt), Some(off), Some(perm)) =
            (self.scratch(S::Cnt, 4 * ne_all), self.scratch(S::Off, 4 * ne_all), self.scratch(S::Perm, 4 * pairs))
        else {
            return;
        };
        // Tokens per tile: 16 when the experts see few tokens each (batched decode; the block's
        // work then shrinks with them), else 64. Upper bound of the tiles over all experts: sum
        // of ceil(cnt/bn) <= pairs/bn + experts.
        let bn = self.moe_tile_tokens(pairs, ne_all);
        let (hg, fg) = (hdim.div_ceil(128), ff.div_ceil(128));
        self.route(logits, lr, p, warp_route, sel_e, sel_w);
        self.launch("moe_group", (1, 1, 1), 1024, 0, &[A::P(sel_e), i(n), i(k), i(nsh), i(ne), A::P(cnt), A::P(off), A::P(perm)]);
        if self.moe_counts {
            self.print_moe_counts(cnt, ne_all);
        }
        let tiles = (pairs.div_ceil(bn) + ne_all) as u32;
        // Prompt-size MoEs on Hopper's wgmma fed by TMA (`mmh_*`), from the stacks' row-major
        // f16 copies, the shared FFN (if any) already on cuBLAS.
        let mode = self.mmh_mode.load(Ordering::Relaxed);
        if bn == 64 && nsh == 0 && self.mmh && mode != 0 && hdim % 256 == 0 && ff % 128 == 0 {
            let [g8, u8_, d8] = [experts.gate, experts.up, experts.down];
            let w = match [g8.half_rm(), u8_.half_rm(), d8.half_rm()] {
                [Some(wg), Some(wu), Some(wd)] if mode != 2 => Some(MmhWeights::F16(wg, wu, wd)),
                _ if mode >= 2 && [g8, u8_, d8].iter().all(|w| w.dtype == GgmlType::Q8_0) => {
                    Some(MmhWeights::Q8([g8, u8_, d8].map(|w| (w.mem.ptr, w.row_bytes))))
                }
                _ => None,
            };
            if let Some(w) = w {
                if self.moe_mmh(x, xr, add != 0, w, (ne, k, ff), (cnt, off, perm), act, y) {
                    if let Some(j) = joiner.as_mut() {
                        j.join();
                    }
                    self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, (add, add_n));
                }
                return;
            }
        }
        // Prompt-size MoEs on the f16 tensor cores: from the f16 copies, or (`mmf_q8`; by
        // default where the copies are absent) straight from the Q8_0 weights, turned into f16
        // in registers (`mmfq8_*`).
        let q8w = |w: &CudaWeight| w.dtype == GgmlType::Q8_0;
        let halves = [experts.gate, experts.up, experts.down].into_iter().all(|w| w.half().is_some())
            && shared.is_none_or(|s| [s.gate, s.up, s.down].into_iter().all(|w| w.half().is_some()));
        let q8 = match self.mmf_q8.load(Ordering::Relaxed) {
            0 => false,
            1 => true,
            _ => !halves,
        } && self.mmfq8.is_some()
            && hdim % 128 == 0
            && ff % 128 == 0
            && [experts.gate, experts.up, experts.down].into_iter().all(q8w)
            && shared.is_none_or(|s| [s.gate, s.up, s.down].into_iter().all(q8w));
        if bn == 64 && self.moe_f16 && (q8 || self.mmf.is_some()) {
            let h = |w: &CudaWeight| if q8 { Some((w.mem.ptr, w.row_bytes, w.mat_bytes())) } else { w.half() };
            if let ([Some(hg), Some(hu), Some(hd)], Some(sh)) = (
                [h(experts.gate), h(experts.up), h(experts.down)],
                match shared {
                    None => Some(None),
                    Some(s) => match [h(s.gate), h(s.up), h(s.down)] {
                        [Some(a), Some(b), Some(c)] => Some(Some([a, b, c])),
                        _ => None,
                    },
                },
            ) {
                let (Some(xh), Some(hh)) = (self.scratch(S::Xh, 2 * n * hdim), self.scratch(S::Hh, 2 * pairs * ff)) else { return };
                // The shared chunks as in the int8 path: gate/up chunk c is rows c*ff.. of the
                // shared matrix (f16 copy: ff/64 tiles, 2*ff*hdim bytes on; Q8_0: ff rows on),
                // down chunk c columns c*ff.. of each of its rows (f16 copy: ff/64 stages of 8 KB
                // on; Q8_0: ff/128 groups of 144 bytes on).
                let chunk = |i: usize, rb: usize| match (q8, i < 2) {
                    (false, true) => 2 * ff * hdim,
                    (false, false) => 128 * ff,
                    (true, true) => ff * rb,
                    (true, false) => ff / 128 * 144,
                };
                let grp = |i: usize| (cnt, off, perm, ne_all, sh.map(|s| (s[i].0, s[i].1, chunk(i, s[i].1), ne)));
                // (shared_blas, when it ran, left these very rows in xh: same slot, same size)
                if add == 0 {
                    self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
                }
                if self.mmf_gu.load(Ordering::Relaxed) && (hg.1, hg.2) == (hu.1, hu.2) {
                    // Gate, up and the GLU in one launch (f16 GLU rows into hh).
                    let glu = Some((hu.0, sh.map_or(0, |s| s[1].0), act));
                    self.mmf_launch(hg, ff, hdim, xh, tiles, grp(0), ks, (hh, 0, ff), glu, q8);
                } else {
                    self.mmf_launch(hg, ff, hdim, xh, tiles, grp(0), ks, (g, 0, ff), None, q8);
                    self.mmf_launch(hu, ff, hdim, xh, tiles, grp(1), ks, (u, 0, ff), None, q8);
                    self.f16_rows(g, u, (0, ff), pairs, ff, act, hh);
                }
                self.mmf_launch(hd, hdim, ff, hh, tiles, grp(2), 1, (y, 0, hdim), None, q8);
                if let Some(j) = joiner.as_mut() {
                    j.join();
                }
                self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, (add, add_n));
                return;
            }
        }
        // x's groups as the norm's launch before wrote them (Path::NormQ8), else quantised here.
        let ahead = self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()).take();
        let xq = match ahead.filter(|a| a.rows == (x.0.ptr, xr.off, xr.stride, n, hdim)) {
            Some(a) => a.xq,
            None => {
                let Some(xq) = self.scratch(S::Xq, n * hg * 144) else { return };
                self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, n, hdim, 0, xq);
                xq
            }
        };
        let Some(hq) = self.scratch(S::Hq, pairs * fg * 144) else { return };
        // The shared chunks: gate/up chunk c is rows c*ff.. of the shared matrix; down chunk c
        // is groups c*ff/128.. of each of its rows.
        let groups = |sh: Option<(&CudaWeight, usize)>| {
            let sh = sh.map(|(s, stride)| (s.mem.ptr, s.row_bytes, stride, ne));
            Some(MmqGroups { cnt, off, perm, n_exp: ne_all, sh, pair: None, pair_tiled: 0, pairs, tokens: n })
        };
        let sg = shared.map(|s| (s.gate, ff * s.gate.row_bytes));
        let su = shared.map(|s| (s.up, ff * s.up.row_bytes));
        let sd = shared.map(|s| (s.down, ff / 128 * 144));
        let (gate, up) = (experts.gate, experts.up);
        let gx = ff.div_ceil(64) as u32;
        // Gate and up in one launch where their layouts agree, for decode-size batches (16-token
        // tiles; TS_CUDA_MOE_GU=0: two). Measured on the H200: 64 sequences 6,069 vs 6,009 tok/s;
        // prompts (64-token tiles) lost 2% (pp512 15,014 vs 15,347), so they keep two launches.
        if self.moe_gu && bn == 16 && (gate.row_bytes, gate.mat_bytes()) == (up.row_bytes, up.mat_bytes()) {
            let gr = groups(sg).map(|mut m| {
                m.pair = Some((up.mem.ptr, su.map_or(0, |(s, _)| s.mem.ptr), u));
                m.pair_tiled = up.tiled_ptr();
                m
            });
            self.mmq_launch(gate, ff, hg, xq, (2 * gx, tiles, 1), 0, gr, ks, (g, 0, ff), (1, 0), bn);
            self.xpf_glu_set(experts.down, n);
            self.quant_groups(g, u, 0, ff, pairs, ff, act, hq);
        } else {
            self.mmq_launch(gate, ff, hg, xq, (gx, tiles, 1), 0, groups(sg), ks, (g, 0, ff), (1, 0), bn);
            self.mmq_launch(up, ff, hg, xq, (gx, tiles, 1), 0, groups(su), ks, (u, 0, ff), (1, 0), bn);
            self.quant_groups(g, u, 0, ff, pairs, ff, act, hq);
        }
        self.mmq_launch(experts.down, hdim, fg, hq, (hdim.div_ceil(64) as u32, tiles, 1), 0, groups(sd), 1, (y, 0, hdim), (1, 0), bn);
        if let Some(j) = joiner.as_mut() {
            j.join();
        }
        self.moe_combine(y, (k, ks), hdim, n, (sel_e, sel_w), out, o, (add, add_n));
    }

    /// `TS_CUDA_MOE_COUNTS=1` (a measurement mode: it waits for the device): one line on stderr
    /// per grouped MoE, how its pairs spread over the experts.
    pub(super) fn print_moe_counts(&self, cnt: u64, ne: usize) {
        let mut c = vec![0i32; ne];
        let ok = self.stream.synchronize().is_ok() && unsafe { drv::memcpy_dtoh_sync(&mut c[..], cnt) }.is_ok();
        if !ok {
            return;
        }
        let mut s: Vec<i32> = c.iter().copied().filter(|&v| v > 0).collect();
        s.sort_unstable_by(|a, b| b.cmp(a));
        let total: i32 = s.iter().sum();
        let tiles: i32 = s.iter().map(|v| (v + 127) / 128).sum();
        let tiles16: i32 = s.iter().map(|v| (v + 15) / 16).sum();
        eprintln!(
            "moe counts: {total} pairs over {} of {ne} experts, 128-pair tiles {tiles}, 16-pair tiles {tiles16}, largest {:?}",
            s.len(),
            &s[..s.len().min(8)]
        );
    }

    /// The routed experts of a prompt-size MoE on `mmh_*` (kernels/mmh.cu), after the routing
    /// and grouping (`cnt`, `off`, `perm` over the `ne` experts, `k` slots a token, no shared
    /// slots): x's rows in f16 (already in the `Xh` scratch when `have_xh`: shared_blas made
    /// them), gathered into expert order (`moe_gather_h`), gate, up and the GLU in one launch
    /// (`mmh_gu`, f16 GLU rows in expert order), down (`mmh_dn`, f32 rows of `y` by pair).
    /// `w`: the stacks (gate, up, down) as row-major f16 copies or as Q8_0. False after a
    /// failure (reported).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_mmh(
        &self,
        x: &CudaBuf,
        xr: Rows,
        have_xh: bool,
        w: MmhWeights,
        (ne, k, ff): (usize, usize, usize),
        (cnt, off, perm): (u64, u64, u64),
        act: i32,
        y: u64,
    ) -> bool {
        let (n, hdim) = (xr.n, xr.width);
        let pairs = n * k;
        let (Some(xh), Some(xs), Some(hs)) =
            (self.scratch(S::Xh, 2 * n * hdim), self.scratch(S::Xs, 2 * pairs * hdim), self.scratch(S::Hh, 2 * pairs * ff))
        else {
            return false;
        };
        if !have_xh {
            self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
        }
        let gather = [A::P(xh), A::P(perm), A::P(cnt), A::P(off), i(ne), i(k), i(hdim / 8), A::P(xs)];
        self.launch("moe_gather_h", Self::grid1(pairs * hdim / 8), 256, 0, &gather);
        let (Some(tx), Some(th)) = (self.tma_f16(xs, hdim, pairs, MMH_BM as u32), self.tma_f16(hs, ff, pairs, MMH_BM as u32)) else {
            return false;
        };
        let tiles = (pairs.div_ceil(MMH_BM) + ne) as u32;
        let (gx, dx) = (((ff / 128) as u32, tiles, 1), ((hdim / 256) as u32, tiles, 1));
        // (each kernel's maps come first, then these)
        let (a_cnt, a_off, a_perm, a_ne) = (A::P(cnt), A::P(off), A::P(perm), i(ne));
        let (a_ff, a_hdim, a_hs, a_act, a_y) = (i(ff), i(hdim), A::P(hs), A::I(act), A::P(y));
        match w {
            MmhWeights::F16(wg, wu, wd) => {
                let (Some(tg), Some(tu), Some(td)) =
                    (self.tma_f16(wg, hdim, ne * ff, 128), self.tma_f16(wu, hdim, ne * ff, 128), self.tma_f16(wd, ff, ne * hdim, 256))
                else {
                    return false;
                };
                let smem = MMH_SMEM as u32;
                self.launch("mmh_gu", gx, 384, smem, &[A::T(&tx), A::T(&tg), A::T(&tu), a_cnt, a_off, a_ne, a_ff, a_hdim, a_hs, a_act]);
                self.launch("mmh_dn", dx, 384, smem, &[A::T(&th), A::T(&td), a_cnt, a_off, a_perm, a_ne, a_hdim, a_ff, a_y]);
            }
            MmhWeights::Q8([(wg, rg), (wu, ru), (wd, rd)]) => {
                // The quants (64-byte boxes) and the group headers (16-byte boxes) of each stack.
                let maps = |p: u64, rb: usize, rows: usize, br: u32| (self.tma_u8(p, rb, rows, 64, br), self.tma_u8(p, rb, rows, 16, br));
                let ((Some(gq), Some(gs)), (Some(uq), Some(us)), (Some(dq), Some(ds))) =
                    (maps(wg, rg, ne * ff, 128), maps(wu, ru, ne * ff, 128), maps(wd, rd, ne * hdim, 256))
                else {
                    return false;
                };
                let smem = MMH8_SMEM as u32;
                let gu = [A::T(&tx), A::T(&gq), A::T(&gs), A::T(&uq), A::T(&us), a_cnt, a_off, a_ne, a_ff, a_hdim, a_hs, a_act];
                self.launch("mmh8_gu", gx, 384, smem, &gu);
                self.launch("mmh8_dn", dx, 384, smem, &[A::T(&th), A::T(&dq), A::T(&ds), a_cnt, a_off, a_perm, a_ne, a_hdim, a_ff, a_y]);
            }
        }
        self.mmh_runs.fetch_add(1, Ordering::Relaxed);
        true
    }

    // (The rows form of Path::SharedFork, shared_rows: the shared chunks alone on the int8 rows
    // kernels on the side stream, TS_CUDA_SHARED_FORK_BLAS=0, the same bits as without the
    // fork; measured 64 sequences 9,249 against 9,628 without the fork on the H200,
    // gpu-next145, and was removed; git history has it, commit 901d341.)
    // (The int8 64-token tile form, Path::SharedQ8 / shared_q8: the side stream's shared FFN
    // from its Q8_0 weights, 18 MB a V2-Lite layer against the f16 copies' 35, in four
    // launches (quantisation, gate and up as one pair launch, the GLU's quantisation, down).
    // Correct (moe_shared_fork: 2e-5 to 4e-4 of the rms from the CPU) but 64 sequences 7,374 /
    // 7,363 against 7,903 / 7,896 (-6.7%) on an H100, gpu-next183, 7,552 with the fork point at
    // the op: the tiles' long blocks hold SM places the routed experts' launch needs, where
    // cuBLAS's few short ones finish within the routing's idle window. Removed; git history has
    // it, commit 7f5155a.)

    /// [`CudaBackend::shared_blas`]'s scratch (`Xh`, `Gu`, `Hs`, `Ys`) for `n` rows of `hdim`
    /// and `sf` shared rows, grown where needed. A fork asks first: a slot that grows is zeroed
    /// on the main stream, which must not happen after the side stream has started on it.
    pub(super) fn shared_blas_scratch(&self, n: usize, hdim: usize, sf: usize) -> Option<(u64, u64, u64, u64)> {
        let z = Self::shared_blas_sizes(n, hdim, sf).map(|(s, b)| self.scratch(s, b));
        Some((z[0]?, z[1]?, z[2]?, z[3]?))
    }

    /// [`CudaBackend::shared_blas_scratch`]'s slots and their bytes.
    pub(super) fn shared_blas_sizes(n: usize, hdim: usize, sf: usize) -> [(S, usize); 4] {
        [(S::Xh, 2 * n * hdim), (S::Gu, 8 * n * sf), (S::Hs, 2 * n * sf), (S::Ys, 4 * n * hdim)]
    }

    /// The shared FFN of a prompt-size MoE on cuBLAS, from the row-major f16 copies `(gate, up,
    /// down, sf)` of its `sf` rows: x to f16, gate and up (one batched call where up's copy lies
    /// after gate's), the GLU (`f16_rows`), down; returns its f32 output rows (n x hdim, for
    /// `moe_combine` to add), None after a failure. No copy, no count from the device: the
    /// shapes are known on the host, so this needs no synchronisation. Why: on the H200 one
    /// 512 x 2048 x 5632 GEMM runs at ~700 TFLOP/s where the grouped 64-token tiles reach ~130
    /// (bound by their weight traffic from L2); busy routed experts on cuBLAS were measured too
    /// (gpu-next46/47: their counts must come to the host, and with one sync a layer the eager
    /// prompt's launches fall behind the GPU: pp512 21,529 against 21,652, dropped).
    ///
    /// Inside a side section ([`Path::SharedFork`]), all of it runs on the side stream:
    /// scratch `Xh`, `Gu`, `Hs` and `Ys` are then the side's until the join, which the
    /// caller's other launches before it must not touch.
    pub(super) fn shared_blas(&self, x: &CudaBuf, xr: Rows, (cg, cu, cd, sf): (u64, u64, u64, usize), act: i32) -> Option<u64> {
        let (n, hdim) = (xr.n, xr.width);
        let (xh, gu, hs, ys) = self.shared_blas_scratch(n, hdim, sf)?;
        if !self.bind_ctx() {
            return None;
        }
        self.f16_rows(x.0.ptr, 0, (xr.off, xr.stride), n, hdim, 0, xh);
        let up_rows = 4 * (n * sf) as u64;
        if cu > cg {
            self.gemm_h16((cg, hdim, ((cu - cg) / 2) as i64), (xh, hdim, 0), (gu, sf, (n * sf) as i64), (sf, n, hdim), 2);
        } else {
            self.gemm_h16((cg, hdim, 0), (xh, hdim, 0), (gu, sf, 0), (sf, n, hdim), 1);
            self.gemm_h16((cu, hdim, 0), (xh, hdim, 0), (gu + up_rows, sf, 0), (sf, n, hdim), 1);
        }
        self.f16_rows(gu, gu + up_rows, (0, sf), n, sf, act, hs);
        self.gemm_h16((cd, sf, 0), (hs, sf, 0), (ys, hdim, 0), (hdim, n, sf), 1);
        Some(ys)
    }

    /// out rows = the router-weighted sum of each token's `k` routed rows of `y` (slots with
    /// `sel_e < 0` left out) plus its `ks - k` shared rows unweighted (`moe_combine`; a
    /// four-columns-a-thread variant measured +0.3% on prompts and ±0 at 64 sequences, dropped).
    /// `add` = (rows, rows a token) (pointer 0: none): `n` x that many rows of `hdim` f32 added
    /// last, in order (the shared FFN's: one from [`CudaBackend::shared_blas`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_combine(
        &self,
        y: u64,
        (k, ks): (usize, usize),
        hdim: usize,
        n: usize,
        (sel_e, sel_w): (u64, u64),
        out: &CudaBuf,
        o: Rows,
        (add, add_n): (u64, usize),
    ) {
        let args =
            [A::P(y), i(k), i(ks), l(hdim), l(n), A::P(sel_e), A::P(sel_w), A::P(out.0.ptr), l(o.off), l(o.stride), A::P(add), i(add_n)];
        // (on the main stream: after the shared FFN's join, never inside a side section)
        self.launch_on(&self.stream, "moe_combine", Self::grid1(n * hdim), 256, 0, &args);
    }

    /// [`Backend::moe_shared`] for f16/bf16 experts (checked by the caller), after the routing:
    /// the gate/up products of every slot with the GLU and the router weight (`moe_gateup_sh_<t>`), then
    /// the down products summed over the slots (`moe_down_sh_<t>`). Activations stay f32.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_shared_h16(
        &self,
        x: &CudaBuf,
        xr: Rows,
        p: &MoeParams,
        experts: &Experts<'_, CudaWeight>,
        shared: &Experts<'_, CudaWeight>,
        (n, ks, nsh): (usize, usize, usize),
        (sel_e, sel_w, g): (u64, u64, u64),
        out: &CudaBuf,
        o: Rows,
    ) {
        let (hdim, ff, k) = (xr.width, experts.gate.ne(1), p.k);
        let tn = if experts.gate.dtype == GgmlType::F16 { "f16" } else { "bf16" };
        let act = match p.glu {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        self.launch(
            KName::of(format_args!("moe_gateup_sh_{tn}")).as_str(),
            (ff.div_ceil(8) as u32, (n * ks) as u32, 1),
            256,
            0,
            &moe_gateup_args::<6, 18>(
                experts,
                shared,
                (ff, hdim, k, nsh),
                (sel_e, sel_w),
                [A::P(x.0.ptr), l(xr.off), l(xr.stride), A::I(act), A::P(g), l(ff)],
            ),
        );
        // Staging the activations in shared memory with every weight piece of a lane in flight
        // (moe_down_sh_<t>_s) measured slower on the H200: bf16 tg128 492.4 against 515.5
        // (docs/PERF.md, session 26); dropped.
        let (name, rows) = if self.down_w4.1 {
            (KName::of(format_args!("moe_down_sh_{tn}_w4")), 2)
        } else {
            (KName::of(format_args!("moe_down_sh_{tn}")), 8)
        };
        self.launch(
            name.as_str(),
            (hdim.div_ceil(rows) as u32, n as u32, 1),
            256,
            0,
            &moe_down_args(experts.down, shared.down, (hdim, ff, k, nsh), sel_e, (g, ff), out, o),
        );
    }

    /// The router: expert ids and weights of every (token, slot) pair into `sel_e`/`sel_w`:
    /// `moe_route_warp` (a warp per token; plain top-k) or `moe_route` (a thread per token; expert
    /// groups too). Both take the same leading arguments; the group counts only go to the latter.
    pub(super) fn route(&self, logits: &CudaBuf, lr: Rows, p: &MoeParams, warp_route: bool, sel_e: u64, sel_w: u64) {
        let n = lr.n;
        let mut args = [A::I(0); 13];
        args[..9].copy_from_slice(&Self::route_lead(logits, lr, p));
        if warp_route {
            args[9..11].copy_from_slice(&[A::P(sel_e), A::P(sel_w)]);
            self.launch("moe_route_warp", (n.div_ceil(4) as u32, 1, 1), 128, 0, &args[..11]);
        } else {
            args[9..13].copy_from_slice(&[i(p.n_group), i(p.topk_group), A::P(sel_e), A::P(sel_w)]);
            self.launch("moe_route", (n.div_ceil(128) as u32, 1, 1), 128, 0, &args);
        }
    }

    /// The routing kernels' leading arguments (`moe_route*`, `route_warp_body`): the logits rows,
    /// tokens, experts, k, gating (1 = sigmoid), whether the top k are renormalised, the scale.
    pub(super) fn route_lead(logits: &CudaBuf, lr: Rows, p: &MoeParams) -> [A; 9] {
        let gating = A::I(matches!(p.gating, Gating::Sigmoid) as i32);
        [A::P(logits.0.ptr), l(lr.off), l(lr.stride), i(lr.n), i(p.n_experts), i(p.k), gating, A::I(p.norm_topk as i32), A::F(p.scale)]
    }

    /// `moe_shared` into `out` (radd false), or added into the residual rows `out` (radd: only
    /// on the one-token Q8_0 path of three launches, whose down kernel adds; else it declines
    /// with nothing taken or enqueued).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_shared_to(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        shared: Experts<'_, CudaWeight>,
        p: &MoeParams,
        out: &CudaBuf,
        o: Rows,
        radd: bool,
    ) -> bool {
        let n = xr.n;
        let (hdim, ff, ne, k) = (experts.gate.ne(0), experts.gate.ne(1), p.n_experts, p.k);
        let sf = shared.gate.ne(1);
        let all = [experts.gate, experts.up, experts.down, shared.gate, shared.up, shared.down];
        let ty = experts.gate.dtype;
        let same = all.iter().all(|w| w.dtype == ty);
        // Q8_0 experts (activations quantised once, dp4a), or f16/bf16 experts with 16-byte
        // aligned rows and an input view the float4 loads can read.
        let q8 = same && ty == GgmlType::Q8_0 && ff % 128 == 0 && self.smem_max > 0;
        let h16 = same
            && matches!(ty, GgmlType::F16 | GgmlType::BF16)
            && hdim % 8 == 0
            && ff % 8 == 0
            && all.iter().all(|w| w.mem.ptr % 16 == 0 && w.row_bytes % 16 == 0 && w.mat_bytes() % 16 == 0)
            && xr.off.is_multiple_of(4)
            && xr.stride.is_multiple_of(4);
        let shapes = xr.width == hdim
            && lr.n == n
            && o.n == n
            && lr.width == ne
            && o.width == hdim
            && (experts.gate.ne(2), experts.up.ne(0), experts.up.ne(1), experts.up.ne(2)) == (ne, hdim, ff, ne)
            && (experts.down.ne(0), experts.down.ne(1), experts.down.ne(2)) == (ff, hdim, ne)
            && [shared.gate, shared.up, shared.down].iter().all(|w| w.shape.len() <= 3 && w.ne(2) == 1)
            && (shared.gate.ne(0), shared.up.ne(0), shared.up.ne(1)) == (hdim, hdim, sf)
            && (shared.down.ne(0), shared.down.ne(1)) == (sf, hdim)
            && ff > 0
            && sf.is_multiple_of(ff)
            && (1..=32).contains(&(sf / ff))
            && (1..=32).contains(&k)
            && k <= ne;
        // Into the residual: the path of three launches only (one token, Q8_0, not the one-launch
        // MoE), decided before anything is taken or enqueued.
        if radd && !(n == 1 && self.fused && q8 && shapes && warp_route(p) && self.moe_one.load(Ordering::Relaxed) == 0) {
            return false;
        }
        // A routing made ahead for this op (pre_route) serves it or none: taken on every path
        // (but radd's decline above).
        let routed = self.routed.lock().unwrap_or_else(|e| e.into_inner()).take();
        // Batches above the decode size (the server's steps, prompts): the shared FFN's blocks of
        // ff rows ride in the grouped tensor-core expert products as experts E.. (moe_mmq): one
        // chain of launches instead of the routed one plus the dense FFN's (TS_CUDA_MOE_SH=0:
        // the caller's two chains, to compare).
        let batched = !radd
            && self.fused
            && self.moe_sh
            && n > GEMV_MAX_TOKENS
            && q8
            && self.tc
            && !self.exact
            && MMQ_SMEM <= self.smem_max
            && shapes
            && ne + sf / ff <= 512
            && (1..=64).contains(&p.n_group)
            && ne % p.n_group == 0;
        if batched {
            x.check(xr);
            logits.check(lr);
            out.check(o);
            let (k, ks) = (p.k, p.k + sf / ff);
            let pairs = n * ks;
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(sel_e) = self.scratch(S::SelE, 4 * n * k) else { return true };
            let Some(sel_w) = self.scratch(S::SelW, 4 * n * k) else { return true };
            let Some(g) = self.scratch(S::G, 4 * pairs * ff) else { return true };
            let Some(u) = self.scratch(S::U, 4 * pairs * ff) else { return true };
            let Some(y) = self.scratch(S::Y, 4 * pairs * hdim) else { return true };
            self.moe_mmq(x, xr, logits, lr, &experts, Some(&shared), p, warp_route(p), (sel_e, sel_w, g, u, y), out, o);
            return true;
        }
        let ok = self.fused && (1..=GEMV_MAX_TOKENS).contains(&n) && (q8 || h16) && shapes && warp_route(p);
        if !ok {
            return false;
        }
        x.check(xr);
        logits.check(lr);
        out.check(o);
        let nsh = sf / ff;
        let ks = k + nsh;
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        // Routed already, in the launch that made the logits (pre_route)?
        let pre = n == 1 && routed.is_some_and(|r| r.serves((logits.0.ptr, lr.off), (x.0.ptr, xr.off), p));
        if pre {
            self.pre_routed.fetch_add(1, Ordering::Relaxed);
        }
        // A scratch that cannot be had (an allocation during a capture, or a failed one) has been
        // recorded: the op counts as enqueued (the step is redone or the error reported).
        let (se, sw) = if pre { (S::PreE, S::PreW) } else { (S::SelE, S::SelW) };
        let Some(sel_e) = self.scratch(se, 4 * n * k) else { return true };
        let Some(sel_w) = self.scratch(sw, 4 * n * k) else { return true };
        let Some(g) = self.scratch(S::G, 4 * n * ks * ff) else { return true };
        if h16 {
            if !pre {
                self.route(logits, lr, p, true, sel_e, sel_w);
            }
            self.moe_shared_h16(x, xr, p, &experts, &shared, (n, ks, nsh), (sel_e, sel_w, g), out, o);
            return true;
        }
        // Activations quantised once (the input per token, the GLU output per slot, times its
        // router weight), in the weights' group layout.
        let (xrow, hrow) = (hdim.div_ceil(128) * 144, ff.div_ceil(128) * 144);
        let Some(xq) = self.scratch(if pre { S::PreXq } else { S::Xq }, n * xrow) else { return true };
        let Some(hq) = self.scratch(S::Hq, n * ks * hrow) else { return true };
        let dw = experts.down;
        let act = match p.glu {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        // One token: gate/up and down in one launch whose down warps start on their slots as
        // those finish (moe_sh_q8_one; two warps a down row, as moe_down_sh_q8), with the routing
        // and the input's quantisation in its block 0 (TS_CUDA_MOE_ONE_ROUTE=0: moe_route_quant).
        let cap = self.moe_one.load(Ordering::Relaxed);
        let one = n == 1 && cap > 0 && !pre && !self.down_w4.0 && ks + 2 <= MOE_SH_MAX_SLOTS;
        let inline_route = one && self.moe_one_route;
        // moe_gateup_sh_q8q's arguments, which its one-token variants extend.
        let gu: [A; 17] =
            moe_gateup_args(&experts, &shared, (ff, hdim, k, nsh), (sel_e, sel_w), [A::P(xq), l(xrow), A::I(act), A::P(hq), l(hrow)]);
        if !inline_route && !pre {
            // The routing and the input's quantisation in one launch (moe_route_quant).
            let ngroups = hdim.div_ceil(128);
            let args: [A; 17] = cat(
                Self::route_lead(logits, lr, p),
                [A::P(sel_e), A::P(sel_w), A::P(x.0.ptr), l(xr.off), l(xr.stride), i(hdim), A::P(xq), l(xrow)],
            );
            self.launch("moe_route_quant", ((n.div_ceil(8) + (n * ngroups).div_ceil(8)) as u32, 1, 1), 256, 0, &args);
        }
        if one {
            let Some(cnt) = self.scratch(S::Sync, 4 * (ks + 2)) else { return true };
            let items = ks * ff / 32 + hdim.div_ceil(4);
            let gating = A::I(matches!(p.gating, Gating::Sigmoid) as i32);
            let args: [A; 34] = cat(
                gu,
                [
                    A::P(dw.mem.ptr),
                    l(dw.row_bytes),
                    l(dw.mat_bytes()),
                    i(hdim),
                    A::P(shared.down.mem.ptr),
                    l(shared.down.row_bytes),
                    A::P(out.0.ptr),
                    l(o.off),
                    A::P(cnt),
                    A::P(if inline_route { logits.0.ptr } else { 0 }),
                    l(lr.off),
                    i(p.n_experts),
                    gating,
                    A::I(p.norm_topk as i32),
                    A::F(p.scale),
                    A::P(x.0.ptr),
                    l(xr.off),
                ],
            );
            self.launch("moe_sh_q8_one", (items.min(cap) as u32, 1, 1), 256, 0, &args);
            return true;
        }
        // (The down product by split K inside the gate/up launch, no down launch: each block
        // multiplied its 32 quantised GLU values into every output row and added the partials by
        // integer reds into a fixed-point row, the same bits run to run; Path::MoeSplitK,
        // moe_sh_q8_sk. Correct, but slower on an H100 in the seventy-second session: tg128
        // 505.9 / 507.1 against 629.6 / 629.5, the launch 46.4 us a layer against 20.6 + 11.0
        // for the two; 720,896 64-bit reds a layer on 16 KB, and down rows read one a lane.
        // Removed; commit b8e1a00 has it, docs/PERF.md the figures.)
        // Gate/up with the GLU output quantised in the kernel (32 rows per block).
        // (Each warp's rows 2 and 3 staged in shared memory by cp.async with row 0's loads,
        // three blocks an SM: tg128 650.9 against 709.1 on the H200, docs/PERF.md, session 30;
        // dropped. Each unit's 8 warps as a cluster of 8 one-warp blocks, to even out the 2-3
        // blocks an SM, measured slower on an H100 in the sixty-third session: tg128 562.8 /
        // 564.6 against 619.8 / 620.2; the cluster placement left some SMs without a block and
        // the launch took 34.6 us against 26.5; commit 483bb0c has it.)
        if n == 1 && k <= MOE_SH_MAX_SLOTS && self.path_on(Path::GuDyn) {
            // The routed units claimed from a counter (word 2 of NormSync, zero between launches).
            let Some(sync) = self.scratch(S::NormSync, 16) else { return true };
            let blocks = (self.gu_dyn_per_sm * self.sm_count).min(ks * ff / 32);
            self.took(Path::GuDyn);
            self.launch("moe_gateup_sh_q8d", (blocks as u32, 1, 1), 256, 0, &cat::<17, 1, 18>(gu, [A::P(sync + 8)]));
        } else if let (true, Some(tg), Some(tu)) =
            (n == 1 && hdim.is_multiple_of(128) && self.path_on(Path::GuTile), &experts.gate.tiled, &experts.up.tiled)
        {
            // The routed slots' rows from the tiled copies (no pad bytes).
            self.took(Path::GuTile);
            let tail = [A::P(tg.ptr), A::P(tu.ptr), l(experts.gate.tiled_mat_bytes())];
            self.launch("moe_gateup_sh_q8t", (ff.div_ceil(32) as u32, ks as u32, 1), 256, 0, &cat::<17, 3, 20>(gu, tail));
        } else {
            self.launch("moe_gateup_sh_q8q", (ff.div_ceil(32) as u32, (n * ks) as u32, 1), 256, 0, &gu);
        }
        // Two rounds of weights before the wait with the activations staged in shared memory
        // (moe_down_sh_q8s) measured slower on the H200: tg128 671.9 against 709.5 (docs/PERF.md,
        // session 26); dropped. All of a block's weights copied into shared memory before the
        // wait (moe_down_sh_q8c, ~51 KB a block; the same bits) measured slower on an H100 in the
        // sixty-second session: tg128 559.1 / 560.8 against 631.1 / 629.4, 589.4 without the
        // largest carveout asked; the down blocks, placed at the gate/up's start, slowed it from
        // 20.6 to 28.7-30.1 µs while the down itself took 8.9-11.2 against 11.0. Removed;
        // commit 1c95b8b has it (and the bf16 twin, −5.3%).
        // (The down product by (row tile, slot), each block one run of 8 or 16 rows of one slot's
        // matrix and each tile's last block adding the slots' partial rows, measured slower on an
        // H100 in the seventy-third session: tg128 591.9 (8 rows) and 622.3 (16) against 631.3,
        // the launch 14.4 µs a layer against 11.0. A probe (tools/gpu/downprobe.cu, launches
        // back to back) read the down weights by rows at 2.16 TB/s, by slot at 2.24 and as a
        // plain stream at 2.40: the read pattern costs ~10%; a 26 MB launch alone stays far
        // from the card's 3.35. Path::DownSlot, moe_down_slot_q8; commit 6415321 has it.)
        self.launch(
            if self.down_w4.0 { "moe_down_sh_q8_w4" } else { "moe_down_sh_q8" },
            (hdim.div_ceil(if self.down_w4.0 { 2 } else { 4 }) as u32, n as u32, 1),
            256,
            0,
            &cat::<15, 1, 16>(moe_down_args(dw, shared.down, (hdim, ff, k, nsh), sel_e, (hq, hrow), out, o), [A::I(radd as i32)]),
        );
        true
    }
}
