//! Token sampling, llama.cpp style.
//!
//! Order of the chain (fixed): logit biases → repetition/presence/frequency penalties over the
//! last `repeat_last_n` history tokens → top-k → temperature + softmax → top-p → min-p → draw from a
//! ChaCha20 RNG. `temperature <= 0` is greedy: the arg-max of the penalised logits, ties going to
//! the lowest id.
//!
//! All scratch buffers live in the [`Sampler`] and are reused; after the first call `sample`
//! does not allocate (unless the vocabulary grows).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// Sampling parameters. `Default` gives llama.cpp's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; `<= 0` means greedy (arg-max). Default 0.8.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables. Default 40.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set whose probability reaches `top_p`; `>= 1` disables.
    /// Default 0.95.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` × the best token's; `<= 0` disables.
    /// Default 0.05.
    pub min_p: f32,
    /// Repetition penalty (divide positive logits, multiply negative ones); 1 disables. Default 1.0.
    pub repeat_penalty: f32,
    /// How many of the latest history tokens the penalties look at; 0 disables. Default 64.
    pub repeat_last_n: usize,
    /// Subtracted once from the logit of every token present in the window. Default 0.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the window. Default 0.
    pub frequency_penalty: f32,
    /// RNG seed; `None` seeds from the OS.
    pub seed: Option<u64>,
    /// `(token id, bias)` pairs added to those tokens' logits before anything else (OpenAI's
    /// `logit_bias`, llama.cpp's `--logit-bias`). A bias of `-inf` bans the token; ids past the
    /// vocabulary are ignored; an id listed twice gets both biases. Default empty.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplerParams {
    /// Greedy decoding (temperature 0), everything else default.
    pub fn greedy() -> Self {
        SamplerParams { temperature: 0.0, ..Default::default() }
    }
}

/// A stateful sampler: parameters, RNG and reusable scratch space.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    rng: ChaCha20Rng,
    /// Candidates `(id, logit → prob)`.
    cand: Vec<(u32, f32)>,
    /// Sorted copy of the penalty window.
    window: Vec<u32>,
    last: Option<u32>,
}

/// Descending by value, ties by ascending id: a total order, so results are deterministic.
#[inline]
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

impl Sampler {
    /// A sampler with the given parameters (seeded from `params.seed`, or the OS).
    pub fn new(params: SamplerParams) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha20Rng::seed_from_u64(s),
            None => ChaCha20Rng::seed_from_u64(rand::random::<u64>()),
        };
        Sampler { params, rng, cand: Vec::new(), window: Vec::new(), last: None }
    }

    /// The parameters in use.
    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Re-seeds the RNG.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = ChaCha20Rng::seed_from_u64(seed);
    }

    /// True when [`sample`](Self::sample) over a history of `history_len` tokens is the plain
    /// arg-max of the raw logits ([`ts_core::argmax`]): greedy, no logit bias, and no penalty
    /// applies. Then a backend's on-device arg-max may stand in for the row (see
    /// [`take`](Self::take)).
    pub fn is_plain_greedy(&self, history_len: usize) -> bool {
        let p = &self.params;
        let neutral = p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0;
        p.temperature <= 0.0 && p.logit_bias.is_empty() && (neutral || p.repeat_last_n == 0 || history_len == 0)
    }

    /// Records `id` as picked, when the pick was made elsewhere (the arg-max computed by the
    /// backend for a [`is_plain_greedy`](Self::is_plain_greedy) sampler): same state as `sample`.
    pub fn take(&mut self, id: u32) -> u32 {
        self.last = Some(id);
        id
    }

    /// The next token: `picked` (the backend's arg-max, from `Session::feed_for`) when given, else
    /// [`sample`](Self::sample) over `logits`.
    pub fn next(&mut self, picked: Option<u32>, logits: &[f32], history: &[u32]) -> u32 {
        match picked {
            Some(id) => self.take(id),
            None => self.sample(logits, history),
        }
    }

    /// The id returned by the last [`sample`](Self::sample) call.
    pub fn last(&self) -> Option<u32> {
        self.last
    }

    /// Picks the next token from `logits` (one per vocabulary id). `history` is every token so far
    /// (prompt and generated); the penalties use its last `repeat_last_n` entries.
    ///
    /// Returns 0 for empty logits. NaN logits are treated as −∞.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        if self.is_plain_greedy(history.len()) {
            // Greedy without penalties: the arg-max in one pass, no candidate list (the same
            // choice as below: NaN counts as -inf, ties go to the lowest id).
            let best = ts_core::argmax(logits);
            self.last = Some(best);
            return best;
        }
        // (the scalars copied out: `params` also holds the bias list, and cloning it here would
        // allocate on every call)
        let p = &self.params;
        let (temperature, top_k, top_p, min_p) = (p.temperature, p.top_k, p.top_p, p.min_p);
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })));
        // (ids still equal indices here: the bias and the penalties index the list by id)
        for &(id, b) in &self.params.logit_bias {
            if let Some(c) = self.cand.get_mut(id as usize) {
                c.1 += b;
            }
        }
        self.apply_penalties(history);

        if temperature <= 0.0 {
            let best = self.cand.iter().copied().min_by(by_logit_desc).map_or(0, |c| c.0);
            self.last = Some(best);
            return best;
        }

        // top-k (then sort the survivors, best first)
        let n = self.cand.len();
        if top_k > 0 && top_k < n {
            self.cand.select_nth_unstable_by(top_k - 1, by_logit_desc);
            self.cand.truncate(top_k);
        }
        self.cand.sort_unstable_by(by_logit_desc);

        // temperature + softmax
        let max = self.cand[0].1;
        if max == f32::NEG_INFINITY {
            // Everything masked: fall back to the lowest id among candidates.
            let id = self.cand.iter().map(|c| c.0).min().unwrap_or(0);
            self.last = Some(id);
            return id;
        }
        let inv_t = 1.0 / temperature;
        let mut sum = 0.0f32;
        for c in self.cand.iter_mut() {
            let e = ((c.1 - max) * inv_t).exp();
            c.1 = e;
            sum += e;
        }
        for c in self.cand.iter_mut() {
            c.1 /= sum;
        }

        // top-p
        if top_p < 1.0 {
            let mut cum = 0.0f32;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                cum += c.1;
                if cum >= top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep.max(1));
        }

        // min-p (relative to the best token, unaffected by renormalisation)
        if min_p > 0.0 {
            let thresh = self.cand[0].1 * min_p;
            let keep = self.cand.iter().take_while(|c| c.1 >= thresh).count();
            self.cand.truncate(keep.max(1));
        }

        // draw
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let r = self.rng.random::<f32>() * total;
        let mut acc = 0.0f32;
        let mut chosen = self.cand[self.cand.len() - 1].0;
        for c in &self.cand {
            acc += c.1;
            if r < acc {
                chosen = c.0;
                break;
            }
        }
        self.last = Some(chosen);
        chosen
    }

    fn apply_penalties(&mut self, history: &[u32]) {
        let p = &self.params;
        let neutral = p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0;
        if neutral || p.repeat_last_n == 0 || history.is_empty() {
            return;
        }
        let start = history.len().saturating_sub(p.repeat_last_n);
        self.window.clear();
        self.window.extend_from_slice(&history[start..]);
        self.window.sort_unstable();
        let mut i = 0;
        while i < self.window.len() {
            let id = self.window[i];
            let mut j = i + 1;
            while j < self.window.len() && self.window[j] == id {
                j += 1;
            }
            let count = (j - i) as f32;
            if let Some(c) = self.cand.get_mut(id as usize) {
                let mut l = c.1;
                if l > 0.0 {
                    l /= p.repeat_penalty;
                } else {
                    l *= p.repeat_penalty;
                }
                l -= count * p.frequency_penalty + p.presence_penalty;
                c.1 = l;
            }
            i = j;
        }
    }

    /// Log-probabilities (log-softmax of the raw `logits`, before biases, penalties and truncation) of the
    /// last sampled token and of the `top_n` most likely tokens (best first, ties by id).
    /// Returns `(NaN, …)` if nothing was sampled yet.
    pub fn logprobs(&mut self, logits: &[f32], top_n: usize) -> (f32, Vec<(u32, f32)>) {
        match self.last {
            Some(id) => self.logprobs_for(logits, id, top_n),
            None => {
                let (_, v) = self.logprobs_for(logits, 0, top_n);
                (f32::NAN, v)
            }
        }
    }

    /// Like [`logprobs`](Self::logprobs) for an explicit `chosen` id.
    pub fn logprobs_for(&mut self, logits: &[f32], chosen: u32, top_n: usize) -> (f32, Vec<(u32, f32)>) {
        if logits.is_empty() {
            return (f32::NAN, Vec::new());
        }
        let max = logits.iter().copied().filter(|x| !x.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().filter(|x| !x.is_nan()).map(|&l| ((l - max) as f64).exp()).sum();
        let lse = max + (sum.ln() as f32);
        let lp = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l - lse };
        let chosen_lp = logits.get(chosen as usize).map_or(f32::NAN, |&l| lp(l));
        let n = top_n.min(logits.len());
        if n == 0 {
            return (chosen_lp, Vec::new());
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })));
        if n < self.cand.len() {
            self.cand.select_nth_unstable_by(n - 1, by_logit_desc);
            self.cand.truncate(n);
        }
        self.cand.sort_unstable_by(by_logit_desc);
        (chosen_lp, self.cand.iter().map(|&(id, l)| (id, lp(l))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplerParams)) -> SamplerParams {
        let mut p = SamplerParams { seed: Some(42), ..Default::default() };
        f(&mut p);
        p
    }

    #[test]
    fn defaults_match_llama_cpp() {
        let p = SamplerParams::default();
        assert_eq!((p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n), (0.8, 40, 0.95, 0.05, 1.0, 64));
        assert_eq!(p.seed, None);
    }

    #[test]
    fn greedy_is_argmax_ties_lowest() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[]), 1);
        assert_eq!(s.sample(&[1.0, 5.0, 5.0, 5.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -1.0, -2.0], &[]), 1);
        assert_eq!(s.last(), Some(1));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(params(|p| {
            p.top_k = 1;
            p.temperature = 5.0;
        }));
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
        let argmax = Sampler::new(SamplerParams::greedy()).sample(&logits, &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits, &[]), argmax);
        }
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 31) % 17) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(|p| {
                p.seed = Some(seed);
                p.top_k = 0;
                p.top_p = 1.0;
                p.min_p = 0.0;
                p.temperature = 1.5;
            }));
            (0..64).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        // And the draws are actually spread out.
        let distinct: std::collections::BTreeSet<_> = run(7).into_iter().collect();
        assert!(distinct.len() > 5);
    }

    #[test]
    fn min_p_cuts_unlikely_tokens() {
        // p ∝ exp(logit): token 0 dominant, token 1 at ~0.37×, token 2 at ~0.0067×.
        let logits = [5.0, 4.0, 0.0];
        let mut s = Sampler::new(params(|p| {
            p.temperature = 1.0;
            p.top_k = 0;
            p.top_p = 1.0;
            p.min_p = 0.1;
        }));
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits, &[]) as usize] += 1;
        }
        assert_eq!(seen[2], 0, "min_p must cut token 2: {seen:?}");
        assert!(seen[1] > 200, "token 1 must survive: {seen:?}");
    }

    #[test]
    fn top_p_cuts_tail() {
        // probs 0.5, 0.3, 0.2 (logits = ln p). top_p 0.7 keeps {0, 1}; 0.5 keeps {0}.
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
        let count = |top_p: f32| {
            let mut s = Sampler::new(params(|p| {
                p.temperature = 1.0;
                p.top_k = 0;
                p.min_p = 0.0;
                p.top_p = top_p;
            }));
            let mut seen = [0usize; 3];
            for _ in 0..2000 {
                seen[s.sample(&logits, &[]) as usize] += 1;
            }
            seen
        };
        let a = count(0.7);
        assert!(a[0] > 0 && a[1] > 0 && a[2] == 0, "{a:?}");
        let b = count(0.5);
        assert_eq!(b, [2000, 0, 0]);
        let c = count(1.0);
        assert!(c.iter().all(|&x| x > 0), "{c:?}");
    }

    #[test]
    fn penalties_change_choice() {
        let logits = [2.0, 1.9, -1.0];
        // Repeat penalty: 2.0/1.5 = 1.33 < 1.9 → token 1 wins when token 0 is in the window.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 1.5;
        }));
        assert_eq!(s.sample(&logits, &[]), 0);
        assert_eq!(s.sample(&logits, &[0]), 1);
        // Outside the window the penalty does not apply.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 1.5;
            p.repeat_last_n = 2;
        }));
        assert_eq!(s.sample(&logits, &[0, 2, 2]), 0);
        // Negative logits are multiplied (pushed further down).
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.repeat_penalty = 2.0;
        }));
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]), 1);
        // Frequency penalty grows with count; presence is flat.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.frequency_penalty = 0.06;
        }));
        assert_eq!(s.sample(&logits, &[0]), 0); // 2.0 - 0.06 = 1.94 > 1.9
        assert_eq!(s.sample(&logits, &[0, 0]), 1); // 2.0 - 0.12 = 1.88 < 1.9
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.presence_penalty = 0.2;
        }));
        assert_eq!(s.sample(&logits, &[0]), 1);
        assert_eq!(s.sample(&logits, &[0, 1]), 0);
    }

    #[test]
    fn logit_bias_moves_and_bans() {
        let logits = [2.0, 1.9, -1.0];
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(1, 0.2)];
        }));
        assert!(!s.is_plain_greedy(0), "a bias must keep the row off the device's arg-max");
        assert_eq!(s.sample(&logits, &[]), 1);
        // A ban wins over everything; ids past the vocabulary are ignored.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(0, f32::NEG_INFINITY), (1, f32::NEG_INFINITY), (99, 50.0)];
        }));
        assert_eq!(s.sample(&logits, &[]), 2);
        // Sampled: a banned token never comes; a large bias makes a token all but certain.
        let mut s = Sampler::new(params(|p| {
            p.temperature = 1.0;
            p.top_k = 0;
            p.top_p = 1.0;
            p.min_p = 0.0;
            p.logit_bias = vec![(0, f32::NEG_INFINITY)];
        }));
        assert!((0..500).all(|_| s.sample(&logits, &[]) != 0));
        let mut s = Sampler::new(params(|p| {
            p.temperature = 1.0;
            p.logit_bias = vec![(2, 100.0)];
        }));
        assert!((0..500).all(|_| s.sample(&logits, &[]) == 2));
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0, 3.0];
        let mut s = Sampler::new(SamplerParams::greedy());
        let id = s.sample(&logits, &[]);
        assert_eq!(id, 2);
        let (lp, top) = s.logprobs(&logits, 2);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp - (3.0f32.exp() / z).ln()).abs() < 1e-5);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 3]);
        let total: f32 = (0..4).map(|i| s.logprobs_for(&logits, i, 0).0.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn no_realloc_after_first_call() {
        let logits: Vec<f32> = (0..4096).map(|i| (i % 13) as f32).collect();
        let mut s = Sampler::new(params(|p| {
            p.repeat_penalty = 1.1;
            p.logit_bias = vec![(3, -1.0), (7, f32::NEG_INFINITY)];
        }));
        let hist: Vec<u32> = (0..100).collect();
        s.sample(&logits, &hist);
        let (c1, w1) = (s.cand.as_ptr(), s.window.as_ptr());
        for _ in 0..10 {
            s.sample(&logits, &hist);
        }
        assert_eq!((c1, w1), (s.cand.as_ptr(), s.window.as_ptr()));
    }
}
