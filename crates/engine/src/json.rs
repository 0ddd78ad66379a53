//! JSON mode: generation constrained to one JSON object (OpenAI's `response_format`
//! `{"type": "json_object"}`).
//!
//! [`JsonState`] is a byte-level recogniser of RFC 8259 JSON whose top-level value is an object:
//! a stack of open containers (one bit each: object or array), what the grammar expects next,
//! and the lexer state of a string, number or literal in progress. It is `Copy` (a few words), so
//! trying a token costs no allocation. [`JsonVocab`] holds the vocabulary's byte strings in sorted
//! order with each one's common prefix with the one before; [`JsonVocab::mask`] walks them once
//! per step, reusing the states of the shared prefix, and sets the logit of every token that
//! would break the syntax to `-inf`. Once the object is closed only end-of-generation tokens
//! remain. Written by hand: no crate offers an incremental JSON recogniser over token bytes.
//!
//! Limits that keep a constrained model from looping: at most [`MAX_DEPTH`] nested containers,
//! at most [`MAX_WS`] whitespace bytes in a row outside strings. Raw control bytes are refused in
//! strings (JSON's rule), so a string ends or escapes its newlines.

/// Deepest nesting of objects and arrays.
pub const MAX_DEPTH: u32 = 64;
/// Most whitespace bytes in a row between tokens of the JSON text, of which at most one line
/// break (`\n` or `\r`): indentation, not blank lines (a constrained model otherwise likes
/// to pad its answer with them).
pub const MAX_WS: u8 = 32;

/// One whitespace byte `b` of a run whose count so far is `ws` (its high bit: a line break
/// seen); false when the run is over its limits ([`MAX_WS`]).
pub(crate) fn ws_run(ws: &mut u8, b: u8) -> bool {
    let brk = matches!(b, b'\n' | b'\r');
    if *ws & 0x7f >= MAX_WS || brk && *ws & 0x80 != 0 {
        return false;
    }
    *ws += 1;
    if brk {
        *ws |= 0x80;
    }
    true
}

/// What comes next, outside a string, number or literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The top-level object's `{` (whitespace first allowed).
    Start,
    /// A value (after `:` or `,` in an array).
    Value,
    /// A value or `]` (just after `[`).
    ValueOrEnd,
    /// A key's `"` or `}` (just after `{`).
    KeyOrEnd,
    /// A key's `"` (after `,` in an object).
    Key,
    /// `:` after a key.
    Colon,
    /// `,` or the open container's closer.
    CommaOrEnd,
    /// The top-level object is closed: nothing more.
    Done,
}

/// A token in progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lex {
    None,
    /// Inside a string (`key`: an object key, followed by `:`); `esc`: 0 none, 1 after `\`,
    /// 2..=5 hex digits of `\u` still to come (5 = four).
    Str {
        key: bool,
        esc: u8,
    },
    /// A number: the part being read.
    Num(Num),
    /// `true`, `false` or `null`: which, and how many bytes matched.
    Lit {
        word: u8,
        at: u8,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    /// After `-`.
    Minus,
    /// After a leading `0`.
    Zero,
    Int,
    /// After `.`.
    Dot,
    Frac,
    /// After `e` / `E`.
    Exp,
    /// After the exponent's sign.
    ExpSign,
    ExpInt,
}

const WORDS: [&[u8]; 3] = [b"true", b"false", b"null"];

/// The recogniser's state; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonState {
    /// Bit `i` set: the container at depth `i` (0 = outermost) is an array, else an object.
    arrays: u64,
    depth: u32,
    expect: Expect,
    lex: Lex,
    /// Whitespace bytes in a row.
    ws: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        Self::new()
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl JsonState {
    /// Before the first byte.
    pub const fn new() -> Self {
        JsonState { arrays: 0, depth: 0, expect: Expect::Start, lex: Lex::None, ws: 0 }
    }

    /// True once the top-level object is closed (only end-of-generation may follow).
    pub fn done(&self) -> bool {
        self.expect == Expect::Done
    }

    /// Feeds `bytes`; false (the state then undefined) at the first byte the grammar refuses.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.step(b))
    }

    fn in_array(&self) -> bool {
        self.depth > 0 && self.arrays >> (self.depth - 1) & 1 == 1
    }

    fn open(&mut self, array: bool) -> bool {
        if self.depth >= MAX_DEPTH {
            return false;
        }
        self.arrays = (self.arrays & !(1 << self.depth)) | ((array as u64) << self.depth);
        self.depth += 1;
        self.expect = if array { Expect::ValueOrEnd } else { Expect::KeyOrEnd };
        true
    }

    fn close(&mut self, array: bool) -> bool {
        if self.depth == 0 || self.in_array() != array {
            return false;
        }
        self.depth -= 1;
        self.value_ended();
        true
    }

    /// A value ended: the container's `,` or closer next, or the end at the top level.
    fn value_ended(&mut self) {
        self.expect = if self.depth == 0 { Expect::Done } else { Expect::CommaOrEnd };
    }

    /// A value starting with `b` where one is expected.
    fn start_value(&mut self, b: u8) -> bool {
        match b {
            b'{' => self.open(false),
            b'[' => self.open(true),
            b'"' => {
                self.lex = Lex::Str { key: false, esc: 0 };
                true
            }
            b'-' => {
                self.lex = Lex::Num(Num::Minus);
                true
            }
            b'0' => {
                self.lex = Lex::Num(Num::Zero);
                true
            }
            b'1'..=b'9' => {
                self.lex = Lex::Num(Num::Int);
                true
            }
            b't' | b'f' | b'n' => {
                self.lex = Lex::Lit { word: [b't', b'f', b'n'].iter().position(|&c| c == b).unwrap_or(0) as u8, at: 1 };
                true
            }
            _ => false,
        }
    }

    /// One byte.
    pub fn step(&mut self, b: u8) -> bool {
        match self.lex {
            Lex::Str { key, esc } => return self.string(key, esc, b),
            Lex::Lit { word, at } => {
                let w = WORDS[word as usize];
                if w.get(at as usize) != Some(&b) {
                    return false;
                }
                if at as usize + 1 == w.len() {
                    self.lex = Lex::None;
                    self.value_ended();
                } else {
                    self.lex = Lex::Lit { word, at: at + 1 };
                }
                return true;
            }
            Lex::Num(n) => match (n, b) {
                (Num::Minus, b'0') => return self.num(Num::Zero),
                (Num::Minus, b'1'..=b'9') => return self.num(Num::Int),
                (Num::Int, b'0'..=b'9') => return self.num(Num::Int),
                (Num::Zero | Num::Int, b'.') => return self.num(Num::Dot),
                (Num::Dot | Num::Frac, b'0'..=b'9') => return self.num(Num::Frac),
                (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => return self.num(Num::Exp),
                (Num::Exp, b'+' | b'-') => return self.num(Num::ExpSign),
                (Num::Exp | Num::ExpSign | Num::ExpInt, b'0'..=b'9') => return self.num(Num::ExpInt),
                (Num::Zero | Num::Int | Num::Frac | Num::ExpInt, _) => {
                    // The number ended before this byte, which comes after it.
                    self.lex = Lex::None;
                    self.value_ended();
                }
                _ => return false,
            },
            Lex::None => {}
        }
        if is_ws(b) {
            return self.expect != Expect::Done && ws_run(&mut self.ws, b);
        }
        self.ws = 0;
        match self.expect {
            Expect::Start => b == b'{' && self.open(false),
            Expect::Value => self.start_value(b),
            Expect::ValueOrEnd => b == b']' && self.close(true) || b != b']' && self.start_value(b),
            Expect::KeyOrEnd | Expect::Key if b == b'"' => {
                self.lex = Lex::Str { key: true, esc: 0 };
                true
            }
            Expect::KeyOrEnd => b == b'}' && self.close(false),
            Expect::Key => false,
            Expect::Colon => {
                let ok = b == b':';
                self.expect = Expect::Value;
                ok
            }
            Expect::CommaOrEnd => match b {
                b',' => {
                    self.expect = if self.in_array() { Expect::Value } else { Expect::Key };
                    true
                }
                b']' => self.close(true),
                b'}' => self.close(false),
                _ => false,
            },
            Expect::Done => false,
        }
    }

    fn num(&mut self, n: Num) -> bool {
        self.lex = Lex::Num(n);
        true
    }

    fn string(&mut self, key: bool, esc: u8, b: u8) -> bool {
        match esc {
            0 => match b {
                b'"' => {
                    self.lex = Lex::None;
                    if key {
                        self.expect = Expect::Colon;
                    } else {
                        self.value_ended();
                    }
                    true
                }
                b'\\' => {
                    self.lex = Lex::Str { key, esc: 1 };
                    true
                }
                0..=0x1f => false,
                _ => true,
            },
            1 => {
                let next = match b {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 0,
                    b'u' => 5,
                    _ => return false,
                };
                self.lex = Lex::Str { key, esc: next };
                true
            }
            _ => {
                if !b.is_ascii_hexdigit() {
                    return false;
                }
                self.lex = Lex::Str { key, esc: if esc == 2 { 0 } else { esc - 1 } };
                true
            }
        }
    }
}

/// A byte-level recogniser [`JsonVocab::mask`] can walk a vocabulary with: its state is
/// copied for each token tried, so it must be small and `Copy`. `Cx` is what every step reads
/// and no state owns (a compiled schema; nothing for [`JsonState`]).
pub trait Grammar: Copy {
    type Cx: ?Sized;
    /// One byte; false when the grammar refuses it (the state is then undefined).
    fn step(&mut self, cx: &Self::Cx, b: u8) -> bool;
    /// The value is complete: only end-of-generation may follow.
    fn done(&self) -> bool;
    /// Inside a string whose bytes are free (not after `\`, not a key or an enumerated
    /// value): a token without `"`, `\` or control bytes leaves the state as it is.
    fn plain_string(&self) -> bool;
    /// Feeds `bytes`; false at the first byte the grammar refuses.
    fn feed(&mut self, cx: &Self::Cx, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.step(cx, b))
    }
}

impl Grammar for JsonState {
    type Cx = ();
    fn step(&mut self, _: &(), b: u8) -> bool {
        JsonState::step(self, b)
    }
    fn done(&self) -> bool {
        JsonState::done(self)
    }
    fn plain_string(&self) -> bool {
        matches!(self.lex, Lex::Str { esc: 0, .. })
    }
}

/// A vocabulary's token bytes in sorted order, for [`JsonVocab::mask`].
#[derive(Debug, Clone)]
pub struct JsonVocab {
    /// Every token with bytes (control tokens are left out), sorted by its bytes.
    all: Sorted,
    /// The tokens a string may hold whole (no `"`, `\`, or control byte): inside a string
    /// they are all allowed and leave the state as it was, so a mask there walks only `rest`,
    /// the others.
    plain: Vec<u32>,
    rest: Sorted,
    /// End-of-generation ids: allowed once the object is closed, never before.
    eog: Vec<u32>,
    n_vocab: usize,
}

/// Tokens sorted by their bytes: `(token id, start in bytes, length, common prefix with the
/// entry before)`.
#[derive(Debug, Clone, Default)]
struct Sorted {
    order: Vec<(u32, u32, u16, u16)>,
    bytes: Vec<u8>,
}

impl Sorted {
    fn new<'a>(tokens: impl Iterator<Item = (&'a [u8], u32)>) -> Sorted {
        let mut s = Sorted::default();
        let mut prev: &[u8] = &[];
        for (p, id) in tokens {
            let p = &p[..p.len().min(u16::MAX as usize)];
            let lcp = p.iter().zip(prev).take_while(|(a, b)| a == b).count();
            s.order.push((id, s.bytes.len() as u32, p.len() as u16, lcp as u16));
            s.bytes.extend_from_slice(p);
            prev = p;
        }
        s
    }

    /// Copies `raw[id]` to `out[id]` for every token `state` takes (see [`JsonVocab::mask`]).
    fn walk<G: Grammar>(&self, cx: &G::Cx, state: &G, raw: &[f32], out: &mut [f32], states: &mut Vec<G>) {
        let n = raw.len().min(out.len());
        // states[k]: the state after the current token's first k bytes; `dead`: the shortest
        // prefix of it that failed (tokens sharing it fail too).
        states.clear();
        states.push(*state);
        let mut dead = usize::MAX;
        for &(id, start, len, lcp) in &self.order {
            let (len, lcp) = (len as usize, lcp as usize);
            if dead <= lcp {
                continue;
            }
            dead = usize::MAX;
            states.truncate(lcp + 1);
            let t = &self.bytes[start as usize..start as usize + len];
            let mut ok = true;
            for (k, &b) in t.iter().enumerate().skip(lcp) {
                let mut s = states[k];
                if !s.step(cx, b) {
                    dead = k + 1;
                    ok = false;
                    break;
                }
                states.push(s);
            }
            if ok && (id as usize) < n {
                out[id as usize] = raw[id as usize];
            }
        }
    }
}

impl JsonVocab {
    /// From each token's bytes (`piece(id)`, empty for control tokens) and the
    /// end-of-generation ids.
    pub fn new(n_vocab: usize, piece: impl Fn(u32) -> Vec<u8>, eog: &[u32]) -> JsonVocab {
        let mut toks: Vec<(Vec<u8>, u32)> = (0..n_vocab as u32).map(|id| (piece(id), id)).filter(|(p, _)| !p.is_empty()).collect();
        toks.sort_unstable();
        let plain_bytes = |p: &[u8]| p.iter().all(|&b| b >= 0x20 && b != b'"' && b != b'\\');
        JsonVocab {
            all: Sorted::new(toks.iter().map(|(p, id)| (p.as_slice(), *id))),
            plain: toks.iter().filter(|(p, _)| plain_bytes(p)).map(|(_, id)| *id).collect(),
            rest: Sorted::new(toks.iter().filter(|(p, _)| !plain_bytes(p)).map(|(p, id)| (p.as_slice(), *id))),
            eog: eog.to_vec(),
            n_vocab,
        }
    }

    /// From a tokenizer: each token's decoded bytes (control tokens and end-of-generation give
    /// none: they never take part in the text), and its end-of-generation ids.
    pub fn for_tokenizer(tok: &crate::Tokenizer) -> JsonVocab {
        JsonVocab::new(
            tok.vocab_size(),
            |id| if tok.is_eog(id) { Vec::new() } else { tok.token_bytes(id, false).into_owned() },
            tok.eog_tokens(),
        )
    }

    /// Whether the first byte of a JSON object is some token's (false for a vocabulary
    /// without the bytes JSON needs, such as a synthetic model's).
    pub fn usable(&self) -> bool {
        let raw = vec![0f32; self.n_vocab];
        let mut out = vec![0f32; self.n_vocab];
        self.mask(&(), &JsonState::new(), &raw, &mut out, &mut Vec::new());
        out.iter().any(|v| v.is_finite())
    }

    /// Writes `raw`'s logits to `out` for the tokens `state` can take, `-inf` for the others:
    /// those whose bytes break the syntax, control tokens, and end-of-generation before the
    /// value is complete (after it, everything else). `states` is scratch (kept between calls,
    /// it stops allocating once it holds the longest token's states).
    pub fn mask<G: Grammar>(&self, cx: &G::Cx, state: &G, raw: &[f32], out: &mut [f32], states: &mut Vec<G>) {
        out.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        let n = raw.len().min(out.len());
        if state.done() {
            for &e in &self.eog {
                if (e as usize) < n {
                    out[e as usize] = raw[e as usize];
                }
            }
            return;
        }
        if state.plain_string() {
            for &id in &self.plain {
                if (id as usize) < n {
                    out[id as usize] = raw[id as usize];
                }
            }
            self.rest.walk(cx, state, raw, out, states);
        } else {
            self.all.walk(cx, state, raw, out, states);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accepts(text: &str) -> bool {
        let mut s = JsonState::new();
        s.feed(text.as_bytes()) && s.done()
    }

    fn prefix_ok(text: &str) -> bool {
        JsonState::new().feed(text.as_bytes())
    }

    #[test]
    fn whole_documents() {
        for good in [
            "{}",
            " {\"a\": 1}",
            "{\"a\":[1,-2.5e+3,0,0.25,true,false,null,\"x\\\"y\\u00e9\"],\"b\":{\"c\":[]}}",
            "{\n  \"name\": \"Zoë\",\n  \"tags\": [ ]\n}",
            "{\"n\": -0}",
            "{\"e\": 1E5}",
        ] {
            assert!(accepts(good), "{good}");
        }
        for bad in [
            "[]",
            "1",
            "{\"a\" 1}",
            "{\"a\":}",
            "{,}",
            "{\"a\":1,}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":.5}",
            "{\"a\":tru}",
            "{\"a\":\"x\ny\"}",
            "{\"a\":\"\\q\"}",
            "{\"a\":\"\\u12G4\"}",
            "{\"a\":[1}",
            "{\"a\":{]}",
            "{} {}",
            "{}x",
            "{\"a\":-}",
            "{\"a\":1e}",
            "{'a':1}",
        ] {
            assert!(!accepts(bad), "{bad}");
        }
        // Prefixes of good documents are fine on the way.
        assert!(prefix_ok("{\"a\": [1, 2") && prefix_ok("{\"a\": \"\\u00") && prefix_ok("{\"a\": 1.5e-"));
        // A number ends at the byte after it, which then counts.
        let mut s = JsonState::new();
        assert!(s.feed(b"{\"a\":12") && !s.done() && s.feed(b"}") && s.done());
    }

    /// Random documents (compact and pretty) are accepted, and each with one byte changed is
    /// accepted exactly when serde_json reads an object from it (documents ending in whitespace
    /// and `\u` escapes left out: the one ends generation here, the other may be a lone
    /// surrogate, which serde_json refuses).
    #[test]
    fn agrees_with_serde_json() {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha20Rng::seed_from_u64(5);
        fn value(r: &mut rand_chacha::ChaCha20Rng, depth: u32) -> serde_json::Value {
            use serde_json::json;
            match r.random_range(0..if depth > 3 { 5 } else { 7 }) {
                0 => json!(null),
                1 => json!(r.random_bool(0.5)),
                2 => json!(r.random_range(-1000..1000)),
                3 => json!(r.random_range(-1e6f64..1e6) / 7.0),
                4 => json!(["", "a b", "q\"t", "tab\tnl\n", "é✓", "\\"][r.random_range(0..6)]),
                5 => serde_json::Value::Array((0..r.random_range(0..4)).map(|_| value(r, depth + 1)).collect()),
                _ => serde_json::Value::Object((0..r.random_range(0..4)).map(|i| (format!("k{i}"), value(r, depth + 1))).collect()),
            }
        }
        let alphabet = b"{}[]\":,019.-+eEtrufalsn\\ x";
        let (mut agreed, mut valid_mutants) = (0, 0);
        for i in 0..3000 {
            let obj = serde_json::Value::Object((0..r.random_range(0..4)).map(|k| (format!("f{k}"), value(&mut r, 1))).collect());
            let text = if i % 2 == 0 { serde_json::to_string(&obj) } else { serde_json::to_string_pretty(&obj) }.expect("serialise");
            assert!(accepts(&text), "{text}");
            let mut b = text.into_bytes();
            let at = r.random_range(0..b.len());
            b[at] = alphabet[r.random_range(0..alphabet.len())];
            let Ok(m) = String::from_utf8(b) else { continue };
            // (nor two line breaks in one run of whitespace: allowed by JSON, not here)
            let two_breaks = m.split(|c: char| !c.is_ascii_whitespace()).any(|run| run.matches(['\n', '\r']).count() > 1);
            if m.ends_with(is_ws_char) || m.contains("\\u") || two_breaks {
                continue;
            }
            let parsed = serde_json::from_str::<serde_json::Value>(&m);
            if parsed.as_ref().is_err_and(|e| e.to_string().contains("out of range")) {
                continue; // (syntax, but beyond f64: serde_json's limit, not JSON's)
            }
            let theirs = parsed.is_ok_and(|v| v.is_object());
            assert_eq!(accepts(&m), theirs, "{m}");
            agreed += 1;
            valid_mutants += theirs as usize;
        }
        assert!(agreed > 2000 && valid_mutants > 100, "{agreed} compared, {valid_mutants} valid");
    }

    fn is_ws_char(c: char) -> bool {
        c.is_ascii() && is_ws(c as u8)
    }

    #[test]
    fn limits() {
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH as usize - 1));
        assert!(prefix_ok(&deep));
        assert!(!prefix_ok(&format!("{deep}[")));
        assert!(prefix_ok(&format!("{{{}", " ".repeat(MAX_WS as usize))));
        assert!(prefix_ok("{\n    \"a\":\n 1") && !prefix_ok("{\n\n") && !prefix_ok("{ \r\n"), "one line break a run");
        assert!(!prefix_ok(&format!("{{{}", " ".repeat(MAX_WS as usize + 1))));
        assert!(prefix_ok(&format!("{{\"{}\"", " ".repeat(500))), "whitespace inside strings is text");
    }

    #[test]
    fn mask_follows_the_grammar() {
        let pieces: Vec<&[u8]> = vec![b"{", b"}", b"{\"", b"\"a\"", b":", b" 1", b"x", b"", b"\":", b"}}", b"\"", b"1"];
        let eos = 7u32; // no bytes: a control token
        let v = JsonVocab::new(pieces.len(), |i| pieces[i as usize].to_vec(), &[eos]);
        let raw = vec![1f32; pieces.len()];
        let allowed = |s: &JsonState| {
            let mut m = vec![0f32; pieces.len()];
            v.mask(&(), s, &raw, &mut m, &mut Vec::new());
            (0..pieces.len()).filter(|&i| m[i] == 1.0).collect::<Vec<_>>()
        };
        assert_eq!(allowed(&JsonState::new()), [0, 2]); // `{`, `{"`
        let mut s = JsonState::new();
        assert!(s.feed(b"{"));
        assert_eq!(allowed(&s), [1, 3, 8, 10]); // `}`, `"a"`, `":` (a key holding `:`), `"`
        assert!(s.feed(b"\"a\""));
        assert_eq!(allowed(&s), [4]);
        assert!(s.feed(b":"));
        assert_eq!(allowed(&s), [0, 2, 3, 5, 8, 10, 11]); // objects, strings, numbers
        assert!(s.feed(b" 1"));
        assert_eq!(allowed(&s), [1, 11]); // `}` ends it; `1` continues the number (`}}` closes one too many)
        assert!(s.feed(b"}") && s.done());
        assert_eq!(allowed(&s), [eos as usize]);
        assert!(v.usable());
    }

    /// What a mask costs on the shipped vocabularies (`cargo test --release -p ts-engine
    /// json_mask_speed -- --ignored --nocapture`).
    #[test]
    #[ignore = "a benchmark, not a check: prints what a mask costs on the shipped vocabularies"]
    fn json_mask_speed() {
        for name in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"] {
            let Some(path) = crate::tokenizer::test_model_path(name) else { continue };
            let src = ts_formats::open_model(&path).expect("open");
            let tok = crate::Tokenizer::from_gguf_metadata(src.metadata()).expect("tokenizer");
            let t0 = std::time::Instant::now();
            let v = JsonVocab::for_tokenizer(&tok);
            let built = t0.elapsed();
            let raw = vec![0f32; tok.vocab_size()];
            let mut out = raw.clone();
            let mut states = Vec::new();
            for prefix in ["", "{", "{\"name\": \"Zo", "{\"a\": [1, 2.5", "{\"a\": {\"b\": true}"] {
                let mut s = JsonState::new();
                assert!(s.feed(prefix.as_bytes()));
                let t = std::time::Instant::now();
                for _ in 0..20 {
                    v.mask(&(), &s, &raw, &mut out, &mut states);
                }
                let per = t.elapsed() / 20;
                let allowed = out.iter().filter(|x| x.is_finite()).count();
                eprintln!("{name}: built in {built:?}; after {prefix:?}: {allowed} of {} tokens allowed, {per:?} a mask", tok.vocab_size());
            }
        }
    }
}
