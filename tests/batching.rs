//! The dynamic batcher against the real binary: concurrent requests merge into one execution
//! and each gets exactly its own rows back (ONNX and Wasm), priorities order a batch, queue
//! policies time out (REJECT or DELAY) and bound each level, and random shapes under
//! concurrency never mix two requests' outputs.
//!
//! The batches are made deterministic without timing: a very long `max_queue_delay` with a
//! preferred batch size means a batch runs exactly when its last request arrives.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// Waits until `model` has `n` requests queued.
fn wait_pending(s: &TestServer, model: &str, n: f64) {
    assert!(
        wait_until(Duration::from_secs(120), || s
            .metric("nv_inference_pending_request_count", model)
            == n),
        "{model} never had {n} requests queued"
    );
}

const WAIT_FOR_FOUR: &str =
    "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 120000000 }";

fn simple_body(a: &[i32], b: &[i32]) -> Value {
    json!({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b}]})
}

#[test]
fn concurrent_requests_run_as_one_batch_and_each_gets_its_own_rows() {
    let repo = TempDir::new();
    let simple = std::fs::read_to_string(example_repository().join("simple/config.pbtxt")).unwrap()
        + WAIT_FOR_FOUR;
    add_model(repo.path(), "simple", "simple", &simple);
    let s = TestServer::start(repo.path(), &[]);

    let answers: Vec<(Vec<i32>, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|k| {
                let s = &s;
                scope.spawn(move || {
                    let a: Vec<i32> = (0..16).map(|i| 100 * k + i).collect();
                    let b = vec![k; 16];
                    let (status, out) = infer(s, "simple", &simple_body(&a, &b));
                    assert_eq!(status, 200, "{out}");
                    let sums: Vec<i32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
                    (sums, out)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (sums, out) in answers {
        assert_eq!(out["outputs"][0]["shape"], json!([1, 16]));
        assert_eq!(out["outputs"][0]["data"], json!(sums));
    }
    let st = s.model_stats("simple");
    assert_eq!(st["inference_count"], 4);
    assert_eq!(st["execution_count"], 1, "{st}");
    assert_eq!(st["batch_stats"][0]["batch_size"], 4, "{st}");
    assert_eq!(st["batch_stats"][0]["compute_infer"]["count"], 1);
    assert_eq!(s.metric("nv_inference_exec_count", "simple"), 1.0);
    assert_eq!(s.metric("nv_inference_count", "simple"), 4.0);
}

fn probe_config(extra: &str) -> String {
    std::fs::read_to_string(workspace().join("tests/models/probe/config.pbtxt")).unwrap() + extra
}

fn probe_body(value: f32, priority: Option<u64>, timeout_us: Option<u64>) -> Value {
    let mut params = serde_json::Map::new();
    if let Some(p) = priority {
        params.insert("priority".into(), json!(p));
    }
    if let Some(t) = timeout_us {
        params.insert("timeout".into(), json!(t));
    }
    json!({"parameters": params, "inputs": [
        {"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [value]}]})
}

/// Sends a probe request on its own thread and waits until the model has `queued` requests
/// waiting, so that the arrival order is known.
fn send_queued<'s>(
    scope: &'s std::thread::Scope<'s, '_>,
    s: &'s TestServer,
    model: &'s str,
    body: Value,
    queued: f64,
) -> std::thread::ScopedJoinHandle<'s, (u16, Value)> {
    let handle = scope.spawn(move || infer(s, model, &body));
    wait_pending(s, model, queued);
    handle
}

/// The probe's REPORT says `calls=N`: the position in which its instance served the request.
fn served_position(out: &(u16, Value)) -> String {
    assert_eq!(out.0, 200, "{}", out.1);
    out.1["outputs"][1]["data"][0].as_str().unwrap().to_owned()
}

#[test]
fn a_batch_takes_higher_priorities_first_and_a_stage_gets_it_as_a_list() {
    let repo = TempDir::new();
    let config = probe_config(
        "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 120000000 \
         priority_levels: 2 default_priority_level: 2 }",
    );
    add_model(repo.path(), "ranked", "probe", &config);
    let s = TestServer::start(repo.path(), &[]);
    let [low1, low2, high, low3] = std::thread::scope(|scope| {
        let low1 = send_queued(scope, &s, "ranked", probe_body(1.0, None, None), 1.0);
        let low2 = send_queued(scope, &s, "ranked", probe_body(2.0, Some(2), None), 2.0);
        let high = send_queued(scope, &s, "ranked", probe_body(3.0, Some(1), None), 3.0);
        let low3 = scope.spawn(|| infer(&s, "ranked", &probe_body(4.0, Some(7), None)));
        [low1, low2, high, low3].map(|h| h.join().unwrap())
    });
    assert_eq!(served_position(&high), "calls=1");
    assert_eq!(served_position(&low1), "calls=2");
    assert_eq!(served_position(&low2), "calls=3");
    assert_eq!(
        served_position(&low3),
        "calls=4",
        "priority 7 is out of range: default"
    );
    assert_eq!(low3.1["outputs"][0]["data"], json!([4.0]));
    let st = s.model_stats("ranked");
    assert_eq!(
        (st["execution_count"].clone(), st["inference_count"].clone()),
        (json!(1), json!(4))
    );
}

#[test]
fn queue_policies_reject_or_delay_timed_out_requests_and_bound_each_level() {
    let repo = TempDir::new();
    // Level 1 rejects after its timeout; level 2 delays timed-out requests.
    let config = probe_config(
        "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 120000000 \
         priority_levels: 2 default_priority_level: 2 \
         priority_queue_policy [ \
           { key: 1 value: { timeout_action: REJECT default_timeout_microseconds: 1 } }, \
           { key: 2 value: { timeout_action: DELAY allow_timeout_override: true } } ] }",
    );
    add_model(repo.path(), "policed", "probe", &config);
    let s = TestServer::start(repo.path(), &[]);

    let (status, out) = infer(&s, "policed", &probe_body(1.0, Some(1), None));
    assert_eq!(status, 503, "{out}");
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("model 'policed' version 1: the request timed out in the queue"),
        "{out}"
    );
    assert_eq!(s.metric("nv_inference_request_failure", "policed"), 1.0);

    let [late, a, b, c] = std::thread::scope(|scope| {
        // Times out at once and is delayed behind the three that follow.
        let late = send_queued(scope, &s, "policed", probe_body(9.0, None, Some(1)), 1.0);
        let a = send_queued(scope, &s, "policed", probe_body(1.0, None, None), 2.0);
        let b = send_queued(scope, &s, "policed", probe_body(2.0, None, None), 3.0);
        let c = scope.spawn(|| infer(&s, "policed", &probe_body(3.0, None, None)));
        [late, a, b, c].map(|h| h.join().unwrap())
    });
    assert_eq!(served_position(&a), "calls=1");
    assert_eq!(served_position(&b), "calls=2");
    assert_eq!(served_position(&c), "calls=3");
    assert_eq!(served_position(&late), "calls=4");
    assert_eq!(late.1["outputs"][0]["data"], json!([9.0]));
}

#[test]
fn a_full_priority_level_refuses_at_once() {
    let repo = TempDir::new();
    let config = probe_config(
        "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 120000000 \
         default_queue_policy { max_queue_size: 2 } }",
    );
    add_model(repo.path(), "small", "probe", &config);
    let s = TestServer::start(
        repo.path(),
        &["--model-control-mode", "explicit", "--load-model", "small"],
    );
    std::thread::scope(|scope| {
        let first = send_queued(scope, &s, "small", probe_body(1.0, None, None), 1.0);
        let second = send_queued(scope, &s, "small", probe_body(2.0, None, None), 2.0);
        let (status, out) = infer(&s, "small", &probe_body(3.0, None, None));
        assert_eq!(status, 503, "{out}");
        assert!(
            out["error"]
                .as_str()
                .unwrap()
                .contains("the queue of priority level 1 is full (max_queue_size 2)"),
            "{out}"
        );
        // Unloading lets the queued requests run without waiting for a full batch.
        let resp = http()
            .post(s.url("/v2/repository/models/small/unload"))
            .json(&json!({}))
            .send()
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert_eq!(served_position(&first.join().unwrap()), "calls=1");
        assert_eq!(served_position(&second.join().unwrap()), "calls=2");
    });
}

/// A tiny deterministic generator, so that a failure can be replayed.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

#[test]
fn random_shapes_under_concurrency_never_mix_outputs() {
    let repo = TempDir::new();
    let batching = "dynamic_batching { max_queue_delay_microseconds: 3000 }\n";
    add_model(
        repo.path(),
        "floats",
        "identity_fp32",
        &format!(
            "backend: \"onnxruntime\"\nmax_batch_size: 8\n\
             input [ {{ name: \"INPUT0\", data_type: TYPE_FP32, dims: [ -1 ] }} ]\n\
             output [ {{ name: \"OUTPUT0\", data_type: TYPE_FP32, dims: [ -1 ] }} ]\n\
             instance_group [ {{ count: 2 }} ]\n{batching}"
        ),
    );
    let strings = std::fs::read_to_string(example_repository().join("identity_bytes/config.pbtxt"))
        .unwrap()
        + batching;
    add_model(repo.path(), "strings", "identity_bytes", &strings);
    let s = TestServer::start(repo.path(), &[]);

    std::thread::scope(|scope| {
        for t in 0..8u64 {
            let s = &s;
            scope.spawn(move || {
                let mut rng = Lcg(t + 1);
                for i in 0..15 {
                    let rows = 1 + rng.next(3) as usize;
                    let cols = [1, 2, 5][rng.next(3) as usize];
                    let tag = (t * 1000 + i) as f32;
                    let values: Vec<f32> =
                        (0..rows * cols).map(|k| tag + k as f32 / 100.0).collect();
                    let body = json!({"inputs": [{"name": "INPUT0", "shape": [rows, cols],
                        "datatype": "FP32", "data": values}]});
                    let (status, out) = infer(s, "floats", &body);
                    assert_eq!(status, 200, "{out}");
                    assert_eq!(out["outputs"][0]["shape"], json!([rows, cols]));
                    let got: Vec<f32> =
                        serde_json::from_value(out["outputs"][0]["data"].clone()).unwrap();
                    assert_eq!(got, values, "thread {t} request {i}");

                    let words: Vec<String> = (0..rows * cols)
                        .map(|k| "x".repeat(rng.next(7) as usize) + &format!("{t}-{i}-{k}"))
                        .collect();
                    let body = json!({"inputs": [{"name": "INPUT0", "shape": [rows, cols],
                        "datatype": "BYTES", "data": words}]});
                    let (status, out) = infer(s, "strings", &body);
                    assert_eq!(status, 200, "{out}");
                    assert_eq!(
                        out["outputs"][0]["data"],
                        json!(words),
                        "thread {t} request {i}"
                    );
                }
            });
        }
    });
    let st = s.model_stats("floats");
    assert_eq!(st["inference_stats"]["success"]["count"], 120);
    assert_eq!(st["inference_stats"]["fail"]["count"], 0);
}

#[test]
fn a_client_that_goes_away_frees_its_queue_slot() {
    let repo = TempDir::new();
    add_model(
        repo.path(),
        "waiting",
        "probe",
        &probe_config(WAIT_FOR_FOUR),
    );
    let s = TestServer::start(repo.path(), &[]);
    let canceled = || {
        s.metrics_text()
            .lines()
            .filter(|l| {
                l.starts_with("nv_inference_request_failure{")
                    && l.contains("model=\"waiting\"")
                    && l.contains("reason=\"CANCELED\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };

    // HTTP: the client gives up while its request waits for a batch that never fills.
    let impatient = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let sent = impatient
        .post(s.url("/v2/models/waiting/infer"))
        .json(&probe_body(1.0, None, None))
        .send();
    assert!(
        sent.is_err(),
        "the request should have been held in the queue"
    );
    assert!(
        wait_until(Duration::from_secs(120), || canceled() == 1.0),
        "{}",
        s.metrics_text()
    );
    wait_pending(&s, "waiting", 0.0);

    // gRPC: the call is dropped (cancelled) while queued.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        use wasmtron::proto::inference::{
            grpc_inference_service_client::GrpcInferenceServiceClient,
            model_infer_request::InferInputTensor, InferTensorContents, ModelInferRequest,
        };
        let mut c = GrpcInferenceServiceClient::connect(s.grpc.clone())
            .await
            .unwrap();
        let call = c.model_infer(ModelInferRequest {
            model_name: "waiting".into(),
            inputs: vec![InferInputTensor {
                name: "INPUT0".into(),
                datatype: "FP32".into(),
                shape: vec![1, 1],
                parameters: Default::default(),
                contents: Some(InferTensorContents {
                    fp32_contents: vec![1.0],
                    ..Default::default()
                }),
            }],
            ..Default::default()
        });
        assert!(tokio::time::timeout(Duration::from_secs(2), call)
            .await
            .is_err());
    });
    assert!(
        wait_until(Duration::from_secs(120), || canceled() == 2.0),
        "{}",
        s.metrics_text()
    );
    wait_pending(&s, "waiting", 0.0);

    // Three more fill a batch of four only if the cancelled ones really left the queue.
    std::thread::scope(|scope| {
        let first = send_queued(scope, &s, "waiting", probe_body(1.0, None, None), 1.0);
        let second = send_queued(scope, &s, "waiting", probe_body(2.0, None, None), 2.0);
        let third = send_queued(scope, &s, "waiting", probe_body(3.0, None, None), 3.0);
        let fourth = scope.spawn(|| infer(&s, "waiting", &probe_body(4.0, None, None)));
        for (h, pos) in [first, second, third, fourth].into_iter().zip(1..) {
            assert_eq!(served_position(&h.join().unwrap()), format!("calls={pos}"));
        }
    });
}

fn simple_rows(rows: usize, k: i32) -> Value {
    let a: Vec<i32> = (0..16 * rows as i32).map(|i| i + k).collect();
    let b = vec![k; 16 * rows];
    json!({"inputs": [
        {"name": "INPUT0", "shape": [rows, 16], "datatype": "INT32", "data": a},
        {"name": "INPUT1", "shape": [rows, 16], "datatype": "INT32", "data": b}]})
}

#[test]
fn a_batch_past_the_largest_preferred_size_or_asking_other_outputs_runs_without_waiting() {
    // L0_batcher (test_multi_batch_use_biggest_preferred and the like): Triton issues a
    // batch at once when it cannot grow into a preferred size; the delay here (10 min) is far
    // past the client's timeout, so waiting it out fails the test.
    let repo = TempDir::new();
    let config = std::fs::read_to_string(example_repository().join("simple/config.pbtxt")).unwrap()
        + "dynamic_batching { preferred_batch_size: [ 2, 4 ] \
           max_queue_delay_microseconds: 600000000 }";
    add_model(repo.path(), "simple", "simple", &config);
    let s = TestServer::start(repo.path(), &[]);
    let (status, out) = infer(&s, "simple", &simple_rows(5, 1));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outputs"][0]["shape"], json!([5, 16]));
    // test_multi_different_outputs: two requests asking for different outputs make a batch
    // of 2 (a preferred size) and each gets only its own output.
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = ["OUTPUT0", "OUTPUT1"]
            .into_iter()
            .map(|output| {
                let s = &s;
                scope.spawn(move || {
                    let mut body = simple_rows(1, 2);
                    body["outputs"] = json!([{ "name": output }]);
                    let (status, out) = infer(s, "simple", &body);
                    assert_eq!(status, 200, "{out}");
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (answer, (name, value)) in answers.iter().zip([("OUTPUT0", 6), ("OUTPUT1", 2)]) {
        assert_eq!(answer["outputs"].as_array().unwrap().len(), 1, "{answer}");
        assert_eq!(answer["outputs"][0]["name"], name, "{answer}");
        assert_eq!(answer["outputs"][0]["data"][2], value, "{answer}");
    }
    let st = s.model_stats("simple");
    assert_eq!(st["inference_count"], 7, "{st}");
    assert_eq!(st["execution_count"], 2, "{st}");
}

#[test]
fn triton_delay_scheduler_hook_holds_executions_until_enough_requests_queue() {
    // Triton's QA tests set TRITONSERVER_DELAY_SCHEDULER=N to line requests up: nothing runs
    // until N requests are queued, then the batcher sees them all at once.
    let repo = TempDir::new();
    let config = std::fs::read_to_string(example_repository().join("simple/config.pbtxt")).unwrap()
        + "dynamic_batching { }";
    add_model(repo.path(), "simple", "simple", &config);
    let s = TestServer::start_with_env(repo.path(), &[], &[("TRITONSERVER_DELAY_SCHEDULER", "3")]);
    std::thread::scope(|scope| {
        let first: Vec<_> = (0..2)
            .map(|k| {
                let s = &s;
                scope.spawn(move || infer(s, "simple", &simple_rows(1, k)))
            })
            .collect();
        wait_pending(&s, "simple", 2.0);
        assert_eq!(s.model_stats("simple")["execution_count"], 0);
        let (status, out) = infer(&s, "simple", &simple_rows(1, 2));
        assert_eq!(status, 200, "{out}");
        for h in first {
            let (status, out) = h.join().unwrap();
            assert_eq!(status, 200, "{out}");
        }
    });
    let st = s.model_stats("simple");
    assert_eq!(st["inference_count"], 3, "{st}");
    assert_eq!(st["execution_count"], 1, "{st}");
    assert_eq!(st["batch_stats"][0]["batch_size"], 3, "{st}");
}
