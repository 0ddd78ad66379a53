//! Structured output: generation constrained to JSON that matches a schema (OpenAI's
//! `response_format` `{"type": "json_schema", "json_schema": {"schema": …}}`).
//!
//! [`Schema::compile`] takes the subset of JSON Schema that can be honoured token by token and
//! refuses the rest by name, never ignoring a keyword that would change what is valid:
//!
//! * `type`: `object`, `array`, `string`, `number`, `integer`, `boolean`, `null`, or a list of
//!   them (at most one of each, told apart by the value's first byte; `number` covers
//!   `integer`);
//! * `properties` (every one is written, in the order of the schema's keys as serde_json reads
//!   them: sorted), `required` (each must be among the properties), `additionalProperties`
//!   (none are written, which any setting allows);
//! * `items`, `minItems`, `maxItems`; `enum` and `const` of strings, booleans and null;
//! * annotations (`description`, `title`, `default`, `examples`, `$schema`, `$id`, `strict`).
//!
//! The root must be an object, as OpenAI asks. [`SchemaState`] recognises the output byte by
//! byte as [`crate::json::JsonState`] does (the same whitespace and string rules), keeping a
//! small stack of frames, one per open value, so that [`crate::json::JsonVocab::mask`] can walk
//! the vocabulary with it.

use serde_json::{Map, Value};

use crate::json::{ws_run, Grammar};

/// Deepest nesting of values a schema may describe.
pub const MAX_FRAMES: usize = 12;
/// Most values of one `enum`.
pub const MAX_ENUM: usize = 32;

/// Why a schema cannot be honoured (names the keyword and where it is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SchemaError(pub String);

/// A compiled schema: its nodes, the root first.
#[derive(Debug, Clone, PartialEq)]
pub struct Schema {
    nodes: Vec<Node>,
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    /// Exactly these properties, in this order: the key as JSON text (`"name"`), the value's node.
    Object(Vec<(Vec<u8>, u16)>),
    /// Values of the node, `min ..= max` of them.
    Array {
        item: u16,
        min: u16,
        max: u16,
    },
    String,
    Number {
        integer: bool,
    },
    /// One of these JSON texts, none a prefix of another (strings, true, false, null).
    Enum(Vec<Vec<u8>>),
    /// One of these nodes, told apart by the first byte.
    Union(Vec<u16>),
}

const ANNOTATIONS: [&str; 8] = ["description", "title", "default", "examples", "$schema", "$id", "strict", "$comment"];
const HANDLED: [&str; 9] = ["type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const"];

impl Schema {
    /// Compiles `schema` (see the module doc for what is supported).
    pub fn compile(schema: &Value) -> Result<Schema, SchemaError> {
        let mut s = Schema { nodes: Vec::new() };
        let obj = schema.as_object().ok_or_else(|| SchemaError("the schema must be a JSON object".into()))?;
        let is_object =
            obj.get("type").and_then(Value::as_str) == Some("object") || (obj.get("type").is_none() && obj.contains_key("properties"));
        if !is_object {
            return Err(SchemaError("the schema's root must be an object (\"type\": \"object\")".into()));
        }
        s.node(schema, "schema", 1)?;
        Ok(s)
    }

    fn push(&mut self, n: Node) -> u16 {
        self.nodes.push(n);
        (self.nodes.len() - 1) as u16
    }

    fn node(&mut self, v: &Value, at: &str, depth: usize) -> Result<u16, SchemaError> {
        let err = |m: String| Err(SchemaError(format!("{at}: {m}")));
        if depth > MAX_FRAMES {
            return err(format!("nested deeper than {MAX_FRAMES} levels"));
        }
        if self.nodes.len() >= u16::MAX as usize {
            return err("too many nodes".into());
        }
        let Some(o) = v.as_object() else {
            return err(format!("expected a schema object, got {v}"));
        };
        if let Some(k) = o.keys().find(|k| !HANDLED.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str())) {
            return err(format!(
                "'{k}' is not supported (supported: type, properties, required, items, minItems, maxItems, enum, const, additionalProperties)"
            ));
        }
        if let Some(c) = o.get("const") {
            return self.enumeration(std::slice::from_ref(c), at);
        }
        if let Some(e) = o.get("enum") {
            let Some(vals) = e.as_array() else { return err("'enum' must be an array".into()) };
            return self.enumeration(vals, at);
        }
        let types: Vec<&str> = match o.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(a)) => match a.iter().map(Value::as_str).collect::<Option<Vec<&str>>>() {
                Some(t) => t,
                None => return err("'type' lists a non-string".into()),
            },
            Some(t) => return err(format!("'type' must be a string or a list of strings, got {t}")),
            None if o.contains_key("properties") => vec!["object"],
            None => return err("a schema without 'type' (any value) is not supported".into()),
        };
        let mut kids = Vec::new();
        let mut seen = Vec::new();
        for t in &types {
            let class = match *t {
                "object" => '{',
                "array" => '[',
                "string" => '"',
                "number" | "integer" => '0',
                "boolean" => 't',
                "null" => 'n',
                other => return err(format!("unknown type '{other}'")),
            };
            if seen.contains(&class) {
                // ("number" with "integer": the wider one)
                if class == '0' && *t == "number" {
                    let k = kids.iter().position(|&k| matches!(self.nodes[k as usize], Node::Number { .. })).unwrap_or(0);
                    self.nodes[kids[k] as usize] = Node::Number { integer: false };
                }
                continue;
            }
            seen.push(class);
            let id = match *t {
                "object" => self.object(o, at, depth)?,
                "array" => {
                    let Some(items) = o.get("items") else {
                        return err("an array needs 'items' (arrays of any value are not supported)".into());
                    };
                    let bound = |k: &str, default: u64| match o.get(k) {
                        None => Ok(default),
                        Some(v) => v
                            .as_u64()
                            .map(|n| n.min(u16::MAX as u64))
                            .ok_or_else(|| SchemaError(format!("{at}: '{k}' must be a non-negative integer"))),
                    };
                    let (min, max) = (bound("minItems", 0)? as u16, bound("maxItems", u16::MAX as u64)? as u16);
                    if min > max {
                        return err(format!("minItems {min} is above maxItems {max}"));
                    }
                    let slot = self.push(Node::Array { item: 0, min, max });
                    let item = self.node(items, &format!("{at}.items"), depth + 1)?;
                    self.nodes[slot as usize] = Node::Array { item, min, max };
                    slot
                }
                "string" => self.push(Node::String),
                "number" => self.push(Node::Number { integer: false }),
                "integer" => self.push(Node::Number { integer: true }),
                "boolean" => self.push(Node::Enum(vec![b"true".to_vec(), b"false".to_vec()])),
                _ => self.push(Node::Enum(vec![b"null".to_vec()])),
            };
            kids.push(id);
        }
        match kids.len() {
            0 => err("'type' lists no type".into()),
            1 => Ok(kids[0]),
            _ => Ok(self.push(Node::Union(kids))),
        }
    }

    fn object(&mut self, o: &Map<String, Value>, at: &str, depth: usize) -> Result<u16, SchemaError> {
        let props = match o.get("properties") {
            None => Map::new(),
            Some(Value::Object(p)) => p.clone(),
            Some(p) => return Err(SchemaError(format!("{at}: 'properties' must be an object, got {p}"))),
        };
        if let Some(r) = o.get("required") {
            let Some(r) = r.as_array() else { return Err(SchemaError(format!("{at}: 'required' must be an array"))) };
            if let Some(missing) = r.iter().find(|k| k.as_str().is_none_or(|k| !props.contains_key(k))) {
                return Err(SchemaError(format!("{at}: required property {missing} has no schema in 'properties'")));
            }
        }
        let slot = self.push(Node::Object(Vec::new()));
        let mut out = Vec::with_capacity(props.len());
        for (k, v) in &props {
            let key = serde_json::to_vec(&Value::String(k.clone())).map_err(|e| SchemaError(e.to_string()))?;
            out.push((key, self.node(v, &format!("{at}.properties.{k}"), depth + 1)?));
        }
        self.nodes[slot as usize] = Node::Object(out);
        Ok(slot)
    }

    fn enumeration(&mut self, vals: &[Value], at: &str) -> Result<u16, SchemaError> {
        if vals.is_empty() || vals.len() > MAX_ENUM {
            return Err(SchemaError(format!("{at}: 'enum' must list 1 to {MAX_ENUM} values")));
        }
        let mut texts = Vec::with_capacity(vals.len());
        for v in vals {
            if !(v.is_string() || v.is_boolean() || v.is_null()) {
                return Err(SchemaError(format!("{at}: enumerated value {v} is not supported (strings, booleans and null are)")));
            }
            let t = serde_json::to_vec(v).map_err(|e| SchemaError(e.to_string()))?;
            if !texts.contains(&t) {
                texts.push(t);
            }
        }
        Ok(self.push(Node::Enum(texts)))
    }

    /// The state before the first byte of a document.
    pub fn start(&self) -> SchemaState {
        let mut s = SchemaState { frames: [Frame::default(); MAX_FRAMES], depth: 1, ws: 0 };
        s.frames[0] = Frame { node: 0, ..Frame::default() };
        s
    }
}

// A frame's phases.
const OPEN: u8 = 0; // before the value (whitespace, then its first byte)
const IN: u8 = 1; // string, number, enum: inside it
const KEY: u8 = 2; // object: matching key `i` at byte `at`
const COLON: u8 = 3;
const AFTER: u8 = 4; // object / array: after a value (`,` or the closer)
const FIRST: u8 = 5; // array: after `[` (a value or `]`)
const NEXT: u8 = 6; // array: after `,` (a value)
const LAST: u8 = 7; // object without properties: after `{` (`}`)

// Number lexer states (as `crate::json`'s).
const N_MINUS: u8 = 0;
const N_ZERO: u8 = 1;
const N_INT: u8 = 2;
const N_DOT: u8 = 3;
const N_FRAC: u8 = 4;
const N_EXP: u8 = 5;
const N_EXP_SIGN: u8 = 6;
const N_EXP_INT: u8 = 7;

/// One open value: its node, where in it the text is, and (strings) the escape state or
/// (numbers) the lexer state in `sub`; `i` / `at`: the property and key byte (objects) or
/// the bytes matched (enums), `cand`: the enumerated values still possible.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Frame {
    node: u16,
    phase: u8,
    sub: u8,
    i: u16,
    at: u16,
    cand: u32,
}

/// Where a document is in a [`Schema`]; see the module doc. Steps need the schema
/// ([`Grammar::Cx`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaState {
    frames: [Frame; MAX_FRAMES],
    /// Open values; 0 once the root is complete.
    depth: usize,
    ws: u8,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl SchemaState {
    fn ws(&mut self, b: u8) -> bool {
        ws_run(&mut self.ws, b)
    }

    fn push(&mut self, node: u16) -> bool {
        if self.depth >= MAX_FRAMES {
            return false;
        }
        self.frames[self.depth] = Frame { node, ..Frame::default() };
        self.depth += 1;
        true
    }

    fn pop(&mut self) -> bool {
        self.depth -= 1;
        true
    }
}

impl Grammar for SchemaState {
    type Cx = Schema;

    fn done(&self) -> bool {
        self.depth == 0
    }

    fn plain_string(&self) -> bool {
        // (a string's frame is the one in phase IN with `at` 1 and no candidates: an enum's
        // has candidates, a number's `at` stays 0)
        self.depth > 0 && {
            let f = &self.frames[self.depth - 1];
            f.phase == IN && f.sub == 0 && f.cand == 0 && f.at == 1
        }
    }

    fn step(&mut self, cx: &Schema, b: u8) -> bool {
        // (a number ends at the byte after it, which its parent then takes: hence the loop)
        loop {
            if self.depth == 0 {
                return false;
            }
            let top = self.depth - 1;
            let ws = is_ws(b);
            if !ws {
                self.ws = 0;
            }
            let f = &mut self.frames[top];
            match &cx.nodes[f.node as usize] {
                Node::String => match f.phase {
                    OPEN if ws => return self.ws(b),
                    OPEN => {
                        f.phase = IN;
                        f.sub = 0;
                        f.at = 1; // (marks a string: see `plain_string`)
                        return b == b'"';
                    }
                    _ => {
                        match f.sub {
                            0 => match b {
                                b'"' => return self.pop(),
                                b'\\' => f.sub = 1,
                                0..=0x1f => return false,
                                _ => {}
                            },
                            1 => match b {
                                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => f.sub = 0,
                                b'u' => f.sub = 5,
                                _ => return false,
                            },
                            e => {
                                if !b.is_ascii_hexdigit() {
                                    return false;
                                }
                                f.sub = if e == 2 { 0 } else { e - 1 };
                            }
                        }
                        return true;
                    }
                },
                Node::Number { integer } => {
                    let integer = *integer;
                    if f.phase == OPEN {
                        if ws {
                            return self.ws(b);
                        }
                        f.phase = IN;
                        f.sub = match b {
                            b'-' => N_MINUS,
                            b'0' => N_ZERO,
                            b'1'..=b'9' => N_INT,
                            _ => return false,
                        };
                        return true;
                    }
                    let next = match (f.sub, b) {
                        (N_MINUS, b'0') => Some(N_ZERO),
                        (N_MINUS, b'1'..=b'9') | (N_INT, b'0'..=b'9') => Some(N_INT),
                        (N_ZERO | N_INT, b'.') if !integer => Some(N_DOT),
                        (N_DOT | N_FRAC, b'0'..=b'9') => Some(N_FRAC),
                        (N_ZERO | N_INT | N_FRAC, b'e' | b'E') if !integer => Some(N_EXP),
                        (N_EXP, b'+' | b'-') => Some(N_EXP_SIGN),
                        (N_EXP | N_EXP_SIGN | N_EXP_INT, b'0'..=b'9') => Some(N_EXP_INT),
                        _ => None,
                    };
                    match next {
                        Some(n) => {
                            f.sub = n;
                            return true;
                        }
                        None if matches!(f.sub, N_ZERO | N_INT | N_FRAC | N_EXP_INT) => {
                            // The number ended: the byte is its parent's.
                            self.pop();
                            continue;
                        }
                        None => return false,
                    }
                }
                Node::Enum(vals) => {
                    if f.phase == OPEN {
                        if ws {
                            return self.ws(b);
                        }
                        f.phase = IN;
                        f.at = 0;
                        f.cand = (1u32 << vals.len()) - 1;
                        if vals.len() == 32 {
                            f.cand = u32::MAX;
                        }
                    }
                    let at = f.at as usize;
                    let mut cand = 0;
                    let mut complete = false;
                    for (k, v) in vals.iter().enumerate() {
                        if f.cand >> k & 1 == 1 && v.get(at) == Some(&b) {
                            cand |= 1 << k;
                            complete |= v.len() == at + 1;
                        }
                    }
                    if cand == 0 {
                        return false;
                    }
                    f.cand = cand;
                    f.at += 1;
                    if complete {
                        return self.pop();
                    }
                    return true;
                }
                Node::Union(kids) => {
                    if ws {
                        return self.ws(b);
                    }
                    let pick = kids.iter().copied().find(|&k| match &cx.nodes[k as usize] {
                        Node::Object(_) => b == b'{',
                        Node::Array { .. } => b == b'[',
                        Node::String => b == b'"',
                        Node::Number { .. } => b == b'-' || b.is_ascii_digit(),
                        Node::Enum(v) => v.iter().any(|t| t.first() == Some(&b)),
                        Node::Union(_) => false,
                    });
                    let Some(k) = pick else { return false };
                    *f = Frame { node: k, ..Frame::default() };
                    continue;
                }
                Node::Object(props) => match f.phase {
                    OPEN | COLON | AFTER | LAST if ws => return self.ws(b),
                    KEY if f.at == 0 && ws => return self.ws(b),
                    OPEN => {
                        if b != b'{' {
                            return false;
                        }
                        (f.phase, f.i, f.at) = (if props.is_empty() { LAST } else { KEY }, 0, 0);
                        return true;
                    }
                    LAST => return b == b'}' && self.pop(),
                    KEY => {
                        let key = &props[f.i as usize].0;
                        if key.get(f.at as usize) != Some(&b) {
                            return false;
                        }
                        f.at += 1;
                        if f.at as usize == key.len() {
                            f.phase = COLON;
                        }
                        return true;
                    }
                    COLON => {
                        if b != b':' {
                            return false;
                        }
                        f.phase = AFTER;
                        let child = props[f.i as usize].1;
                        return self.push(child);
                    }
                    _ => {
                        if (f.i as usize) + 1 < props.len() {
                            if b != b',' {
                                return false;
                            }
                            (f.phase, f.i, f.at) = (KEY, f.i + 1, 0);
                            return true;
                        }
                        return b == b'}' && self.pop();
                    }
                },
                Node::Array { item, min, max } => {
                    // (`i`: the items so far)
                    let (item, min, max) = (*item, *min, *max);
                    match f.phase {
                        _ if ws => return self.ws(b),
                        OPEN => {
                            f.phase = FIRST;
                            return b == b'[';
                        }
                        FIRST if b == b']' => return min == 0 && self.pop(),
                        FIRST | NEXT => {
                            if f.i >= max {
                                return false;
                            }
                            f.phase = AFTER;
                            f.i += 1;
                            if !self.push(item) {
                                return false;
                            }
                            continue;
                        }
                        _ => match b {
                            b',' if f.i < max => {
                                f.phase = NEXT;
                                return true;
                            }
                            b']' => return f.i >= min && self.pop(),
                            _ => return false,
                        },
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn accepts(s: &Schema, text: &str) -> bool {
        let mut st = s.start();
        st.feed(s, text.as_bytes()) && st.done()
    }

    #[test]
    fn compiles_the_subset_and_refuses_the_rest() {
        let ok = json!({"type": "object", "properties": {
            "name": {"type": "string", "description": "who"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "kind": {"enum": ["cat", "dog", null]},
            "score": {"type": ["number", "null"]},
            "ok": {"type": "boolean"},
            "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"], "additionalProperties": false}
        }, "required": ["name"], "additionalProperties": false});
        Schema::compile(&ok).expect("supported");
        for (bad, says) in [
            (json!({"type": "array", "items": {"type": "string"}}), "root must be an object"),
            (json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a"}}}), "'pattern' is not supported"),
            (json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}), "'anyOf' is not supported"),
            (json!({"type": "object", "properties": {"a": {}}}), "without 'type'"),
            (json!({"type": "object", "properties": {"a": {"enum": [1, 2]}}}), "enumerated value 1"),
            (json!({"type": "object", "properties": {"a": {"type": "array"}}}), "needs 'items'"),
            (json!({"type": "object", "properties": {}, "required": ["b"]}), "required property \"b\""),
            (json!({"type": "object", "properties": {"a": {"type": "date"}}}), "unknown type 'date'"),
        ] {
            let e = Schema::compile(&bad).expect_err(&bad.to_string());
            assert!(e.0.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn documents_of_the_schema_and_only_them() {
        let s = Schema::compile(&json!({"type": "object", "properties": {
            "age": {"type": "integer"},
            "kind": {"enum": ["cat", "caterpillar", null]},
            "name": {"type": "string"},
            "score": {"type": ["number", "null", "string"]},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "boolean"}}}}
        }}))
        .expect("compiles");
        for good in [
            r#"{"age":3,"kind":"cat","name":"Tom","score":1.5e3,"tags":[]}"#,
            r#"{ "age": -0, "kind": "caterpillar", "name": "a\"b\u00e9", "score": null, "tags": [ {"t": true}, {"t":false} ] }"#,
            "{\n  \"age\": 10,\n  \"kind\": null,\n  \"name\": \"\",\n  \"score\": \"high\",\n  \"tags\": [{\"t\": true}]\n}",
        ] {
            assert!(accepts(&s, good), "{good}");
        }
        for bad in [
            r#"{"age":3.5,"kind":"cat","name":"Tom","score":1,"tags":[]}"#,
            r#"{"age":3,"kind":"dog","name":"Tom","score":1,"tags":[]}"#,
            r#"{"age":3,"kind":"cat","name":"Tom","score":true,"tags":[]}"#,
            r#"{"age":3,"kind":"cat","name":"Tom","score":1}"#,
            r#"{"kind":"cat","age":3,"name":"Tom","score":1,"tags":[]}"#,
            r#"{"age":3,"kind":"cat","name":"Tom","score":1,"tags":[{"t":1}]}"#,
            r#"{"age":3,"kind":"cat","name":"Tom","score":1,"tags":[],"x":1}"#,
            r#"{"age":3,"kind":"cat","name":"Tom","score":1,"tags":[]} "#,
            r#"{"age":3,"kind":"cat","name":"T
om","score":1,"tags":[]}"#,
        ] {
            assert!(!accepts(&s, bad), "{bad}");
        }
        // Array bounds.
        let s2 = Schema::compile(
            &json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}}),
        )
        .unwrap();
        assert!(accepts(&s2, r#"{"a":[1]}"#) && accepts(&s2, r#"{"a":[1, 2]}"#));
        assert!(!accepts(&s2, r#"{"a":[]}"#) && !accepts(&s2, r#"{"a":[1,2,3]}"#));
        // Empty objects, nested arrays, a number ending at its parent's closer.
        let s = Schema::compile(&json!({"type": "object", "properties": {"e": {"type": "object"}, "m": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}}})).unwrap();
        assert!(accepts(&s, r#"{"e":{},"m":[[1,2],[],[3]]}"#));
        assert!(!accepts(&s, r#"{"e":{"a":1},"m":[]}"#));
    }

    /// What a document must be for `schema` (a reference for the test below, on serde_json's
    /// reading of the text; the schemas are those `random_schema` makes).
    fn valid(v: &Value, schema: &Value) -> bool {
        if let Some(e) = schema.get("enum") {
            return e.as_array().is_some_and(|e| e.contains(v));
        }
        let types: Vec<&str> = match &schema["type"] {
            Value::String(t) => vec![t.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        types.iter().any(|t| match *t {
            "object" => v.as_object().is_some_and(|o| {
                let props = schema["properties"].as_object().cloned().unwrap_or_default();
                o.len() == props.len() && props.iter().all(|(k, ps)| o.get(k).is_some_and(|x| valid(x, ps)))
            }),
            "array" => v.as_array().is_some_and(|a| {
                let (min, max) = (schema["minItems"].as_u64().unwrap_or(0), schema["maxItems"].as_u64().unwrap_or(u64::MAX));
                (min..=max).contains(&(a.len() as u64)) && a.iter().all(|x| valid(x, &schema["items"]))
            }),
            "string" => v.is_string(),
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            _ => false,
        })
    }

    fn random_schema(r: &mut rand_chacha::ChaCha20Rng, depth: u32) -> Value {
        use rand::Rng;
        match r.random_range(0..if depth >= 3 { 7 } else { 9 }) {
            0 => json!({"type": "string"}),
            1 => json!({"type": "integer"}),
            2 => json!({"type": "number"}),
            3 => json!({"type": "boolean"}),
            4 => json!({"type": ["string", "null"]}),
            5 => json!({"enum": ["a", "ab", "b\"q", true, null]}),
            6 => json!({"type": ["integer", "boolean"]}),
            7 => {
                let (min, max) = (r.random_range(0..2u64), r.random_range(2..4u64));
                json!({"type": "array", "items": random_schema(r, depth + 1), "minItems": min, "maxItems": max})
            }
            _ => {
                let props: Map<String, Value> = (0..r.random_range(0..4)).map(|i| (format!("k{i}"), random_schema(r, depth + 1))).collect();
                json!({"type": "object", "properties": props})
            }
        }
    }

    fn random_doc(r: &mut rand_chacha::ChaCha20Rng, schema: &Value) -> Value {
        use rand::Rng;
        if let Some(e) = schema["enum"].as_array() {
            return e[r.random_range(0..e.len())].clone();
        }
        let t = match &schema["type"] {
            Value::Array(a) => a[r.random_range(0..a.len())].as_str().unwrap_or("null").to_string(),
            t => t.as_str().unwrap_or("null").to_string(),
        };
        match t.as_str() {
            "object" => Value::Object(
                schema["properties"]
                    .as_object()
                    .map(|p| p.iter().map(|(k, s)| (k.clone(), random_doc(r, s))).collect())
                    .unwrap_or_default(),
            ),
            "array" => {
                let n = r.random_range(schema["minItems"].as_u64().unwrap_or(0)..=schema["maxItems"].as_u64().unwrap_or(3));
                Value::Array((0..n).map(|_| random_doc(r, &schema["items"])).collect())
            }
            "string" => json!(["", "x y", "q\"t", "tab\t", "é✓"][r.random_range(0..5)]),
            "integer" => json!(r.random_range(-500i64..500)),
            "number" => json!(r.random_range(-1e4f64..1e4) / 3.0),
            "boolean" => json!(r.random_bool(0.5)),
            _ => Value::Null,
        }
    }

    /// Random schemas and random documents of them: each document is accepted (compact and
    /// pretty), and each with one byte changed is accepted exactly when it is still a document
    /// of the schema by the reference above (mutants outside what the two can compare left
    /// out: trailing whitespace, two line breaks in a run, `\u` escapes, `-0`, numbers beyond
    /// f64).
    #[test]
    fn agrees_with_a_reference_validator() {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha20Rng::seed_from_u64(9);
        let alphabet = b"{}[]\":,019.-+eEtrufalsnkxab ";
        let (mut compared, mut valid_mutants) = (0, 0);
        for i in 0..3000 {
            let props: Map<String, Value> = (0..r.random_range(1..4)).map(|k| (format!("k{k}"), random_schema(&mut r, 1))).collect();
            let schema = json!({"type": "object", "properties": props});
            let compiled = Schema::compile(&schema).unwrap_or_else(|e| panic!("{schema}: {e}"));
            let doc = random_doc(&mut r, &schema);
            assert!(valid(&doc, &schema), "{doc} of {schema}");
            let text = if i % 2 == 0 { serde_json::to_string(&doc) } else { serde_json::to_string_pretty(&doc) }.expect("serialise");
            assert!(accepts(&compiled, &text), "{text} of {schema}");
            let mut b = text.into_bytes();
            let at = r.random_range(0..b.len());
            b[at] = alphabet[r.random_range(0..alphabet.len())];
            let Ok(m) = String::from_utf8(b) else { continue };
            let two_breaks = m.split(|c: char| !c.is_ascii_whitespace()).any(|run| run.matches(['\n', '\r']).count() > 1);
            if m.ends_with(|c: char| c.is_ascii_whitespace()) || m.contains("\\u") || m.contains("-0") || two_breaks {
                continue;
            }
            let parsed = serde_json::from_str::<Value>(&m);
            if parsed.as_ref().is_err_and(|e| e.to_string().contains("out of range")) {
                continue;
            }
            let theirs = parsed.is_ok_and(|v| valid(&v, &schema));
            assert_eq!(accepts(&compiled, &m), theirs, "{m} of {schema}");
            compared += 1;
            valid_mutants += theirs as usize;
        }
        assert!(compared > 2000 && valid_mutants > 100, "{compared} compared, {valid_mutants} valid");
    }

    #[test]
    fn masks_keep_to_the_schema() {
        use crate::json::JsonVocab;
        let s = Schema::compile(&json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}})).unwrap();
        let pieces: Vec<&[u8]> = vec![b"{", b"\"n\"", b"\"ok\"", b":", b" true", b"1", b"1.5", b",", b"}", b"\"x\"", b"false"];
        let v = JsonVocab::new(pieces.len(), |i| pieces[i as usize].to_vec(), &[]);
        let raw = vec![1f32; pieces.len()];
        let allowed = |st: &SchemaState| {
            let mut m = vec![0f32; pieces.len()];
            v.mask(&s, st, &raw, &mut m, &mut Vec::new());
            (0..pieces.len()).filter(|&i| m[i] == 1.0).collect::<Vec<_>>()
        };
        let mut st = s.start();
        assert_eq!(allowed(&st), [0]);
        assert!(st.feed(&s, b"{"));
        assert_eq!(allowed(&st), [1]); // keys in order: "n" first (sorted)
        assert!(st.feed(&s, b"\"n\":"));
        assert_eq!(allowed(&st), [5]); // an integer: `1`, not `1.5`
        assert!(st.feed(&s, b"1"));
        assert_eq!(allowed(&st), [5, 7]); // more digits, or `,`
        assert!(st.feed(&s, b",\"ok\":"));
        assert_eq!(allowed(&st), [4, 10]); // ` true`, `false`
        assert!(st.feed(&s, b"false"));
        assert_eq!(allowed(&st), [8]);
        assert!(st.feed(&s, b"}") && st.done());
    }
}
