//! [`Backend`] for [`CudaBackend`]: each op picks its kernels (the fast decode paths, the fused
//! ops, the tensor-core paths) and enqueues them; the work itself is in the sibling modules.

use super::*;

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Cache = CudaCache;
    type Weight = CudaWeight;
    type Batch = CudaBatch;
    type Rope = CudaRope;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize) -> Result<CudaBuf> {
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("buffer of {len} floats overflows") })?;
        Ok(CudaBuf(Arc::new(self.alloc_mem(bytes, &format!("buffer of {len} floats"))?)))
    }

    fn alloc_cache(&self, rows: usize, width: usize) -> Result<CudaCache> {
        let bytes = rows
            .checked_mul(width)
            .and_then(|v| v.checked_mul(4))
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("cache of {rows} x {width} overflows") })?;
        Ok(CudaCache { mem: self.alloc_mem(bytes, &format!("KV cache of {rows} rows x {width}"))?, rows, width, half: false })
    }

    fn cache_copy(&self, cache: &CudaCache, width: usize, src: usize, dst: usize, n: usize) -> Result<()> {
        let vb = if cache.half { 2 } else { 4 };
        let end = |r: usize| r.checked_add(n).is_some_and(|e| e <= cache.rows);
        if width != cache.width || !(end(src) && end(dst)) || (src < dst + n && dst < src + n) {
            return Err(BackendError::Unsupported(format!(
                "cache copy of {n} rows from row {src} to row {dst} (width {width}) in a cache of {} x {}",
                cache.rows, cache.width
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let row = (width * vb) as u64;
        // (on the stream, in order with the steps before and after it; never inside a recording:
        // the engine copies between steps)
        unsafe {
            drv::memcpy_dtod_async(
                cache.mem.ptr + dst as u64 * row,
                cache.mem.ptr + src as u64 * row,
                n * row as usize,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| dev_err("device-to-device cache copy", e))
    }

    fn cache_value_bytes(&self, cache: &CudaCache) -> usize {
        if cache.half {
            2
        } else {
            4
        }
    }

    fn alloc_latent_cache(&self, rows: usize, width: usize, kv_lora: usize, heads: usize) -> Result<CudaCache> {
        // f16 where every MLA kernel that can meet this cache has an f16 twin: V2's shapes
        // (576 = 512 + 64) on the tensor cores (mla_prefill_h, mla_split_tc_h; the 16-head SIMT
        // split mla_split_18_16_h), written by norm_rope_cache_h / mla_rope_absorb_1_h /
        // cache_write_h.
        let half = self.mla_f16
            && self.tc
            && (width, kv_lora) == (576, 512)
            && heads > 0
            && heads.is_multiple_of(16)
            && ms_smem_h(self.ms_nb).max(MP_SMEM) <= self.smem_max;
        if !half {
            return self.alloc_cache(rows, width);
        }
        let bytes = rows
            .checked_mul(width)
            .and_then(|v| v.checked_mul(2))
            .ok_or_else(|| BackendError::OutOfMemory { device: self.name.clone(), what: format!("cache of {rows} x {width} overflows") })?;
        Ok(CudaCache { mem: self.alloc_mem(bytes, &format!("MLA cache of {rows} rows x {width} (f16)"))?, rows, width, half: true })
    }

    fn load_remaining(&self, src_bytes: u64) {
        self.load_left.store(src_bytes, Ordering::Relaxed);
    }

    fn upload_weight(&self, t: &TensorData<'_>, usage: WeightUse) -> Result<CudaWeight> {
        let err = |what: String| BackendError::Weight { name: t.name.to_string(), what };
        if !t.dtype.is_supported_weight() || tname(t.dtype).is_none() {
            return Err(err(format!("type {} is not supported", t.dtype.name())));
        }
        let ne0 = t.shape.first().copied().unwrap_or(1);
        let file_row = t.dtype.row_bytes(ne0).ok_or_else(|| err(format!("row of {ne0} is not whole {} blocks", t.dtype.name())))?;
        let rows: usize = t.shape.iter().skip(1).product();
        if file_row.checked_mul(rows) != Some(t.data.len()) {
            return Err(err(format!("{} bytes of data for shape {:?} of {}", t.data.len(), t.shape, t.dtype.name())));
        }
        if usage == WeightUse::Vector {
            let mut v = vec![0f32; t.numel()];
            quant::dequantize(t.dtype, t.data, &mut v).map_err(|e| err(e.to_string()))?;
            let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
            let mem = self.alloc_mem(bytes.len(), &format!("tensor '{}'", t.name))?;
            self.upload_bytes(&mem, 0, &bytes)?;
            return Ok(CudaWeight {
                dtype: GgmlType::F32,
                shape: t.shape.to_vec(),
                mem,
                row_bytes: ne0 * 4,
                tiled: None,
                half: None,
                half_rm: false,
            });
        }
        let data = repack(t.dtype, t.data, ne0);
        let row_bytes = dev_row_bytes(t.dtype, ne0);
        let mem = self.alloc_mem(data.len(), &format!("tensor '{}'", t.name))?;
        self.upload_bytes(&mem, 0, &data)?;
        let stack = t.dtype == GgmlType::Q8_0 && t.shape.len() == 3 && t.shape[2] > 1;
        let tile = stack
            && match self.moe_tiled.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(tile16_mat_bytes(row_bytes, t.shape[1]) * t.shape[2]),
            };
        let tiled = if tile {
            let (rows, rows16, mats) = (t.shape[1], t.shape[1].next_multiple_of(16), t.shape[2]);
            // Out of memory for the copy: an error only when asked for (TS_CUDA_MOE_TILED=1);
            // by default the stack stays row-major (the same bits, only slower).
            match self.alloc_mem(mats * tile16_mat_bytes(row_bytes, rows), &format!("tensor '{}' (16-row tiles)", t.name)) {
                Ok(tl) => {
                    let ng = row_bytes / 144;
                    let total = mats * rows16 / 16 * ng * (TILE_GROUP / 16);
                    let blocks = total.div_ceil(256).min(65_536) as u32;
                    self.launch("tile16_q8", (blocks, 1, 1), 256, 0, &[A::P(mem.ptr), A::P(tl.ptr), l(rows), l(rows16), l(ng), l(total)]);
                    Some(tl)
                }
                Err(BackendError::OutOfMemory { .. }) if self.moe_tiled.load(Ordering::Relaxed) == 2 => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        // The f16 copy for prompt MoEs: Q8_0 expert matrices (and shared FFNs) of whole groups.
        let half_bytes = 2 * ne0 * rows;
        let half = usage == WeightUse::Expert
            && self.tc
            && self.mmf.is_some()
            && t.dtype == GgmlType::Q8_0
            && t.shape.len() >= 2
            && ne0 % 128 == 0
            && t.shape[1].is_multiple_of(64)
            && match self.f16_copy.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(half_bytes),
            };
        // Dense matrices for cuBLAS (dense_blas): a row-major copy.
        let dense = usage == WeightUse::Matmul
            && self.tc
            && self.dense_blas.load(Ordering::Relaxed)
            && t.dtype == GgmlType::Q8_0
            && t.shape.len() >= 2
            && ne0 % 128 == 0
            && match self.f16_copy.load(Ordering::Relaxed) {
                0 => false,
                1 => true,
                _ => self.tile_fits(half_bytes),
            };
        let half = half || dense;
        // With the shared FFN on cuBLAS (moe_blas): a row-major copy of the shared FFN's matrices
        // (2-D); the routed experts' stacks get one only for mmh_* (otherwise they run from
        // Q8_0 on mmfq8, which needs no copy).
        let half_rm = dense || (self.moe_blas.load(Ordering::Relaxed) && (self.mmfq8.is_some() || self.mmh_copies()));
        let unused_stack = !dense && half_rm && t.shape.len() > 2 && !self.mmh_copies();
        let half = if half && !unused_stack {
            match self.alloc_mem(half_bytes, &format!("tensor '{}' (f16 copy)", t.name)) {
                Ok(h) => {
                    let total = half_bytes / 16;
                    let blocks = total.div_ceil(256).min(65_536) as u32;
                    let args = [A::P(mem.ptr), A::P(h.ptr), l(total), i(row_bytes / 144), i(!half_rm as usize)];
                    self.launch("q8_to_f16", (blocks, 1, 1), 256, 0, &args);
                    Some(h)
                }
                Err(BackendError::OutOfMemory { .. }) if self.f16_copy.load(Ordering::Relaxed) == 2 => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        Ok(CudaWeight { dtype: t.dtype, shape: t.shape.to_vec(), mem, row_bytes, tiled, half, half_rm })
    }

    fn upload_rope(&self, spec: &RopeSpec) -> Result<CudaRope> {
        if !spec.dim.is_multiple_of(2) || spec.freqs.len() != spec.dim / 2 {
            return Err(BackendError::Unsupported(format!("rope: {} frequencies for {} dimensions", spec.freqs.len(), spec.dim)));
        }
        let bytes: Vec<u8> = spec.freqs.iter().flat_map(|f| f.to_le_bytes()).collect();
        let freqs = self.alloc_mem(bytes.len(), "rope table")?;
        self.upload_bytes(&freqs, 0, &bytes)?;
        Ok(CudaRope { freqs, dim: spec.dim, mode: spec.mode, mscale: spec.mscale })
    }

    fn alloc_batch(&self, max_tokens: usize) -> Result<CudaBatch> {
        let mt = max_tokens.max(1);
        let mem = self.alloc_mem(16 * mt, "batch")?;
        let pinned = HostPinned::new(&self.ctx, 16 * mt).zip(HostPinned::new(&self.ctx, 16 * mt)).map(|(a, b)| [a, b]);
        Ok(CudaBatch {
            mem,
            max_tokens: mt,
            tokens: Vec::with_capacity(mt),
            n_outputs: 0,
            slot_len: 0,
            host: vec![0; 16 * mt],
            pinned,
            sent: [None, None],
            flip: 0,
        })
    }

    fn upload_batch(&self, meta: &BatchMeta, batch: &mut CudaBatch) -> Result<()> {
        let n = meta.len();
        if n > batch.max_tokens {
            return Err(BackendError::Unsupported(format!("batch of {n} tokens exceeds the {} it was sized for", batch.max_tokens)));
        }
        if meta.outputs.len() > batch.max_tokens {
            return Err(BackendError::Unsupported(format!(
                "{} output rows exceed the {} the batch was sized for",
                meta.outputs.len(),
                batch.max_tokens
            )));
        }
        let mt = batch.max_tokens;
        let mut put = |field: usize, i: usize, v: u32| {
            let at = 4 * (field * mt + i);
            batch.host[at..at + 4].copy_from_slice(&v.to_le_bytes());
        };
        // Tokens that are a previous step's pick (TOKEN_FROM_ARGMAX + row) are copied on the
        // device from the last arg-max's ids after the upload (FedRuns); their rows checked here.
        let last_rows = self.argq.lock().unwrap_or_else(|e| e.into_inner()).rows;
        for (t, tm) in meta.tokens.iter().enumerate() {
            let fed = tm.token >= TOKEN_FROM_ARGMAX;
            put(0, t, if fed { 0 } else { tm.token });
            put(1, t, tm.pos);
            put(2, t, tm.slot);
            let r = tm.token.wrapping_sub(TOKEN_FROM_ARGMAX) as usize;
            if fed && r >= last_rows {
                return Err(BackendError::Unsupported(format!("token {t} takes row {r} of the last arg-max, which had {last_rows} rows")));
            }
        }
        for (i, &o) in meta.outputs.iter().enumerate() {
            put(3, i, o);
        }
        if self.batch_fill.load(Ordering::Relaxed) && n == 1 && meta.outputs.len() <= 1 {
            // One token: written by a kernel from its arguments (batch_fill_1), its pick taken on
            // the device where it is one.
            let tm = meta.tokens[0];
            let (ids, row) = match FedRuns::of(&meta.tokens).next() {
                Some((_, r, _)) => {
                    let ids = self.scratch_ptr(S::Ids).ok_or_else(|| BackendError::Unsupported("no arg-max to take tokens from".into()))?;
                    (ids, r)
                }
                None => (0, 0),
            };
            let args = [
                A::P(batch.mem.ptr),
                l(mt),
                A::I(tm.token as i32),
                A::I(tm.pos as i32),
                A::I(tm.slot as i32),
                i(meta.outputs.len()),
                A::I(meta.outputs.first().map_or(0, |&o| o as i32)),
                A::P(ids),
                i(row),
            ];
            self.launch("batch_fill_1", (1, 1, 1), 32, 0, &args);
            self.take_error()?;
            batch.set_meta(meta);
            return Ok(());
        }
        match batch.pinned.as_mut() {
            Some(pin) => {
                // This copy's last upload must have been done before it is rewritten.
                let k = batch.flip;
                if let Some(ev) = &batch.sent[k] {
                    ev.synchronize().map_err(|e| dev_err("batch upload event", e))?;
                }
                let stage = pin[k].bytes();
                stage.copy_from_slice(&batch.host);
                self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
                unsafe { drv::memcpy_htod_async(batch.mem.ptr, &*stage, self.stream.cu_stream()) }
                    .map_err(|e| dev_err("host-to-device copy", e))?;
                match &batch.sent[k] {
                    Some(ev) => ev.record(&self.stream).map_err(|e| dev_err("batch upload event", e))?,
                    None => batch.sent[k] = Some(self.stream.record_event(None).map_err(|e| dev_err("batch upload event", e))?),
                }
                batch.flip ^= 1;
            }
            None => self.upload_bytes(&batch.mem, 0, &batch.host)?,
        }
        for (t, r, c) in FedRuns::of(&meta.tokens) {
            let ids = self.scratch_ptr(S::Ids).ok_or_else(|| BackendError::Unsupported("no arg-max to take tokens from".into()))?;
            unsafe { drv::memcpy_dtod_async(batch.tok_ptr() + 4 * t as u64, ids + 4 * r as u64, 4 * c, self.stream.cu_stream()) }
                .map_err(|e| dev_err("device-to-device copy", e))?;
        }
        batch.set_meta(meta);
        Ok(())
    }

    fn write(&self, dst: &CudaBuf, off: usize, src: &[f32]) -> Result<()> {
        if off + src.len() > dst.len() {
            return Err(BackendError::Unsupported(format!("write of {} floats at {off} outside a buffer of {}", src.len(), dst.len())));
        }
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, src.len() * 4) };
        self.upload_bytes(&dst.0, off * 4, bytes)
    }

    fn read(&self, buf: &CudaBuf, rows: Rows, dst: &mut [f32]) -> Result<()> {
        buf.check(rows);
        assert_eq!(dst.len(), rows.n * rows.width);
        self.synchronize()?;
        let contiguous = rows.n <= 1 || rows.stride == rows.width;
        if contiguous && 4 * dst.len() >= PINNED_MIN_BYTES {
            let mut pin = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
            if pin.as_ref().is_none_or(|p| p.len < dst.len()) {
                *pin = None;
                self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
                let ptr = unsafe { drv::malloc_host(4 * dst.len(), 0) }.map_err(|e| dev_err("pinned host allocation", e))?;
                *pin = Some(Pinned { ptr: ptr as *mut f32, len: dst.len() });
            }
            if let Some(p) = pin.as_ref() {
                // Safety: `p` holds at least dst.len() f32s and nothing else uses it (mutex).
                let stage = unsafe { std::slice::from_raw_parts_mut(p.ptr, dst.len()) };
                unsafe { drv::memcpy_dtoh_async(stage, buf.0.ptr + 4 * rows.off as u64, self.stream.cu_stream()) }
                    .map_err(|e| dev_err("device-to-host copy", e))?;
                self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))?;
                dst.copy_from_slice(stage);
                return Ok(());
            }
        }
        let r = if contiguous {
            unsafe { drv::memcpy_dtoh_async(dst, buf.0.ptr + 4 * rows.off as u64, self.stream.cu_stream()) }
        } else {
            let mut r = Ok(());
            for (j, chunk) in dst.chunks_mut(rows.width.max(1)).enumerate() {
                r = unsafe { drv::memcpy_dtoh_async(chunk, buf.0.ptr + 4 * (rows.off + j * rows.stride) as u64, self.stream.cu_stream()) };
                if r.is_err() {
                    break;
                }
            }
            r
        };
        r.map_err(|e| dev_err("device-to-host copy", e))?;
        self.stream.synchronize().map_err(|e| dev_err("cuda stream", e))
    }

    fn argmax_rows(&self, x: &CudaBuf, xr: Rows, out: &mut [u32]) -> Result<()> {
        x.check(xr);
        assert_eq!(out.len(), xr.n);
        if xr.n == 0 {
            return Ok(());
        }
        if xr.width > i32::MAX as usize {
            return Err(BackendError::Unsupported(format!("arg-max over rows of {} values", xr.width)));
        }
        let Some(ids) = self.enqueue_argmax(x, xr, 0) else { return self.synchronize() };
        self.argq.lock().unwrap_or_else(|e| e.into_inner()).rows = xr.n;
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        unsafe { drv::memcpy_dtoh_async(out, ids, self.stream.cu_stream()) }.map_err(|e| dev_err("device-to-host copy", e))?;
        self.synchronize()
    }

    fn chains_argmax(&self) -> bool {
        true
    }

    fn argmax_rows_queued(&self, x: &CudaBuf, xr: Rows) -> Result<()> {
        x.check(xr);
        if xr.n == 0 || xr.width > i32::MAX as usize {
            return Err(BackendError::Unsupported(format!("queued arg-max over {} rows of {} values", xr.n, xr.width)));
        }
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        if q.pending.len() >= 2 {
            return Err(BackendError::Unsupported("a third queued arg-max before the first was collected".into()));
        }
        let k = q.next;
        // The slot is free (at most one other is pending); grown where too small.
        if q.slots[k].as_ref().is_none_or(|(p, _, _)| p.len < 4 * xr.n) {
            let len = 4 * xr.n.next_power_of_two();
            // Mapped memory: argmax_final writes the ids there itself (with batch_fill; else a copy).
            let mapped = if self.batch_fill.load(Ordering::Relaxed) { HostPinned::mapped(&self.ctx, len) } else { None };
            let (pin, dev) = match mapped {
                Some(m) => m,
                None => (
                    HostPinned::new(&self.ctx, len).ok_or_else(|| BackendError::Device("pinned host allocation for arg-max ids".into()))?,
                    0,
                ),
            };
            let ev = self.ctx.new_event(None).map_err(|e| dev_err("arg-max event", e))?;
            q.slots[k] = Some((pin, dev, ev));
        }
        let Some((pin, dev, ev)) = q.slots[k].as_mut() else { return Err(BackendError::Device("arg-max slot missing".into())) };
        let Some(ids) = self.enqueue_argmax(x, xr, *dev) else { return self.synchronize() };
        if *dev == 0 {
            // Safety: the slot holds at least 4 * n bytes, and nothing reads them before its event.
            let dst = unsafe { std::slice::from_raw_parts_mut(pin.ptr as *mut u32, xr.n) };
            self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
            unsafe { drv::memcpy_dtoh_async(dst, ids, self.stream.cu_stream()) }.map_err(|e| dev_err("device-to-host copy", e))?;
        }
        ev.record(&self.stream).map_err(|e| dev_err("arg-max event", e))?;
        q.rows = xr.n;
        q.pending.push_back((k, xr.n));
        q.next ^= 1;
        Ok(())
    }

    fn argmax_collect(&self, out: &mut [u32]) -> Result<()> {
        let mut q = self.argq.lock().unwrap_or_else(|e| e.into_inner());
        let Some((k, n)) = q.pending.pop_front() else {
            return Err(BackendError::Unsupported("no queued arg-max to collect".into()));
        };
        if out.len() != n {
            return Err(BackendError::Unsupported(format!("the queued arg-max has {n} rows, not {}", out.len())));
        }
        let Some((pin, _, ev)) = q.slots[k].as_ref() else { return Err(BackendError::Device("arg-max slot missing".into())) };
        ev.synchronize().map_err(|e| dev_err("arg-max event", e))?;
        self.take_error()?;
        // Safety: the slot's copy of n ids is done (its event has passed).
        out.copy_from_slice(unsafe { std::slice::from_raw_parts(pin.ptr as *const u32, n) });
        Ok(())
    }

    fn gather_outputs(&self, x: &CudaBuf, xr: Rows, batch: &CudaBatch, out: &CudaBuf, o: Rows) {
        assert_eq!((xr.n, o.n, xr.width), (batch.tokens.len(), batch.n_outputs, o.width));
        x.check(xr);
        out.check(o);
        self.launch(
            "gather_rows",
            (o.n as u32, 1, 1),
            256,
            0,
            &[A::P(x.0.ptr), l(xr.off), l(xr.stride), A::P(batch.out_ptr()), A::P(out.0.ptr), l(o.off), l(o.stride), i(o.width)],
        );
    }

    fn embed(&self, table: &CudaWeight, batch: &CudaBatch, scale: f32, out: &CudaBuf, o: Rows) {
        let dim = table.ne(0);
        assert_eq!(o.width, dim);
        assert_eq!(o.n, batch.tokens.len());
        out.check(o);
        if let Some(tm) = batch.tokens.iter().find(|tm| tm.token as usize >= table.ne(1) && tm.token < TOKEN_FROM_ARGMAX) {
            self.fail(format!("token id {} outside the vocabulary of {}", tm.token, table.ne(1)));
            return;
        }
        let Some(tn) = tname(table.dtype) else { return };
        self.launch(
            KName::of(format_args!("embed_{tn}")).as_str(),
            (o.n as u32, 1, 1),
            128,
            0,
            &[A::P(table.mem.ptr), l(table.row_bytes), A::P(batch.tok_ptr()), A::F(scale), A::P(out.0.ptr), l(o.off), l(o.stride), i(dim)],
        );
    }

    fn rms_norm(&self, x: &CudaBuf, xr: Rows, w: Option<&CudaWeight>, eps: f32, out: &CudaBuf, o: Rows) {
        assert_eq!((xr.n, xr.width), (o.n, o.width));
        x.check(xr);
        out.check(o);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), xr.width, "norm weight length != row width {}", xr.width);
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        let block = xr.width.next_power_of_two().clamp(32, 256) as u32;
        self.launch(
            "rms_norm",
            (xr.n as u32, 1, 1),
            block,
            0,
            &[
                A::P(x.0.ptr),
                l(xr.off),
                l(xr.stride),
                A::P(w.map_or(0, |w| w.mem.ptr)),
                A::I(w.is_some() as i32),
                A::F(eps),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                i(xr.width),
            ],
        );
    }

    fn matmul(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, out: &CudaBuf, o: Rows) {
        assert!(w.ne(2) == 1, "matmul with a 3-D weight {:?}: use matmul_grouped", w.shape);
        self.matmul_groups(x, xr, w, 1, out, o);
    }

    fn matmul_grouped(&self, x: &CudaBuf, xr: Rows, w: &CudaWeight, out: &CudaBuf, o: Rows) {
        self.matmul_groups(x, xr, w, w.ne(2), out, o);
    }

    fn add(&self, a: &CudaBuf, ar: Rows, b: &CudaBuf, br: Rows, out: &CudaBuf, o: Rows) {
        assert!(ar.n == br.n && ar.n == o.n && ar.width == br.width && ar.width == o.width);
        a.check(ar);
        b.check(br);
        out.check(o);
        let total = o.n * o.width;
        self.launch(
            "add_rows",
            Self::grid1(total),
            256,
            0,
            &[
                A::P(a.0.ptr),
                l(ar.off),
                l(ar.stride),
                A::P(b.0.ptr),
                l(br.off),
                l(br.stride),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                l(o.width),
                l(total),
            ],
        );
    }

    fn scale(&self, x: &CudaBuf, xr: Rows, s: f32) {
        x.check(xr);
        let total = xr.n * xr.width;
        self.launch("scale_rows", Self::grid1(total), 256, 0, &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(xr.width), l(total), A::F(s)]);
    }

    fn glu(&self, kind: Glu, gate: &CudaBuf, gr: Rows, up: &CudaBuf, ur: Rows, out: &CudaBuf, o: Rows) {
        assert!(gr.n == ur.n && gr.n == o.n && gr.width == ur.width && gr.width == o.width);
        gate.check(gr);
        up.check(ur);
        out.check(o);
        let total = o.n * o.width;
        let k = match kind {
            Glu::SwiGlu => 0,
            Glu::GeGluTanh => 1,
        };
        self.launch(
            "glu_rows",
            Self::grid1(total),
            256,
            0,
            &[
                A::I(k),
                A::P(gate.0.ptr),
                l(gr.off),
                l(gr.stride),
                A::P(up.0.ptr),
                l(ur.off),
                l(ur.stride),
                A::P(out.0.ptr),
                l(o.off),
                l(o.stride),
                l(o.width),
                l(total),
            ],
        );
    }

    fn softcap(&self, x: &CudaBuf, xr: Rows, cap: f32) {
        x.check(xr);
        let total = xr.n * xr.width;
        self.launch(
            "softcap_rows",
            Self::grid1(total),
            256,
            0,
            &[A::P(x.0.ptr), l(xr.off), l(xr.stride), l(xr.width), l(total), A::F(cap)],
        );
    }

    fn copy(&self, src: &CudaBuf, sr: Rows, dst: &CudaBuf, dr: Rows) {
        assert!(sr.n == dr.n && sr.width == dr.width);
        src.check(sr);
        dst.check(dr);
        let total = sr.n * sr.width;
        self.launch(
            "copy_rows",
            Self::grid1(total),
            256,
            0,
            &[A::P(src.0.ptr), l(sr.off), l(sr.stride), A::P(dst.0.ptr), l(dr.off), l(dr.stride), l(sr.width), l(total)],
        );
    }

    fn rope(&self, x: &CudaBuf, xr: Rows, heads_per_token: usize, batch: &CudaBatch, rope: &CudaRope) {
        assert!(rope.dim <= xr.width && rope.dim.is_multiple_of(2));
        assert_eq!(xr.n, batch.tokens.len() * heads_per_token, "rope: rows != tokens * heads");
        x.check(xr);
        let half = rope.dim / 2;
        let mode = rope_mode(rope);
        self.launch(
            "rope_rows",
            Self::grid1(xr.n * half),
            256,
            0,
            &[
                A::P(x.0.ptr),
                l(xr.off),
                l(xr.stride),
                l(xr.n),
                i(heads_per_token),
                A::P(batch.pos_ptr()),
                A::P(rope.freqs.ptr),
                i(half),
                A::I(mode),
                A::F(rope.mscale),
            ],
        );
    }

    fn cache_write(&self, cache: &CudaCache, src: &CudaBuf, sr: Rows, batch: &CudaBatch) {
        assert_eq!(sr.n, batch.tokens.len());
        assert_eq!(sr.width, cache.width, "cache_write: row width {} != cache width {}", sr.width, cache.width);
        src.check(sr);
        if !self.check_cache_rows(batch, cache.rows, "cache_write") {
            return;
        }
        let total = sr.n * sr.width;
        self.launch(
            cache.kernel("cache_write").as_str(),
            Self::grid1(total),
            256,
            0,
            &[
                A::P(cache.mem.ptr),
                A::P(src.0.ptr),
                l(sr.off),
                l(sr.stride),
                l(sr.width),
                l(sr.n),
                A::P(batch.pos_ptr()),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
            ],
        );
    }

    fn attention(&self, q: &CudaBuf, qr: Rows, k: &CudaCache, v: &CudaCache, batch: &CudaBatch, p: &AttnParams, out: &CudaBuf, o: Rows) {
        assert!(!k.half && !v.half, "attention: K/V caches are f32 (an f16 cache is an MLA latent cache)");
        let (nh, nkv, hd, vd) = (p.n_heads, p.n_kv_heads, p.head_dim, p.v_dim);
        assert_eq!(qr.width, nh * hd);
        assert_eq!(o.width, nh * vd);
        assert_eq!(qr.n, batch.tokens.len());
        assert_eq!(nh % nkv, 0);
        assert_eq!(k.width, nkv * hd, "attention: K cache width");
        assert_eq!(v.width, nkv * vd, "attention: V cache width");
        q.check(qr);
        out.check(o);
        if !self.check_cache_rows(batch, k.rows.min(v.rows), "attention") {
            return;
        }
        self.attention_launch(
            (q, qr.off, qr.stride, hd),
            (k.mem.ptr, k.width, hd),
            (v.mem.ptr, v.width, vd),
            (out, o.off, o.stride, vd),
            batch,
            nh,
            nh / nkv,
            hd,
            vd,
            p.scale,
            p.window.unwrap_or(0),
            p.softcap.unwrap_or(0.0),
        );
    }

    fn mla_attention(&self, q: &CudaBuf, qr: Rows, cache: &CudaCache, batch: &CudaBatch, p: &MlaParams, out: &CudaBuf, o: Rows) {
        self.mla_attention_run(q, qr, cache, batch, p, out, o, false, false, 0);
    }

    fn moe(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        p: &MoeParams,
        out: &CudaBuf,
        o: Rows,
    ) {
        // A routing made ahead (pre_route) is for moe_shared only; this op routes itself.
        self.routed.lock().unwrap_or_else(|e| e.into_inner()).take();
        let n = xr.n;
        assert!(lr.n == n && o.n == n && lr.width == p.n_experts && o.width == xr.width);
        x.check(xr);
        logits.check(lr);
        out.check(o);
        let (hdim, ff, ne) = (experts.gate.ne(0), experts.gate.ne(1), p.n_experts);
        assert_eq!(hdim, xr.width);
        assert_eq!(experts.gate.ne(2), ne);
        assert_eq!((experts.up.ne(0), experts.up.ne(1), experts.up.ne(2)), (hdim, ff, ne), "moe: up shape");
        assert_eq!((experts.down.ne(0), experts.down.ne(1), experts.down.ne(2)), (ff, hdim, ne), "moe: down shape");
        if n == 0 {
            return;
        }
        if ne > 512 || p.n_group > 64 || p.n_group == 0 || ne % p.n_group != 0 || p.k == 0 || p.k > ne {
            self.fail(format!("moe: {ne} experts in {} groups, top {} is not supported (at most 512 experts, 64 groups)", p.n_group, p.k));
            return;
        }
        let (Some(gt), Some(ut), Some(dt)) = (tname(experts.gate.dtype), tname(experts.up.dtype), tname(experts.down.dtype)) else {
            self.fail("moe: expert weight type without kernels".into());
            return;
        };
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let k = p.k;
        let pairs = n * k;
        let Some(sel_e) = self.scratch(S::SelE, 4 * pairs) else { return };
        let Some(sel_w) = self.scratch(S::SelW, 4 * pairs) else { return };
        let Some(g) = self.scratch(S::G, 4 * pairs * ff) else { return };
        let Some(u) = self.scratch(S::U, 4 * pairs * ff) else { return };
        let Some(y) = self.scratch(S::Y, 4 * pairs * hdim) else { return };
        let warp_route = warp_route(p);
        let fast = n <= GEMV_MAX_TOKENS
            && !self.exact
            && [experts.gate.dtype, experts.up.dtype, experts.down.dtype].iter().all(|&t| t == GgmlType::Q8_0)
            && hdim * 9 / 8 <= self.smem_max
            && k * ff * 9 / 8 <= self.smem_max;
        if fast && warp_route {
            // Decode: route (one warp per token), gate+up+GLU of all pairs in one launch, down and
            // the weighted sum in one launch (kernels/fast.cu).
            self.route(logits, lr, p, true, sel_e, sel_w);
            let act = match p.glu {
                Glu::SwiGlu => 0,
                Glu::GeGluTanh => 1,
            };
            let (gw, uw, dw) = (experts.gate, experts.up, experts.down);
            self.launch(
                "moe_gateup_q8",
                (ff.div_ceil(8) as u32, pairs as u32, 1),
                256,
                (hdim * 9 / 8) as u32,
                &[
                    A::P(gw.mem.ptr),
                    A::P(uw.mem.ptr),
                    l(gw.row_bytes),
                    l(gw.mat_bytes()),
                    i(ff),
                    i(hdim),
                    A::P(sel_e),
                    A::P(x.0.ptr),
                    l(xr.off),
                    l(xr.stride),
                    i(k),
                    A::I(act),
                    A::P(g),
                    l(ff),
                ],
            );
            self.launch(
                "moe_down_q8",
                (hdim.div_ceil(8) as u32, n as u32, 1),
                256,
                (k * ff * 9 / 8) as u32,
                &[
                    A::P(dw.mem.ptr),
                    l(dw.row_bytes),
                    l(dw.mat_bytes()),
                    i(hdim),
                    i(ff),
                    i(k),
                    A::P(sel_e),
                    A::P(sel_w),
                    A::P(g),
                    l(ff),
                    A::P(out.0.ptr),
                    l(o.off),
                    l(o.stride),
                ],
            );
            return;
        }
        let all_q8 = [experts.gate.dtype, experts.up.dtype, experts.down.dtype].iter().all(|&t| t == GgmlType::Q8_0);
        if self.tc && all_q8 && n > GEMV_MAX_TOKENS && MMQ_SMEM <= self.smem_max {
            self.moe_mmq(x, xr, logits, lr, &experts, None, p, warp_route, (sel_e, sel_w, g, u, y), out, o);
            return;
        }
        self.route(logits, lr, p, false, sel_e, sel_w);
        // (weight, m, kdim, input ptr, input off, input stride, in_div, output ptr, output stride)
        type Prod<'a> = (&'a CudaWeight, &'a str, usize, usize, u64, usize, usize, usize, u64, usize);
        let prods: [Prod; 3] = [
            (experts.gate, gt, ff, hdim, x.0.ptr, xr.off, xr.stride, k, g, ff),
            (experts.up, ut, ff, hdim, x.0.ptr, xr.off, xr.stride, k, u, ff),
            (experts.down, dt, hdim, ff, g, 0, ff, 1, y, hdim),
        ];
        let grouped = n > GEMV_MAX_TOKENS;
        let (cnt, off, perm) = if grouped {
            let (Some(c), Some(of), Some(pm)) =
                (self.scratch(S::Cnt, 4 * ne), self.scratch(S::Off, 4 * ne), self.scratch(S::Perm, 4 * pairs))
            else {
                return;
            };
            self.launch("moe_group", (1, 1, 1), 1024, 0, &[A::P(sel_e), i(n), i(k), i(0), i(ne), A::P(c), A::P(of), A::P(pm)]);
            (c, of, pm)
        } else {
            (0, 0, 0)
        };
        for (idx, &(w, tn, m, kd, ip, ioff, istr, div, op, ostr)) in prods.iter().enumerate() {
            if idx == 2 {
                // g = act(g) * u before the down projection.
                let total = pairs * ff;
                let kind = match p.glu {
                    Glu::SwiGlu => 0,
                    Glu::GeGluTanh => 1,
                };
                self.launch(
                    "glu_rows",
                    Self::grid1(total),
                    256,
                    0,
                    &[A::I(kind), A::P(g), l(0), l(ff), A::P(u), l(0), l(ff), A::P(g), l(0), l(ff), l(ff), l(total)],
                );
            }
            if grouped {
                self.launch(
                    KName::of(format_args!("moe_gemm_{tn}")).as_str(),
                    (m.div_ceil(64) as u32, n.div_ceil(64) as u32, ne as u32),
                    256,
                    0,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(kd),
                        A::P(cnt),
                        A::P(off),
                        A::P(perm),
                        A::P(ip),
                        l(ioff),
                        l(istr),
                        i(div),
                        A::P(op),
                        l(ostr),
                    ],
                );
            } else {
                let h16 = if h16_vector_ok(w, kd, ioff, istr) { "h16_" } else { "" };
                self.launch(
                    KName::of(format_args!("moe_gemv_{h16}{tn}")).as_str(),
                    (m.div_ceil(4) as u32, pairs as u32, 1),
                    128,
                    0,
                    &[
                        A::P(w.mem.ptr),
                        l(w.row_bytes),
                        l(w.mat_bytes()),
                        i(m),
                        i(kd),
                        A::P(sel_e),
                        A::P(ip),
                        l(ioff),
                        l(istr),
                        i(div),
                        A::P(op),
                        l(ostr),
                    ],
                );
            }
        }
        self.moe_combine(y, (k, k), hdim, n, (sel_e, sel_w), out, o, (0, 0));
    }

    /// What picks the MLA decode's kernels for the batch: long-context (`TS_CUDA_MLA_LONG`), one
    /// token at a short context (`mo_att`: the attention inside `mla_out_q8`), a batch's splits.
    fn graph_class(&self, batch: &BatchMeta) -> u64 {
        let pos = || batch.tokens.iter().map(|t| t.pos);
        let n = batch.tokens.len();
        let splits = if n > 1 { self.batch_mla_splits(n, pos()) as u64 } else { 0 };
        let tc_splits = if n > 1 { self.tc_batch_splits(n, pos()) as u64 } else { 0 };
        let short = n == 1 && pos().all(|p| p < self.mo_att.load(Ordering::Relaxed));
        self.long_context(n, pos()) as u64 | (short as u64) << 1 | splits << 2 | tc_splits << 12
    }

    /// CUDA graphs for steps of up to [`GRAPH_MAX_TOKENS`] tokens (decode, batched decode): a key runs eagerly the
    /// first time (scratch reaches its size), is captured the second time and replayed after
    /// that, one launch instead of hundreds. Any scratch reallocation drops every recording (they
    /// hold scratch pointers); an allocation during capture spoils it (the step runs eagerly).
    /// `TS_CUDA_GRAPHS=0` turns recording off.
    fn graph_begin(&self, key: u64, n_tokens: usize) -> bool {
        if n_tokens == 0 || n_tokens > self.graph_max || !self.graphs_on {
            return false;
        }
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        if gs.capturing.is_some() {
            return false;
        }
        if let Some(g) = gs.graphs.get(&key) {
            if let Err(e) = g.0.launch() {
                self.fail(format!("CUDA graph launch: {e:?}"));
            } else if let (Some(tr), Some(names)) = (&self.trace, gs.names.get(&key)) {
                tr.lock().unwrap_or_else(|e| e.into_inner()).extend(names.iter().cloned());
            }
            gs.counts.replayed += 1;
            return true;
        }
        if gs.failed.contains(&key) {
            return false;
        }
        if gs.graphs.len() >= GRAPH_MAX_COUNT {
            return false;
        }
        if gs.seen.len() >= 16 * GRAPH_MAX_COUNT {
            // Keys seen once (a server's mixed batches) are forgotten now and then.
            gs.seen.clear();
        }
        if !gs.seen.insert(key)
            && self.ctx.bind_to_thread().is_ok()
            && self.stream.begin_capture(drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).is_ok()
        {
            gs.capturing = Some(key);
            gs.spoiled = false;
        }
        false
    }

    /// Scratch (dequantised weights, MoE intermediates) and step recordings are sized on first
    /// use, so the loader runs the widest forward and one decode step at open.
    fn warm_up_at_open(&self) -> bool {
        true
    }

    fn graph_end(&self) -> bool {
        let mut gs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(key) = gs.capturing.take() else {
            gs.counts.eager += 1;
            return true;
        };
        let spoiled = std::mem::take(&mut gs.spoiled);
        match self.stream.end_capture(drv_sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(graph)) if !spoiled => {
                let names = std::mem::take(&mut gs.capture_names);
                if let Err(e) = graph.launch() {
                    self.fail(format!("CUDA graph launch: {e:?}"));
                } else if let Some(tr) = &self.trace {
                    tr.lock().unwrap_or_else(|e| e.into_inner()).extend(names.iter().cloned());
                }
                gs.names.insert(key, names);
                gs.graphs.insert(key, Graph(graph));
                gs.counts.recorded += 1;
                true
            }
            _ => {
                gs.capture_names.clear();
                gs.failed.insert(key);
                gs.counts.eager += 1;
                false
            }
        }
    }

    fn step_counts(&self) -> StepCounts {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).counts
    }

    fn matmul_many(&self, x: &CudaBuf, xr: Rows, jobs: &[(&CudaWeight, &CudaBuf, Rows)]) {
        let n = xr.n;
        let k = xr.width;
        let nt = if n == 1 {
            1
        } else if n == 2 {
            2
        } else if n <= 4 {
            4
        } else {
            8
        };
        let fast = self.fused
            && jobs.len() >= 2
            && (1..=GEMV_MAX_TOKENS).contains(&n)
            && nt * k * 9 / 8 <= self.smem_max
            && jobs.iter().all(|(w, _, o)| {
                w.dtype == GgmlType::Q8_0
                    && w.shape.len() <= 3
                    && w.ne(2) == 1
                    && w.ne(0) == k
                    && o.n == n
                    && o.width == w.ne(1)
                    && w.ne(1) > 0
            });
        // Prompts and decode batches (Path::DenseBlasBatch) with every matrix's f16 copy
        // (dense_blas): the input in f16 once, one cuBLAS product a job (the same bits as each
        // `matmul` alone).
        if self.blas_jobs(n, k, jobs) && self.dense_blas_take(n) {
            x.check(xr);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let Some(xh) = self.f16_input(x, xr) else { return };
            self.gemm_jobs_h16(xh, n, k, jobs);
            return;
        }
        // Above the GEMV sizes, on the int8 tensor cores: the input quantised once for all jobs
        // (each `matmul` would quantise it again; the same bits).
        if self.mmq_many(n, k, jobs) {
            x.check(xr);
            let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
            let ngroups = k.div_ceil(128);
            let Some(xq) = self.scratch(S::Xq, n * ngroups * 144) else { return };
            self.quant_groups(x.0.ptr, 0, xr.off, xr.stride, n, k, 0, xq);
            self.mmq_jobs(ngroups, xq, n, jobs);
            return;
        }
        if !fast {
            for &(w, out, o) in jobs {
                self.matmul(x, xr, w, out, o);
            }
            return;
        }
        x.check(xr);
        // One launch per 3 jobs (a lone last job goes through the plain GEMV).
        for chunk in jobs.chunks(3) {
            if chunk.len() == 1 {
                let (w, out, o) = chunk[0];
                self.matmul(x, xr, w, out, o);
                continue;
            }
            let (table, lpr, total) = multi_jobs(chunk, k);
            // The job table (a fixed array: launching allocates nothing), then the shared input.
            let args: [A; 27] = cat(table, [i(k), A::P(x.0.ptr), l(xr.off), l(xr.stride), i(n), i(lpr)]);
            self.launch(
                KName::of(format_args!("gemv_q8_multi_{nt}")).as_str(),
                (total.min(self.sm_count * 8) as u32, n.div_ceil(nt) as u32, 1),
                256,
                (nt * k * 9 / 8) as u32,
                &args,
            );
        }
    }

    fn norm_qkv_rope_cache(
        &self,
        (x, xr): (&CudaBuf, Rows),
        delta: Option<(&CudaBuf, Rows)>,
        w: Option<&CudaWeight>,
        eps: f32,
        (out, o): (&CudaBuf, Rows),
        jobs: [(&CudaWeight, &CudaBuf, Rows); 2],
        (norm_width, kv_w): (usize, Option<&CudaWeight>),
        q_rope: (&CudaBuf, Rows, &CudaBuf, Rows, usize),
        absorb: Option<(&CudaWeight, Rows, Rows)>,
        batch: &CudaBatch,
        rope: &CudaRope,
        cache: &CudaCache,
    ) {
        let (_, kv, kvo) = jobs[1];
        let op = Nrc { x: kv, xr: kvo, norm_width, w: kv_w, eps, q: Some(q_rope), batch, rope, cache, joint: None };
        if self.qkv_joint((x, xr), delta, w, (out, o), jobs, &op, absorb) {
            return;
        }
        self.norm_matmul_many((x, xr), delta, w, eps, (out, o), &jobs);
        self.mla_rope_cache_write(kv, kvo, norm_width, kv_w, eps, q_rope, absorb, batch, rope, cache);
    }

    fn join_products(&self, weights: &mut [&mut CudaWeight]) {
        self.join_half_copies(weights);
    }

    fn add_rms_norm_matmul_many(
        &self,
        x: (&CudaBuf, Rows),
        delta: (&CudaBuf, Rows),
        w: Option<&CudaWeight>,
        eps: f32,
        out: (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        self.norm_matmul_many(x, Some(delta), w, eps, out, jobs);
    }

    fn rms_norm_matmul_many(
        &self,
        x: (&CudaBuf, Rows),
        w: Option<&CudaWeight>,
        eps: f32,
        out: (&CudaBuf, Rows),
        jobs: &[(&CudaWeight, &CudaBuf, Rows)],
    ) {
        self.norm_matmul_many(x, None, w, eps, out, jobs);
    }

    fn prefetch_hint(&self, weights: &[&CudaWeight]) {
        let mut h = [(0u64, 0usize); 4];
        let mut x = [(0u64, 0usize); 4];
        // Routed expert stacks (a tiled copy) go to `xpf`'s regions, the first bytes of each
        // (gate and up: half of xpf each; down, the third: xpf_dn); the others to `l2pf`'s.
        let plain = weights.iter().filter(|w| w.tiled.is_none());
        let stacks = weights.iter().filter_map(|w| w.tiled.as_ref());
        if self.l2pf > 0 {
            for (slot, w) in h.iter_mut().zip(plain) {
                *slot = (w.mem.ptr, w.mem.bytes / 16 * 16);
            }
        }
        if self.xpf + self.xpf_dn > 0 {
            for (i, (slot, t)) in x.iter_mut().zip(stacks).enumerate() {
                let (want, skip) = if i < 2 { (self.xpf / 2, self.xpf_skip.min(t.bytes)) } else { (self.xpf_dn, 0) };
                let bytes = want.min(t.bytes - skip) / 16 * 16;
                *slot = (if bytes > 0 { t.ptr + skip as u64 } else { 0 }, bytes);
            }
        }
        *self.l2_hint.lock().unwrap_or_else(|e| e.into_inner()) = h;
        *self.xpf_hint.lock().unwrap_or_else(|e| e.into_inner()) = x;
    }

    fn mla_attention_out(
        &self,
        (q, qr): (&CudaBuf, Rows),
        cache: &CudaCache,
        batch: &CudaBatch,
        p: &MlaParams,
        (w_uv, wo): (&CudaWeight, &CudaWeight),
        (lat, lr, av, avr, avo): (&CudaBuf, Rows, &CudaBuf, Rows, Rows),
        (x, xr, y): (&CudaBuf, Rows, &CudaBuf),
        w: Option<&CudaWeight>,
        eps: f32,
        out: &CudaBuf,
        o: Rows,
        next: Option<MoeNext<'_, CudaWeight, CudaBuf>>,
    ) {
        let (nh, kl, hd) = (p.n_heads, p.kv_lora, xr.width);
        *self.routed.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.fork_ahead_clear();
        let rows = self.mla_out.load(Ordering::Relaxed);
        // One token (a decode step) of V2's shapes with Q8_0 value and output weights:
        // mla_out_q8's preconditions (kernels/fused.cu), else the plain chain.
        let one = self.fused
            && rows > 0
            && batch.tokens.len() == 1
            && xr.n == 1
            && o.n == 1
            && o.width == hd
            && lr.n == nh
            && lr.width == kl
            && lr.off % 2 == 0
            && lr.stride % 2 == 0
            && w_uv.dtype == GgmlType::Q8_0
            && wo.dtype == GgmlType::Q8_0
            && (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2)) == (kl, MO_VD, nh)
            && w_uv.row_bytes == kl / 128 * 144
            && kl % 128 == 0
            && kl <= 512
            && nh <= MO_MAX_PARTS
            && (wo.ne(0), wo.ne(1)) == (nh * MO_VD, hd)
            && wo.row_bytes == nh * 144
            && hd <= 2 * 1024
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == hd)
            && mla_out_smem(kl, w_uv.row_bytes, rows) <= self.smem_max;
        // The same for f16 / bf16 value and output weights (mla_out_<t>, clusters of 8 blocks a
        // head).
        let h16 = !one
            && self.fused
            && self.path_on(Path::Out16)
            && self.clusters()
            && batch.tokens.len() == 1
            && xr.n == 1
            && o.n == 1
            && o.width == hd
            && lr.n == nh
            && lr.width == kl
            && lr.off % 2 == 0
            && lr.stride % 2 == 0
            && matches!(w_uv.dtype, GgmlType::F16 | GgmlType::BF16)
            && wo.dtype == w_uv.dtype
            && (w_uv.ne(0), w_uv.ne(1), w_uv.ne(2)) == (kl, MO_VD, nh)
            && w_uv.row_bytes == 2 * kl
            && kl % 8 == 0
            && kl <= 512
            && nh <= MO_MAX_PARTS
            && (wo.ne(0), wo.ne(1)) == (nh * MO_VD, hd)
            && wo.row_bytes == 2 * nh * MO_VD
            && hd % MH_CLUSTER == 0
            && hd <= 2 * 1024
            && [w_uv, wo].iter().all(|w| w.mem.ptr % 16 == 0 && w.mat_bytes() % 16 == 0)
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == hd)
            && mla_out_h16_smem(kl, hd) <= self.smem_max;
        if !one && !h16 {
            // A decode batch on the int8 products: W_uv's split sum quantises the values for
            // W_o (Path::SumQ8), else the two products as they come.
            // (W_o's partial outputs left for the norm's launch to sum when it takes NormQ8)
            let n = xr.n;
            let nq8 = next.is_some() && self.norm_q8_ok(n, hd, (o.n, o.width), w);
            let mut y_parts = None;
            let sq = self.path_on(Path::SumQ8)
                && self.tc
                && MMQ_SMEM <= self.smem_max
                && (GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS).contains(&xr.n)
                && [w_uv, wo].iter().all(|w| w.dtype == GgmlType::Q8_0)
                && (w_uv.ne(0), w_uv.ne(2)) == (lr.width, nh)
                && lr.n == xr.n * nh
                && (avr.n, avr.width) == (lr.n, w_uv.ne(1))
                && (avo.n, avo.width) == (xr.n, nh * w_uv.ne(1))
                // (the value rows per head and per token are one packed block of memory)
                && (avr.off, avr.stride, avo.stride) == (avo.off, avr.width, avo.width)
                && w_uv.ne(1).is_multiple_of(128)
                && (wo.ne(0), wo.ne(1), wo.ne(2)) == (avo.width, hd, 1);
            // The values' product on cuBLAS from f16 rows (values_out_blas): the attention's
            // merge writes them beside its f32 output, so no f16_rows launch before W_uv.
            let lat_h = if !sq && self.path_on(Path::LatH) && self.values_out_blas_ok((lat, lr), (w_uv, wo), (avr, avo), xr) {
                let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
                match self.scratch(S::LatH, 2 * lr.n * lr.width) {
                    Some(p) => p,
                    None => return,
                }
            } else {
                0
            };
            let (_, lat_h_done) = self.mla_attention_run(q, qr, cache, batch, p, lat, lr, false, false, lat_h);
            // (Held through the norm's launch, which may read W_o's partials from the Part
            // scratch; dropped before the router's product, which takes it itself.)
            let op = sq.then(|| self.scratch_op.lock().unwrap_or_else(|e| e.into_inner()));
            if sq {
                self.took(Path::SumQ8);
                lat.check(lr);
                av.check(avr);
                y.check(xr);
                let (gl, gv) = (lr.width.div_ceil(128), avo.width / 128);
                let Some(xq) = self.scratch(S::Xq, lr.n * gl * 144) else { return };
                let Some(vq) = self.scratch(S::SumXq, xr.n * gv * 144) else { return };
                self.quant_groups(lat.0.ptr, 0, lr.off, lr.stride, lr.n, lr.width, 0, xq);
                self.mmq_dense(w_uv, gl, xq, (lr.n, xr.n, nh), av, avr, SplitSum::Q8(vq));
                // (the norm sums partials on its register path only: rows of <= 8 x 256 values)
                let ys = if nq8 && hd <= 8 * 256 { SplitSum::Leave } else { SplitSum::Plain };
                y_parts = self.mmq_dense(wo, gv, vq, (xr.n, xr.n, 1), y, xr, ys);
            } else if !self.values_out_blas((lat, lr), (w_uv, wo), (avr, avo), (y, xr), (lat_h_done && lat_h != 0).then_some(lat_h)) {
                self.matmul_grouped(lat, lr, w_uv, av, avr);
                self.matmul(av, avo, wo, y, xr);
            }
            // A decode batch before a MoE: the norm's launch also quantises its rows for the
            // MoE's int8 products (Path::NormQ8), and sums W_o's partials if they were left.
            if nq8 {
                let Some(xq) = self.scratch(S::NormXq, n * hd.div_ceil(128) * 144) else { return };
                self.took(Path::NormQ8);
                let delta = match y_parts {
                    Some((part, nsplit)) => (part, Rows::packed(n, hd), nsplit),
                    None => {
                        y.check(xr);
                        (y.0.ptr, xr, 0)
                    }
                };
                self.add_rms_norm_q8((x, xr), Some(delta), w, eps, (out, o), xq);
                *self.norm_xq.lock().unwrap_or_else(|e| e.into_inner()) = Some(NormXq { rows: (out.0.ptr, o.off, o.stride, n, hd), xq });
            } else {
                self.add_rms_norm(x, xr, y, xr, w, eps, out, o);
            }
            drop(op);
            // The MoE's shared FFN may fork from here (Path::SharedFork): it reads the norm's
            // rows, not the router's logits.
            if next.is_some() && (GEMV_MAX_TOKENS + 1..=GRAPH_MAX_TOKENS).contains(&n) {
                self.fork_ahead(out.0.ptr + 4 * o.off as u64);
            }
            if let Some(m) = next {
                self.matmul(out, o, m.router, m.logits.0, m.logits.1);
            }
            return;
        }
        x.check(xr);
        out.check(o);
        lat.check(lr);
        // A short context: the attention in mla_out_q8's blocks (mo_attend's shapes), else the
        // split kernel's partial rows, merged by mla_out_q8; or lat, written merged.
        let short = cache.half
            && (qr.width, kl, cache.width, p.rope_dim) == (576, 512, 576, 64)
            && qr.n == nh
            && qr.off % 2 == 0
            && qr.stride % 2 == 0
            && batch.tokens[0].pos < self.mo_att.load(Ordering::Relaxed);
        let (part, nsp, hp) = if short {
            q.check(qr);
            self.take_hint(false);
            if !self.check_cache_rows(batch, cache.rows, "mla_attention_out") {
                return;
            }
            self.mo_att_done.fetch_add(1, Ordering::Relaxed);
            (0, 0, false)
        } else {
            // (mla_out_q8p merges f16 partial rows; mla_out_<t> only f32 ones.)
            self.mla_attention_run(q, qr, cache, batch, p, lat, lr, true, !h16, 0).0.unwrap_or((0, 0, false))
        };
        let att = if short {
            [
                A::P(q.0.ptr),
                l(qr.off),
                l(qr.stride),
                A::P(cache.mem.ptr),
                A::P(batch.slot_ptr()),
                A::I(batch.slot_len as i32),
                A::F(p.scale),
            ]
        } else {
            [A::P(0), l(0), l(0), A::P(0), A::P(0), A::I(0), A::F(0.0)]
        };
        // Held from here to the routing's record (`routed`), so that no other op's launches come
        // between this one's on the stream.
        let _op = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
        let Some(ho) = self.scratch(S::Ho, 4 * nh * hd) else { return };
        // The arguments both output kernels open with (kernels/fused.cu): the partial rows and
        // their count, the latent rows, the positions, the shapes, W_uv and W_o. The Q8_0
        // kernel then takes its block's W_o rows before `ho`; the 16-bit one (a cluster of 8
        // blocks a head) has no such argument.
        let head: [A; 14] = [
            A::P(part),
            i(nsp),
            A::P(lat.0.ptr),
            l(lr.off),
            l(lr.stride),
            A::P(batch.pos_ptr()),
            i(nh),
            i(kl),
            A::P(w_uv.mem.ptr),
            l(w_uv.row_bytes),
            l(w_uv.mat_bytes()),
            A::P(wo.mem.ptr),
            l(wo.row_bytes),
            i(hd),
        ];
        if h16 {
            self.took(Path::Out16);
            let name = if w_uv.dtype == GgmlType::BF16 { "mla_out_bf16" } else { "mla_out_f16" };
            self.launch(
                name,
                (MH_CLUSTER as u32, nh as u32, 1),
                256,
                mla_out_h16_smem(kl, hd) as u32,
                &cat::<15, 7, 22>(cat(head, [A::P(ho)]), att),
            );
        } else {
            self.launch(
                if hp { "mla_out_q8p" } else { "mla_out_q8" },
                (hd.div_ceil(rows) as u32, nh as u32, 1),
                256,
                mla_out_smem(kl, w_uv.row_bytes, rows) as u32,
                &cat::<16, 7, 23>(cat(head, [i(rows), A::P(ho)]), att),
            );
        }
        // With `next` a few-row f32 matrix of the row's width (the MoE router): the norm and
        // that product in one launch (add_rms_norm_parts_router, the same bits as the two).
        let fused_next = next.as_ref().filter(|m| {
            self.norm_router.load(Ordering::Relaxed)
                && m.router.dtype == GgmlType::F32
                && m.router.ne(0) == hd
                && hd % 128 == 0
                && m.logits.1.n == 1
                && m.logits.1.width == m.router.ne(1)
        });
        // add_rms_norm_parts' arguments, which the router's kernel extends.
        let norm = [
            A::P(x.0.ptr),
            l(xr.off),
            A::P(ho),
            l(hd),
            i(nh),
            A::P(w.map_or(0, |w| w.mem.ptr)),
            A::I(w.is_some() as i32),
            A::F(eps),
            A::P(out.0.ptr),
            l(o.off),
            i(hd),
        ];
        if let Some(&MoeNext { router: nw, logits: (nb, nr), params: mp }) = fused_next {
            nb.check(nr);
            // The MoE's routing too (pre_route): plain top-k, the router's
            // rows being the experts.
            // rows being the experts, at most 64 of them (one cluster of 8 blocks, sm_90 on).
            let pre = self.pre_route.load(Ordering::Relaxed)
                && self.clusters()
                && warp_route(mp)
                && mp.n_experts == nw.ne(1)
                && mp.n_experts <= 64
                && mp.k > 0;
            let router = [A::P(nw.mem.ptr), i(nw.ne(1)), A::P(nb.0.ptr), l(nr.off)];
            if pre {
                let (Some(se), Some(sw)) = (self.scratch(S::PreE, 4 * mp.k), self.scratch(S::PreW, 4 * mp.k)) else { return };
                let Some(xq) = self.scratch(S::PreXq, hd / 128 * 144) else { return };
                let gating = A::I(matches!(mp.gating, Gating::Sigmoid) as i32);
                let route = [i(mp.k), gating, A::I(mp.norm_topk as i32), A::F(mp.scale), A::P(se), A::P(sw), A::P(xq)];
                let args: [A; 22] = cat(cat::<11, 4, 15>(norm, router), route);
                // (By column slices of the row, add_rms_norm_parts_router_route_s, measured
                // slower on the H200: tg128 675.3 against 709.9; docs/PERF.md, session 27.)
                // (At 512 threads a block with the router's rows in shared memory, so that its
                // cluster fits beside mla_out_q8's blocks: tg128 623.5 against 709.1 on the H200,
                // docs/PERF.md, session 30; dropped. Its router rows asked into L2 by mla_out_q8's
                // blocks before their wait: tg128 629.2 against 631.1 / 629.4 on an H100, sixty-
                // second session, noise; removed, commit 1c95b8b has it. Every layer's router rows
                // in one allocation read through a persisting L2 access-policy window: tg128 628.6
                // / 628.9 against 629.7 / 629.8 on an H100, seventy-fourth session; removed,
                // commit 10038ce has it.)
                self.launch("add_rms_norm_parts_router_route", (8, 1, 1), 1024, 0, &args);
                *self.routed.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(Routed { logits: (nb.0.ptr, nr.off), input: (out.0.ptr, o.off), p: *mp });
                return;
            }
            let Some(done) = self.scratch(S::NormSync, 16) else { return };
            let args: [A; 16] = cat(cat::<11, 4, 15>(norm, router), [A::P(done)]);
            self.launch("add_rms_norm_parts_router", (nw.ne(1).div_ceil(8) as u32, 1, 1), 1024, 0, &args);
            return;
        }
        self.launch("add_rms_norm_parts", (1, 1, 1), 1024, 0, &norm);
        drop(_op);
        if let Some(m) = next {
            self.matmul(out, o, m.router, m.logits.0, m.logits.1);
        }
    }

    fn add_rms_norm(&self, x: &CudaBuf, xr: Rows, delta: &CudaBuf, dr: Rows, w: Option<&CudaWeight>, eps: f32, out: &CudaBuf, o: Rows) {
        if !self.fused {
            self.add(x, xr, delta, dr, x, xr);
            self.rms_norm(x, xr, w, eps, out, o);
            return;
        }
        assert!(xr.n == dr.n && xr.n == o.n && xr.width == dr.width && xr.width == o.width, "add_rms_norm: shapes {xr:?} {dr:?} {o:?}");
        x.check(xr);
        delta.check(dr);
        out.check(o);
        if let Some(w) = w {
            assert_eq!(w.ne(0) * w.ne(1), xr.width, "norm weight length != row width {}", xr.width);
            assert_eq!(w.dtype, GgmlType::F32, "norm weights must be uploaded as WeightUse::Vector");
        }
        let block = xr.width.next_power_of_two().clamp(32, 256) as u32;
        // Backend::prefetch_hint's regions go with a one-row norm (a decode layer's start) under
        // TS_CUDA_L2PF=2 (taken either way): one block's bulk prefetches, a measurement.
        let hint = self.take_hint(xr.n == 1 && self.l2pf >= 2);
        let hint = if xr.n > 1 { self.take_xpf(1, xr.n) } else { hint };
        let args: [A; 21] = cat(add_norm_args((x, xr), (delta.0.ptr, dr), w, eps, (out, o)), hint);
        self.launch("add_rms_norm", (xr.n as u32, 1, 1), block, 0, &args);
    }

    fn rope_copy(&self, src: &CudaBuf, sr: Rows, dst: &CudaBuf, dr: Rows, heads_per_token: usize, batch: &CudaBatch, rope: &CudaRope) {
        if !self.fused {
            self.copy(src, sr, dst, dr);
            self.rope(dst, dr, heads_per_token, batch, rope);
            return;
        }
        assert!(sr.n == dr.n && sr.width == dr.width, "rope_copy: shapes {sr:?} {dr:?}");
        assert!(rope.dim <= sr.width && rope.dim.is_multiple_of(2));
        assert_eq!(sr.n, batch.tokens.len() * heads_per_token, "rope_copy: rows != tokens * heads");
        src.check(sr);
        dst.check(dr);
        let half = rope.dim / 2;
        let mode = rope_mode(rope);
        self.launch(
            "rope_copy_rows",
            Self::grid1(sr.n * (sr.width - half)),
            256,
            0,
            &[
                A::P(src.0.ptr),
                l(sr.off),
                l(sr.stride),
                A::P(dst.0.ptr),
                l(dr.off),
                l(dr.stride),
                l(sr.n),
                i(sr.width),
                i(heads_per_token),
                A::P(batch.pos_ptr()),
                A::P(rope.freqs.ptr),
                i(half),
                A::I(mode),
                A::F(rope.mscale),
            ],
        );
    }

    fn norm_rope_cache_write(
        &self,
        x: &CudaBuf,
        xr: Rows,
        norm_width: usize,
        w: Option<&CudaWeight>,
        eps: f32,
        batch: &CudaBatch,
        rope: &CudaRope,
        cache: &CudaCache,
    ) {
        self.norm_rope_cache(&Nrc { x, xr, norm_width, w, eps, q: None, batch, rope, cache, joint: None }, None);
    }

    fn mla_rope_cache_write(
        &self,
        x: &CudaBuf,
        xr: Rows,
        norm_width: usize,
        w: Option<&CudaWeight>,
        eps: f32,
        q: (&CudaBuf, Rows, &CudaBuf, Rows, usize),
        absorb: Option<(&CudaWeight, Rows, Rows)>,
        batch: &CudaBatch,
        rope: &CudaRope,
        cache: &CudaCache,
    ) {
        let (qs, qr, qd, qdr, heads) = q;
        assert!(qr.n == qdr.n && qr.width == qdr.width, "mla_rope_cache_write: q shapes {qr:?} {qdr:?}");
        assert!(rope.dim <= qr.width, "mla_rope_cache_write: rope {} over q width {}", rope.dim, qr.width);
        assert_eq!(qr.n, batch.tokens.len() * heads, "mla_rope_cache_write: q rows != tokens * heads");
        qs.check(qr);
        qd.check(qdr);
        let op = Nrc { x, xr, norm_width, w, eps, q: Some(q), batch, rope, cache, joint: None };
        let Some((wk, src, dst)) = absorb else {
            self.norm_rope_cache(&op, None);
            return;
        };
        // One decode token: the absorbed query's product (gemv_q8_1's body, one matrix per head)
        // in the same launch as norm_rope_cache (mla_rope_absorb_1), whose blocks must then be
        // GQ_THREADS wide. Otherwise the two ops one after the other.
        let (k, m) = (wk.ne(0), wk.ne(1));
        // 16-bit W_uk (mla_rope_absorb_<t>_1): rows of at most 128 values, half a warp each.
        let h16 = matches!(wk.dtype, GgmlType::F16 | GgmlType::BF16)
            && self.path_on(Path::Absorb16)
            && k % 8 == 0
            && k <= 128
            && wk.mem.ptr % 16 == 0
            && wk.row_bytes % 16 == 0
            && wk.mat_bytes() % 16 == 0
            && src.off % 4 == 0
            && src.stride % 4 == 0;
        let smem = if h16 { 0 } else { k * 9 / 8 };
        let merged = self.fused
            && self.rope_absorb
            && !self.exact
            && xr.n == 1
            && (wk.dtype == GgmlType::Q8_0 || h16)
            && wk.shape.len() == 3
            && wk.ne(2) == heads
            && (src.n, src.width, dst.n, dst.width) == (heads, k, heads, m)
            && norm_width.next_power_of_two().clamp(32, 256) == 256
            && norm_width > 0
            && norm_width + rope.dim <= xr.width
            && rope.dim.is_multiple_of(2)
            && xr.width == cache.width
            && w.is_none_or(|w| w.dtype == GgmlType::F32 && w.ne(0) * w.ne(1) == norm_width)
            && smem <= self.smem_max;
        if !merged {
            // A decode batch's absorbed query on cuBLAS from W_uk's f16 copy: the launch before
            // writes q_nope's f16 rows too (Path::QnopeH), so no f16_rows launch between them.
            let ng = src.n / heads.max(1);
            if self.qnope_h_ok(wk, heads, src, dst) {
                let op_lock = self.scratch_op.lock().unwrap_or_else(|e| e.into_inner());
                let Some(xh) = self.scratch(S::XBf16, 2 * k * src.n) else { return };
                if self.norm_rope_cache(&op, Some((qs, src, xh))) {
                    self.took(Path::QnopeH);
                    self.took(Path::DenseBlasBatch);
                    self.absorb_h16(xh, wk, heads, ng, qd, dst);
                    return;
                }
                drop(op_lock);
                self.matmul_grouped(qs, src, wk, qd, dst);
                return;
            }
            self.norm_rope_cache(&op, None);
            self.matmul_grouped(qs, src, wk, qd, dst);
            return;
        }
        x.check(xr);
        qs.check(src);
        qd.check(dst);
        if !self.check_cache_rows(batch, cache.rows, "mla_rope_cache_write") {
            return;
        }
        let (_, qblocks, nrc) = op.args();
        let lpr = (k / 16).next_power_of_two().min(32);
        // Blocks a head: Q8_0 as gemv_q8_1's tiles; 16-bit weights RA_ROWS rows a half-warp.
        let gtiles = if h16 { m.div_ceil(8 * 2 * 4) } else { m.div_ceil(8 * (32 / lpr)).min(self.sm_count * 8) };
        let args: [A; 36] = cat(
            nrc,
            [
                i(qblocks),
                A::P(wk.mem.ptr),
                l(wk.row_bytes),
                l(wk.mat_bytes()),
                i(m),
                i(k),
                l(src.off),
                l(src.stride),
                l(dst.off),
                l(dst.stride),
                i(gtiles),
                i(lpr),
            ],
        );
        if h16 {
            self.took(Path::Absorb16);
        }
        let name = match wk.dtype {
            GgmlType::BF16 => "mla_rope_absorb_bf16_1",
            GgmlType::F16 => "mla_rope_absorb_f16_1",
            _ => "mla_rope_absorb_1",
        };
        self.launch(cache.kernel(name).as_str(), ((1 + qblocks + gtiles * heads) as u32, 1, 1), 256, smem as u32, &args);
    }

    fn moe_shared(
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
    ) -> bool {
        self.moe_shared_to(x, xr, logits, lr, experts, shared, p, out, o, false)
    }

    fn moe_shared_residual(
        &self,
        x: &CudaBuf,
        xr: Rows,
        logits: &CudaBuf,
        lr: Rows,
        experts: Experts<'_, CudaWeight>,
        shared: Experts<'_, CudaWeight>,
        p: &MoeParams,
        res: &CudaBuf,
        rr: Rows,
    ) -> bool {
        self.moe_residual.load(Ordering::Relaxed) && self.moe_shared_to(x, xr, logits, lr, experts, shared, p, res, rr, true)
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| dev_err("cuda context", e))?;
        let r = self.stream.synchronize().map_err(|e| dev_err("cuda stream", e));
        self.take_error()?;
        r
    }
}
