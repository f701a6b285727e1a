//! What every field of `config.pbtxt` means here, per backend: honoured with Triton's meaning,
//! refused at load naming the field, file and line, or — only where Triton ignores it too for
//! that backend (a TensorRT setting on an ONNX model, an ensemble's instances) — accepted with
//! one log line saying it has no effect. [`FIELDS`] is the one table that decides it; a test
//! holds it to the schema (every field has a row) and the manual's configuration reference is
//! checked against it.

use prost_reflect::{DynamicMessage, Value};

use super::config::{model_config_descriptor, ConfigError};
use crate::proto::inference::ModelConfig;

/// The kinds of model a configuration can describe, each with its own reading of the fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `backend: "onnxruntime"` / `platform: "onnxruntime_onnx"` (the default).
    Onnx,
    /// `backend: "wasm"`: a WebAssembly stage.
    Stage,
    /// `backend: "generation"`: text generation with in-flight batching.
    Generation,
    /// `platform: "ensemble"`.
    Ensemble,
}

impl Family {
    fn column(self) -> usize {
        self as usize
    }

    /// The name the manual's table uses for this family.
    pub fn label(self) -> &'static str {
        match self {
            Family::Onnx => "onnxruntime",
            Family::Stage => "wasm",
            Family::Generation => "generation",
            Family::Ensemble => "ensemble",
        }
    }

    /// Every family, in the table's column order.
    pub const ALL: [Family; 4] = [
        Family::Onnx,
        Family::Stage,
        Family::Generation,
        Family::Ensemble,
    ];
}

/// How one field is treated for one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Means what it means on Triton.
    Honoured,
    /// A message whose own fields are judged one by one.
    Container,
    /// Refused at load; the text says why.
    Refused(&'static str),
    /// Accepted with one log line: Triton ignores it too for this backend; the text says why.
    NoEffect(&'static str),
}

/// One row of the table: a field's dotted path (list and map entries add no segment) and its
/// treatment for each [`Family`].
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// e.g. `optimization.graph.level`.
    pub path: &'static str,
    /// Indexed by [`Family`]'s order.
    pub by_family: [Treatment; 4],
}

impl Row {
    /// This row's treatment for `family`.
    pub fn treatment(&self, family: Family) -> Treatment {
        self.by_family[family.column()]
    }
}

use Treatment::{Container as C, Honoured as H, NoEffect, Refused};

const fn all(path: &'static str, t: Treatment) -> Row {
    Row {
        path,
        by_family: [t, t, t, t],
    }
}

const fn each(
    path: &'static str,
    onnx: Treatment,
    stage: Treatment,
    generation: Treatment,
    ensemble: Treatment,
) -> Row {
    Row {
        path,
        by_family: [onnx, stage, generation, ensemble],
    }
}

/// Honoured by the backends that execute, without effect on an ensemble (which runs none of
/// its own: its steps' models do).
const fn executing(path: &'static str, ensemble_why: &'static str) -> Row {
    each(path, H, H, H, NoEffect(ensemble_why))
}

mod table;
pub use table::FIELDS;

/// The row of `path`, if the table has one.
pub fn row(path: &str) -> Option<&'static Row> {
    FIELDS.iter().find(|r| r.path == path)
}

/// One field set in a configuration that has no effect here, for the load's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoEffectField {
    /// The field's dotted path.
    pub path: &'static str,
    /// Why it has no effect.
    pub why: &'static str,
    /// Where it was written (`file:line`), or the file alone when the line is unknown.
    pub at: String,
}

/// Checks every field set in `config` against the table for `family`: the first refused one
/// is an error naming the field, file and line (found in `text`, the file's contents, when
/// given); fields without effect are returned for the caller to log once each.
pub fn check(
    config: &ModelConfig,
    family: Family,
    text: Option<&str>,
    file: &str,
) -> Result<Vec<NoEffectField>, ConfigError> {
    let mut dynamic = DynamicMessage::new(model_config_descriptor().clone());
    dynamic
        .transcode_from(config)
        .map_err(|e| ConfigError::Invalid {
            file: file.to_owned(),
            message: e.to_string(),
        })?;
    let mut set = Vec::new();
    set_fields(&dynamic, "", &mut set);
    let mut quiet = Vec::new();
    for path in set {
        let Some(row) = row(&path) else {
            // The schema test keeps every field in the table; a field without a row would be
            // a build defect, refused rather than ignored.
            return Err(ConfigError::Invalid {
                file: file.to_owned(),
                message: format!("field '{path}' is not supported by this server"),
            });
        };
        let at = || match text.and_then(|t| line_of(t, row.path)) {
            Some(line) => format!("{file}:{line}"),
            None => file.to_owned(),
        };
        match row.treatment(family) {
            Treatment::Honoured | Treatment::Container => {}
            Treatment::Refused(why) => {
                return Err(ConfigError::Invalid {
                    file: at(),
                    message: format!(
                        "field '{}' is not supported for {} models: {why}",
                        row.path,
                        family.label()
                    ),
                })
            }
            Treatment::NoEffect(why) => {
                if !quiet.iter().any(|q: &NoEffectField| q.path == row.path) {
                    quiet.push(NoEffectField {
                        path: row.path,
                        why,
                        at: at(),
                    });
                }
            }
        }
    }
    Ok(quiet)
}

/// The dotted paths of the fields set in `message` (and in the messages it holds), parents
/// before their fields.
fn set_fields(message: &DynamicMessage, prefix: &str, out: &mut Vec<String>) {
    for (field, value) in message.fields() {
        let path = format!("{prefix}{}", field.name());
        out.push(path.clone());
        let nested = format!("{path}.");
        let mut visit = |v: &Value| {
            if let Value::Message(m) = v {
                set_fields(m, &nested, out);
            }
        };
        match value {
            Value::List(items) => items.iter().for_each(&mut visit),
            Value::Map(entries) => entries.values().for_each(&mut visit),
            other => visit(other),
        }
    }
}

/// The line of `text` where the field at `path` is written: each segment is looked for after
/// the previous one, as a name followed by `:`, `{` or `[` (comments and strings skipped).
fn line_of(text: &str, path: &str) -> Option<usize> {
    let tokens = names(text);
    let mut from = 0;
    let mut line = None;
    for segment in path.split('.') {
        let (index, found_line) = tokens[from..]
            .iter()
            .enumerate()
            .find(|(_, (name, _))| name == segment)
            .map(|(i, (_, l))| (from + i, *l))?;
        from = index + 1;
        line = Some(found_line);
    }
    line
}

/// The field names written in a text-format file, with their lines.
fn names(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (number, raw) in text.lines().enumerate() {
        let mut code = String::new();
        let mut in_string = None;
        for c in raw.chars() {
            match in_string {
                Some(q) if c == q => in_string = None,
                Some(_) => {}
                None if c == '"' || c == '\'' => in_string = Some(c),
                None if c == '#' => break,
                None => code.push(c),
            }
        }
        let bytes: Vec<char> = code.chars().collect();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii_alphabetic() || bytes[i] == '_' {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_') {
                    i += 1;
                }
                let word: String = bytes[start..i].iter().collect();
                let next = bytes[i..].iter().find(|c| !c.is_whitespace());
                if matches!(next, Some(':' | '{' | '[')) {
                    out.push((word, number + 1));
                }
            } else {
                i += 1;
            }
        }
    }
    out
}

/// The configuration reference of `docs/configuration.md`, one line per field: `path | onnxruntime | wasm |
/// generation | ensemble`, each `honoured`, `refused` or `no effect` (containers skipped).
pub fn reference_lines() -> Vec<String> {
    FIELDS
        .iter()
        .filter(|r| {
            Family::ALL
                .iter()
                .any(|f| r.treatment(*f) != Treatment::Container)
        })
        .map(|r| {
            let cells: Vec<&str> = Family::ALL
                .iter()
                .map(|f| match r.treatment(*f) {
                    Treatment::Honoured => "honoured",
                    Treatment::Container => "(its fields)",
                    Treatment::Refused(_) => "refused",
                    Treatment::NoEffect(_) => "no effect",
                })
                .collect();
            format!("| `{}` | {} |", r.path, cells.join(" | "))
        })
        .collect()
}

/// `docs/configuration.md`'s block, between its markers, as [`reference_lines`] makes it.
pub fn reference_block() -> String {
    let mut out = String::from(
        "| field | onnxruntime | wasm | generation | ensemble |\n|---|---|---|---|---|\n",
    );
    for line in reference_lines() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests;
