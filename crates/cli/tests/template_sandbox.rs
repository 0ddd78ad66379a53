//! Model-supplied chat templates render in a memory- and CPU-limited child process
//! (`turbospark __render-template`, see ts_engine::chat): a template that doubles a string until
//! it needs terabytes ends with a render error, and the caller goes on.

use std::path::PathBuf;
use std::time::Instant;

use ts_engine::chat::{render_in_child_process, ChatMessage, ChatTemplate};

fn sandboxed() {
    render_in_child_process(PathBuf::from(env!("CARGO_BIN_EXE_turbospark")));
}

fn msgs() -> Vec<ChatMessage> {
    vec![ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hello <b>there</b> \u{1F600}")]
}

#[test]
fn child_renders_like_the_process() {
    let src = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let t = ChatTemplate::new(src).unwrap();
    let here = t.render(&msgs(), true, "<s>", "</s>").unwrap();
    sandboxed();
    let there = t.render(&msgs(), true, "<s>", "</s>").unwrap();
    assert_eq!(here, there);
    // Errors come back with their kind and message.
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
    let e = t.render(&msgs(), true, "", "").unwrap_err().to_string();
    assert!(e.contains("no system role"), "{e}");
    assert!(!e.contains("chat template: chat template"), "{e}");
    let t = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}").unwrap();
    let e = t.render(&msgs(), true, "", "").unwrap_err().to_string();
    assert!(e.to_lowercase().contains("fuel"), "{e}");
}

#[test]
fn string_doubling_hits_the_memory_limit_not_the_machine() {
    sandboxed();
    // 2^45 bytes if it ran to the end.
    let src = "{% set ns = namespace(s='x') %}{% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
    let t = ChatTemplate::new(src).unwrap();
    let t0 = Instant::now();
    let e = t.render(&msgs(), true, "", "").unwrap_err().to_string();
    assert!(e.contains("sandbox") && e.contains("memory"), "{e}");
    assert!(!e.contains('\n'), "one line: {e:?}");
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());

    // The same for lists, and the caller still renders afterwards.
    let src = "{% set ns = namespace(l=[1]) %}{% for i in range(45) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}";
    let e = ChatTemplate::new(src).unwrap().render(&msgs(), true, "", "").unwrap_err().to_string();
    assert!(e.contains("sandbox") || e.contains("too"), "{e}");
    let ok = ChatTemplate::new("{{ messages | length }}").unwrap().render(&msgs(), true, "", "").unwrap();
    assert_eq!(ok, "2");
}
