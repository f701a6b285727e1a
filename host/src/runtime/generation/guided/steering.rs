//! JSON answers that always parse. A grammar alone lets a small model write a number or a
//! string that never ends, and a `max_tokens` limit then cuts the answer mid-value. Two
//! things keep it whole:
//!
//! - **Bounds** written into the schema where it leaves them open, as llama.cpp's schema
//!   grammars bound integers: integers of at most 16 digits, numbers within ±10^15 with at
//!   most 6 decimals, strings of at most [`MAX_STRING`] characters. Bounds the schema gives
//!   (`maximum`, `maxLength`, `enum`, `pattern`, …) are kept as they are.
//! - **Steering to close**: once the tokens left are about what closing the open strings,
//!   arrays and objects takes, only the allowed tokens that close something may come: in a
//!   string a quote; outside one `}` or `]`, else a quote (a key or string value the grammar
//!   requires), else a separator (`,`, to reach a required field), else a short value
//!   (digits, `true`, `false`, `null`). The grammar still decides what is
//!   allowed; steering only chooses among it.

use serde_json::{json, Map, Value};

/// The longest string a schema that sets no bound of its own allows.
pub const MAX_STRING: u64 = 1000;
/// Integers have at most 16 digits, as in llama.cpp's JSON-schema grammars.
const MAX_INTEGER: i64 = 9_999_999_999_999_999;
/// Numbers stay within ±10^15 with at most six decimals.
const MAX_NUMBER: f64 = 1e15;
const NUMBER_STEP: f64 = 1e-6;

/// Tokens kept in reserve beyond what closing the open structures takes.
const RESERVE: usize = 6;

/// A schema with bounds where it leaves numbers and strings open. An object schema that says
/// nothing of its members (`{"type": "object"}`, OpenAI's `json_object`) becomes
/// [`bounded_json_object`]: any members, their values bounded.
pub fn bound_schema(mut schema: Value) -> Value {
    if open_object(&schema) {
        return bounded_json_object();
    }
    bound(&mut schema);
    schema
}

/// `{"type": "object"}`, perhaps titled or described, and nothing more.
fn open_object(schema: &Value) -> bool {
    schema.as_object().is_some_and(|map| {
        map.get("type") == Some(&json!("object"))
            && map
                .keys()
                .all(|k| matches!(k.as_str(), "type" | "title" | "description"))
    })
}

/// Any JSON value (the `json` guide type and `json_object`), bounded the same way.
pub fn bounded_any_json() -> Value {
    let value = json!({"$ref": "#/$defs/value"});
    json!({
        "$defs": {"value": {"anyOf": [
            {"type": "object", "additionalProperties": value},
            {"type": "array", "items": value},
            {"type": "string", "maxLength": MAX_STRING},
            {"type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER},
            {"type": "number", "minimum": -MAX_NUMBER, "maximum": MAX_NUMBER,
             "multipleOf": NUMBER_STEP},
            {"type": "boolean"},
            {"type": "null"},
        ]}},
        "$ref": "#/$defs/value",
    })
}

/// Any JSON object (OpenAI's `json_object`), its values bounded the same way.
pub fn bounded_json_object() -> Value {
    let mut schema = bounded_any_json();
    schema["$ref"] = Value::Null;
    if let Some(map) = schema.as_object_mut() {
        map.remove("$ref");
        map.insert("type".into(), json!("object"));
        map.insert(
            "additionalProperties".into(),
            json!({"$ref": "#/$defs/value"}),
        );
    }
    schema
}

fn types_of(node: &Map<String, Value>) -> Vec<String> {
    match node.get("type") {
        Some(Value::String(t)) => vec![t.clone()],
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect(),
        _ => Vec::new(),
    }
}

fn bound(node: &mut Value) {
    match node {
        Value::Object(map) => {
            bound_here(map);
            for (key, child) in map.iter_mut() {
                // Literal values are data, not schemas.
                if !matches!(key.as_str(), "enum" | "const" | "default" | "examples") {
                    bound(child);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(bound),
        _ => {}
    }
}

fn bound_here(map: &mut Map<String, Value>) {
    if map.contains_key("enum") || map.contains_key("const") {
        return;
    }
    let types = types_of(map);
    let open = |map: &Map<String, Value>, keys: &[&str]| keys.iter().all(|k| !map.contains_key(*k));
    // A schema of several types gets each bound that applies; "number" covers integers.
    let has = |t: &str| types.iter().any(|x| x == t);
    let numeric = has("number") || has("integer");
    if numeric {
        let integer = !has("number");
        let (low, high) = if integer {
            (json!(-MAX_INTEGER), json!(MAX_INTEGER))
        } else {
            (json!(-MAX_NUMBER), json!(MAX_NUMBER))
        };
        if open(map, &["minimum", "exclusiveMinimum"]) {
            map.insert("minimum".into(), low);
        }
        if open(map, &["maximum", "exclusiveMaximum"]) {
            map.insert("maximum".into(), high);
        }
        if !integer && open(map, &["multipleOf"]) {
            map.insert("multipleOf".into(), json!(NUMBER_STEP));
        }
    }
    if has("string") && open(map, &["maxLength", "pattern", "format"]) {
        map.insert("maxLength".into(), json!(MAX_STRING));
    }
}

/// About how many tokens the shortest document `schema` allows takes (every required field
/// with its shortest value), counted from its JSON text at about a token for every byte and a
/// quarter (a guide's forced keys are often spelled a piece at a time): steering starts that
/// early, so that an answer begun late still has room for the fields it must have.
pub fn shortest_answer_tokens(schema: &Value) -> usize {
    shortest_bytes(schema, schema, 0) * 4 / 5 + 2
}

fn shortest_bytes(node: &Value, root: &Value, depth: usize) -> usize {
    const DEEPEST: usize = 8;
    let Some(map) = node.as_object() else {
        return 1;
    };
    if depth > DEEPEST {
        return 2;
    }
    let of = |n: &Value| shortest_bytes(n, root, depth + 1);
    if let Some(reference) = map.get("$ref").and_then(Value::as_str) {
        // Only references into this document ("#/..."); others count as a short value.
        let target = reference
            .strip_prefix('#')
            .and_then(|pointer| root.pointer(pointer));
        return target.map_or(2, of);
    }
    if let Some(values) = map.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .map(|v| v.to_string().len())
            .min()
            .unwrap_or(2);
    }
    if let Some(value) = map.get("const") {
        return value.to_string().len();
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = map.get(key).and_then(Value::as_array) {
            return options.iter().map(of).min().unwrap_or(1);
        }
    }
    if let Some(all) = map.get("allOf").and_then(Value::as_array) {
        return all.iter().map(of).max().unwrap_or(1);
    }
    let number = |key: &str| map.get(key).and_then(Value::as_u64).unwrap_or(0) as usize;
    types_of(map)
        .iter()
        .map(|t| match t.as_str() {
            "object" => {
                let properties = map.get("properties").and_then(Value::as_object);
                let required = map.get("required").and_then(Value::as_array);
                2 + required.map_or(0, |names| {
                    names
                        .iter()
                        .filter_map(Value::as_str)
                        .map(|name| {
                            let value = properties.and_then(|p| p.get(name)).map_or(1, of);
                            name.len() + 6 + value
                        })
                        .sum()
                })
            }
            "array" => {
                let item = map.get("items").map_or(1, of);
                2 + number("minItems") * (item + 2)
            }
            "string" => 2 + number("minLength"),
            "boolean" => 4,
            "null" => 4,
            _ => 1,
        })
        .min()
        .unwrap_or(1)
}

/// What steering needs to know of each token: whether it closes, separates or is a short
/// value (classes computed once per vocabulary).
pub struct TokenClasses {
    class: Vec<u8>,
}

const OTHER: u8 = 0;
/// Closing marks beginning with a bracket (`}`, `]`, `}]`, …).
const BRACKET: u8 = 1;
/// Closing marks beginning with a quote (`"`, `"}`, …): the end of a string, or outside one
/// the start of a key or string value the grammar requires.
const QUOTE: u8 = 2;
const SEPARATES: u8 = 3;
const SHORT_VALUE: u8 = 4;

impl TokenClasses {
    /// The classes of a vocabulary, token by token.
    pub fn of<'a>(tokens: impl Iterator<Item = &'a [u8]>) -> Self {
        let class = tokens
            .map(|bytes| {
                let text = bytes.trim_ascii();
                if text.is_empty() {
                    OTHER
                } else if text.iter().all(|b| matches!(b, b'"' | b'}' | b']' | b' ')) {
                    if text[0] == b'"' {
                        QUOTE
                    } else {
                        BRACKET
                    }
                } else if text == b"," {
                    SEPARATES
                } else if text.iter().all(u8::is_ascii_digit)
                    || matches!(text, b"true" | b"false" | b"null")
                {
                    SHORT_VALUE
                } else {
                    OTHER
                }
            })
            .collect();
        Self { class }
    }

    fn of_token(&self, token: usize) -> u8 {
        self.class.get(token).copied().unwrap_or(OTHER)
    }
}

/// Where the answer is in its JSON: how many strings, arrays and objects are open.
#[derive(Debug, Default, Clone)]
pub struct JsonShape {
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// An object or array was opened.
    opened: bool,
}

impl JsonShape {
    /// Moves past the text of one token.
    pub fn advance(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    self.depth += 1;
                    self.opened = true;
                }
                b'}' | b']' => self.depth = self.depth.saturating_sub(1),
                _ => {}
            }
        }
    }

    /// An object or array was opened and everything opened is closed.
    pub fn closed(&self) -> bool {
        self.opened && self.depth == 0 && !self.in_string
    }

    /// Tokens closing what is open takes, with a reserve, and room for the shortest answer
    /// (`shortest` tokens) for the fields still required.
    fn closing_needs(&self, shortest: usize) -> usize {
        2 * self.depth + usize::from(self.in_string) + RESERVE + shortest
    }
}

/// Narrows masked `logits` (disallowed tokens at -inf) to the tokens that close the answer
/// soonest, once `remaining` tokens are about what closing takes.
pub fn steer(
    classes: &TokenClasses,
    shape: &JsonShape,
    shortest: usize,
    remaining: usize,
    logits: &mut [f32],
) {
    if remaining > shape.closing_needs(shortest) {
        return;
    }
    // In a string only a quote ends it (a bracket there is just a character).
    let tiers: &[u8] = if shape.in_string {
        &[QUOTE, SHORT_VALUE]
    } else {
        &[BRACKET, QUOTE, SEPARATES, SHORT_VALUE]
    };
    for &wanted in tiers {
        let any = logits
            .iter()
            .enumerate()
            .any(|(t, l)| l.is_finite() && classes.of_token(t) == wanted);
        if any {
            for (t, l) in logits.iter_mut().enumerate() {
                if classes.of_token(t) != wanted {
                    *l = f32::NEG_INFINITY;
                }
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_object_that_says_nothing_of_its_members_gets_bounded_members() {
        let open = bound_schema(json!({"type": "object", "title": "any"}));
        assert_eq!(open, bounded_json_object());
        assert_eq!(
            open["additionalProperties"],
            json!({"$ref": "#/$defs/value"})
        );
        // One that names its members is bounded where it leaves them open, as before.
        let named =
            bound_schema(json!({"type": "object", "properties": {"a": {"type": "string"}}}));
        assert_eq!(named["properties"]["a"]["maxLength"], json!(MAX_STRING));
        assert!(named.get("$defs").is_none());
    }

    #[test]
    fn open_numbers_and_strings_get_bounds_and_given_bounds_stay() {
        let schema = bound_schema(json!({
            "type": "object",
            "properties": {
                "age": {"type": "integer"},
                "score": {"type": "number", "maximum": 1},
                "name": {"type": "string"},
                "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "color": {"type": "string", "enum": ["red"]},
                "tags": {"type": "array", "items": {"type": ["string", "null"]}},
            },
            "$defs": {"n": {"type": "number"}},
        }));
        let p = &schema["properties"];
        assert_eq!(p["age"]["maximum"], json!(MAX_INTEGER));
        assert_eq!(p["age"]["minimum"], json!(-MAX_INTEGER));
        assert_eq!(p["score"]["maximum"], json!(1));
        assert_eq!(p["score"]["multipleOf"], json!(NUMBER_STEP));
        assert_eq!(p["name"]["maxLength"], json!(MAX_STRING));
        assert!(p["code"].get("maxLength").is_none());
        assert!(p["color"].get("maxLength").is_none());
        assert_eq!(p["tags"]["items"]["maxLength"], json!(MAX_STRING));
        assert_eq!(schema["$defs"]["n"]["minimum"], json!(-MAX_NUMBER));
    }

    #[test]
    fn the_shortest_answer_counts_required_fields_only() {
        let person = json!({"type": "object", "required": ["name", "address"], "properties": {
            "name": {"type": "string"}, "nickname": {"type": "string"},
            "address": {"$ref": "#/$defs/address"}},
            "$defs": {"address": {"type": "object", "required": ["zip"],
                                  "properties": {"zip": {"type": "integer"}}}}});
        // {"name": "", "address": {"zip": 0}}: 35 bytes.
        let tokens = shortest_answer_tokens(&person);
        assert!((25..=35).contains(&tokens), "{tokens}");
        assert_eq!(shortest_answer_tokens(&json!({"type": "object"})), 3);
    }

    #[test]
    fn the_shape_follows_strings_escapes_and_nesting() {
        let mut shape = JsonShape::default();
        shape.advance(br#"{"a": [1, {"b": "x\"}"#);
        assert!(shape.in_string);
        assert_eq!(shape.depth, 3);
        shape.advance(br#"y"}], "c": 2"#);
        assert!(!shape.in_string);
        assert_eq!(shape.depth, 1);
        assert!(!shape.closed());
        shape.advance(b"}");
        assert!(shape.closed());
    }

    #[test]
    fn near_the_end_closers_come_first_then_separators_then_short_values() {
        let vocab: [&[u8]; 6] = [b"}", b"\"", b", ", b"42", b"hello", b" the"];
        let classes = TokenClasses::of(vocab.iter().copied());
        let shape = JsonShape {
            depth: 1,
            opened: true,
            ..Default::default()
        };
        let far = shape.closing_needs(3) + 1;
        let mut logits = vec![0.0f32; 6];
        steer(&classes, &shape, 3, far, &mut logits);
        assert!(
            logits.iter().all(|l| l.is_finite()),
            "far from the end: unchanged"
        );
        steer(&classes, &shape, 3, 2, &mut logits);
        assert_eq!(
            logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>(),
            [true, false, false, false, false, false]
        );
        // In a string, only the quote ends it.
        let in_string = JsonShape {
            in_string: true,
            ..shape.clone()
        };
        let mut logits = vec![0.0f32; 6];
        steer(&classes, &in_string, 3, 2, &mut logits);
        assert_eq!(
            logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>(),
            [false, true, false, false, false, false]
        );
        // Closing not allowed here: a separator, then a short value.
        let mut logits = vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0, 0.0, 0.0];
        steer(&classes, &shape, 3, 2, &mut logits);
        assert_eq!(
            logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>(),
            [false, false, true, false, false, false]
        );
        let mut logits = vec![
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            f32::NEG_INFINITY,
            0.0,
            0.0,
            0.0,
        ];
        steer(&classes, &shape, 3, 2, &mut logits);
        assert_eq!(
            logits.iter().map(|l| l.is_finite()).collect::<Vec<_>>(),
            [false, false, false, true, false, false]
        );
    }
}
