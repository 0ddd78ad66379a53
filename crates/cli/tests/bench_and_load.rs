//! The measuring commands work end to end on the CPU with a random-weight model: `bench` with
//! batched decode (`--parallel`), and `loadtest --prompt-ids` against `serve` (token-id prompts
//! for a model without a tokenizer).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_turbospark"))
}

/// A random llama-tiny GGUF of the test's own, removed when dropped (the tests run in parallel).
struct Tiny(PathBuf);
impl Drop for Tiny {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
fn tiny(test: &str) -> Tiny {
    let p = std::env::temp_dir().join(format!("ts-bench-load-{}-{test}.gguf", std::process::id()));
    let out = bin().args(["synth", "--preset", "llama-tiny", "-o"]).arg(&p).output().unwrap();
    assert!(out.status.success(), "synth: {}", String::from_utf8_lossy(&out.stderr));
    Tiny(p)
}

/// The t/s median of a bench table row whose test column is `test`.
fn rate(table: &str, test: &str) -> Option<f64> {
    table.lines().find(|l| l.split('|').nth(5).map(str::trim) == Some(test))?.split('|').nth(6)?.split_whitespace().next()?.parse().ok()
}

#[test]
fn bench_reports_batched_decode() {
    let tm = tiny("bench");
    let m = &tm.0;
    let out = bin()
        .args(["bench", "--backend", "cpu", "-t", "2", "-p", "8", "-n", "4", "--parallel", "3", "-r", "1", "-m"])
        .arg(m)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for test in ["pp8", "tg4", "tg4 x3"] {
        let r = rate(&text, test).unwrap_or_else(|| panic!("no {test} row in:\n{text}"));
        assert!(r > 0.0 && r.is_finite(), "{test}: {r}");
    }
    // At depth: every sequence's first 5 positions filled first, in forwards of 4 tokens that
    // cross from one sequence's slot to the next; the same tokens run after run.
    let at_depth = || {
        let out = bin()
            .args([
                "bench",
                "--backend",
                "cpu",
                "-t",
                "2",
                "-p",
                "0",
                "-n",
                "3",
                "-d",
                "5",
                "--parallel",
                "3",
                "-b",
                "4",
                "-r",
                "1",
                "--hash",
                "-m",
            ])
            .arg(m)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let r = rate(&text, "tg3 x3 @ d5").unwrap_or_else(|| panic!("no tg3 x3 @ d5 row in:\n{text}"));
        assert!(r > 0.0 && r.is_finite(), "tg3 x3 @ d5: {r}");
        text.lines().find(|l| l.starts_with("tokens of tg3 x3 @ d5: hash ")).expect("its hash line").to_string()
    };
    assert_eq!(at_depth(), at_depth());
}

/// `--parallel-prompt`: a wave of prompts prefilled together, as a server takes requests that
/// arrive at once; its row, and the same greedy picks whether the forwards hold 5 tokens (one
/// prompt split over two, two prompts in one) or all 21 at once (the tiny model is batch
/// invariant on the CPU).
#[test]
fn bench_reports_a_wave_of_prompts() {
    let tm = tiny("wave");
    let m = &tm.0;
    let wave = |b: &str| {
        let out = bin()
            .args(["bench", "--backend", "cpu", "-t", "2", "-p", "0", "-n", "0", "--parallel", "3"])
            .args(["--parallel-prompt", "7", "-b", b, "-r", "1", "--hash", "-m"])
            .arg(m)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let r = rate(&text, "pp7 x3").unwrap_or_else(|| panic!("no pp7 x3 row in:\n{text}"));
        assert!(r > 0.0 && r.is_finite(), "pp7 x3: {r}");
        text.lines().find(|l| l.starts_with("tokens of pp7 x3: hash ")).expect("its hash line").to_string()
    };
    assert_eq!(wave("5"), wave("21"));
}

#[test]
fn loadtest_with_token_id_prompts() {
    let tm = tiny("load");
    let m = &tm.0;
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let mut server = bin()
        .args(["serve", "--backend", "cpu", "-t", "2", "--max-seqs", "4", "-c", "256", "--port", &port.to_string(), "-m"])
        .arg(m)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The load test checks /health itself; retry until the server is up.
    let t0 = Instant::now();
    let out = loop {
        let out = bin()
            .args([
                "loadtest",
                "--url",
                &url,
                "--clients",
                "3",
                "--duration",
                "1",
                "--max-tokens",
                "4",
                "--prompt-ids",
                "8",
                "--temperature",
                "0",
            ])
            .output()
            .unwrap();
        if out.status.success() || t0.elapsed() > Duration::from_secs(60) {
            break out;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    // Each client repeats its prompt: the server's prompt cache serves all but the last token
    // of each repeat. With --fresh-prompts every prompt is new: nothing comes from the cache.
    let again = |fresh: bool| {
        let mut c = bin();
        c.args(["loadtest", "--url", &url, "--clients", "3", "--duration", "1", "--max-tokens", "4", "--prompt-ids", "8"]);
        c.args(["--temperature", "0"]);
        if fresh {
            c.arg("--fresh-prompts");
        }
        String::from_utf8_lossy(&c.output().unwrap().stdout).into_owned()
    };
    let (repeated, fresh) = (again(false), again(true));
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains(" 0 errors"), "{text}");
    assert!(text.contains("completed"), "{text}");
    // The steady window, from the server's own token counter.
    assert!(text.lines().any(|l| l.starts_with("steady: ") && l.contains("tok/s")), "{text}");
    // ... and its steps in that window: rows and generated tokens a step, milliseconds a step.
    assert!(
        text.lines().any(|l| l.starts_with("steady steps: ")
            && l.contains("rows a step (")
            && l.contains("tokens generated")
            && l.contains("ms a step")),
        "{text}"
    );
    // "prompts: N tokens, M of them from the server's prompt cache"
    let cached = |t: &str| -> (u64, u64) {
        let l = t.lines().find(|l| l.starts_with("prompts: ")).unwrap_or_else(|| panic!("no prompts line in:\n{t}"));
        let n: Vec<u64> = l.split(|c: char| !c.is_ascii_digit()).filter_map(|w| w.parse().ok()).collect();
        (n[0], n[1])
    };
    let (p, c) = cached(&repeated);
    assert!(p > 0 && c > 0 && c < p, "repeated prompts: {repeated}");
    // (a fresh prompt may still start with the token a slot's last prompt did: a token or two)
    let (p, c) = cached(&fresh);
    assert!(p > 0 && c * 20 < p, "fresh prompts: {fresh}");
}
