//! The official `openai` Python package as a real client (tests/server/test_openai_client.py).
//!
//! Set-up is the test's own: a virtual environment under the target directory with `openai`
//! installed by pip (once; reused afterwards). Without python3, venv or a reachable package index
//! the test is skipped, loudly. Every child process runs under a time limit.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ts_server::ServerConfig;

/// Runs `cmd` with stdout+stderr to `log`, killing it after `limit`. Returns (success, output).
fn run_limited(mut cmd: Command, log: &Path, limit: Duration) -> (bool, String) {
    let out = std::fs::File::create(log).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut child = match cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn() {
        Ok(c) => c,
        Err(e) => return (false, format!("cannot start {cmd:?}: {e}")),
    };
    let t0 = Instant::now();
    let ok = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st.success(),
            Ok(None) if t0.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                let text = std::fs::read_to_string(log).unwrap_or_default();
                return (false, format!("{text}\n(killed after {} s)", limit.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => return (false, format!("waiting for {cmd:?}: {e}")),
        }
    };
    (ok, std::fs::read_to_string(log).unwrap_or_default())
}

fn skip(why: &str) {
    eprintln!("\n*** SKIPPED openai client test: {why} ***\n");
}

/// A venv with `openai`, or None (after saying why) when it cannot be made.
fn venv_python() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let py = dir.join("bin").join("python");
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv-setup.log");
    let has_openai = |py: &Path| {
        let mut c = Command::new(py);
        c.args(["-c", "import openai"]);
        run_limited(c, &log, Duration::from_secs(60)).0
    };
    if py.is_file() && has_openai(&py) {
        return Some(py);
    }
    let host = std::env::var("TURBOSPARK_PYTHON").unwrap_or_else(|_| "python3".into());
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = Command::new(&host);
    c.args(["-m", "venv"]).arg(&dir);
    let (ok, out) = run_limited(c, &log, Duration::from_secs(120));
    if !ok {
        skip(&format!("`{host} -m venv` failed (python3 with venv is needed): {}", out.trim()));
        return None;
    }
    let mut c = Command::new(&py);
    c.args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "openai"]);
    let (ok, out) = run_limited(c, &log, Duration::from_secs(300));
    if !ok || !has_openai(&py) {
        skip(&format!("pip could not install openai: {}", out.trim().lines().last().unwrap_or("")));
        return None;
    }
    Some(py)
}

#[test]
fn official_openai_python_client() {
    let Some(py) = venv_python() else { return };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/server/test_openai_client.py");
    assert!(script.is_file(), "{} missing", script.display());
    // (keyed: the client's api_key must reach the server as its Authorization header)
    let key = "ts-test-key";
    let s = start(2, 512, ServerConfig { prefill_chunk: 64, api_key: Some(ts_server::ApiKey(key.into())), ..ServerConfig::default() });
    let mut c = Command::new(&py);
    c.arg(&script)
        .env("TS_SERVER_URL", s.url())
        .env("TS_MODEL_ID", s.model_id())
        .env("TS_API_KEY", key)
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("OPENAI_BASE_URL");
    let log = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-client-test.log");
    let (ok, out) = run_limited(c, &log, Duration::from_secs(240));
    eprintln!("{out}");
    assert!(ok, "the openai client test failed:\n{out}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
    s.shutdown().expect("shutdown");
}
