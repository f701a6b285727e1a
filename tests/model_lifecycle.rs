//! Loading, reloading and unloading models, control modes, version policies, and the load-time
//! errors a person gets for broken configurations and model files.

use std::time::Duration;

use crate::common::*;
use base64::Engine;
use serde_json::{json, Value};

fn post(s: &TestServer, path: &str, body: Value) -> reqwest::blocking::Response {
    http().post(s.url(path)).json(&body).send().unwrap()
}

fn index(s: &TestServer) -> Vec<Value> {
    post(s, "/v2/repository/index", json!({}))
        .json::<Vec<Value>>()
        .unwrap()
}

fn entry<'a>(index: &'a [Value], name: &str) -> &'a Value {
    index
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in index"))
}

fn infer_ok(s: &TestServer) -> bool {
    post(s, "/v2/models/simple/infer", simple_request()).status() == 200
}

#[test]
fn explicit_mode_loads_and_unloads_on_request() {
    let repo = temp_repository(&["simple", "identity_fp32"]);
    let s = TestServer::start(
        repo.path(),
        &[
            "--model-control-mode",
            "explicit",
            "--load-model",
            "identity_fp32",
        ],
    );
    let idx = index(&s);
    assert_eq!(entry(&idx, "simple")["state"], "UNAVAILABLE");
    assert_eq!(entry(&idx, "identity_fp32")["state"], "READY");
    assert_eq!(
        http()
            .get(s.url("/v2/models/simple/ready"))
            .send()
            .unwrap()
            .status(),
        400
    );

    assert_eq!(
        post(&s, "/v2/repository/models/simple/load", json!({})).status(),
        200
    );
    assert!(infer_ok(&s));
    let idx = index(&s);
    assert_eq!(entry(&idx, "simple")["state"], "READY");
    assert_eq!(entry(&idx, "simple")["version"], "1");
    let ready: Vec<Value> = post(&s, "/v2/repository/index", json!({"ready": true}))
        .json()
        .unwrap();
    assert_eq!(ready.len(), 2);

    assert_eq!(
        post(&s, "/v2/repository/models/simple/unload", json!({})).status(),
        200
    );
    assert_eq!(
        post(&s, "/v2/models/simple/infer", simple_request()).status(),
        404
    );
    let idx = index(&s);
    assert_eq!(entry(&idx, "simple")["state"], "UNAVAILABLE");
    // An unloaded model does not make the server unready.
    assert_eq!(
        http()
            .get(s.url("/v2/health/ready"))
            .send()
            .unwrap()
            .status(),
        200
    );

    let resp = post(&s, "/v2/repository/models/ghost/load", json!({}));
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().unwrap();
    assert!(body["error"].as_str().unwrap().contains("'ghost'"));
}

#[test]
fn load_with_config_and_file_overrides() {
    let repo = temp_repository(&["simple"]);
    let s = TestServer::start(
        repo.path(),
        &["--model-control-mode", "explicit", "--load-model", "simple"],
    );
    // A JSON config override changes the served configuration.
    let config = json!({"backend": "onnxruntime", "max_batch_size": 4,
        "input": [{"name": "INPUT0", "data_type": "TYPE_INT32", "dims": [16]}, {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_INT32", "dims": [16]}]});
    let resp = post(
        &s,
        "/v2/repository/models/simple/load",
        json!({"parameters": {"config": config.to_string()}}),
    );
    assert_eq!(resp.status(), 200, "{}", resp.text().unwrap());
    let served: Value = http()
        .get(s.url("/v2/models/simple/config"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(served["max_batch_size"], 4);
    assert_eq!(served["output"].as_array().unwrap().len(), 1);

    // A model uploaded as files under a new name.
    let onnx = std::fs::read(example_repository().join("simple/1/model.onnx")).unwrap();
    let b64 = base64::engine::general_purpose::STANDARD.encode(onnx);
    let resp = post(
        &s,
        "/v2/repository/models/uploaded/load",
        json!({"parameters": {"config": json!({"backend": "onnxruntime"}).to_string(), "file:1/model.onnx": b64}}),
    );
    assert_eq!(resp.status(), 200, "{}", resp.text().unwrap());
    let meta: Value = http()
        .get(s.url("/v2/models/uploaded"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(meta["inputs"][0]["name"], "INPUT0");

    let resp = post(
        &s,
        "/v2/repository/models/simple/load",
        json!({"parameters": {"config": "{not json"}}),
    );
    assert_eq!(resp.status(), 400);
    assert!(resp
        .text()
        .unwrap()
        .contains("invalid JSON model configuration"));
    let resp = post(
        &s,
        "/v2/repository/models/x/load",
        json!({"parameters": {"config": "{}", "file:../escape/model.onnx": "AAAA"}}),
    );
    assert_eq!(resp.status(), 400);
    assert!(resp
        .text()
        .unwrap()
        .contains("load parameter 'file:../escape/model.onnx': the part '..'"));
}

#[test]
fn broken_configs_and_models_fail_clearly_while_others_serve() {
    let repo = temp_repository(&["simple"]);
    let root = repo.path();
    let add = |name: &str, config: &str, model: Option<&[u8]>| {
        std::fs::create_dir_all(root.join(name).join("1")).unwrap();
        std::fs::write(root.join(name).join("config.pbtxt"), config).unwrap();
        let bytes = model.map(<[u8]>::to_vec).unwrap_or_else(|| {
            std::fs::read(example_repository().join("simple/1/model.onnx")).unwrap()
        });
        std::fs::write(root.join(name).join("1/model.onnx"), bytes).unwrap();
    };
    add("syntax", "name: \"syntax\"\nmax_batch_size: 8\ninput [ { name: \"INPUT0\" data_type: TYPE_INT32 dims: [ 16 ] }\n", None);
    add(
        "unknown_field",
        "max_batch_size: 8\n  colour: \"blue\"\n",
        None,
    );
    add("wrong_type", "max_batch_size: \"eight\"\n", None);
    add(
        "corrupt",
        "backend: \"onnxruntime\"\n",
        Some(b"this is not an onnx file"),
    );
    add(
        "dtype_mismatch",
        "max_batch_size: 8\ninput [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] }, { name: \"INPUT1\" data_type: TYPE_INT32 dims: [ 16 ] } ]\noutput [ { name: \"OUTPUT0\" data_type: TYPE_INT32 dims: [ 16 ] } ]\n",
        None,
    );
    add(
        "rank_mismatch",
        "max_batch_size: 8\ninput [ { name: \"INPUT0\" data_type: TYPE_INT32 dims: [ 1, 16 ] }, { name: \"INPUT1\" data_type: TYPE_INT32 dims: [ 16 ] } ]\noutput [ { name: \"OUTPUT0\" data_type: TYPE_INT32 dims: [ 16 ] } ]\n",
        None,
    );
    add("gpu", "instance_group [ { kind: KIND_GPU } ]\n", None);
    add("name_mismatch", "name: \"other\"\n", None);
    std::fs::create_dir_all(root.join("no_versions")).unwrap();
    std::fs::write(
        root.join("no_versions/config.pbtxt"),
        "backend: \"onnxruntime\"\n",
    )
    .unwrap();

    let s = TestServer::start(root, &["--strict-readiness", "false"]);
    assert!(infer_ok(&s), "healthy models keep serving");
    assert_eq!(
        http()
            .get(s.url("/v2/health/ready"))
            .send()
            .unwrap()
            .status(),
        200
    );
    let idx = index(&s);
    let reason = |name: &str| {
        let e = entry(&idx, name);
        assert_eq!(e["state"], "UNAVAILABLE", "{name}: {e}");
        e["reason"].as_str().unwrap().to_owned()
    };
    let r = reason("syntax");
    assert!(
        r.contains("syntax/config.pbtxt:4:1") && r.contains("end of input"),
        "{r}"
    );
    let r = reason("unknown_field");
    assert!(
        r.contains("unknown_field/config.pbtxt:2:3") && r.contains("colour"),
        "{r}"
    );
    let r = reason("wrong_type");
    assert!(
        r.contains("wrong_type/config.pbtxt:1:17") && r.contains("\"eight\""),
        "{r}"
    );
    let r = reason("corrupt");
    assert!(
        r.contains("ONNX Runtime cannot load") && r.contains("corrupt/1/model.onnx"),
        "{r}"
    );
    let r = reason("dtype_mismatch");
    assert!(r.contains("input 'INPUT0': config.pbtxt says data_type TYPE_FP32 but the ONNX model has TYPE_INT32"), "{r}");
    let r = reason("rank_mismatch");
    assert!(
        r.contains("has 2 dimensions")
            && r.contains("max_batch_size 8 adds a leading batch dimension"),
        "{r}"
    );
    let r = reason("gpu");
    assert!(
        r.contains("KIND_GPU") && r.contains("use kind: KIND_CPU"),
        "{r}"
    );
    let r = reason("name_mismatch");
    assert!(r.contains("field 'name'") && r.contains("\"other\""), "{r}");
    let r = reason("no_versions");
    assert!(r.contains("no version to load"), "{r}");
}

#[test]
fn strict_readiness_reports_a_failed_model() {
    let repo = temp_repository(&["simple"]);
    std::fs::create_dir_all(repo.path().join("broken/1")).unwrap();
    std::fs::write(
        repo.path().join("broken/config.pbtxt"),
        "max_batch_size: -3\n",
    )
    .unwrap();
    let s = TestServer::start(repo.path(), &[]);
    assert_eq!(
        http()
            .get(s.url("/v2/health/live"))
            .send()
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        http()
            .get(s.url("/v2/health/ready"))
            .send()
            .unwrap()
            .status(),
        400
    );
    assert!(infer_ok(&s));
}

#[test]
fn failed_reload_keeps_the_old_version_and_good_reload_swaps() {
    let repo = temp_repository(&["simple"]);
    let s = TestServer::start(
        repo.path(),
        &["--model-control-mode", "explicit", "--load-model", "*"],
    );
    assert!(infer_ok(&s));
    let config_path = repo.path().join("simple/config.pbtxt");
    let good = std::fs::read_to_string(&config_path).unwrap();
    std::fs::write(&config_path, "max_batch_size: [oops\n").unwrap();
    let resp = post(&s, "/v2/repository/models/simple/load", json!({}));
    assert_eq!(resp.status(), 400);
    assert!(resp.text().unwrap().contains("config.pbtxt:1:"));
    assert!(infer_ok(&s), "the old version keeps serving");

    // A second version and `all` policy: both versions serve after the reload.
    crate::common::copy_dir(&repo.path().join("simple/1"), &repo.path().join("simple/2"));
    let reload_with_policy = |policy: &str| -> Value {
        std::fs::write(&config_path, format!("{good}\nversion_policy: {policy}\n")).unwrap();
        let resp = post(&s, "/v2/repository/models/simple/load", json!({}));
        assert_eq!(resp.status(), 200);
        let meta: Value = http()
            .get(s.url("/v2/models/simple"))
            .send()
            .unwrap()
            .json()
            .unwrap();
        meta["versions"].clone()
    };
    assert_eq!(reload_with_policy("{ all { } }"), json!(["1", "2"]));
    let resp: Value = post(&s, "/v2/models/simple/versions/1/infer", simple_request())
        .json()
        .unwrap();
    assert_eq!(resp["model_version"], "1");
    let resp: Value = post(&s, "/v2/models/simple/infer", simple_request())
        .json()
        .unwrap();
    assert_eq!(
        resp["model_version"], "2",
        "no version given: the highest serves"
    );
    assert_eq!(
        reload_with_policy("{ specific { versions: [ 1 ] } }"),
        json!(["1"])
    );
    assert_eq!(
        reload_with_policy("{ latest { num_versions: 1 } }"),
        json!(["2"])
    );
}

#[test]
fn poll_mode_follows_the_repository() {
    let repo = temp_repository(&["simple"]);
    std::fs::create_dir_all(repo.path().join("broken/1")).unwrap();
    std::fs::write(
        repo.path().join("broken/config.pbtxt"),
        "max_batch_size: -1\n",
    )
    .unwrap();
    let s = TestServer::start(
        repo.path(),
        &[
            "--model-control-mode",
            "poll",
            "--repository-poll-secs",
            "1",
        ],
    );
    assert!(infer_ok(&s));
    let resp = post(&s, "/v2/repository/models/simple/unload", json!({}));
    // Triton's UNAVAILABLE (503) and words.
    assert_eq!(resp.status(), 503);
    assert!(resp.text().unwrap().contains("polling is enabled"));

    crate::common::copy_dir(
        &example_repository().join("identity_fp32"),
        &repo.path().join("added"),
    );
    std::fs::write(
        repo.path().join("added/config.pbtxt"),
        std::fs::read_to_string(example_repository().join("identity_fp32/config.pbtxt")).unwrap(),
    )
    .unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || http()
            .get(s.url("/v2/models/added/ready"))
            .send()
            .map(|r| r.status() == 200)
            .unwrap_or(false)),
        "new model was not picked up; log:\n{}",
        s.log_text()
    );
    std::fs::remove_dir_all(repo.path().join("added")).unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || http()
            .get(s.url("/v2/models/added/ready"))
            .send()
            .map(|r| r.status() == 400)
            .unwrap_or(false)),
        "removed model still served"
    );
    assert!(infer_ok(&s));
    // Several polls have run by now; the unchanged broken model was not retried each time.
    let failures = s
        .log_text()
        .lines()
        .filter(|l| l.contains("model load failed") && l.contains("broken"))
        .count();
    assert_eq!(failures, 1, "log:\n{}", s.log_text());
}

/// GPU placement on a host without a GPU: `KIND_GPU` fails to load with what is missing (the
/// NVIDIA driver in a GPU build, the `cuda` feature otherwise), an unknown accelerator is named,
/// and a TensorRT accelerator on CPU instances is legal and ignored, as in Triton.
#[test]
fn gpu_instance_groups_say_what_is_missing_on_a_cpu_host() {
    let repo = temp_repository(&["simple"]);
    let root = repo.path();
    let simple = std::fs::read_to_string(root.join("simple/config.pbtxt")).unwrap();
    let variant = |name: &str, tail: &str| {
        copy_dir(&root.join("simple"), &root.join(name));
        let text = simple
            .replace("name: \"simple\"", &format!("name: \"{name}\""))
            .replace("instance_group [ { count: 1, kind: KIND_CPU } ]", tail);
        std::fs::write(root.join(name).join("config.pbtxt"), text).unwrap();
    };
    variant(
        "on_gpu",
        "instance_group [ { count: 2, kind: KIND_GPU, gpus: [ 0 ] } ]",
    );
    let tensorrt = "optimization { execution_accelerators { gpu_execution_accelerator: \
                    [ { name: \"tensorrt\", parameters { key: \"precision_mode\" value: \"FP16\" } } ] } }";
    variant(
        "trt_on_cpu",
        &format!("instance_group [ {{ kind: KIND_CPU }} ]\n{tensorrt}"),
    );
    variant(
        "bad_accelerator",
        "optimization { execution_accelerators { gpu_execution_accelerator: [ { name: \"tensorrt_llm\" } ] } }",
    );
    let s = TestServer::start(root, &["--strict-readiness", "false"]);
    let idx = index(&s);
    if entry(&idx, "on_gpu")["state"] == "READY" {
        return; // a GPU build on a GPU host: nothing is missing
    }
    let reason = entry(&idx, "on_gpu")["reason"].as_str().unwrap().to_owned();
    assert!(
        reason.contains("instance_group[0] asks for KIND_GPU") && reason.contains("KIND_CPU"),
        "{reason}"
    );
    if cfg!(feature = "cuda") {
        assert!(reason.contains("NVIDIA driver"), "{reason}");
    } else {
        assert!(reason.contains("--features cuda"), "{reason}");
    }
    assert_eq!(entry(&idx, "trt_on_cpu")["state"], "READY");
    let body = simple_request();
    assert_eq!(post(&s, "/v2/models/trt_on_cpu/infer", body).status(), 200);
    let reason = entry(&idx, "bad_accelerator")["reason"].as_str().unwrap();
    assert!(
        reason.contains("gpu_execution_accelerator[0] name 'tensorrt_llm' is not supported"),
        "{reason}"
    );
    assert!(infer_ok(&s), "the CPU model next to them serves");
}
