//! Requests already accepted are never lost: not on SIGTERM (readiness flips at once, the
//! process drains and exits 0), not on unload, not on reload.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};
use wasmtron::proto::inference::{grpc_inference_service_client::GrpcInferenceServiceClient, *};

fn slow_request(batch: usize) -> Value {
    json!({"inputs": [{"name": "INPUT0", "shape": [batch, 512], "datatype": "FP32", "data": vec![0.5f32; batch * 512]}]})
}

/// A binary request: no JSON decoding, so every request is accepted at once.
fn post_slow_binary(url: &str, batch: usize) -> reqwest::Result<u16> {
    let header = json!({"inputs": [{"name": "INPUT0", "shape": [batch, 512], "datatype": "FP32",
        "parameters": {"binary_data_size": batch * 512 * 4}}]});
    let (body, len) = binary_body(&header, &vec![0u8; batch * 512 * 4]);
    http()
        .post(url)
        .header("Inference-Header-Content-Length", len.to_string())
        .body(body)
        .send()
        .map(|r| r.status().as_u16())
}

fn pending(s: &TestServer) -> u64 {
    let text = s.metrics_text();
    text.lines()
        .find(|l| l.starts_with("nv_inference_pending_request_count{model=\"slow\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let repo = temp_repository(&["slow"]);
    let mut s = TestServer::start(repo.path(), &["--exit-timeout-secs", "300"]);
    let url = s.url("/v2/models/slow/infer");
    // One instance: the later requests queue behind the first.
    let mut clients: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || post_slow_binary(&url, 1024))
        })
        .collect();
    let grpc = s.grpc.clone();
    clients.push(std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let mut c = GrpcInferenceServiceClient::connect(grpc).await.unwrap();
            let request = ModelInferRequest {
                model_name: "slow".into(),
                inputs: vec![model_infer_request::InferInputTensor {
                    name: "INPUT0".into(),
                    datatype: "FP32".into(),
                    shape: vec![1024, 512],
                    ..Default::default()
                }],
                raw_input_contents: vec![vec![0u8; 1024 * 512 * 4].into()],
                ..Default::default()
            };
            Ok(match c.model_infer(request).await {
                Ok(_) => 200,
                Err(status) => panic!("gRPC request lost: {status}"),
            })
        })
    }));
    // All four accepted (one running, three queued) before the signal: a request still on
    // its way when the server stops listening is refused, not lost.
    assert!(
        wait_until(Duration::from_secs(120), || pending(&s) >= 3),
        "requests never queued"
    );
    let pid = s.pid();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    // Not ready any more, while the accepted requests are still running.
    assert!(wait_until(Duration::from_secs(30), || {
        http()
            .get(s.url("/v2/health/ready"))
            .send()
            .map(|r| r.status() == 400)
            .unwrap_or(false)
    }));
    let refused = http().post(&url).json(&slow_request(1)).send().unwrap();
    assert_eq!(refused.status(), 503);
    for c in clients {
        let status: Result<u16, reqwest::Error> = c.join().unwrap();
        assert_eq!(status.unwrap(), 200, "an accepted request was lost");
    }
    let status = s
        .terminate(Duration::from_secs(120))
        .expect("server exits after draining");
    assert!(status.success(), "exit status {status:?}");
}

#[test]
fn unload_and_reload_let_accepted_requests_finish() {
    let repo = temp_repository(&["slow", "simple"]);
    let s = TestServer::start(
        repo.path(),
        &["--model-control-mode", "explicit", "--load-model", "*"],
    );
    let url = s.url("/v2/models/slow/infer");
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || post_slow_binary(&url, 1024))
        })
        .collect();
    assert!(
        wait_until(Duration::from_secs(120), || pending(&s) >= 2),
        "requests never queued"
    );
    // A reload swaps in a new version set while the old one finishes its queue...
    let reload = http()
        .post(s.url("/v2/repository/models/slow/load"))
        .json(&json!({}))
        .send()
        .unwrap();
    assert_eq!(reload.status(), 200);
    // ...and an unload takes the model away without dropping what was accepted.
    let unload = http()
        .post(s.url("/v2/repository/models/slow/unload"))
        .json(&json!({}))
        .send()
        .unwrap();
    assert_eq!(unload.status(), 200);
    assert_eq!(
        http()
            .get(s.url("/v2/models/slow/ready"))
            .send()
            .unwrap()
            .status(),
        400
    );
    for c in clients {
        assert_eq!(
            c.join().unwrap().unwrap(),
            200,
            "an accepted request was lost"
        );
    }
    let after = http().post(&url).json(&slow_request(1)).send().unwrap();
    assert_eq!(after.status(), 404);
}
