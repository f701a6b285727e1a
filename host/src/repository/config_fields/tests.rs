use super::*;
use crate::repository::config::parse_text;
use prost_reflect::{Kind, MessageDescriptor};
use std::path::Path;

fn schema_paths(message: &MessageDescriptor, prefix: &str, out: &mut Vec<String>) {
    for field in message.fields() {
        let path = format!("{prefix}{}", field.name());
        out.push(path.clone());
        let value_kind = if field.is_map() {
            match field.kind() {
                Kind::Message(entry) => entry.map_entry_value_field().kind(),
                other => other,
            }
        } else {
            field.kind()
        };
        if let Kind::Message(inner) = value_kind {
            schema_paths(&inner, &format!("{path}."), out);
        }
    }
}

#[test]
fn every_field_of_the_schema_has_exactly_one_row() {
    let mut paths = Vec::new();
    schema_paths(model_config_descriptor(), "", &mut paths);
    let missing: Vec<&String> = paths.iter().filter(|p| row(p).is_none()).collect();
    assert!(missing.is_empty(), "fields without a row: {missing:?}");
    let stale: Vec<&str> = FIELDS
        .iter()
        .map(|r| r.path)
        .filter(|p| !paths.iter().any(|s| s == p))
        .collect();
    assert!(stale.is_empty(), "rows for no field: {stale:?}");
    for (i, r) in FIELDS.iter().enumerate() {
        assert!(
            !FIELDS[..i].iter().any(|o| o.path == r.path),
            "two rows for {}",
            r.path
        );
    }
    assert_eq!(FIELDS.len(), paths.len());
}

#[test]
fn the_manuals_reference_is_the_table() {
    let readme = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md"),
    )
    .unwrap();
    let begin =
        "<!-- config-fields:begin (generated from host/src/repository/config_fields/table.rs) -->\n";
    let end = "<!-- config-fields:end -->";
    let start = readme.find(begin).map(|i| i + begin.len());
    let stop = readme.find(end);
    let written = match (start, stop) {
        (Some(a), Some(b)) if a <= b => &readme[a..b],
        _ => "",
    };
    let want = reference_block();
    if written != want {
        std::fs::write(std::env::temp_dir().join("config-fields.md"), &want).unwrap();
    }
    assert!(
        written == want,
        "docs/configuration.md's field table differs from the code's; the table the code makes is in \
         {}",
        std::env::temp_dir().join("config-fields.md").display()
    );
}

#[test]
fn a_refused_field_is_named_with_its_file_and_line() {
    let text = "name: \"m\"\nmax_batch_size: 8\ninput [\n  {\n    name: \"x\"\n    \
                data_type: TYPE_FP32\n    dims: [ -1 ]\n    is_shape_tensor: true\n  }\n]\n";
    let config = parse_text(text, Path::new("m/config.pbtxt")).unwrap();
    let e = check(&config, Family::Onnx, Some(text), "m/config.pbtxt")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("m/config.pbtxt:8: field 'input.is_shape_tensor' is not supported"),
        "{e}"
    );
}

#[test]
fn fields_without_effect_are_reported_once_with_their_line() {
    let text = "name: \"m\"\noptimization {\n  cuda { graphs: true }\n  priority: \
                PRIORITY_MAX\n}\ninstance_group [ { count: 1 profile: [\"0\"] }, { count: 1 \
                profile: [\"1\"] } ]\n";
    let config = parse_text(text, Path::new("c")).unwrap();
    let quiet = check(&config, Family::Onnx, Some(text), "c").unwrap();
    let mut paths: Vec<(&str, &str)> = quiet.iter().map(|q| (q.path, q.at.as_str())).collect();
    paths.sort();
    assert_eq!(
        paths,
        vec![
            ("instance_group.profile", "c:6"),
            ("optimization.cuda.graphs", "c:3"),
            ("optimization.priority", "c:4"),
        ]
    );
}

#[test]
fn the_same_field_reads_differently_per_backend() {
    let text = "name: \"m\"\ndynamic_batching { }\n";
    let config = parse_text(text, Path::new("c")).unwrap();
    assert!(check(&config, Family::Onnx, Some(text), "c").is_ok());
    let e = check(&config, Family::Generation, Some(text), "c")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("c:2: field 'dynamic_batching' is not supported for generation"),
        "{e}"
    );
}
