//! `run --json`: the output is one JSON object (or, cut by -n, the start of one), and nothing
//! else: no echoed prompt. The default model (SmolLM2, fetched once with pip) on the CPU.

use std::process::Command;

use ts_engine::json::JsonState;

#[test]
fn run_json_writes_one_object() {
    for (args, temp) in
        [(&["--chat", "Describe a cat as a JSON object with its name and age."][..], "0"), (&["A JSON object about Paris:"][..], "0.8")]
    {
        let out = Command::new(env!("CARGO_BIN_EXE_turbospark"))
            .args(["run", "--json", "-n", "160", "--temp", temp, "-s", "3", "--backend", "cpu"])
            .args(args)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {err}");
        let text = String::from_utf8(out.stdout).expect("UTF-8");
        let text = text.strip_suffix('\n').unwrap_or(&text);
        let mut g = JsonState::new();
        assert!(g.feed(text.as_bytes()), "{args:?}: not JSON: {text:?}");
        if g.done() {
            let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v.is_object());
        }
    }
}
