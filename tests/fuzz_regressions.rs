//! Replays the fuzz targets' seeds and every crash `make fuzz` has found (fuzz/regressions/)
//! through the same code the fuzzers run, on the stable toolchain, plus every configuration
//! this repository ships.

#[path = "../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Feeds every saved input of `target` to `check`; returns how many there were.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let mut count = 0;
    for kind in ["seeds", "regressions"] {
        let dir = workspace().join("fuzz").join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let data = std::fs::read(&path).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&data));
            assert!(outcome.is_ok(), "{} fails", path.display());
            count += 1;
        }
    }
    count
}

#[test]
fn config_inputs() {
    assert!(replay("config_pbtxt", fuzz_checks::config_pbtxt) > 0);
    // Every configuration served or tested here parses, validates and round-trips.
    let mut configs = 0;
    for repo in [
        "model_repository",
        "tests/models",
        "benches/triton/model_repository",
    ] {
        let Ok(models) = std::fs::read_dir(workspace().join(repo)) else {
            continue;
        };
        for model in models {
            let path = model.unwrap().path().join("config.pbtxt");
            if let Ok(text) = std::fs::read(&path) {
                let mut input = vec![0u8];
                input.extend(text);
                let outcome = std::panic::catch_unwind(|| fuzz_checks::config_pbtxt(&input));
                assert!(outcome.is_ok(), "{} fails", path.display());
                configs += 1;
            }
        }
    }
    assert!(configs > 20, "found only {configs} configurations");
}

#[test]
fn http_infer_body_inputs() {
    assert!(replay("http_infer_body", fuzz_checks::http_infer_body) > 0);
}

#[test]
fn grpc_infer_request_inputs() {
    assert!(replay("grpc_infer_request", fuzz_checks::grpc_infer_request) > 0);
}

#[test]
fn bytes_codec_inputs() {
    assert!(replay("bytes_codec", fuzz_checks::bytes_codec) > 0);
}

#[test]
fn tenancy_toml_inputs() {
    assert!(replay("tenancy_toml", fuzz_checks::tenancy_toml) > 0);
    // The seed the fuzzer grows from is a config that parses, so mutations reach the checks
    // after parsing (reload, keys, permissions), not only the TOML syntax errors.
    let seed = std::fs::read(workspace().join("fuzz/seeds/tenancy_toml/two_tenants")).unwrap();
    let text = seed.split(|&b| b == 0).next().unwrap();
    let parsed = wasmtron::tenancy::Tenancy::parse(std::str::from_utf8(text).unwrap(), "seed");
    assert!(parsed.is_ok(), "{:?}", parsed.err().map(|e| e.to_string()));
}

#[test]
fn request_names_inputs() {
    assert!(replay("request_names", fuzz_checks::request_names) > 0);
}

#[test]
fn generate_request_inputs() {
    assert!(replay("generate_request", fuzz_checks::generate_request) > 0);
}
