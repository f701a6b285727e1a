//! `config.pbtxt`: protobuf text format for [`ModelConfig`], parsed by reflection over our own
//! descriptor set, with errors that name the file, line, column and field. Also the JSON form
//! of the configuration served by the model-configuration extension and taken by the load API.

use std::{path::Path, sync::OnceLock};

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};

use crate::proto::{inference::ModelConfig, FILE_DESCRIPTOR_SET};

/// Why a configuration could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Text-format syntax or schema error at a position in the file.
    #[error("{file}:{line}:{column}: {message}")]
    Syntax {
        /// The file (or `<config>` for in-memory text).
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What was wrong, naming the field.
        message: String,
    },
    /// A JSON configuration (load API) that does not fit the schema.
    #[error("invalid JSON model configuration: {0}")]
    Json(String),
    /// A well-formed configuration whose values do not make sense.
    #[error("{file}: {message}")]
    Invalid {
        /// The file the configuration came from.
        file: String,
        /// What is wrong, naming the field.
        message: String,
    },
}

pub(super) fn model_config_descriptor() -> &'static MessageDescriptor {
    static DESCRIPTOR: OnceLock<MessageDescriptor> = OnceLock::new();
    DESCRIPTOR.get_or_init(|| {
        // The descriptor set is produced by our own build script from our own protos; failing to
        // decode it is a build defect, not a runtime condition.
        #[allow(clippy::expect_used)]
        let pool = DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("embedded descriptor set");
        #[allow(clippy::expect_used)]
        pool.get_message_by_name("inference.ModelConfig")
            .expect("inference.ModelConfig in descriptor set")
    })
}

/// Parses `config.pbtxt` text. `file` is only used in error messages.
pub fn parse_text(text: &str, file: &Path) -> Result<ModelConfig, ConfigError> {
    let file_name = file.display().to_string();
    let (normalized, inserts) = insert_list_colons(text);
    let dynamic = DynamicMessage::parse_text_format(model_config_descriptor().clone(), &normalized)
        .map_err(|err| {
            let offset = error_offset(&err).map(|o| o - inserts.iter().filter(|&&i| i < o).count());
            let (line, column) = line_column(text, offset.unwrap_or(text.len()));
            ConfigError::Syntax {
                file: file_name.clone(),
                line,
                column,
                message: err.to_string(),
            }
        })?;
    dynamic
        .transcode_to::<ModelConfig>()
        .map_err(|err| ConfigError::Invalid {
            file: file_name,
            message: err.to_string(),
        })
}

/// Parses the JSON form of a configuration (as given to the load API's `config` parameter).
pub fn parse_json(json: &str) -> Result<ModelConfig, ConfigError> {
    let mut de = serde_json::Deserializer::from_str(json);
    let dynamic = DynamicMessage::deserialize(model_config_descriptor().clone(), &mut de)
        .map_err(|e| ConfigError::Json(e.to_string()))?;
    de.end().map_err(|e| ConfigError::Json(e.to_string()))?;
    dynamic
        .transcode_to::<ModelConfig>()
        .map_err(|e| ConfigError::Json(e.to_string()))
}

/// Renders a configuration as JSON the way Triton does: proto field names, every field present,
/// 64-bit integers as numbers.
pub fn to_json(config: &ModelConfig) -> serde_json::Value {
    let mut dynamic = DynamicMessage::new(model_config_descriptor().clone());
    if dynamic.transcode_from(config).is_err() {
        return serde_json::Value::Null;
    }
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(false)
        .stringify_64_bit_integers(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .unwrap_or(serde_json::Value::Null)
}

/// Triton configs write message lists without a colon (`input [ { ... } ]`), which the text
/// format allows but prost-reflect does not parse: insert the colon, skipping strings and
/// comments. Returns the new text and the original offsets where a colon was inserted.
fn insert_list_colons(text: &str) -> (String, Vec<usize>) {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 16);
    let mut inserts = Vec::new();
    // The last two significant tokens: (is_identifier, is_colon).
    let mut prev_ident = false;
    let mut before_prev_colon = false;
    let mut prev_colon = false;
    let mut i = 0;
    let mut copied = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' | b'\'' => {
                i += 1;
                while i < bytes.len() && bytes[i] != c && bytes[i] != b'\n' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                i += 1;
                before_prev_colon = prev_colon;
                prev_ident = false;
                prev_colon = false;
            }
            c if c.is_ascii_whitespace() => i += 1,
            c if c.is_ascii_alphabetic() || c == b'_' => {
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                before_prev_colon = prev_colon;
                prev_ident = true;
                prev_colon = false;
            }
            _ => {
                if c == b'[' && prev_ident && !before_prev_colon {
                    out.push_str(&text[copied..i]);
                    out.push(':');
                    copied = i;
                    inserts.push(i);
                }
                before_prev_colon = prev_colon;
                prev_ident = false;
                prev_colon = c == b':';
                // Skip the rest of a number or punctuation char by char; UTF-8 continuation bytes
                // never equal ASCII delimiters, so byte stepping is safe.
                i += 1;
            }
        }
    }
    out.push_str(&text[copied..]);
    (out, inserts)
}

fn error_offset(err: &prost_reflect::text_format::ParseError) -> Option<usize> {
    use miette::Diagnostic;
    err.labels()?.next().map(|label| label.offset())
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text.as_bytes()[..offset];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |p| p + 1);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIMPLE: &str = r#"
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "INPUT0"   # a comment with [ brackets
    data_type: TYPE_INT32
    dims: [ 16 ]
  }
]
output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters [ { key: "intra_op_thread_count" value: { string_value: "1" } } ]
version_policy: { latest { num_versions: 2 } }
"#;

    #[test]
    fn parses_triton_list_style() {
        let config = parse_text(SIMPLE, Path::new("simple/config.pbtxt")).unwrap();
        assert_eq!(config.name, "simple");
        assert_eq!(config.max_batch_size, 8);
        assert_eq!(config.input.len(), 1);
        assert_eq!(config.input[0].dims, vec![16]);
        assert_eq!(config.instance_group[0].count, 2);
        assert_eq!(config.parameters["intra_op_thread_count"].string_value, "1");
        assert!(config.scheduling_choice.is_some());
    }

    #[test]
    fn unknown_field_names_line_column_and_field() {
        let text = "name: \"m\"\nmax_batch_size: 1\n  bogus_field: 3\n";
        let err = parse_text(text, Path::new("m/config.pbtxt")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("m/config.pbtxt:3:3:"), "{msg}");
        assert!(msg.contains("bogus_field"), "{msg}");
    }

    #[test]
    fn wrong_type_is_located_after_inserted_colons() {
        let text = "input [ { name: \"a\" } ]\nmax_batch_size: \"eight\"\n";
        let err = parse_text(text, Path::new("c.pbtxt")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("c.pbtxt:2:17:"), "{msg}");
    }

    #[test]
    fn json_round_trip_uses_numbers_and_field_names() {
        let config = parse_text(SIMPLE, Path::new("x")).unwrap();
        let json = to_json(&config);
        assert_eq!(json["max_batch_size"], 8);
        assert_eq!(json["input"][0]["dims"][0], 16);
        assert_eq!(json["input"][0]["data_type"], "TYPE_INT32");
        let back = parse_json(&json.to_string()).unwrap();
        assert_eq!(back, config);
    }
}
