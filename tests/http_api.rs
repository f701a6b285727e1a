//! KServe v2 over HTTP against the real binary: every route, JSON and binary tensors, and the
//! bad inputs a client can send, each with its status code and a message naming the problem.

use base64::Engine;
use std::io::Write;

use crate::common::*;
use reqwest::{blocking::Response, StatusCode};
use serde_json::{json, Value};

fn server() -> (TempDir, TestServer) {
    let repo = temp_repository(&["simple", "identity_bytes", "identity_fp32"]);
    let server = TestServer::start(repo.path(), &["--http-max-input-size", "1000000"]);
    (repo, server)
}

fn error_of(resp: Response) -> (StatusCode, String) {
    let status = resp.status();
    let body: Value = resp.json().expect("error body is JSON");
    (
        status,
        body["error"].as_str().expect("error field").to_owned(),
    )
}

fn post_infer(s: &TestServer, model: &str, body: &Value) -> Response {
    http()
        .post(s.url(&format!("/v2/models/{model}/infer")))
        .json(body)
        .send()
        .unwrap()
}

#[test]
fn health_and_metadata_routes() {
    let (_repo, s) = server();
    let c = http();
    assert_eq!(
        c.get(s.url("/v2/health/live")).send().unwrap().status(),
        200
    );
    assert_eq!(
        c.get(s.url("/v2/health/ready")).send().unwrap().status(),
        200
    );
    let meta: Value = c.get(s.url("/v2")).send().unwrap().json().unwrap();
    assert_eq!(meta["name"], "triton");
    assert!(meta["extensions"]
        .as_array()
        .unwrap()
        .contains(&json!("binary_tensor_data")));

    for path in ["/v2/models/simple", "/v2/models/simple/versions/1"] {
        let m: Value = c.get(s.url(path)).send().unwrap().json().unwrap();
        assert_eq!(m["name"], "simple");
        assert_eq!(m["versions"], json!(["1"]));
        assert_eq!(m["platform"], "onnxruntime_onnx");
        assert_eq!(
            m["inputs"][0],
            json!({"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]})
        );
        assert_eq!(m["outputs"][1]["name"], "OUTPUT1");
    }
    assert_eq!(
        c.get(s.url("/v2/models/simple/ready"))
            .send()
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(s.url("/v2/models/simple/versions/1/ready"))
            .send()
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(s.url("/v2/models/simple/versions/2/ready"))
            .send()
            .unwrap()
            .status(),
        400
    );
    assert_eq!(
        c.get(s.url("/v2/models/nope/ready"))
            .send()
            .unwrap()
            .status(),
        400
    );

    let config: Value = c
        .get(s.url("/v2/models/simple/config"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(config["name"], "simple");
    assert_eq!(config["max_batch_size"], 8);
    assert_eq!(config["input"][0]["data_type"], "TYPE_INT32");
    assert_eq!(config["input"][0]["dims"], json!([16]));
    assert_eq!(config["instance_group"][0]["kind"], "KIND_CPU");
}

#[test]
fn unknown_things_are_named_with_404() {
    let (_repo, s) = server();
    let (status, msg) = error_of(http().get(s.url("/v2/models/nope")).send().unwrap());
    assert_eq!(status, 404);
    assert!(msg.contains("'nope'"), "{msg}");
    let (status, msg) = error_of(
        http()
            .get(s.url("/v2/models/simple/versions/9"))
            .send()
            .unwrap(),
    );
    assert_eq!(status, 404);
    assert!(msg.contains("version 9"), "{msg}");
    let (status, msg) = error_of(post_infer(&s, "nope", &simple_request()));
    assert_eq!(status, 404);
    assert!(msg.contains("nope"), "{msg}");
    // The model is looked up before the body is read: a malformed body to an unknown model
    // names the model, on every inference route.
    let (status, msg) = error_of(post_infer(&s, "nope", &json!({})));
    assert_eq!(
        (status.as_u16(), msg.contains("'nope'")),
        (404, true),
        "{msg}"
    );
    for route in ["infer", "generate", "generate_stream"] {
        let resp = http()
            .post(s.url(&format!("/v2/models/nope/versions/3/{route}")))
            .body("{not json")
            .send()
            .unwrap();
        let (status, msg) = error_of(resp);
        assert_eq!(status, 404, "{route}: {msg}");
        assert!(msg.contains("'nope'"), "{route}: {msg}");
    }
    let (status, msg) = error_of(http().get(s.url("/v2/not/a/route")).send().unwrap());
    assert_eq!((status, msg.as_str()), (StatusCode::NOT_FOUND, "Not Found"));
    let (status, msg) = error_of(
        http()
            .get(s.url("/v2/models/simple/versions/x"))
            .send()
            .unwrap(),
    );
    assert_eq!(status, 400);
    assert!(msg.contains("invalid version 'x'"), "{msg}");
    assert_eq!(
        http()
            .delete(s.url("/v2/health/live"))
            .send()
            .unwrap()
            .status(),
        405
    );
}

#[test]
fn json_inference_returns_exact_outputs() {
    let (_repo, s) = server();
    let mut body = simple_request();
    body["id"] = json!("req-1");
    // Nested data is accepted as well as flat.
    body["inputs"][1]["data"] = json!([vec![1; 16]]);
    let resp: Value = post_infer(&s, "simple", &body).json().unwrap();
    assert_eq!(resp["model_name"], "simple");
    assert_eq!(resp["model_version"], "1");
    assert_eq!(resp["id"], "req-1");
    let sum: Vec<i64> = (1..17).collect();
    let diff: Vec<i64> = (-1..15).collect();
    assert_eq!(
        resp["outputs"][0],
        json!({"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16], "data": sum})
    );
    assert_eq!(resp["outputs"][1]["data"], json!(diff));

    // Only the requested output comes back, on the versioned route too.
    body["outputs"] = json!([{"name": "OUTPUT1"}]);
    let resp: Value = http()
        .post(s.url("/v2/models/simple/versions/1/infer"))
        .json(&body)
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(resp["outputs"].as_array().unwrap().len(), 1);
    assert_eq!(resp["outputs"][0]["name"], "OUTPUT1");

    let strings = json!({"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "data": ["héllo", ""]}]});
    let resp: Value = post_infer(&s, "identity_bytes", &strings).json().unwrap();
    assert_eq!(resp["outputs"][0]["data"], json!(["héllo", ""]));
    assert_eq!(resp["outputs"][0]["datatype"], "BYTES");
}

fn post_binary(s: &TestServer, model: &str, body: Vec<u8>, header_len: usize) -> Response {
    http()
        .post(s.url(&format!("/v2/models/{model}/infer")))
        .header("Inference-Header-Content-Length", header_len.to_string())
        .header("Content-Type", "application/octet-stream")
        .body(body)
        .send()
        .unwrap()
}

fn i32s(values: impl IntoIterator<Item = i32>) -> Vec<u8> {
    values.into_iter().flat_map(i32::to_le_bytes).collect()
}

#[test]
fn binary_tensor_extension_both_ways() {
    let (_repo, s) = server();
    let header = json!({
        "inputs": [
            {"name": "INPUT0", "shape": [2, 16], "datatype": "INT32", "parameters": {"binary_data_size": 128}},
            {"name": "INPUT1", "shape": [2, 16], "datatype": "INT32", "parameters": {"binary_data_size": 128}},
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}, {"name": "OUTPUT1", "parameters": {"binary_data": false}}],
    });
    let mut data = i32s(0..32);
    data.extend(i32s(std::iter::repeat_n(10, 32)));
    let (body, len) = binary_body(&header, &data);
    let resp = post_binary(&s, "simple", body, len);
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/octet-stream");
    let json_len: usize = resp.headers()["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = resp.bytes().unwrap();
    let head: Value = serde_json::from_slice(&bytes[..json_len]).unwrap();
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 128);
    assert!(head["outputs"][0].get("data").is_none());
    assert_eq!(&bytes[json_len..], &i32s(10..42)[..]);
    let diff: Vec<i32> = (-10..22).collect();
    assert_eq!(head["outputs"][1]["data"], json!(diff));

    // BYTES with 4-byte length prefixes, and binary_data_output for every output.
    let post_strings = |items: &[&[u8]]| {
        let mut strings = Vec::new();
        for item in items {
            strings.extend_from_slice(&(item.len() as u32).to_le_bytes());
            strings.extend_from_slice(item);
        }
        let header = json!({
            "parameters": {"binary_data_output": true},
            "inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "parameters": {"binary_data_size": strings.len()}}],
        });
        let (body, len) = binary_body(&header, &strings);
        (strings, post_binary(&s, "identity_bytes", body, len))
    };
    // Not UTF-8: ONNX string tensors refuse it with a clear 400.
    let (status, msg) = error_of(post_strings(&[b"ab", b"\xff\x01"]).1);
    assert_eq!(status, 400);
    assert!(msg.contains("UTF-8"), "{msg}");

    let (strings, resp) = post_strings(&[b"ab", b"xyz"]);
    let json_len: usize = resp.headers()["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = resp.bytes().unwrap();
    assert_eq!(&bytes[json_len..], &strings[..]);

    // Raw binary request: the body is the single input; outputs come back binary.
    let resp = post_binary(&s, "identity_bytes", b"raw text".to_vec(), 0);
    assert_eq!(resp.status(), 200);
    let json_len: usize = resp.headers()["inference-header-content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = resp.bytes().unwrap();
    let head: Value = serde_json::from_slice(&bytes[..json_len]).unwrap();
    assert_eq!(head["outputs"][0]["shape"], json!([1, 1]));
    assert_eq!(&bytes[json_len + 4..], b"raw text");
}

#[test]
fn compressed_bodies() {
    let (_repo, s) = server();
    let raw = serde_json::to_vec(&simple_request()).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&raw).unwrap();
    let resp = http()
        .post(s.url("/v2/models/simple/infer"))
        .header("Content-Encoding", "gzip")
        .header("Accept-Encoding", "deflate")
        .body(gz.finish().unwrap())
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-encoding"], "deflate");
    let mut out = Vec::new();
    std::io::Read::read_to_end(
        &mut flate2::read::ZlibDecoder::new(&resp.bytes().unwrap()[..]),
        &mut out,
    )
    .unwrap();
    let body: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(body["outputs"][0]["data"][15], 16);

    let resp = http()
        .post(s.url("/v2/models/simple/infer"))
        .header("Content-Encoding", "gzip")
        .body(b"definitely not gzip".to_vec())
        .send()
        .unwrap();
    let (status, msg) = error_of(resp);
    assert_eq!(status, 400);
    assert!(msg.contains("decompress"), "{msg}");
}

#[test]
fn large_outputs_arrive_whole_with_their_length_compressed_or_not() {
    // 100 KiB of output: encoded off the async runtime (the large-response path).
    let (_repo, s) = server();
    let values: Vec<f32> = (0..25_600).map(|i| i as f32 * 0.5).collect();
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let header = json!({
        "inputs": [{"name": "INPUT0", "shape": [256, 100], "datatype": "FP32",
                    "parameters": {"binary_data_size": raw.len()}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": true}}]
    });
    let (body, header_len) = binary_body(&header, &raw);
    let send = |accept: Option<&str>| {
        let mut req = http()
            .post(s.url("/v2/models/identity_fp32/infer"))
            .header("Inference-Header-Content-Length", header_len)
            .body(body.clone());
        if let Some(a) = accept {
            req = req.header("Accept-Encoding", a);
        }
        let resp = req.send().unwrap();
        assert_eq!(resp.status(), 200);
        let headers = resp.headers().clone();
        let bytes = resp.bytes().unwrap();
        let length: usize = headers["content-length"].to_str().unwrap().parse().unwrap();
        assert_eq!(length, bytes.len(), "Content-Length is the body's length");
        assert!(!headers.contains_key("transfer-encoding"));
        let json_length: usize = headers["inference-header-content-length"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        (
            headers.get("content-encoding").cloned(),
            bytes.to_vec(),
            json_length,
        )
    };
    let check = |plain: &[u8], json_length: usize| {
        let json: Value = serde_json::from_slice(&plain[..json_length]).unwrap();
        assert_eq!(
            json["outputs"][0]["parameters"]["binary_data_size"],
            raw.len()
        );
        assert_eq!(&plain[json_length..], &raw[..]);
    };

    let (encoding, plain, json_length) = send(None);
    assert_eq!(encoding, None);
    check(&plain, json_length);

    let (encoding, gz, json_length) = send(Some("gzip"));
    assert_eq!(encoding.unwrap(), "gzip");
    let mut plain = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut plain).unwrap();
    check(&plain, json_length);

    // The same output as JSON numbers.
    let json_header = json!({
        "inputs": [{"name": "INPUT0", "shape": [256, 100], "datatype": "FP32",
                    "parameters": {"binary_data_size": raw.len()}}]
    });
    let (json_body, json_header_len) = binary_body(&json_header, &raw);
    let resp = http()
        .post(s.url("/v2/models/identity_fp32/infer"))
        .header("Inference-Header-Content-Length", json_header_len)
        .body(json_body)
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().unwrap();
    assert_eq!(v["outputs"][0]["data"][25_599], 12_799.5);
}

#[test]
fn bad_requests_get_clear_errors_and_the_server_keeps_serving() {
    let (_repo, s) = server();
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"inputs": [{"name": "INPUT0"}]}),
            "failed to parse the request JSON",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": vec![1.0; 16]},
                              {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]}]}),
            "data-type is 'FP32', but model 'simple' expects 'INT32'",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 8], "datatype": "INT32", "data": vec![1; 8]},
                              {"name": "INPUT1", "shape": [1, 8], "datatype": "INT32", "data": vec![1; 8]}]}),
            "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 15]},
                              {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]}]}),
            "unexpected number of elements for input 'INPUT0'",
        ),
        (
            json!({"inputs": [{"name": "INPUT9", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]}]}),
            "unexpected inference input 'INPUT9' for model 'simple'",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]}]}),
            "missing input 'INPUT1'",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [9, 16], "datatype": "INT32", "data": vec![1; 144]},
                              {"name": "INPUT1", "shape": [9, 16], "datatype": "INT32", "data": vec![1; 144]}]}),
            "batch-size must be <= 8",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT33", "data": vec![1; 16]}]}),
            "unknown datatype 'INT33'",
        ),
        (
            json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": vec!["a"; 16]}]}),
            "not a valid INT32 value",
        ),
    ];
    for (body, expected) in cases {
        let (status, msg) = error_of(post_infer(&s, "simple", &body));
        assert_eq!(status, 400, "{msg}");
        assert!(msg.contains(expected), "expected '{expected}' in '{msg}'");
    }
    let mut body = simple_request();
    body["outputs"] = json!([{"name": "OUTPUT7"}]);
    let (status, msg) = error_of(post_infer(&s, "simple", &body));
    assert_eq!(status, 400);
    assert!(
        msg.contains("unexpected inference output 'OUTPUT7'"),
        "{msg}"
    );

    let fp16 =
        json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP16", "data": [1.0]}]});
    let (status, msg) = error_of(post_infer(&s, "identity_fp32", &fp16));
    assert_eq!(status, 400);
    assert!(msg.contains("binary tensor data extension"), "{msg}");

    // Malformed JSON text.
    let resp = http()
        .post(s.url("/v2/models/simple/infer"))
        .body("{not json")
        .send()
        .unwrap();
    let (status, msg) = error_of(resp);
    assert_eq!(status, 400);
    assert!(
        msg.contains("failed to parse the request JSON buffer"),
        "{msg}"
    );

    // Oversized body (the server runs with a 1 MB cap).
    let resp = http()
        .post(s.url("/v2/models/simple/infer"))
        .body(vec![b' '; 1_100_000])
        .send()
        .unwrap();
    let (status, msg) = error_of(resp);
    assert_eq!(status, 400);
    assert!(msg.contains("maximum input size"), "{msg}");

    // Truncated binary section and a binary_data_size that disagrees with the body.
    let header = json!({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}]});
    let (body, len) = binary_body(&header, &i32s(0..20));
    let (status, msg) = error_of(post_binary(&s, "simple", body, len));
    assert_eq!(status, 400);
    assert!(
        msg.contains("binary_data_size 64 runs past the end"),
        "{msg}"
    );
    let (body, len) = binary_body(&header, &i32s(0..40));
    let (status, msg) = error_of(post_binary(&s, "simple", body, len));
    assert_eq!(status, 400);
    assert!(msg.contains("add up to 128"), "{msg}");
    let header = json!({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 60}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 68}}]});
    let (body, len) = binary_body(&header, &i32s(0..32));
    let (status, msg) = error_of(post_binary(&s, "simple", body, len));
    assert_eq!(status, 400);
    assert!(msg.contains("needs 64 bytes of data, got 60"), "{msg}");
    let (status, msg) = error_of(post_binary(&s, "simple", b"{}".to_vec(), 99));
    assert_eq!(status, 400);
    assert!(
        msg.contains("Inference-Header-Content-Length is 99"),
        "{msg}"
    );
    let (status, msg) = error_of(post_binary(&s, "simple", vec![0; 64], 0));
    assert_eq!(status, 400);
    assert!(msg.contains("exactly one input"), "{msg}");

    // Failures are counted, and the model still answers.
    let resp: Value = post_infer(&s, "simple", &simple_request()).json().unwrap();
    assert_eq!(resp["outputs"][0]["data"][0], 1);
    let stats: Value = http()
        .get(s.url("/v2/models/simple/stats"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let st = &stats["model_stats"][0];
    assert_eq!(st["inference_stats"]["success"]["count"], 1);
    assert!(st["inference_stats"]["fail"]["count"].as_u64().unwrap() >= 6);
}

#[test]
fn statistics_and_metrics_follow_inferences() {
    let (_repo, s) = server();
    let mut body = simple_request();
    body["inputs"][0]["shape"] = json!([2, 16]);
    body["inputs"][0]["data"] = json!(vec![1; 32]);
    body["inputs"][1]["shape"] = json!([2, 16]);
    body["inputs"][1]["data"] = json!(vec![1; 32]);
    for _ in 0..3 {
        assert_eq!(post_infer(&s, "simple", &body).status(), 200);
    }
    let stats: Value = http()
        .get(s.url("/v2/models/simple/versions/1/stats"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let st = &stats["model_stats"][0];
    assert_eq!(st["name"], "simple");
    assert_eq!(st["version"], "1");
    assert_eq!(st["inference_count"], 6);
    assert_eq!(st["execution_count"], 3);
    assert_eq!(st["inference_stats"]["success"]["count"], 3);
    assert_eq!(st["batch_stats"][0]["batch_size"], 2);
    assert_eq!(st["batch_stats"][0]["compute_infer"]["count"], 3);
    assert!(st["last_inference"].as_u64().unwrap() > 0);

    let all: Value = http()
        .get(s.url("/v2/models/stats"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(all["model_stats"].as_array().unwrap().len(), 3);

    let text = s.metrics_text();
    for line in [
        "nv_inference_request_success{model=\"simple\",version=\"1\"} 3",
        "nv_inference_count{model=\"simple\",version=\"1\"} 6",
        "nv_inference_exec_count{model=\"simple\",version=\"1\"} 3",
        "nv_inference_request_failure{model=\"simple\",reason=\"BACKEND\",version=\"1\"} 0",
        "nv_inference_pending_request_count{model=\"simple\",version=\"1\"} 0",
    ] {
        assert!(text.contains(line), "missing '{line}' in:\n{text}");
    }
    for name in [
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
        "nv_model_load_duration_secs",
    ] {
        assert!(text.contains(&format!("# TYPE {name} ")), "missing {name}");
    }
}

#[test]
fn unsupported_extensions_say_so() {
    let repo = temp_repository(&["simple"]);
    let s = TestServer::start(repo.path(), &["--allow-client-shm=true"]);
    // CUDA shared memory needs a GPU build and a GPU: without them registering says which is
    // missing (this suite runs in a GPU build on a CPU-only host as well as without one).
    let handle = base64::engine::general_purpose::STANDARD.encode([0u8; 64]);
    let (status, msg) = error_of(
        http()
            .post(s.url("/v2/cudasharedmemory/region/g/register"))
            .json(&json!({"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 64}))
            .send()
            .unwrap(),
    );
    assert_eq!(status, 501);
    assert!(msg.contains("CUDA shared memory is not available"), "{msg}");
    let missing = if cfg!(feature = "cuda") {
        "NVIDIA driver"
    } else {
        "--features cuda"
    };
    assert!(msg.contains(missing), "{msg}");
}

#[test]
fn the_classification_extension_answers_each_rows_top_classes_with_labels() {
    let repo = temp_repository(&["simple"]);
    // Triton's quick-start model with a label file for OUTPUT0, as image_client's models have.
    let config = repo.path().join("simple/config.pbtxt");
    let text = std::fs::read_to_string(&config).unwrap().replacen(
        "name: \"OUTPUT0\"",
        "name: \"OUTPUT0\"\n    label_filename: \"sums.txt\"",
        1,
    );
    std::fs::write(&config, text).unwrap();
    let labels: Vec<String> = (0..16).map(|i| format!("sum{}", i + 1)).collect();
    std::fs::write(repo.path().join("simple/sums.txt"), labels.join("\n")).unwrap();
    let s = TestServer::start(repo.path(), &[]);
    let mut body = simple_request();
    body["outputs"] = json!([{"name": "OUTPUT0", "parameters": {"classification": 2}}]);
    let answer: Value = post_infer(&s, "simple", &body).json().unwrap();
    let output = &answer["outputs"][0];
    assert_eq!(output["datatype"], "BYTES", "{answer}");
    assert_eq!(output["shape"], json!([1, 2]), "{answer}");
    // OUTPUT0 = 1..16: the two largest, as "value:index:label", integers written as such.
    assert_eq!(
        output["data"],
        json!(["16:15:sum16", "15:14:sum15"]),
        "{answer}"
    );
    // A count that is not a positive integer is refused naming the output.
    body["outputs"] = json!([{"name": "OUTPUT0", "parameters": {"classification": 0}}]);
    let (status, msg) = error_of(post_infer(&s, "simple", &body));
    assert_eq!(status, 400);
    assert!(
        msg.contains("output 'OUTPUT0': parameter 'classification'"),
        "{msg}"
    );
}
