//! # ts-engine — the text side of the runtime
//!
//! * [`tokenizer`] — GGUF vocabularies (byte-level BPE, SentencePiece-style, none) on the HF
//!   `tokenizers` crate, plus a UTF-8-safe streaming detokenizer.
//! * [`chat`]      — chat templates (`tokenizer.chat_template`) rendered with minijinja, sandboxed.
//! * [`sampler`]   — llama.cpp-style sampling (penalties, top-k, temperature, top-p, min-p).
//! * [`json`]      — JSON mode: the tokens that keep the output one JSON object.
//! * [`json_schema`] — structured output: the tokens that keep it to a JSON schema.
//! * [`hub`]       — the model cache: known models fetched with pip, sha256-checked.
//! * [`session`]   — one sequence over a model's cache slot: chunked prefill, decode, logits.

pub mod chat;
pub mod hub;
pub mod json;
pub mod json_schema;
pub mod sampler;
pub mod session;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use sampler::{Sampler, SamplerParams};
pub use tokenizer::{test_model_path, StreamDecoder, Tokenizer};
