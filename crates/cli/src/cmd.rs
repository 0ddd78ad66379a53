//! The subcommands.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use rayon::prelude::*;
use ts_engine::hub;
use ts_engine::json::{Grammar, JsonState, JsonVocab};
use ts_engine::json_schema::Schema;
use ts_engine::sampler::{Sampler, SamplerParams};
use ts_engine::session::Session;
use ts_engine::tokenizer::{StreamDecoder, Tokenizer};
use ts_formats::GgmlType;

use crate::load::{self, Loaded};
use crate::ModelOpts;

/// Sampling flags, named as llama.cpp names them.
#[derive(Args, Clone, Debug)]
pub struct SampleOpts {
    /// Temperature; 0 = greedy (always the most likely token).
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability sums to P (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many recent tokens --repeat-penalty looks at.
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtract this from the logit of every token already in the last --repeat-last-n (0 = off).
    #[arg(long = "presence-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Subtract this times its count from the logit of every token in the last --repeat-last-n
    /// (0 = off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Add BIAS to a token's logit, as TOKEN_ID+BIAS or TOKEN_ID-BIAS (repeatable; llama.cpp's
    /// form). TOKEN_ID-inf bans the token: `-l 13-inf` never writes id 13. Ids come from
    /// `turbospark tokenize`.
    #[arg(short = 'l', long = "logit-bias", value_name = "TOKEN_ID(+|-)BIAS", value_parser = parse_logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Random seed; the same seed gives the same text (default: random).
    #[arg(short = 's', long = "seed")]
    pub seed: Option<u64>,
}

/// One `--logit-bias` value: `ID+B`, `ID-B` or `ID-inf` (llama.cpp's syntax; `ID=B` also).
fn parse_logit_bias(s: &str) -> std::result::Result<(u32, f32), String> {
    let at = s.find(['+', '-', '=']).ok_or_else(|| format!("'{s}' is not TOKEN_ID+BIAS, TOKEN_ID-BIAS or TOKEN_ID-inf"))?;
    let id = s[..at].trim().parse::<u32>().map_err(|_| format!("'{}' in '{s}' is not a token id", &s[..at]))?;
    let rest = s[at..].strip_prefix('=').unwrap_or(&s[at..]).trim();
    let b = match rest {
        "-inf" | "-Inf" | "-INF" => f32::NEG_INFINITY,
        _ => rest.parse::<f32>().ok().filter(|b| b.is_finite()).ok_or_else(|| format!("'{rest}' in '{s}' is not a finite bias or -inf"))?,
    };
    Ok((id, b))
}

impl SampleOpts {
    /// The sampler's parameters, for a model of `n_vocab` tokens (every --logit-bias id inside).
    fn params(&self, n_vocab: usize) -> Result<SamplerParams> {
        if let Some(&(id, _)) = self.logit_bias.iter().find(|e| e.0 as usize >= n_vocab) {
            bail!("--logit-bias: token id {id} is outside the vocabulary (0..{n_vocab})");
        }
        Ok(SamplerParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.clone(),
            seed: self.seed,
        })
    }
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    #[command(flatten)]
    pub s: SampleOpts,
    /// Tokens to generate (generation also stops at the model's end-of-generation token).
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Do not stop at end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Read the prompt from a file instead.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Wrap the prompt as one user turn with the model's chat template (for instruct models).
    #[arg(long)]
    pub chat: bool,
    /// JSON mode: only tokens that keep the output one JSON object are sampled, and generation
    /// ends when the object closes (the server's `response_format` `json_object`). Ask for JSON
    /// in the prompt too: the model still chooses what goes in it.
    #[arg(long)]
    pub json: bool,
    /// JSON mode with a schema: the output is a JSON document of the JSON Schema in FILE (the
    /// server's `response_format` `json_schema`; the subset `ts_engine::json_schema` supports:
    /// objects whose properties are all written, arrays, strings, numbers, integers, booleans,
    /// null, enums). Implies --json.
    #[arg(long = "json-schema", value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
    /// Prompt as token ids (e.g. 1,2,3) instead of text; the generated ids are printed as a JSON
    /// array. Works with models that have no tokenizer (synthetic ones).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "file", "chat"])]
    pub tokens: Option<Vec<u32>>,
    /// The prompt, used raw (no chat template; see `chat` for that).
    pub prompt: Option<String>,
}

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    #[command(flatten)]
    pub s: SampleOpts,
    /// System prompt.
    #[arg(long = "system")]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    pub n_predict: usize,
}

#[derive(Args)]
pub struct TokenizeArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    /// Do not add BOS even when the model asks for it.
    #[arg(long)]
    pub no_bos: bool,
    pub text: String,
}

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', conflicts_with = "text")]
    pub tokens: Option<Vec<u32>>,
    /// Or text to tokenise (BOS as the model says).
    #[arg(long)]
    pub text: Option<String>,
    /// Output .npy file (float32 [n_tokens, vocab]).
    #[arg(short = 'o', long)]
    pub output: PathBuf,
}

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    /// Text file to score.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Stop after this many windows (default: all).
    #[arg(long)]
    pub chunks: Option<usize>,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub m: ModelOpts,
    /// Prompt tokens to process (pp test); 0 skips it.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Tokens to generate one at a time (tg test); 0 skips it.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Context already in the cache before the tg test (decode at depth); with --parallel, in
    /// each sequence's cache before its steps.
    #[arg(short = 'd', long = "depth", default_value_t = 0)]
    pub depth: usize,
    /// Repetitions (the median is reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub reps: usize,
    /// Also decode this many sequences at once (one token each per forward, each in its own
    /// cache slot, greedy) for --n-gen steps and report the aggregate tok/s, as a server with that
    /// many concurrent requests would (test `tg128 x64`).
    #[arg(long = "parallel", value_name = "N", default_value_t = 0)]
    pub parallel: usize,
    /// With --parallel N: also time N prompts of this many random tokens, one a sequence,
    /// prefilled together in forwards of up to the batch size (-b), slot after slot, each
    /// sequence's last token picked greedily on the backend: what a server does with N requests
    /// that arrive at once (test `pp32 x64`, prompt tokens a second; with the server's prefill
    /// chunk as -b, e.g. `-b 1024` on CUDA).
    #[arg(long = "parallel-prompt", value_name = "TOKENS", default_value_t = 0)]
    pub parallel_prompt: usize,
    /// Print a hash of the greedy tokens each generation test produced, to compare builds,
    /// backends or switches such as TS_CUDA_GRAPHS=0: equal hashes, same tokens. It covers the
    /// warm-up and every repetition, each of which starts from its own token, so only runs with
    /// the same -r (and -n, -d, --parallel) can be compared.
    #[arg(long = "hash")]
    pub hash: bool,
    /// Copy every sequence's logits to the host and pick the arg-max there (the default picks it
    /// on the backend and copies back one id per sequence, as the server does for greedy rows).
    #[arg(long = "host-argmax")]
    pub host_argmax: bool,
    /// Enqueue each decode step only after the previous pick reached the host (the default
    /// chains steps on the device where the backend can: the next step is enqueued with the
    /// previous pick still on the device, so the host's turn overlaps the device's work).
    #[arg(long = "no-chain")]
    pub no_chain: bool,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Model: a .gguf file, an HF folder, or a known name.
    pub model: String,
    /// Print every tensor (default: the first 40).
    #[arg(long)]
    pub all: bool,
    /// Also load the model and print its geometry (default: metadata only).
    #[arg(long)]
    pub load: bool,
    /// Scan every tensor for NaN and Inf values (dequantising each block); exit 1 if any.
    #[arg(long)]
    pub check: bool,
}

#[derive(Args)]
pub struct SynthArgs {
    /// Shape preset: deepseek-v2-lite, tiny (deepseek2); llama-tiny, gemma3-tiny, smollm2-135m or
    /// gemma3-270m (the real small models' quantisation mixes, the last two at their real shapes;
    /// --quant does not apply to these four).
    #[arg(long, default_value = "deepseek-v2-lite")]
    pub preset: String,
    /// Weight type of the matrices: q8_0, bf16, f16 or f32 (norms and the router stay f32).
    #[arg(long, default_value = "q8_0")]
    pub quant: String,
    /// Output .gguf file (or a folder with --hf).
    #[arg(short = 'o', long)]
    pub output: PathBuf,
    /// Write a Hugging Face folder (config.json + model.safetensors) instead of GGUF.
    #[arg(long, conflicts_with = "legacy")]
    pub hf: bool,
    /// Write the legacy GGUF layout (one attn_kv_b) instead of the MLA layout (attn_k_b/attn_v_b).
    #[arg(long)]
    pub legacy: bool,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

fn tokenizer_of(l: &Loaded) -> Result<Tokenizer> {
    Tokenizer::from_gguf_metadata(l.src.metadata()).with_context(|| format!("{}: tokenizer", l.path.display()))
}

/// Streams generated tokens to stdout; returns (generated count, seconds spent generating).
fn generate(
    sess: &mut Session,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    n: usize,
    ignore_eos: bool,
    out: &mut dyn Write,
) -> Result<(usize, f64)> {
    generate_json(sess, tok, sampler, n, ignore_eos, None, out)
}

/// JSON mode's generation loop: each pick from the logits masked to the tokens that keep the
/// text in `state`'s grammar, until the document is complete.
#[allow(clippy::too_many_arguments)]
fn constrained<G: Grammar>(
    sess: &mut Session,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    n: usize,
    v: &JsonVocab,
    cx: &G::Cx,
    mut state: G,
    out: &mut dyn Write,
    t0: Instant,
) -> Result<(usize, f64)> {
    let mut dec = StreamDecoder::new(tok);
    let (mut count, mut row, mut walk) = (0, vec![0f32; sess.logits.len()], Vec::new());
    while count < n {
        if sess.pos >= sess.ctx() {
            eprintln!("\nturbospark: context full ({} tokens)", sess.ctx());
            break;
        }
        v.mask(cx, &state, &sess.logits, &mut row, &mut walk);
        let id = sampler.sample(&row, &sess.tokens);
        if tok.is_eog(id) || !state.feed(cx, &tok.token_bytes(id, false)) {
            break;
        }
        count += 1;
        out.write_all(dec.push(id).as_bytes())?;
        out.flush()?;
        if state.done() {
            break;
        }
        sess.feed(&[id])?;
    }
    out.write_all(dec.flush().as_bytes())?;
    out.flush()?;
    Ok((count, t0.elapsed().as_secs_f64()))
}

/// [`generate`], in JSON mode with `json` (`run --json`, `--json-schema`): the vocabulary and,
/// with a schema, the schema.
fn generate_json(
    sess: &mut Session,
    tok: &Tokenizer,
    sampler: &mut Sampler,
    n: usize,
    ignore_eos: bool,
    json: Option<(&JsonVocab, Option<&Schema>)>,
    out: &mut dyn Write,
) -> Result<(usize, f64)> {
    let t0 = Instant::now();
    match json {
        Some((v, None)) => return constrained(sess, tok, sampler, n, v, &(), JsonState::new(), out, t0),
        Some((v, Some(schema))) => return constrained(sess, tok, sampler, n, v, schema, schema.start(), out, t0),
        None => {}
    }
    let mut dec = StreamDecoder::new(tok);
    let mut count = 0;
    // A plain greedy sampler takes the backend's arg-max (`Session::feed_for`): one id comes back
    // per token instead of the logits row.
    let mut picked: Option<u32> = None;
    // A plain greedy sampler on a backend that chains steps: after the first pick, each step is
    // enqueued before the previous pick reaches the host (Session::greedy_chain; the same picks).
    let chain = sampler.is_plain_greedy(sess.tokens.len() + 1) && sess.model.chains_argmax();
    for _ in 0..n {
        if sess.pos >= sess.ctx() {
            eprintln!("\nturbospark: context full ({} tokens)", sess.ctx());
            break;
        }
        let id = sampler.next(picked.take(), &sess.logits, &sess.tokens);
        if !ignore_eos && tok.is_eog(id) {
            break;
        }
        count += 1;
        let text = dec.push(id);
        if !text.is_empty() {
            out.write_all(text.as_bytes())?;
            out.flush()?;
        }
        if chain && count < n {
            let mut failed: Option<std::io::Error> = None;
            let mut eog = false;
            sess.greedy_chain(id, n - count, |pick| {
                sampler.take(pick);
                if !ignore_eos && tok.is_eog(pick) {
                    eog = true;
                    return false;
                }
                count += 1;
                let text = dec.push(pick);
                if !text.is_empty() {
                    if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                        failed = Some(e);
                        return false;
                    }
                }
                true
            })?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            if !eog && count < n && sess.pos + 1 >= sess.ctx() {
                eprintln!("\nturbospark: context full ({} tokens)", sess.ctx());
            }
            break;
        }
        picked = sess.feed_for(id, sampler)?;
    }
    let rest = dec.flush();
    out.write_all(rest.as_bytes())?;
    out.flush()?;
    Ok((count, t0.elapsed().as_secs_f64()))
}

pub fn run(a: RunArgs) -> Result<()> {
    if let Some(ids) = &a.tokens {
        return run_tokens(&a, ids);
    }
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f).with_context(|| format!("{}", f.display()))?,
        (Some(_), Some(_)) => bail!("give the prompt either as an argument or with -f, not both"),
        (None, None) => bail!("no prompt: turbospark run \"your prompt\" (or -f FILE)"),
    };
    let schema = match &a.json_schema {
        Some(f) => {
            let text = std::fs::read_to_string(f).with_context(|| format!("--json-schema {}", f.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("--json-schema {}: not JSON", f.display()))?;
            Some(Schema::compile(&v).with_context(|| format!("--json-schema {}", f.display()))?)
        }
        None => None,
    };
    let mut l = load::load(&a.m, Some(&hub::SMOLLM2), 1)?;
    let tok = tokenizer_of(&l)?;
    let ids = if a.chat {
        use ts_engine::chat::{ChatMessage, ChatTemplate};
        let tmpl = ChatTemplate::from_gguf_metadata(l.src.metadata())?;
        let bos_s = tok.bos().and_then(|b| tok.token_str(b)).unwrap_or("").to_string();
        let eos_s = tok.eos().and_then(|b| tok.token_str(b)).unwrap_or("").to_string();
        let text = tmpl.render(&[ChatMessage::new("user", prompt.clone())], true, &bos_s, &eos_s)?;
        tok.encode_with(&text, tok.add_bos() && !starts_with_bos(&tok, &text), true)?
    } else {
        tok.encode(&prompt, true).with_context(|| format!("{}", l.path.display()))?
    };
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    let ctx = l.model.options().ctx;
    if ids.len() >= ctx {
        bail!("the prompt is {} tokens but the context holds {ctx} (raise --ctx-size)", ids.len());
    }
    let mut sampler = Sampler::new(a.s.params(l.model.info().n_vocab)?);
    let mut sess = Session::new(l.model.as_mut(), 0);
    let t0 = Instant::now();
    sess.feed(&ids)?;
    let pp = t0.elapsed().as_secs_f64();
    let mut stdout = std::io::stdout().lock();
    // (the raw prompt is echoed before its continuation, but not in JSON mode: the output is
    // then the object alone, for a pipe)
    if !a.chat && !a.json && a.json_schema.is_none() {
        stdout.write_all(prompt.as_bytes())?;
    }
    let json = (a.json || schema.is_some()).then(|| JsonVocab::for_tokenizer(&tok));
    if json.as_ref().is_some_and(|v| !v.usable()) {
        bail!("--json: this model's tokens cannot write JSON");
    }
    let json = json.as_ref().map(|v| (v, schema.as_ref()));
    let (n, tg) = generate_json(&mut sess, &tok, &mut sampler, a.n_predict, a.ignore_eos, json, &mut stdout)?;
    writeln!(stdout)?;
    if n == 0 && !a.chat {
        eprintln!("turbospark: the model ended its turn at once; for an instruct model try `--chat` (or `turbospark chat`)");
    }
    eprintln!(
        "turbospark: prompt {} tokens in {:.2}s ({:.1} tok/s), generated {} tokens in {:.2}s ({:.1} tok/s)",
        ids.len(),
        pp,
        ids.len() as f64 / pp.max(1e-9),
        n,
        tg,
        n as f64 / tg.max(1e-9)
    );
    Ok(())
}

/// `run --tokens`: ids in, ids out (greedy or sampled), for models without a tokenizer.
fn run_tokens(a: &RunArgs, ids: &[u32]) -> Result<()> {
    let mut l = load::load(&a.m, Some(&hub::SMOLLM2), 1)?;
    let nv = l.model.info().n_vocab;
    if ids.is_empty() {
        bail!("--tokens: no ids given");
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= nv) {
        bail!("token id {bad} is outside the vocabulary ({nv})");
    }
    let ctx = l.model.options().ctx;
    if ids.len() + a.n_predict > ctx {
        bail!("{} prompt + {} generated tokens do not fit the context of {ctx} (raise --ctx-size)", ids.len(), a.n_predict);
    }
    let mut sampler = Sampler::new(a.s.params(l.model.info().n_vocab)?);
    let mut sess = Session::new(l.model.as_mut(), 0);
    let t0 = Instant::now();
    sess.feed(ids)?;
    let pp = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut out = Vec::with_capacity(a.n_predict);
    let mut picked: Option<u32> = None;
    for _ in 0..a.n_predict {
        let id = sampler.next(picked.take(), &sess.logits, &sess.tokens);
        out.push(id);
        picked = sess.feed_for(id, &sampler)?;
    }
    let tg = t1.elapsed().as_secs_f64();
    println!("{}", serde_json::to_string(&out)?);
    eprintln!(
        "turbospark: prompt {} tokens in {:.3}s ({:.1} tok/s), generated {} tokens in {:.3}s ({:.1} tok/s)",
        ids.len(),
        pp,
        ids.len() as f64 / pp.max(1e-9),
        out.len(),
        tg,
        out.len() as f64 / tg.max(1e-9)
    );
    Ok(())
}

pub fn chat(a: ChatArgs) -> Result<()> {
    use ts_engine::chat::{ChatMessage, ChatTemplate};
    let mut l = load::load(&a.m, Some(&hub::SMOLLM2), 1)?;
    let tok = tokenizer_of(&l)?;
    let tmpl = ChatTemplate::from_gguf_metadata(l.src.metadata())?;
    let bos_s = tok.bos().and_then(|b| tok.token_str(b)).unwrap_or("").to_string();
    let eos_s = tok.eos().and_then(|b| tok.token_str(b)).unwrap_or("").to_string();
    let mut sampler = Sampler::new(a.s.params(l.model.info().n_vocab)?);
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &a.system {
        history.push(ChatMessage::new("system", s));
    }
    let mut rl = rustyline::DefaultEditor::new()?;
    eprintln!("turbospark chat: type a message; Ctrl-D or /exit quits, /reset clears the history.");
    let mut sess = Session::new(l.model.as_mut(), 0);
    loop {
        let line = match rl.readline("> ") {
            Ok(l) => l,
            Err(rustyline::error::ReadlineError::Interrupted) => continue,
            Err(_) => break,
        };
        let line = line.trim().to_string();
        if line.is_empty() {
            continue;
        }
        let _ = rl.add_history_entry(&line);
        if line == "/exit" || line == "/quit" {
            break;
        }
        if line == "/reset" {
            history.retain(|m| m.role == "system");
            sess.reset();
            continue;
        }
        history.push(ChatMessage::new("user", &line));
        // Render the whole conversation and re-use the cache for the longest common token prefix.
        let rendered = tmpl.render(&history, true, &bos_s, &eos_s)?;
        let ids = tok.encode_with(&rendered, tok.add_bos() && !starts_with_bos(&tok, &rendered), true)?;
        if ids.len() + 1 >= sess.ctx() {
            eprintln!("turbospark: the conversation no longer fits the context ({} tokens); history cleared", sess.ctx());
            history.retain(|m| m.role == "system");
            sess.reset();
            continue;
        }
        let common = sess.tokens.iter().zip(&ids).take_while(|(a, b)| a == b).count().min(ids.len() - 1);
        sess.rewind(common);
        sess.feed(&ids[common..])?;
        let mut out = Vec::new();
        let mut tee = Tee { buf: &mut out, inner: std::io::stdout() };
        let (n, secs) = generate(&mut sess, &tok, &mut sampler, a.n_predict, false, &mut tee)?;
        println!();
        eprintln!("[{n} tokens, {:.1} tok/s]", n as f64 / secs.max(1e-9));
        history.push(ChatMessage::new("assistant", String::from_utf8_lossy(&out).to_string()));
    }
    Ok(())
}

/// Writes to stdout and keeps a copy.
struct Tee<'a> {
    buf: &'a mut Vec<u8>,
    inner: std::io::Stdout,
}
impl Write for Tee<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        self.inner.write_all(b)?;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let path = load::resolve(a.m.model.as_deref(), Some(&hub::SMOLLM2))?;
    let src = load::open_source(&path)?;
    let tok = Tokenizer::from_gguf_metadata(src.metadata()).with_context(|| format!("{}: tokenizer", path.display()))?;
    let ids = tok.encode(&a.text, !a.no_bos)?;
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

pub fn logits(a: LogitsArgs) -> Result<()> {
    let mut l = load::load(&a.m, None, 1)?;
    let ids = match (&a.tokens, &a.text) {
        (Some(t), _) => t.clone(),
        (None, Some(text)) => tokenizer_of(&l)?.encode(text, true)?,
        (None, None) => bail!("give --tokens 1,2,3 or --text \"...\""),
    };
    if ids.is_empty() {
        bail!("no tokens");
    }
    let nv = l.model.info().n_vocab;
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= nv) {
        bail!("token id {bad} is outside the vocabulary ({nv})");
    }
    let ctx = l.model.options().ctx;
    if ids.len() > ctx {
        bail!("{} tokens do not fit the context of {ctx} (raise --ctx-size)", ids.len());
    }
    let mut out = vec![0f32; ids.len() * nv];
    let mut sess = Session::new(l.model.as_mut(), 0);
    sess.feed_all_logits(&ids, &mut out)?;
    write_npy(&a.output, &out, ids.len(), nv)?;
    eprintln!("turbospark: wrote {} x {} logits to {}", ids.len(), nv, a.output.display());
    Ok(())
}

/// A float32 C-order .npy file (format 1.0). Written by hand: the format is a 10-byte preamble
/// and a Python-dict header, and no well-kept crate writes it without pulling in ndarray.
pub fn write_npy(path: &std::path::Path, data: &[f32], rows: usize, cols: usize) -> Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let tmp = path.with_extension("npy.tmp");
    std::fs::write(&tmp, &bytes).with_context(|| format!("{}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("{}", path.display()))?;
    Ok(())
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("{}", a.file.display()))?;
    let mut l = load::load(&a.m, None, 1)?;
    let tok = tokenizer_of(&l)?;
    let ids = tok.encode(&text, false)?;
    let n_ctx = l.model.options().ctx;
    if n_ctx < 8 {
        bail!("--ctx-size {n_ctx} is too small for perplexity");
    }
    let n_chunks = (ids.len() / n_ctx).min(a.chunks.unwrap_or(usize::MAX));
    if n_chunks == 0 {
        bail!("{}: {} tokens is less than one window of {n_ctx} (lower --ctx-size)", a.file.display(), ids.len());
    }
    let nv = l.model.info().n_vocab;
    let first = n_ctx / 2;
    let mut logits = vec![0f32; n_ctx * nv];
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let t0 = Instant::now();
    eprintln!("turbospark: perplexity over {n_chunks} windows of {n_ctx} tokens, scoring the second half of each");
    for c in 0..n_chunks {
        let mut w: Vec<u32> = ids[c * n_ctx..(c + 1) * n_ctx].to_vec();
        // As llama.cpp: the window starts with BOS when the model uses one.
        if tok.add_bos() {
            if let Some(b) = tok.bos() {
                w[0] = b;
            }
        }
        let mut sess = Session::new(l.model.as_mut(), 0);
        sess.feed_all_logits(&w, &mut logits)?;
        for i in first..n_ctx - 1 {
            let row = &logits[i * nv..(i + 1) * nv];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            let lp = row[w[i + 1] as usize] as f64 - lse;
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
        let ppl = (nll / count as f64).exp();
        eprint!("[{}]{:.4} ", c + 1, ppl);
    }
    eprintln!();
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    let err = ppl * (var / (count as f64 - 1.0).max(1.0)).sqrt();
    println!("Final estimate: PPL = {ppl:.4} +/- {err:.5}");
    eprintln!("turbospark: {count} tokens scored in {:.1}s", t0.elapsed().as_secs_f64());
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let mut m = a.m.clone();
    let need = (a.depth + a.n_prompt.max(1) + a.n_gen).max(a.parallel_prompt);
    if m.ctx_size.is_none() {
        m.ctx_size = Some(need.max(512));
    }
    if a.parallel > 0 && m.batch_size.is_some_and(|b| b < a.parallel) {
        m.batch_size = Some(a.parallel);
    }
    let mut l = load::load(&m, None, 1 + a.parallel)?;
    let ctx = l.model.options().ctx;
    if a.depth + a.n_prompt > ctx || a.depth + a.n_gen > ctx || a.parallel_prompt > ctx {
        bail!("the test needs {need} tokens of context; raise --ctx-size");
    }
    let nv = l.model.info().n_vocab as u32;
    let info = l.model.info().clone();
    let reps = a.reps.max(1);
    // Deterministic pseudo-random tokens (as llama-bench, the text does not matter).
    let mut x = 0x9E3779B97F4A7C15u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % nv as u64) as u32
    };
    println!("| model | backend | size | params | test | t/s |");
    println!("| --- | --- | ---: | ---: | --- | ---: |");
    let label = if info.name.is_empty() { info.arch.clone() } else { info.name.clone() };
    let row = |test: String, v: &mut Vec<f64>| {
        let med = median(v);
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        println!(
            "| {} | {} | {:.2} GiB | {:.2} B | {} | {:.2} (min {:.2}, max {:.2}) |",
            label,
            l.backend_name,
            info.weight_bytes as f64 / (1u64 << 30) as f64,
            info.n_params as f64 / 1e9,
            test,
            med,
            min,
            max
        );
    };
    let mut sess = Session::new(l.model.as_mut(), 0);
    if a.n_prompt > 0 {
        let toks: Vec<u32> = (0..a.n_prompt).map(|_| rnd()).collect();
        // Warm-up once, then timed repetitions.
        let mut v = Vec::new();
        for r in 0..reps + 1 {
            sess.reset();
            let t0 = Instant::now();
            sess.feed(&toks)?;
            if r > 0 {
                v.push(a.n_prompt as f64 / t0.elapsed().as_secs_f64());
            }
        }
        row(format!("pp{}", a.n_prompt), &mut v);
    }
    let mut hash = FNV_START;
    if a.n_gen > 0 {
        let mut v = Vec::new();
        let depth_toks: Vec<u32> = (0..a.depth).map(|_| rnd()).collect();
        for r in 0..reps + 1 {
            sess.reset();
            if !depth_toks.is_empty() {
                sess.feed(&depth_toks)?;
            }
            let mut t = rnd();
            let t0 = Instant::now();
            if !a.host_argmax && !a.no_chain {
                // The picks made on the backend, each step enqueued before the previous pick
                // reaches the host (Session::greedy_chain): the same tokens as the loop below.
                let n = sess.greedy_chain(t, a.n_gen, |id| {
                    hash = fnv_step(hash, id);
                    true
                })?;
                if n != a.n_gen {
                    anyhow::bail!("the greedy chain stopped after {n} of {} tokens", a.n_gen);
                }
            } else {
                for _ in 0..a.n_gen {
                    // The next token is the arg-max, picked on the backend (one id comes back).
                    t = if a.host_argmax {
                        sess.feed(&[t])?;
                        ts_core::argmax(&sess.logits)
                    } else {
                        sess.feed_greedy(&[t])?
                    };
                    hash = fnv_step(hash, t);
                }
            }
            if r > 0 {
                v.push(a.n_gen as f64 / t0.elapsed().as_secs_f64());
            }
        }
        let name = if a.depth > 0 { format!("tg{} @ d{}", a.n_gen, a.depth) } else { format!("tg{}", a.n_gen) };
        row(name.clone(), &mut v);
        if a.hash {
            println!("tokens of {name}: hash {hash:016x}");
        }
    }
    drop(sess);
    if a.parallel > 0 && a.parallel_prompt > 0 {
        // Slots 1..=N, each a prompt from position 0, fed in forwards of up to the batch size
        // (slot after slot, as the server's prefill chunks take a wave of new requests); a
        // forward's output rows are the last tokens of the prompts it completes.
        let (np, pl) = (a.parallel, a.parallel_prompt);
        let mb = l.model.options().max_batch.max(1);
        let prompts: Vec<Vec<u32>> = (0..np).map(|_| (0..pl).map(|_| rnd()).collect()).collect();
        let mut meta = ts_core::BatchMeta { slot_len: ctx as u32, ..Default::default() };
        let mut ids = vec![0u32; np];
        let (mut v, mut phash) = (Vec::new(), FNV_START);
        for r in 0..reps + 1 {
            let t0 = Instant::now();
            let mut all = (0..np).flat_map(|s| (0..pl).map(move |p| (s, p))).peekable();
            while all.peek().is_some() {
                meta.tokens.clear();
                meta.outputs.clear();
                for (s, p) in all.by_ref().take(mb) {
                    if p + 1 == pl {
                        meta.outputs.push(meta.tokens.len() as u32);
                    }
                    meta.tokens.push(ts_core::TokenMeta { token: prompts[s][p], pos: p as u32, slot: 1 + s as u32 });
                }
                let no = meta.outputs.len();
                let out = ts_models::Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut ids[..no]), queue_argmax: false };
                l.model.forward_outputs(&meta, out)?;
                for &t in &ids[..no] {
                    phash = fnv_step(phash, t);
                }
            }
            if r > 0 {
                v.push((np * pl) as f64 / t0.elapsed().as_secs_f64());
            }
        }
        let name = format!("pp{pl} x{np}");
        row(name.clone(), &mut v);
        if a.hash {
            println!("tokens of {name}: hash {phash:016x}");
        }
    }
    if a.parallel > 0 && a.n_gen > 0 {
        // Slots 1..=N (slot 0 is the single-sequence tests'), positions 0.. in each.
        let np = a.parallel;
        let nvu = nv as usize;
        let mut logits = vec![0f32; np * nvu];
        let mut meta = ts_core::BatchMeta { slot_len: ctx as u32, ..Default::default() };
        let mut v = Vec::new();
        let mut phash = FNV_START;
        // -d: every slot's first `depth` positions hold a prompt of random tokens, fed once in
        // forwards of up to the batch size (slot after slot); each step then attends over them,
        // as a server's sequences do past their prompts.
        let d0 = a.depth as u32;
        if a.depth > 0 {
            let mb = l.model.options().max_batch.max(1);
            let mut one = vec![0f32; nvu];
            let all = (0..np as u32).flat_map(|s| (0..d0).map(move |p| (s, p)));
            let mut fill = all.peekable();
            while fill.peek().is_some() {
                meta.tokens.clear();
                meta.outputs.clear();
                for (s, p) in fill.by_ref().take(mb) {
                    meta.tokens.push(ts_core::TokenMeta { token: rnd(), pos: p, slot: 1 + s });
                }
                meta.outputs.push(meta.tokens.len() as u32 - 1);
                l.model.forward(&meta, &mut one)?;
            }
        }
        for r in 0..reps + 1 {
            let mut toks: Vec<u32> = (0..np).map(|_| rnd()).collect();
            let t0 = Instant::now();
            if !a.host_argmax && !a.no_chain && l.model.chains_argmax() {
                // Each step enqueued before the previous step's picks reach the host: its
                // tokens are those picks on the device (TOKEN_FROM_ARGMAX + row). The same
                // tokens, hashed in the same order, as the loop below.
                for step in 0..a.n_gen {
                    meta.tokens.clear();
                    meta.outputs.clear();
                    for (s, &t) in toks.iter().enumerate() {
                        meta.outputs.push(s as u32);
                        let token = if step == 0 { t } else { ts_core::TOKEN_FROM_ARGMAX + s as u32 };
                        meta.tokens.push(ts_core::TokenMeta { token, pos: d0 + step as u32, slot: 1 + s as u32 });
                    }
                    l.model.forward_outputs(&meta, ts_models::Outputs::queued())?;
                    if step > 0 {
                        l.model.argmax_collect(&mut toks)?;
                        for &t in &toks {
                            phash = fnv_step(phash, t);
                        }
                    }
                }
                l.model.argmax_collect(&mut toks)?;
                for &t in &toks {
                    phash = fnv_step(phash, t);
                }
                if r > 0 {
                    v.push((np * a.n_gen) as f64 / t0.elapsed().as_secs_f64());
                }
                continue;
            }
            for step in 0..a.n_gen {
                meta.tokens.clear();
                meta.outputs.clear();
                for (s, &t) in toks.iter().enumerate() {
                    meta.outputs.push(s as u32);
                    meta.tokens.push(ts_core::TokenMeta { token: t, pos: d0 + step as u32, slot: 1 + s as u32 });
                }
                // Greedy rows, as the server runs them: the backend picks each row's arg-max
                // and only the ids come back (`--host-argmax`: all logits, picked here).
                if a.host_argmax {
                    l.model.forward(&meta, &mut logits)?;
                    toks.par_iter_mut().zip(logits.par_chunks(nvu)).for_each(|(t, row)| *t = ts_core::argmax(row));
                } else {
                    let out =
                        ts_models::Outputs { full_rows: Some(&[]), logits: &mut [], argmax: Some(&mut toks[..]), queue_argmax: false };
                    l.model.forward_outputs(&meta, out)?;
                }
                for &t in &toks {
                    phash = fnv_step(phash, t);
                }
            }
            if r > 0 {
                v.push((np * a.n_gen) as f64 / t0.elapsed().as_secs_f64());
            }
        }
        let name = if a.depth > 0 { format!("tg{} x{np} @ d{}", a.n_gen, a.depth) } else { format!("tg{} x{np}", a.n_gen) };
        row(name.clone(), &mut v);
        if a.hash {
            println!("tokens of {name}: hash {phash:016x}");
        }
    }
    Ok(())
}

/// FNV-1a over token ids (`bench --hash`).
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;
fn fnv_step(h: u64, t: u32) -> u64 {
    t.to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

pub fn inspect(a: InspectArgs) -> Result<()> {
    let path = load::resolve(Some(&a.model), None)?;
    let src = load::open_source(&path)?;
    println!("file: {}", path.display());
    let md = src.metadata();
    println!("architecture: {}", md.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("?"));
    println!("\nmetadata ({} keys):", md.len());
    for (k, v) in md {
        println!("  {k} = {}", v.short());
    }
    let names = src.tensor_names();
    let mut mix: std::collections::BTreeMap<&str, (usize, u64, u64)> = Default::default();
    let mut params = 0u64;
    let mut bytes = 0u64;
    for n in &names {
        if let Some(t) = src.tensor(n) {
            let e = mix.entry(t.dtype.name()).or_default();
            e.0 += 1;
            e.1 += t.numel() as u64;
            e.2 += t.data.len() as u64;
            params += t.numel() as u64;
            bytes += t.data.len() as u64;
        }
    }
    println!("\ntensors: {} ({:.3} B parameters, {:.2} GiB)", names.len(), params as f64 / 1e9, bytes as f64 / (1u64 << 30) as f64);
    println!("quantisation mix:");
    for (ty, (n, p, b)) in &mix {
        println!(
            "  {ty:>5}: {n:>5} tensors, {:>7.2}% of parameters, {:.1} MiB",
            100.0 * *p as f64 / params.max(1) as f64,
            *b as f64 / (1 << 20) as f64
        );
    }
    let show = if a.all { names.len() } else { names.len().min(40) };
    for n in names.iter().take(show) {
        if let Some(t) = src.tensor(n) {
            println!("  {:<48} {:>6} {:?}", n, t.dtype.name(), t.shape);
        }
    }
    if show < names.len() {
        println!("  … {} more (--all)", names.len() - show);
    }
    if a.check {
        let mut bad = 0usize;
        let mut buf: Vec<f32> = Vec::new();
        for n in &names {
            let Some(t) = src.tensor(n) else { continue };
            if !t.dtype.is_supported_weight() {
                println!("  {n}: type {} not checked", t.dtype.name());
                continue;
            }
            let ne0 = t.shape.first().copied().unwrap_or(1);
            let rb = t.dtype.row_bytes(ne0).unwrap_or(0);
            buf.resize(ne0, 0.0);
            let (mut nan, mut inf) = (0usize, 0usize);
            for row in t.data.chunks_exact(rb.max(1)) {
                ts_formats::quant::dequantize(t.dtype, row, &mut buf)?;
                nan += buf.iter().filter(|v| v.is_nan()).count();
                inf += buf.iter().filter(|v| v.is_infinite()).count();
            }
            if nan + inf > 0 {
                println!("  {n}: {nan} NaN, {inf} Inf");
                bad += 1;
            }
        }
        if bad > 0 {
            bail!("{}: {bad} tensors hold NaN or Inf values", path.display());
        }
        println!("check: every tensor is finite");
    }
    if a.load {
        let be = std::sync::Arc::new(ts_cpu::CpuBackend::new(None)?);
        let opts = ts_models::RuntimeOptions { ctx: 16, n_slots: 1, max_batch: 1 };
        let model = ts_models::load(src.as_ref(), be, opts)?;
        let i = model.info();
        println!("\nmodel: {} layers, hidden {}, vocab {}, trained context {}", i.n_layers, i.n_embd, i.n_vocab, i.n_ctx_train);
        for (k, v) in &i.details {
            println!("  {k}: {v}");
        }
        println!("  KV cache: {} bytes per token of context", i.cache_bytes_per_token);
        println!(
            "  batch-invariant on this CPU: {}",
            if i.batch_invariant {
                "yes (a row gets the same bits in any batch: `serve` needs no padding)"
            } else {
                "no (`serve` pads its forwards to --row-multiple rows)"
            }
        );
    }
    Ok(())
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let quant = GgmlType::parse(&a.quant).with_context(|| format!("--quant {}: unknown type (q8_0, bf16, f16, f32)", a.quant))?;
    let t0 = Instant::now();
    synth_impl(&a, quant)?;
    eprintln!("turbospark: wrote {} in {:.1}s", a.output.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

pub fn models() -> Result<()> {
    println!("Models that -m NAME fetches (cache: {}):", hub::models_dir().display());
    for k in hub::KNOWN {
        let cached = if hub::cached_path(k).is_file() { "cached" } else { "not cached" };
        println!("  {:<16} {} [{}]", k.aliases[0], k.about, cached);
    }
    Ok(())
}

fn synth_impl(a: &SynthArgs, quant: GgmlType) -> Result<()> {
    use ts_models::synth::{Preset, SynthFormat};
    if let Some(dense) = ts_models::synth_dense::DensePreset::parse(&a.preset) {
        if a.hf || a.legacy {
            bail!("--preset {}: only GGUF output (with the real models' quantisation mix)", a.preset);
        }
        ts_models::synth_dense::synth_dense(dense, a.seed, &a.output)?;
        return Ok(());
    }
    let preset = Preset::parse(&a.preset).with_context(|| {
        format!("--preset {}: unknown (deepseek-v2-lite, tiny, llama-tiny, gemma3-tiny, smollm2-135m, gemma3-270m)", a.preset)
    })?;
    let format = if a.hf {
        SynthFormat::Hf
    } else if a.legacy {
        SynthFormat::GgufLegacy
    } else {
        SynthFormat::Gguf
    };
    ts_models::synth::synth(preset, quant, a.seed, &a.output, format)?;
    Ok(())
}

/// True when a rendered chat already begins with the BOS token's text (many templates write it),
/// so the tokenizer must not add a second one.
fn starts_with_bos(tok: &Tokenizer, text: &str) -> bool {
    tok.bos().and_then(|b| tok.token_str(b)).is_some_and(|b| !b.is_empty() && text.starts_with(b))
}

#[cfg(test)]
mod tests {
    use super::parse_logit_bias;

    #[test]
    fn logit_bias_values() {
        assert_eq!(parse_logit_bias("15043+1"), Ok((15043, 1.0)));
        assert_eq!(parse_logit_bias("15043-0.5"), Ok((15043, -0.5)));
        assert_eq!(parse_logit_bias("13-inf"), Ok((13, f32::NEG_INFINITY)));
        assert_eq!(parse_logit_bias("7=-2"), Ok((7, -2.0)));
        for bad in ["15043", "x+1", "-3+1", "5+inf", "5+nan", "5+", "5+1e40"] {
            assert!(parse_logit_bias(bad).is_err(), "{bad}");
        }
    }
}
