//! Shape buckets and warm-up against the real binary on the CPU provider: batches padded to
//! a bucket and sequences padded to a multiple answer exactly what unpadded runs answer,
//! statistics count real rows while a metric counts the padding, `model_warmup` runs before
//! the model is READY, and broken warm-up or provider settings fail the load by field name.
//!
//! Batches are made deterministic without timing, as in tests/batching.rs: a very long
//! `max_queue_delay` with preferred batch sizes runs a batch exactly when it is complete.

use crate::common::*;
use serde_json::{json, Value};

// One instance: warm-up runs once per instance, and the counts below are one instance's.
const SIMPLE_IO: &str = r#"
max_batch_size: 8
instance_group [ { count: 1, kind: KIND_CPU } ]
input [ { name: "INPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
        { name: "INPUT1", data_type: TYPE_INT32, dims: [ 16 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_INT32, dims: [ 16 ] },
         { name: "OUTPUT1", data_type: TYPE_INT32, dims: [ 16 ] } ]
"#;

const ENCODER_IO: &str = r#"
max_batch_size: 8
input [ { name: "input_ids", data_type: TYPE_INT64, dims: [ -1 ] },
        { name: "attention_mask", data_type: TYPE_INT64, dims: [ -1 ] } ]
output [ { name: "last_hidden_state", data_type: TYPE_FP32, dims: [ -1, 8 ] },
         { name: "pooled", data_type: TYPE_FP32, dims: [ 8 ] } ]
"#;

/// A request of `rows` rows to `simple`: INPUT0 = 100 * k + i, INPUT1 = k for row k.
fn simple_rows(first: i32, rows: i32) -> (Value, Vec<i32>) {
    let a: Vec<i32> = (first..first + rows)
        .flat_map(|k| (0..16).map(move |i| 100 * k + i))
        .collect();
    let b: Vec<i32> = (first..first + rows).flat_map(|k| [k; 16]).collect();
    let sums = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let body = json!({"inputs": [
        {"name": "INPUT0", "shape": [rows, 16], "datatype": "INT32", "data": a},
        {"name": "INPUT1", "shape": [rows, 16], "datatype": "INT32", "data": b}]});
    (body, sums)
}

#[test]
fn batches_are_padded_to_buckets_and_the_padding_never_reaches_a_client() {
    let repo = TempDir::new();
    let config = format!(
        "{SIMPLE_IO}dynamic_batching {{ preferred_batch_size: [ 3, 5 ] max_queue_delay_microseconds: 120000000 }}\n\
         parameters [ {{ key: \"batch_buckets\", value: {{ string_value: \"2 4\" }} }},\n\
                      {{ key: \"session_per_bucket\", value: {{ string_value: \"true\" }} }} ]\n"
    );
    add_model(repo.path(), "bucketed", "simple", &config);
    let s = TestServer::start(repo.path(), &[]);
    // Buckets 2, 4 and 8 (max_batch_size) were each run once at load, before READY.
    let st = s.model_stats("bucketed");
    assert_eq!(st["warmup"]["count"], 3, "{st}");
    assert_eq!(st["inference_count"], 0, "warm-up is not inference: {st}");

    // Three one-row requests: one batch of 3, padded to 4.
    let answers: Vec<(Vec<i32>, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|k| {
                let s = &s;
                scope.spawn(move || {
                    let (body, sums) = simple_rows(k, 1);
                    let (status, out) = infer(s, "bucketed", &body);
                    assert_eq!(status, 200, "{out}");
                    (sums, out)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (sums, out) in answers {
        assert_eq!(out["outputs"][0]["shape"], json!([1, 16]), "{out}");
        assert_eq!(out["outputs"][0]["data"], json!(sums));
    }
    // One request of 5 rows, padded to 8: its answer has 5 rows.
    let (body, sums) = simple_rows(10, 5);
    let (status, out) = infer(&s, "bucketed", &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outputs"][0]["shape"], json!([5, 16]));
    assert_eq!(out["outputs"][0]["data"], json!(sums));

    let st = s.model_stats("bucketed");
    assert_eq!(st["inference_count"], 8, "real rows only: {st}");
    assert_eq!(st["execution_count"], 2, "{st}");
    let sizes: Vec<&Value> = st["batch_stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| &b["batch_size"])
        .collect();
    assert_eq!(sizes, [&json!(3), &json!(5)], "{st}");
    assert_eq!(s.metric("wasmtron_inference_padded_rows", "bucketed"), 4.0);
}

/// `ids` as a one-row encoder request (every position attended).
fn encoder_request(ids: &[i64]) -> Value {
    json!({"inputs": [
        {"name": "input_ids", "shape": [1, ids.len()], "datatype": "INT64", "data": ids},
        {"name": "attention_mask", "shape": [1, ids.len()], "datatype": "INT64", "data": vec![1; ids.len()]}]})
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn sequences_padded_to_a_multiple_batch_together_and_answer_as_unpadded() {
    let repo = TempDir::new();
    add_model(
        repo.path(),
        "padded",
        "masked_encoder",
        &format!(
            "{ENCODER_IO}dynamic_batching {{ preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 120000000 }}\n\
             parameters [ {{ key: \"pad_sequence_to_multiple\", value: {{ string_value: \"8\" }} }} ]\n"
        ),
    );
    add_model(repo.path(), "plain", "masked_encoder", ENCODER_IO);
    let s = TestServer::start(repo.path(), &[]);
    let texts: [&[i64]; 2] = [&[3, 7, 11], &[5, 1, 4, 9, 2, 6]];
    // Lengths 3 and 6 both pad to 8, so they run as one batch.
    let padded: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = texts
            .iter()
            .map(|ids| {
                let s = &s;
                scope.spawn(move || {
                    let (status, out) = infer(s, "padded", &encoder_request(ids));
                    assert_eq!(status, 200, "{out}");
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (ids, got) in texts.iter().zip(&padded) {
        let (status, want) = infer(&s, "plain", &encoder_request(ids));
        assert_eq!(status, 200, "{want}");
        for (k, output) in ["last_hidden_state", "pooled"].iter().enumerate() {
            let (g, w) = (&got["outputs"][k], &want["outputs"][k]);
            assert_eq!(g["name"], *output);
            assert_eq!(g["shape"], w["shape"], "{output} for length {}", ids.len());
            for (a, b) in floats(&g["data"]).iter().zip(floats(&w["data"])) {
                assert!((a - b).abs() <= 1e-5, "{output}: {a} vs {b}");
            }
        }
    }
    assert_eq!(
        padded[0]["outputs"][0]["shape"],
        json!([1, 3, 8]),
        "cut back to the request's own length"
    );
    let st = s.model_stats("padded");
    assert_eq!(st["execution_count"], 1, "lengths 3 and 6 batched: {st}");
    assert_eq!(st["inference_count"], 2, "{st}");
}

fn index(s: &TestServer) -> Vec<Value> {
    http()
        .post(s.url("/v2/repository/index"))
        .json(&json!({}))
        .send()
        .unwrap()
        .json()
        .unwrap()
}

fn simple_warmup(name: &str, input1: &str, count: u32) -> String {
    format!(
        "model_warmup [ {{ name: \"{name}\" batch_size: 2 count: {count}\n\
           inputs {{ key: \"INPUT0\" value: {{ data_type: TYPE_INT32 dims: [ 16 ] zero_data: true }} }}\n\
           inputs {{ key: \"INPUT1\" value: {{ data_type: TYPE_INT32 dims: [ 16 ] {input1} }} }} }} ]\n"
    )
}

#[test]
fn model_warmup_runs_before_ready_and_bad_warmups_fail_the_load_by_name() {
    let repo = TempDir::new();
    let r = repo.path();
    add_model(
        r,
        "warm",
        "simple",
        &(SIMPLE_IO.to_owned() + &simple_warmup("zeros", "random_data: true", 2)),
    );
    add_model(
        r,
        "from_file",
        "simple",
        &(SIMPLE_IO.to_owned() + &simple_warmup("file", "input_data_file: \"ones\"", 1)),
    );
    std::fs::create_dir_all(r.join("from_file/warmup")).unwrap();
    std::fs::write(
        r.join("from_file/warmup/ones"),
        1i32.to_le_bytes().repeat(16),
    )
    .unwrap();
    // Passes the checks but fails to run: ids past the 50-word vocabulary.
    add_model(
        r,
        "fails",
        "masked_encoder",
        &format!(
            "{ENCODER_IO}model_warmup [ {{ name: \"far ids\" batch_size: 1\n\
               inputs {{ key: \"input_ids\" value: {{ data_type: TYPE_INT64 dims: [ 4 ] input_data_file: \"far\" }} }}\n\
               inputs {{ key: \"attention_mask\" value: {{ data_type: TYPE_INT64 dims: [ 4 ] zero_data: true }} }} }} ]\n"
        ),
    );
    std::fs::create_dir_all(r.join("fails/warmup")).unwrap();
    std::fs::write(r.join("fails/warmup/far"), 1000i64.to_le_bytes().repeat(4)).unwrap();
    let unknown = simple_warmup("typo", "zero_data: true", 1).replace("\"INPUT1\"", "\"INPUT2\"");
    add_model(
        r,
        "unknown_input",
        "simple",
        &(SIMPLE_IO.to_owned() + &unknown),
    );
    add_model(
        r,
        "wrong_dims",
        "simple",
        &(SIMPLE_IO.to_owned()
            + &simple_warmup("dims", "zero_data: true", 1).replacen(
                "dims: [ 16 ]",
                "dims: [ 15 ]",
                1,
            )),
    );
    add_model(
        r,
        "missing_file",
        "simple",
        &(SIMPLE_IO.to_owned() + &simple_warmup("gone", "input_data_file: \"gone\"", 1)),
    );
    add_model(
        r,
        "cuda_option",
        "simple",
        &(SIMPLE_IO.to_owned()
            + "optimization { execution_accelerators { gpu_execution_accelerator [ { name: \"cuda\"\n\
                 parameters { key: \"cudnn_conv_algo_search\" value: \"FAST\" } } ] } }\n"),
    );
    add_model(
        r,
        "bad_bucket",
        "simple",
        &(SIMPLE_IO.to_owned()
            + "parameters [ { key: \"batch_buckets\", value: { string_value: \"4 16\" } } ]\n"),
    );
    // Wasm stages warm up the same way; a stage that traps on its sample fails the load.
    let stage_warmup = "model_warmup [ { name: \"stage\" batch_size: 1 count: 2\n\
         inputs { key: \"INPUT0\" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]\n";
    for (name, mode) in [("stage", "echo"), ("stage_panics", "panic")] {
        add_probe(r, name, mode, &[]);
        let config = r.join(name).join("config.pbtxt");
        let text = std::fs::read_to_string(&config).unwrap() + stage_warmup;
        std::fs::write(config, text).unwrap();
    }
    let s = TestServer::start(r, &["--strict-readiness", "false"]);

    assert_eq!(s.model_stats("stage")["warmup"]["count"], 2);
    let st = s.model_stats("warm");
    assert_eq!(
        st["warmup"]["count"], 2,
        "the sample ran `count` times: {st}"
    );
    assert!(st["warmup"]["ns"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["inference_count"], 0, "{st}");
    assert_eq!(s.model_stats("from_file")["warmup"]["count"], 1);
    assert!(s.metric("wasmtron_model_warmup_duration_secs", "warm") > 0.0);
    let (status, _) = infer(&s, "warm", &simple_rows(0, 1).0);
    assert_eq!(status, 200);

    let idx = index(&s);
    let reason = |name: &str| {
        let e = idx
            .iter()
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in index"));
        assert_eq!(e["state"], "UNAVAILABLE", "{name}: {e}");
        e["reason"].as_str().unwrap().to_owned()
    };
    let expected = [
        ("fails", "model 'fails': warm-up sample 'far ids' failed on instance 0: ONNX Runtime failed to run the model"),
        ("unknown_input", "model_warmup[0] ('typo'): inputs names 'INPUT2', which is not an input of the model (its inputs are: INPUT0, INPUT1)"),
        ("wrong_dims", "model_warmup[0] ('dims'): inputs['INPUT0']: dims [15] do not fit the input's dims [16]"),
        ("missing_file", "model_warmup[0] ('gone'): inputs['INPUT1']: input_data_file 'gone' cannot be read"),
        ("cuda_option", "gpu_execution_accelerator[0] parameter 'cudnn_conv_algo_search' must be EXHAUSTIVE (0), HEURISTIC (1) or DEFAULT (2), got \"FAST\""),
        ("bad_bucket", "parameter 'batch_buckets': size 16 is larger than max_batch_size 8"),
        ("stage_panics", "model 'stage_panics': warm-up sample 'stage' failed on instance 0"),
    ];
    for (model, want) in expected {
        let r = reason(model);
        assert!(r.contains(want), "{model}: {r}");
    }
    // The healthy models keep serving.
    let (status, _) = infer(&s, "from_file", &simple_rows(0, 2).0);
    assert_eq!(status, 200);
}
