//! Decoupled models and streaming against the real binary: a Wasm stage that sends 0..N
//! responses per request over gRPC `ModelStreamInfer` (and HTTP server-sent events), with
//! Triton's final-response flags; unary calls to it are refused with a clear error.

use crate::common::*;
use serde_json::{json, Value};
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient, infer_parameter::ParameterChoice,
    model_infer_request::InferInputTensor, InferParameter, InferTensorContents, ModelInferRequest,
    ModelStreamInferResponse,
};

fn streaming_server() -> (TempDir, TestServer) {
    let repo = temp_repository(&["simple"]);
    add_probe(repo.path(), "streamer", "stream", &[]);
    let config = repo.path().join("streamer/config.pbtxt");
    let text = std::fs::read_to_string(&config).unwrap()
        + "model_transaction_policy { decoupled: true }\n";
    std::fs::write(config, text).unwrap();
    add_probe(repo.path(), "undecided", "stream", &[]);
    let s = TestServer::start(repo.path(), &[]);
    (repo, s)
}

fn request(model: &str, id: &str, values: &[f32], empty_final: bool) -> ModelInferRequest {
    let mut parameters = std::collections::HashMap::new();
    if empty_final {
        parameters.insert(
            "triton_enable_empty_final_response".to_owned(),
            InferParameter {
                parameter_choice: Some(ParameterChoice::BoolParam(true)),
            },
        );
    }
    ModelInferRequest {
        model_name: model.into(),
        id: id.into(),
        parameters,
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![1, values.len() as i64],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                fp32_contents: values.to_vec(),
                ..Default::default()
            }),
        }],
        ..Default::default()
    }
}

/// (id, OUTPUT0 value, REPORT text, triton_final_response) of one streamed response; the
/// value and report are None for an empty response.
type Seen = (String, Option<f32>, Option<String>, Option<bool>);

fn describe(r: &ModelStreamInferResponse) -> Seen {
    assert_eq!(r.error_message, "", "{r:?}");
    let resp = r.infer_response.as_ref().unwrap();
    let last = match resp
        .parameters
        .get("triton_final_response")
        .and_then(|p| p.parameter_choice.clone())
    {
        Some(ParameterChoice::BoolParam(b)) => Some(b),
        _ => None,
    };
    if resp.outputs.is_empty() {
        return (resp.id.clone(), None, None, last);
    }
    let value = f32::from_le_bytes(resp.raw_output_contents[0][..4].try_into().unwrap());
    let report = String::from_utf8(resp.raw_output_contents[1][4..].to_vec()).unwrap();
    (resp.id.clone(), Some(value), Some(report), last)
}

fn stream(
    s: &TestServer,
    requests: Vec<ModelInferRequest>,
    expect: usize,
) -> Vec<ModelStreamInferResponse> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = GrpcInferenceServiceClient::connect(s.grpc.clone())
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        for r in requests {
            tx.send(r).await.unwrap();
        }
        let mut responses = c
            .model_stream_infer(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut seen = Vec::new();
        while seen.len() < expect {
            seen.push(responses.message().await.unwrap().unwrap());
        }
        drop(tx);
        // Nothing more arrives once the client stops sending.
        assert!(responses.message().await.unwrap().is_none());
        seen
    })
}

#[test]
fn a_decoupled_stage_streams_zero_to_n_responses_over_grpc() {
    let (_repo, s) = streaming_server();
    let seen: Vec<Seen> = stream(
        &s,
        vec![
            request("streamer", "three", &[1.5, 2.5, 3.5], true),
            request("streamer", "none", &[], true),
            request("streamer", "plain", &[7.0], false),
        ],
        6,
    )
    .iter()
    .map(describe)
    .collect();
    let one = |id: &str, v: f32, report: &str| {
        (id.to_owned(), Some(v), Some(report.to_owned()), Some(false))
    };
    let end = |id: &str| (id.to_owned(), None, None, Some(true));
    // The requests run at once, as on Triton: each one's responses come in order, the
    // requests' in the order they finish.
    let of = |id: &str| -> Vec<Seen> { seen.iter().filter(|r| r.0 == id).cloned().collect() };
    assert_eq!(seen.len(), 6, "{seen:?}");
    assert_eq!(
        of("three"),
        [
            one("three", 1.5, "1/3"),
            one("three", 2.5, "2/3"),
            one("three", 3.5, "3/3"),
            end("three"),
        ]
    );
    assert_eq!(of("none"), [end("none")]);
    // No empty final response was asked for.
    assert_eq!(of("plain"), [one("plain", 7.0, "1/1")]);
}

#[test]
fn unary_calls_to_a_decoupled_model_are_refused_and_only_decoupled_models_respond() {
    let (_repo, s) = streaming_server();
    let body =
        json!({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]});
    assert_error(
        infer(&s, "streamer", &body),
        400,
        "model 'streamer' is decoupled (0..N responses per request): use the gRPC stream",
    );
    assert_error(
        infer(&s, "undecided", &body),
        400,
        "model 'undecided' is not decoupled",
    );
    // The stream answers other models too, once each.
    let seen = stream(&s, vec![request("undecided", "x", &[1.0], false)], 1);
    assert!(
        seen[0].error_message.contains("is not decoupled"),
        "{seen:?}"
    );
}

/// The `data:` payloads of a server-sent-events body.
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[test]
fn generate_and_generate_stream_speak_flat_json_and_server_sent_events() {
    let (_repo, s) = streaming_server();
    let resp = http()
        .post(s.url("/v2/models/streamer/generate_stream"))
        .json(&json!({"INPUT0": [1.5, 2.5], "parameters": {"note": "x"}}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(
        events(&resp.text().unwrap()),
        [
            json!({"model_name": "streamer", "model_version": "1", "OUTPUT0": 1.5, "REPORT": "1/2"}),
            json!({"model_name": "streamer", "model_version": "1", "OUTPUT0": 2.5, "REPORT": "2/2"}),
        ]
    );

    // One response: /generate answers with the flat object.
    let a: Vec<i32> = (0..16).collect();
    let resp = http()
        .post(s.url("/v2/models/simple/generate"))
        .json(&json!({"INPUT0": a, "INPUT1": vec![2; 16]}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let out: Value = resp.json().unwrap();
    let sums: Vec<i32> = (2..18).collect();
    assert_eq!(out["OUTPUT0"], json!(sums));
    assert_eq!(out["model_version"], "1");

    // Several responses do not fit /generate; a bad field is refused before inference.
    let answer = post_json(
        &s,
        "/v2/models/streamer/generate",
        &json!({"INPUT0": [1.0, 2.0]}),
    );
    assert_error(answer, 400, "sent 2 responses; use generate_stream");
    let bad = json!({"INPUT0": [1, 2, 3], "INPUT1": vec![2; 16]});
    let answer = post_json(&s, "/v2/models/simple/generate_stream", &bad);
    assert_error(answer, 400, "field 'INPUT0' has 3 element(s)");

    // An inference error after the stream started arrives in-band.
    let resp = http()
        .post(s.url("/v2/models/undecided/generate_stream"))
        .json(&json!({"INPUT0": [1.0]}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let got = events(&resp.text().unwrap());
    assert_eq!(got.len(), 1);
    assert!(
        got[0]["error"]
            .as_str()
            .unwrap()
            .contains("is not decoupled"),
        "{got:?}"
    );
}

#[test]
fn the_words_example_streams_one_response_per_word_over_grpc_and_sse() {
    let repo = temp_repository(&["words"]);
    let s = TestServer::start(repo.path(), &[]);
    let mut request = ModelInferRequest {
        model_name: "words".into(),
        id: "w".into(),
        inputs: vec![InferInputTensor {
            name: "TEXT".into(),
            datatype: "BYTES".into(),
            shape: vec![1],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                bytes_contents: vec![b"streams beat stubs".to_vec()],
                ..Default::default()
            }),
        }],
        ..Default::default()
    };
    request.parameters.insert(
        "triton_enable_empty_final_response".to_owned(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::BoolParam(true)),
        },
    );
    let seen = stream(&s, vec![request], 4);
    let words: Vec<(String, i64)> = seen[..3]
        .iter()
        .map(|r| {
            let resp = r.infer_response.as_ref().unwrap();
            let word = String::from_utf8(resp.raw_output_contents[0][4..].to_vec()).unwrap();
            let position = i64::from_le_bytes(resp.raw_output_contents[1][..8].try_into().unwrap());
            (word, position)
        })
        .collect();
    assert_eq!(
        words,
        [
            ("streams".into(), 0),
            ("beat".into(), 1),
            ("stubs".into(), 2)
        ]
    );
    assert_eq!(describe(&seen[3]), ("w".into(), None, None, Some(true)));

    let resp = http()
        .post(s.url("/v2/models/words/generate_stream"))
        .json(&json!({"TEXT": "two words"}))
        .send()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        events(&resp.text().unwrap()),
        [
            json!({"model_name": "words", "model_version": "1", "WORD": "two", "POSITION": 0}),
            json!({"model_name": "words", "model_version": "1", "WORD": "words", "POSITION": 1}),
        ]
    );
}
