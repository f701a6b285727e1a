//! Structured output and function calling: `response_format`, `tools` / `tool_choice` and
//! vLLM's `guided_json` / `guided_regex` / `guided_choice` become a guide for the model's
//! constrained decoding (TensorRT-LLM's `guided_decoding_guide_type` and
//! `guided_decoding_guide` inputs), plus a system message that describes the tools; the text
//! generated under the guide is read back as content or as `tool_calls`.
//!
//! Calls are written in the Hermes format many chat models are trained on: each call is a
//! `{"name": …, "arguments": {…}}` object between `<tool_call>` and `</tool_call>`. With
//! `tool_choice` `auto` the grammar lets the model answer either text (which then does not
//! start with `<`) or calls; `required` makes it answer a JSON list of calls; a named function
//! makes it answer that function's arguments only.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{json, value::RawValue, Value};

use super::{
    invalid::Invalid,
    types::{
        CompletionRequest, FunctionCall, FunctionCallDelta, ResponseFormat, Tool, ToolCall,
        ToolCallDelta, ToolChoice,
    },
};
use crate::limits::MAX_GUIDE_BYTES;

/// Opens a call in the model's text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes a call in the model's text.
pub const CALL_CLOSE: &str = "</tool_call>";

/// JSON written as Python's `json.dumps` writes it (llguidance's options), as the decoder
/// writes JSON guides by default.
static COMPACT: std::sync::LazyLock<Value> = std::sync::LazyLock::new(
    || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
);

/// OpenAI's limit on the functions one request may offer.
pub const MAX_TOOLS: usize = 128;

/// How the generated text is read back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Shape {
    /// As content (free or guided text).
    #[default]
    Text,
    /// As the arguments of the one function named by `tool_choice`.
    Call(String),
    /// As a JSON list of calls (`tool_choice: required`).
    Calls,
    /// As content, or as calls when it starts with `<tool_call>` (`tool_choice: auto`).
    Auto,
}

/// What a request's structure asks of the model.
#[derive(Debug, Default)]
pub struct Structure {
    /// The guide: its type and text.
    pub guide: Option<(&'static str, String)>,
    /// Text to add to the system message (the tools and how to call them).
    pub system: Option<String>,
    /// How to read the answer.
    pub shape: Shape,
}

fn field(param: &str, message: String) -> Invalid {
    Invalid::field(param, message)
}

/// Writes JSON (it cannot fail for a `Value`).
fn text_of(value: &Value) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// A schema given as an object, or as text holding one (vLLM takes both for `guided_json`),
/// read once its size is known to fit a guide.
fn schema_of(param: &str, raw: &RawValue) -> Result<Value, Invalid> {
    let text = raw.get();
    if text.len() > MAX_GUIDE_BYTES {
        return Err(field(
            param,
            format!(
                "'{param}' is a schema of {} bytes, more than {MAX_GUIDE_BYTES}",
                text.len()
            ),
        ));
    }
    let value: Value = serde_json::from_str(text)
        .map_err(|e| field(param, format!("'{param}' is not a JSON schema: {e}")))?;
    let value = match value {
        Value::String(text) => serde_json::from_str(&text)
            .map_err(|e| field(param, format!("'{param}' is not a JSON schema: {e}")))?,
        other => other,
    };
    if value.is_object() || value.is_boolean() {
        Ok(value)
    } else {
        Err(field(
            param,
            format!("'{param}' must be a JSON schema (an object)"),
        ))
    }
}

/// Escapes `text` for a regular expression.
fn regex_literal(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~ ".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The guide of a request that asks for structured output without tools.
fn format_guide(req: &mut CompletionRequest) -> Result<Option<(&'static str, String)>, Invalid> {
    let mut asked: Vec<(&str, (&'static str, String))> = Vec::new();
    match req.response_format.take() {
        None => {}
        Some(ResponseFormat { kind, .. }) if kind == "text" => {}
        Some(ResponseFormat { kind, .. }) if kind == "json_object" => asked.push((
            "response_format",
            (
                "json_schema",
                // Any object (the backend bounds its numbers and strings so that it ends).
                text_of(&json!({"type": "object"})),
            ),
        )),
        Some(ResponseFormat {
            kind,
            json_schema: Some(json_schema),
        }) if kind == "json_schema" => {
            if json_schema.name.is_empty() {
                return Err(field(
                    "response_format",
                    "'response_format.json_schema.name' is empty".into(),
                ));
            }
            let schema = match &json_schema.schema {
                Some(s) => schema_of("response_format", s)?,
                None => json!({}),
            };
            asked.push(("response_format", ("json_schema", text_of(&schema))));
        }
        Some(ResponseFormat { kind, .. }) if kind == "json_schema" => {
            return Err(field(
                "response_format",
                "'response_format' of type 'json_schema' needs 'json_schema'".into(),
            ))
        }
        Some(ResponseFormat { kind, .. }) => {
            return Err(field(
                "response_format",
                format!(
                    "'response_format.type' is '{kind}'; expected 'text', 'json_object' or \
                     'json_schema'"
                ),
            ))
        }
    }
    if let Some(schema) = req.guided_json.take() {
        let schema = schema_of("guided_json", &schema)?;
        asked.push(("guided_json", ("json_schema", text_of(&schema))));
    }
    if let Some(regex) = req.guided_regex.take() {
        asked.push(("guided_regex", ("regex", regex)));
    }
    if let Some(choices) = req.guided_choice.take() {
        if choices.is_empty() {
            return Err(field("guided_choice", "'guided_choice' is empty".into()));
        }
        let alternatives: Vec<String> = choices.iter().map(|c| regex_literal(c)).collect();
        asked.push((
            "guided_choice",
            ("regex", format!("({})", alternatives.join("|"))),
        ));
    }
    if asked.len() > 1 {
        return Err(field(
            asked[1].0,
            format!(
                "'{}' and '{}' both constrain the answer; give one",
                asked[0].0, asked[1].0
            ),
        ));
    }
    Ok(asked.pop().map(|(_, guide)| guide))
}

/// Checks the tools: functions with names of letters, digits, `_` and `-` (up to 64), each
/// once, and object schemas for their parameters.
fn check_tools(tools: &[Tool]) -> Result<(), Invalid> {
    if tools.len() > MAX_TOOLS {
        return Err(field(
            "tools",
            format!("'tools' has {} functions; at most {MAX_TOOLS}", tools.len()),
        ));
    }
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(field(
                "tools",
                format!(
                    "tools[{i}].type is '{}'; only 'function' is supported",
                    tool.kind
                ),
            ));
        }
        let name = &tool.function.name;
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(field(
                "tools",
                format!(
                    "tools[{i}].function.name '{name}' must be 1 to 64 letters, digits, '_' or '-'"
                ),
            ));
        }
        if tools[..i].iter().any(|t| &t.function.name == name) {
            return Err(field(
                "tools",
                format!("tools[{i}]: function '{name}' is offered twice"),
            ));
        }
        if let Some(p) = &tool.function.parameters {
            if p.get().len() > MAX_GUIDE_BYTES || !p.get().trim_start().starts_with('{') {
                return Err(field(
                    "tools",
                    format!(
                        "tools[{i}].function.parameters must be a JSON schema object of at \
                         most {MAX_GUIDE_BYTES} bytes"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A tool's parameters schema (checked by [`check_tools`]), or an object of anything.
fn parameters(tool: &Tool) -> Value {
    tool.function
        .parameters
        .as_ref()
        .and_then(|p| serde_json::from_str(p.get()).ok())
        .unwrap_or_else(|| json!({"type": "object"}))
}

/// The schema of one call of any of `tools`: `{"name": …, "arguments": {…}}`.
fn call_schema(tools: &[Tool]) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": parameters(t),
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    json!({"anyOf": calls})
}

/// The system message's description of the tools and of how to call them.
fn tools_prompt(tools: &[Tool], shape: &Shape) -> String {
    let mut out = String::from(
        "# Tools\n\nYou may call functions to help with the user's request. The functions, one \
         JSON object per line:\n<tools>\n",
    );
    for tool in tools {
        out.push_str(&serde_json::to_string(tool).unwrap_or_default());
        out.push('\n');
    }
    out.push_str("</tools>\n\n");
    match shape {
        Shape::Call(name) => out.push_str(&format!(
            "Call the function '{name}' now: answer only its arguments, as one JSON object."
        )),
        Shape::Calls => out.push_str(
            "Call one or more functions now: answer a JSON list of calls, each \
             {\"name\": <function name>, \"arguments\": <arguments object>}.",
        ),
        _ => out.push_str(
            "To call a function, answer one JSON object with its name and arguments between \
             <tool_call> and </tool_call>:\n<tool_call>{\"name\": <function name>, \
             \"arguments\": <arguments object>}</tool_call>\nOtherwise answer in plain text.",
        ),
    }
    out
}

/// Reads a request's structure: what to guide the text with and how to read it back. Takes
/// the fields it reads out of `req`.
pub fn structure(req: &mut CompletionRequest) -> Result<Structure, Invalid> {
    let guide = format_guide(req)?;
    let tools = req.tools.take().unwrap_or_default();
    check_tools(&tools)?;
    let choice = req.tool_choice.take();
    let shape = match choice {
        None if tools.is_empty() => Shape::Text,
        None => Shape::Auto,
        Some(ToolChoice::Mode(mode)) => match mode.as_str() {
            "none" => Shape::Text,
            "auto" | "required" if tools.is_empty() => {
                return Err(field(
                    "tool_choice",
                    format!("'tool_choice' is '{mode}' but 'tools' offers no function"),
                ))
            }
            "auto" => Shape::Auto,
            "required" => Shape::Calls,
            other => {
                return Err(field(
                    "tool_choice",
                    format!(
                        "'tool_choice' is '{other}'; it must be none, auto, required or \
                         {{\"type\": \"function\", \"function\": {{\"name\": …}}}}"
                    ),
                ))
            }
        },
        Some(ToolChoice::Named { kind, function }) => {
            if kind != "function" {
                return Err(field(
                    "tool_choice",
                    format!("'tool_choice.type' is '{kind}'; only 'function' is supported"),
                ));
            }
            if !tools.iter().any(|t| t.function.name == function.name) {
                return Err(field(
                    "tool_choice",
                    format!(
                        "'tool_choice' names function '{}', which 'tools' does not offer",
                        function.name
                    ),
                ));
            }
            Shape::Call(function.name)
        }
    };
    if shape == Shape::Text {
        return Ok(Structure {
            guide,
            system: None,
            shape,
        });
    }
    if guide.is_some() {
        return Err(field(
            "response_format",
            "a constrained answer ('response_format', 'guided_*') with tools is supported only \
             with 'tool_choice': 'none'"
                .into(),
        ));
    }
    // JSON guides get the decoder's compact layout by default; the Lark grammar's embedded
    // schema is not a JSON guide, so it says so itself.
    let guide = match &shape {
        Shape::Call(name) => {
            let tool = tools.iter().find(|t| &t.function.name == name);
            (
                "json_schema",
                text_of(&tool.map(parameters).unwrap_or_else(|| json!({}))),
            )
        }
        Shape::Calls => {
            let list = json!({"type": "array", "items": call_schema(&tools), "minItems": 1});
            ("json_schema", text_of(&list))
        }
        _ => {
            let mut body = call_schema(&tools);
            body["x-guidance"] = COMPACT.clone();
            // Text that does not open a call, or calls one after another.
            let grammar = format!(
                "start: TEXT | calls\nTEXT: /([^<](.|\\n)*)?/\ncalls: call (\"\\n\" call)*\n\
                 call: \"{CALL_OPEN}\" body \"{CALL_CLOSE}\"\nbody: %json {}\n",
                text_of(&body)
            );
            ("lark", grammar)
        }
    };
    let system = tools_prompt(&tools, &shape);
    Ok(Structure {
        guide: Some(guide),
        system: Some(system),
        shape,
    })
}

/// A new call id.
fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("call_{t:x}{n:06x}")
}

/// A call from a `{"name": …, "arguments": …}` object.
fn call_from(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = text_of(value.get("arguments")?);
    Some(ToolCall {
        id: call_id(),
        kind: "function".into(),
        function: FunctionCall { name, arguments },
    })
}

/// The calls in `text` written as `<tool_call>{…}</tool_call>`, one after another (`None`
/// when it is not only that).
fn tagged_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let body = rest.strip_prefix(CALL_OPEN)?;
        let end = body.find(CALL_CLOSE)?;
        let value: Value = serde_json::from_str(&body[..end]).ok()?;
        calls.push(call_from(&value)?);
        rest = body[end + CALL_CLOSE.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// Reads a whole answer: its content (none when it is calls) and its calls.
pub fn read_answer(shape: &Shape, text: &str) -> (Option<String>, Vec<ToolCall>) {
    match shape {
        Shape::Text => (Some(text.to_owned()), Vec::new()),
        Shape::Call(name) => (
            None,
            vec![ToolCall {
                id: call_id(),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.clone(),
                    arguments: text.to_owned(),
                },
            }],
        ),
        Shape::Calls => {
            let calls: Option<Vec<ToolCall>> = serde_json::from_str::<Vec<Value>>(text)
                .ok()
                .and_then(|items| items.iter().map(call_from).collect());
            match calls {
                Some(calls) if !calls.is_empty() => (None, calls),
                // Cut short (length): the text as it came.
                _ => (Some(text.to_owned()), Vec::new()),
            }
        }
        Shape::Auto => match tagged_calls(text) {
            Some(calls) => (None, calls),
            None => (Some(text.to_owned()), Vec::new()),
        },
    }
}

/// The finish reason of an answer: `tool_calls` when the model chose to call (with `auto` or
/// `required`; a named function ends with `stop`, as OpenAI's does).
pub fn finish_reason(shape: &Shape, called: bool, finish: String) -> String {
    if called && finish == "stop" && matches!(shape, Shape::Calls | Shape::Auto) {
        "tool_calls".into()
    } else {
        finish
    }
}

/// What a streamed choice says next.
#[derive(Debug, PartialEq)]
pub enum Said {
    /// Content.
    Text(String),
    /// Calls, or more of a call's arguments.
    Calls(Vec<ToolCallDelta>),
}

/// One streamed choice read as its shape says: content goes out as it comes, a named call's
/// arguments too; calls in a list or in tags are held until whole.
#[derive(Debug, Default)]
pub struct Reader {
    shape: Shape,
    held: String,
    /// Auto: the answer turned out to be text.
    text: bool,
    /// Named: the call's first piece went out.
    opened: bool,
    /// Calls answered.
    pub calls: usize,
}

impl Reader {
    /// A reader for answers of `shape`.
    pub fn new(shape: Shape) -> Self {
        Self {
            shape,
            ..Self::default()
        }
    }

    /// Takes more text.
    pub fn push(&mut self, text: String) -> Option<Said> {
        match &self.shape {
            Shape::Text => Some(Said::Text(text)),
            Shape::Call(name) => {
                let first = !self.opened;
                self.opened = true;
                self.calls = 1;
                Some(Said::Calls(vec![ToolCallDelta {
                    index: 0,
                    id: first.then(call_id),
                    kind: first.then_some("function"),
                    function: FunctionCallDelta {
                        name: first.then(|| name.clone()),
                        arguments: text,
                    },
                }]))
            }
            Shape::Calls => {
                self.held.push_str(&text);
                None
            }
            Shape::Auto => {
                if self.text {
                    return Some(Said::Text(text));
                }
                self.held.push_str(&text);
                match self.held.chars().next() {
                    Some(c) if c != '<' => {
                        self.text = true;
                        Some(Said::Text(std::mem::take(&mut self.held)))
                    }
                    _ => None,
                }
            }
        }
    }

    /// The end of the answer: what was held.
    pub fn finish(&mut self) -> Option<Said> {
        if self.held.is_empty() {
            return None;
        }
        let held = std::mem::take(&mut self.held);
        match read_answer(&self.shape, &held) {
            (_, calls) if !calls.is_empty() => {
                self.calls = calls.len();
                Some(Said::Calls(
                    calls
                        .into_iter()
                        .enumerate()
                        .map(|(i, c)| ToolCallDelta {
                            index: i as u32,
                            id: Some(c.id),
                            kind: Some("function"),
                            function: FunctionCallDelta {
                                name: Some(c.function.name),
                                arguments: c.function.arguments,
                            },
                        })
                        .collect(),
                ))
            }
            (content, _) => content.map(Said::Text),
        }
    }

    /// The finish reason to answer for `finish`.
    pub fn finish_reason(&self, finish: String) -> String {
        finish_reason(&self.shape, self.calls > 0, finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontends::http::openai::decode::read;

    fn request(body: Value) -> CompletionRequest {
        read(body.to_string().as_bytes()).unwrap()
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}])
    }

    #[test]
    fn formats_become_guides() {
        let s = structure(&mut request(
            json!({"response_format": {"type": "json_object"}}),
        ))
        .unwrap();
        let (kind, schema) = s.guide.unwrap();
        assert_eq!(kind, "json_schema");
        let schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
        // Any object: the backend bounds its values so that the answer cannot grow a string
        // or a number forever (the steering's own tests).
        assert_eq!(schema, json!({"type": "object"}));
        let s = structure(&mut request(json!({"guided_choice": ["yes", "no way"]}))).unwrap();
        assert_eq!(s.guide, Some(("regex", r"(yes|no\ way)".into())));
        let s = structure(&mut request(json!({"response_format": {"type": "text"}}))).unwrap();
        assert!(s.guide.is_none() && s.system.is_none());
        let e = structure(&mut request(
            json!({"response_format": {"type": "json_object"},
            "guided_regex": "a+"}),
        ))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("guided_regex"));
    }

    #[test]
    fn tool_choices_pick_the_shape_and_bad_ones_are_refused() {
        let s = structure(&mut request(json!({"tools": weather()}))).unwrap();
        assert_eq!(s.shape, Shape::Auto);
        assert_eq!(s.guide.as_ref().unwrap().0, "lark");
        assert!(s.system.unwrap().contains("get_weather"));
        let s = structure(&mut request(
            json!({"tools": weather(), "tool_choice": "required"}),
        ))
        .unwrap();
        assert_eq!(s.shape, Shape::Calls);
        let s = structure(&mut request(
            json!({"tools": weather(), "tool_choice": "none"}),
        ))
        .unwrap();
        assert_eq!(s.shape, Shape::Text);
        assert!(s.guide.is_none());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let s = structure(&mut request(
            json!({"tools": weather(), "tool_choice": named}),
        ))
        .unwrap();
        assert_eq!(s.shape, Shape::Call("get_weather".into()));
        for (body, param) in [
            (
                json!({"tools": weather(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": weather(), "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
                "tools",
            ),
        ] {
            let e = structure(&mut request(body)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.error.message);
        }
    }

    #[test]
    fn answers_are_read_as_their_shape_says() {
        let (content, calls) = read_answer(&Shape::Auto, "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>");
        assert!(content.is_none());
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.arguments, r#"{"a":1}"#);
        assert_eq!(calls[1].function.name, "g");
        assert_ne!(calls[0].id, calls[1].id);
        let (content, calls) = read_answer(&Shape::Auto, "Hello.");
        assert_eq!(content.as_deref(), Some("Hello."));
        assert!(calls.is_empty());
        let (content, calls) =
            read_answer(&Shape::Calls, r#"[{"name": "f", "arguments": {"x": "y"}}]"#);
        assert!(content.is_none() && calls[0].function.name == "f");
        // Cut short: the text as it came.
        let (content, calls) = read_answer(&Shape::Calls, r#"[{"name": "f", "argu"#);
        assert!(content.is_some() && calls.is_empty());
        assert_eq!(
            finish_reason(&Shape::Calls, false, "length".into()),
            "length"
        );
        assert_eq!(
            finish_reason(&Shape::Calls, true, "stop".into()),
            "tool_calls"
        );
        assert_eq!(
            finish_reason(&Shape::Call("f".into()), true, "stop".into()),
            "stop"
        );
    }

    #[test]
    fn a_stream_holds_calls_until_whole_and_passes_text_on() {
        let mut r = Reader::new(Shape::Auto);
        assert_eq!(r.push("Hi".into()), Some(Said::Text("Hi".into())));
        assert_eq!(r.push(" there".into()), Some(Said::Text(" there".into())));
        assert_eq!(r.finish(), None);
        assert_eq!(r.finish_reason("stop".into()), "stop");
        let mut r = Reader::new(Shape::Auto);
        assert_eq!(r.push("<tool_".into()), None);
        assert_eq!(
            r.push("call>{\"name\": \"f\", \"arguments\": {}}</tool_call>".into()),
            None
        );
        let Some(Said::Calls(calls)) = r.finish() else {
            panic!("no calls")
        };
        assert_eq!(calls[0].function.name.as_deref(), Some("f"));
        assert_eq!(r.finish_reason("stop".into()), "tool_calls");
        let mut r = Reader::new(Shape::Call("f".into()));
        let Some(Said::Calls(first)) = r.push("{\"a\"".into()) else {
            panic!("no call")
        };
        assert!(first[0].id.is_some() && first[0].function.name.as_deref() == Some("f"));
        let Some(Said::Calls(next)) = r.push(": 1}".into()) else {
            panic!("no call")
        };
        assert!(next[0].id.is_none() && next[0].function.arguments == ": 1}");
        assert_eq!(r.finish_reason("stop".into()), "stop");
    }
}
