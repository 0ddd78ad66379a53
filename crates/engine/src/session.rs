//! A single-sequence generation session over a [`Model`]: prefill in chunks, then decode.
//!
//! The session owns cache slot `slot` of the model; `pos` is how many tokens of the sequence
//! the cache holds. Batched multi-sequence stepping (the server) builds [`BatchMeta`]s itself.

use ts_core::{BatchMeta, TokenMeta};
use ts_models::{Model, Outputs};

use crate::Sampler;

/// Errors of a generation session: one line each.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("the prompt and generation need {need} tokens but the context holds {ctx} (raise --ctx-size)")]
    ContextFull { need: usize, ctx: usize },
    #[error(transparent)]
    Model(#[from] ts_models::ModelError),
}

pub struct Session<'m> {
    pub model: &'m mut dyn Model,
    /// Cache slot this sequence lives in.
    pub slot: u32,
    /// Tokens already in the cache (the next token's position).
    pub pos: usize,
    /// Logits of the last token fed, `[n_vocab]`.
    pub logits: Vec<f32>,
    /// All tokens of the sequence so far (prompt + generated).
    pub tokens: Vec<u32>,
    meta: BatchMeta,
}

impl<'m> Session<'m> {
    pub fn new(model: &'m mut dyn Model, slot: u32) -> Self {
        let nv = model.info().n_vocab;
        let ctx = model.options().ctx as u32;
        Session { model, slot, pos: 0, logits: vec![0.0; nv], tokens: Vec::new(), meta: BatchMeta { slot_len: ctx, ..Default::default() } }
    }

    pub fn ctx(&self) -> usize {
        self.model.options().ctx
    }

    /// Forget the sequence (the cache rows are simply overwritten later).
    pub fn reset(&mut self) {
        self.pos = 0;
        self.tokens.clear();
    }

    /// Keep only the first `n` tokens of the sequence (later cache rows are overwritten).
    pub fn rewind(&mut self, n: usize) {
        let n = n.min(self.pos);
        self.pos = n;
        self.tokens.truncate(n);
    }

    /// Feed `tokens` (prefill in chunks of the model's max batch); afterwards `logits` holds the
    /// last token's logits.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<(), SessionError> {
        self.feed_chunks(tokens, false).map(|_| ())
    }

    /// [`feed`](Self::feed), returning the greedy pick ([`ts_core::argmax`]) after the last token
    /// instead of its logits: the backend computes the arg-max where the logits are and copies
    /// back one id (a GPU then skips a 400 KB copy and a host scan per token). `logits` is left
    /// as it was.
    pub fn feed_greedy(&mut self, tokens: &[u32]) -> Result<u32, SessionError> {
        self.feed_chunks(tokens, true)
    }

    /// Feed the sampled token `id` for `sampler`'s next pick: when that pick is the plain arg-max
    /// ([`Sampler::is_plain_greedy`]) the backend makes it and it is returned ([`feed_greedy`](Self::feed_greedy));
    /// otherwise `logits` is filled ([`feed`](Self::feed)) and `None` is returned. Pass the result
    /// to [`Sampler::next`].
    pub fn feed_for(&mut self, id: u32, sampler: &Sampler) -> Result<Option<u32>, SessionError> {
        if sampler.is_plain_greedy(self.tokens.len() + 1) {
            self.feed_greedy(&[id]).map(Some)
        } else {
            self.feed(&[id]).map(|_| None)
        }
    }

    /// Greedy continuation: feed `first`, then each pick in turn (the plain arg-max, as
    /// [`feed_greedy`](Self::feed_greedy) one token at a time), handing every pick to `emit`
    /// until it returns false, `max` picks were made or the context is full. Returns the number
    /// of picks handed over; afterwards the session is as if those feeds had run one by one
    /// (`pos` and `tokens` count `first` and every pick fed after it, not the last pick).
    ///
    /// Where the backend chains steps on the device ([`Model::chains_argmax`]), the step that
    /// feeds a pick is enqueued before that pick reaches the host (its token is the previous
    /// step's arg-max on the device, [`ts_core::TOKEN_FROM_ARGMAX`]), so the host's turn between
    /// tokens overlaps the device's work. When `emit` stops the chain, the one step already
    /// enqueued past it is waited for and forgotten: it wrote only the cache row at `pos`, which
    /// the next feed overwrites.
    pub fn greedy_chain(&mut self, first: u32, max: usize, mut emit: impl FnMut(u32) -> bool) -> Result<usize, SessionError> {
        let ctx = self.ctx();
        if max == 0 {
            return Ok(0);
        }
        if self.pos >= ctx {
            return Err(SessionError::ContextFull { need: self.pos + 1, ctx });
        }
        if !self.model.chains_argmax() {
            let (mut t, mut n) = (first, 0);
            while n < max && self.pos < ctx {
                t = self.feed_greedy(&[t])?;
                n += 1;
                if !emit(t) {
                    break;
                }
            }
            return Ok(n);
        }
        // `queued`: steps enqueued and not collected, the oldest feeding `fed` at `self.pos`.
        let mut fed = first;
        self.step_queued(first, self.pos)?;
        let mut queued = 1usize;
        let mut n = 0usize;
        let mut id = [0u32];
        let r = loop {
            // The next step, fed the pick of the one before it, at the position after it: while
            // more picks may be wanted and the context holds it.
            let next_pos = self.pos + queued;
            if n + queued < max && next_pos < ctx && queued < 2 {
                if let Err(e) = self.step_queued(ts_core::TOKEN_FROM_ARGMAX, next_pos) {
                    break Err(e);
                }
                queued += 1;
            }
            if let Err(e) = self.model.argmax_collect(&mut id) {
                break Err(e.into());
            }
            queued -= 1;
            self.pos += 1;
            self.tokens.push(fed);
            fed = id[0];
            n += 1;
            if !emit(id[0]) || n >= max || self.pos >= ctx {
                break Ok(n);
            }
            if queued == 0 {
                // Past the context's end or the wanted picks no step was enqueued: none to wait on.
                break Ok(n);
            }
        };
        // A step enqueued past the last pick handed over: waited for, its pick forgotten.
        for _ in 0..queued {
            let mut skip = [0u32];
            self.model.argmax_collect(&mut skip)?;
        }
        r
    }

    /// One decode token (`token` at `pos` of this slot) with its arg-max queued on the backend.
    fn step_queued(&mut self, token: u32, pos: usize) -> Result<(), SessionError> {
        self.meta.tokens.clear();
        self.meta.tokens.push(TokenMeta { token, pos: pos as u32, slot: self.slot });
        self.meta.outputs.clear();
        self.meta.outputs.push(0);
        Ok(self.model.forward_outputs(&self.meta, Outputs::queued())?)
    }

    /// The chunk loop of `feed` (`greedy` false: the last token's logits into `logits`, returns 0)
    /// and `feed_greedy` (its arg-max returned, `logits` untouched).
    fn feed_chunks(&mut self, tokens: &[u32], greedy: bool) -> Result<u32, SessionError> {
        let ctx = self.ctx();
        if self.pos + tokens.len() > ctx {
            return Err(SessionError::ContextFull { need: self.pos + tokens.len(), ctx });
        }
        let chunk = self.model.options().max_batch.max(1);
        let mut id = [0u32];
        for part in tokens.chunks(chunk) {
            self.meta.tokens.clear();
            for (i, &t) in part.iter().enumerate() {
                self.meta.tokens.push(TokenMeta { token: t, pos: (self.pos + i) as u32, slot: self.slot });
            }
            self.meta.outputs.clear();
            self.meta.outputs.push(part.len() as u32 - 1);
            let out = if greedy {
                Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut id), queue_argmax: false }
            } else {
                Outputs::all(&mut self.logits)
            };
            self.model.forward_outputs(&self.meta, out)?;
            self.pos += part.len();
            self.tokens.extend_from_slice(part);
        }
        Ok(id[0])
    }

    /// Teacher-forced logits for every token of `tokens` (from position `self.pos`), written to
    /// `out` (`[tokens.len(), n_vocab]`).
    pub fn feed_all_logits(&mut self, tokens: &[u32], out: &mut [f32]) -> Result<(), SessionError> {
        let ctx = self.ctx();
        if self.pos + tokens.len() > ctx {
            return Err(SessionError::ContextFull { need: self.pos + tokens.len(), ctx });
        }
        let nv = self.model.info().n_vocab;
        let chunk = self.model.options().max_batch.max(1);
        for (ci, part) in tokens.chunks(chunk).enumerate() {
            self.meta.tokens.clear();
            self.meta.outputs.clear();
            for (i, &t) in part.iter().enumerate() {
                self.meta.tokens.push(TokenMeta { token: t, pos: (self.pos + i) as u32, slot: self.slot });
                self.meta.outputs.push(i as u32);
            }
            let o0 = ci * chunk * nv;
            self.model.forward(&self.meta, &mut out[o0..o0 + part.len() * nv])?;
            self.pos += part.len();
            self.tokens.extend_from_slice(part);
        }
        if let Some(last) = out.chunks(nv).last() {
            self.logits.copy_from_slice(last);
        }
        Ok(())
    }
}
