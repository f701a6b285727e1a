//! Request limits against the real binary (rank, elements, string length, JSON depth, gRPC
//! message size): each over-limit request gets a clear error naming the tensor and the flag,
//! and the server keeps serving.

use crate::common::*;
use serde_json::json;
use tonic::Code;
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient,
    model_infer_request::InferInputTensor, *,
};

const LIMITS: &[&str] = &[
    "--max-tensor-rank",
    "4",
    "--max-tensor-elements",
    "1000",
    "--max-string-bytes",
    "64",
    "--max-json-depth",
    "16",
    "--grpc-max-message-size",
    "65536",
];

fn server() -> (TempDir, TestServer) {
    let repo = temp_repository(&["identity_fp32", "identity_bytes"]);
    let server = TestServer::start(repo.path(), LIMITS);
    (repo, server)
}

fn fp32_request(shape: &[usize]) -> serde_json::Value {
    let n: usize = shape.iter().product();
    json!({"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "FP32", "data": vec![1.0; n]}]})
}

fn still_serving(s: &TestServer) {
    let (status, body) = infer(s, "identity_fp32", &fp32_request(&[2, 3]));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outputs"][0]["shape"], json!([2, 3]));
}

#[test]
fn http_requests_over_the_limits_are_refused_by_name() {
    let (_repo, s) = server();
    still_serving(&s);

    // Rank: identity_fp32 takes 2-D only, but the rank limit answers first and cheaply.
    let answer = infer(&s, "identity_fp32", &fp32_request(&[1, 1, 1, 1, 1]));
    assert_error(answer, 400, "input 'INPUT0' has 5 dimensions");

    // Elements: 40 x 40 fits the model's dims but not --max-tensor-elements.
    let header = json!({"inputs": [{"name": "INPUT0", "shape": [40, 40], "datatype": "FP32",
        "parameters": {"binary_data_size": 6400}}]});
    let (body, len) = binary_body(&header, &[0u8; 6400]);
    let resp = http()
        .post(s.url("/v2/models/identity_fp32/infer"))
        .header("Inference-Header-Content-Length", len.to_string())
        .body(body)
        .send()
        .unwrap();
    assert_eq!(resp.status(), 400);
    let message = resp.json::<serde_json::Value>().unwrap()["error"].to_string();
    assert!(
        message.contains("40x40 elements") && message.contains("--max-tensor-elements"),
        "{message}"
    );

    // String length: one 100-byte element among short ones.
    let long = "x".repeat(100);
    let request = json!({"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES",
        "data": ["a", long, "b"]}]});
    assert_error(
        infer(&s, "identity_bytes", &request),
        400,
        "BYTES element 1 is 100 bytes long",
    );

    // JSON depth: 20 levels of nesting, however few elements.
    let mut nested = json!(1.0);
    for _ in 0..20 {
        nested = json!([nested]);
    }
    let request = json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32",
        "data": nested}]});
    assert_error(
        infer(&s, "identity_fp32", &request),
        400,
        "more than 16 levels deep (--max-json-depth)",
    );

    still_serving(&s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_requests_over_the_limits_are_refused() {
    let (_repo, s) = server();
    let mut c = GrpcInferenceServiceClient::connect(s.grpc.clone())
        .await
        .unwrap();
    let request = |shape: Vec<i64>, bytes: usize| ModelInferRequest {
        model_name: "identity_fp32".into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape,
            ..Default::default()
        }],
        raw_input_contents: vec![vec![0u8; bytes].into()],
        ..Default::default()
    };

    // Larger than --grpc-max-message-size: refused before it is decoded (tonic answers
    // OUT_OF_RANGE where grpc-core would say RESOURCE_EXHAUSTED).
    let err = c
        .model_infer(request(vec![200, 100], 80_000))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    assert!(
        err.message().contains("the limit is: 65536 bytes"),
        "{err:?}"
    );

    let err = c
        .model_infer(request(vec![1, 1, 1, 1, 1, 1], 4))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("input 'INPUT0'") && err.message().contains("6 dimensions"),
        "{}",
        err.message()
    );

    let ok = c.model_infer(request(vec![2, 2], 16)).await.unwrap();
    assert_eq!(ok.into_inner().outputs[0].shape, vec![2, 2]);
}
