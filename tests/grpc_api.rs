//! `inference.GRPCInferenceService` and `grpc.health.v1` against the real binary.

use crate::common::*;
use tonic::Code;
use wasmtron::proto::inference::{
    grpc_inference_service_client::GrpcInferenceServiceClient,
    model_infer_request::InferInputTensor, *,
};

type Client = GrpcInferenceServiceClient<tonic::transport::Channel>;

async fn client(s: &TestServer) -> Client {
    GrpcInferenceServiceClient::connect(s.grpc.clone())
        .await
        .unwrap()
}

fn server() -> (TempDir, TestServer) {
    server_with(&[])
}

fn server_with(flags: &[&str]) -> (TempDir, TestServer) {
    let repo = temp_repository(&["simple", "identity_bytes"]);
    let server = TestServer::start(repo.path(), flags);
    (repo, server)
}

fn typed_simple_request() -> ModelInferRequest {
    let input = |name: &str, data: Vec<i32>| InferInputTensor {
        name: name.into(),
        datatype: "INT32".into(),
        shape: vec![1, 16],
        parameters: Default::default(),
        contents: Some(InferTensorContents {
            int_contents: data,
            ..Default::default()
        }),
    };
    ModelInferRequest {
        model_name: "simple".into(),
        id: "g1".into(),
        inputs: vec![
            input("INPUT0", (0..16).collect()),
            input("INPUT1", vec![2; 16]),
        ],
        ..Default::default()
    }
}

/// Registers system shared memory under a key that names no object: the error it gets.
async fn register_missing_region(c: &mut Client) -> tonic::Status {
    c.system_shared_memory_register(SystemSharedMemoryRegisterRequest {
        name: "r".into(),
        key: "/wasmtron_no_such_key".into(),
        offset: 0,
        byte_size: 8,
    })
    .await
    .unwrap_err()
}

fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metadata_config_and_index() {
    let (_repo, s) = server();
    let mut c = client(&s).await;
    assert!(
        c.server_live(ServerLiveRequest {})
            .await
            .unwrap()
            .into_inner()
            .live
    );
    assert!(
        c.server_ready(ServerReadyRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    let ready = c
        .model_ready(ModelReadyRequest {
            name: "simple".into(),
            version: "1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(ready.ready);
    let meta = c
        .server_metadata(ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    // Triton's default `--id`, which its clients and QA tests compare with.
    assert_eq!(meta.name, "triton");
    assert!(meta.extensions.contains(&"model_repository".to_owned()));
    let m = c
        .model_metadata(ModelMetadataRequest {
            name: "simple".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.versions, vec!["1"]);
    assert_eq!(m.inputs[0].shape, vec![-1, 16]);
    assert_eq!(m.inputs[0].datatype, "INT32");
    let config = c
        .model_config(ModelConfigRequest {
            name: "simple".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .unwrap();
    assert_eq!(config.max_batch_size, 8);
    assert_eq!(config.output[1].name, "OUTPUT1");
    let index = c
        .repository_index(RepositoryIndexRequest {
            repository_name: String::new(),
            ready: true,
        })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = index
        .models
        .iter()
        .map(|m| (m.name.as_str(), m.state.as_str()))
        .collect();
    assert_eq!(
        names,
        vec![("identity_bytes", "READY"), ("simple", "READY")]
    );
    let err = c
        .model_metadata(ModelMetadataRequest {
            name: "ghost".into(),
            version: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("ghost"));

    let channel = tonic::transport::Channel::from_shared(s.grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let status = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infer_with_typed_and_raw_contents() {
    let (_repo, s) = server();
    let mut c = client(&s).await;
    let resp = c
        .model_infer(typed_simple_request())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.model_name, "simple");
    assert_eq!(resp.model_version, "1");
    assert_eq!(resp.id, "g1");
    assert_eq!(resp.outputs[0].name, "OUTPUT0");
    assert_eq!(resp.outputs[0].shape, vec![1, 16]);
    assert_eq!(
        i32s(&resp.raw_output_contents[0]),
        (2..18).collect::<Vec<_>>()
    );
    assert_eq!(
        i32s(&resp.raw_output_contents[1]),
        (-2..14).collect::<Vec<_>>()
    );

    let mut raw = typed_simple_request();
    for input in &mut raw.inputs {
        input.contents = None;
    }
    raw.raw_input_contents = vec![
        (0..16).flat_map(i32::to_le_bytes).collect(),
        (0..16).map(|_| 5i32).flat_map(i32::to_le_bytes).collect(),
    ];
    raw.outputs = vec![model_infer_request::InferRequestedOutputTensor {
        name: "OUTPUT1".into(),
        parameters: Default::default(),
    }];
    let resp = c.model_infer(raw).await.unwrap().into_inner();
    assert_eq!(resp.outputs.len(), 1);
    assert_eq!(
        i32s(&resp.raw_output_contents[0]),
        (-5..11).collect::<Vec<_>>()
    );

    let bytes_req = ModelInferRequest {
        model_name: "identity_bytes".into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "BYTES".into(),
            shape: vec![1, 2],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                bytes_contents: vec![b"one".to_vec(), b"three".to_vec()],
                ..Default::default()
            }),
        }],
        ..Default::default()
    };
    let resp = c.model_infer(bytes_req).await.unwrap().into_inner();
    assert_eq!(
        resp.raw_output_contents[0],
        b"\x03\0\0\0one\x05\0\0\0three".to_vec()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_map_to_grpc_codes() {
    let (_repo, s) = server_with(&["--allow-client-shm=true"]);
    let mut c = client(&s).await;
    let mut unknown = typed_simple_request();
    unknown.model_name = "ghost".into();
    let err = c.model_infer(unknown.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // A malformed request to an unknown model names the model, not the request's flaw.
    let mut malformed = unknown;
    malformed.inputs[0].datatype = "NOPE".into();
    malformed.raw_input_contents = vec![vec![0u8; 3].into()];
    let err = c.model_infer(malformed.clone()).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{}", err.message());
    assert!(err.message().contains("'ghost'"), "{}", err.message());
    let mut answers = c
        .model_stream_infer(tokio_stream::iter([malformed]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    assert!(
        answer.error_message.contains("unknown model: 'ghost'"),
        "{}",
        answer.error_message
    );

    let mut wrong_type = typed_simple_request();
    wrong_type.inputs[0].datatype = "FP32".into();
    let err = c.model_infer(wrong_type).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("expects 'INT32'"),
        "{}",
        err.message()
    );

    let mut mixed = typed_simple_request();
    mixed.raw_input_contents = vec![vec![0u8; 64].into()];
    let err = c.model_infer(mixed).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("raw_input_contents has 1 entries"),
        "{}",
        err.message()
    );

    let mut short = typed_simple_request();
    short.inputs[1]
        .contents
        .as_mut()
        .unwrap()
        .int_contents
        .pop();
    let err = c.model_infer(short).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("needs 64 bytes of data, got 60"),
        "{}",
        err.message()
    );

    let err = c
        .cuda_shared_memory_register(CudaSharedMemoryRegisterRequest {
            name: "g".into(),
            raw_handle: vec![0; 64],
            device_id: 0,
            byte_size: 64,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert!(
        err.message().contains("CUDA shared memory"),
        "{}",
        err.message()
    );

    // System shared memory is served: an unknown key is named.
    let err = register_missing_region(&mut c).await;
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("'/wasmtron_no_such_key'"),
        "{}",
        err.message()
    );

    let err = c
        .repository_model_load(RepositoryModelLoadRequest {
            model_name: "simple".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    // Triton's code and words, then which mode it is.
    assert_eq!(err.code(), Code::Unavailable);
    assert!(err
        .message()
        .contains("explicit model load / unload is not allowed if polling is enabled"));
    assert!(
        err.message().contains("--model-control-mode=explicit"),
        "{}",
        err.message()
    );

    // Still serving.
    assert!(c.model_infer(typed_simple_request()).await.is_ok());
    let stats = c
        .model_statistics(ModelStatisticsRequest {
            name: "simple".into(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let inf = stats.model_stats[0].inference_stats.unwrap();
    assert_eq!(inf.success.unwrap().count, 1);
    assert_eq!(inf.fail.unwrap().count, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_answers_every_request_with_in_band_errors() {
    let (_repo, s) = server();
    let mut c = client(&s).await;
    let mut bad = typed_simple_request();
    bad.id = "bad".into();
    bad.inputs.pop();
    let mut second = typed_simple_request();
    second.id = "g2".into();
    let requests = vec![typed_simple_request(), bad, second];
    let mut stream = c
        .model_stream_infer(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let mut got = std::collections::BTreeMap::new();
    while let Some(item) = stream.message().await.unwrap() {
        let id = item.infer_response.as_ref().unwrap().id.clone();
        assert!(got.insert(id, item.error_message).is_none());
    }
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(got["g1"], "");
    assert_eq!(got["g2"], "");
    assert!(
        got["bad"].contains("missing input 'INPUT1'"),
        "{}",
        got["bad"]
    );
}

/// One request of sequence 7 to `accumulate` (OUTPUT = running sum, starting at 100).
fn accumulate_step(id: &str, value: i32, start: bool, end: bool) -> ModelInferRequest {
    let param = |choice| InferParameter {
        parameter_choice: Some(choice),
    };
    use infer_parameter::ParameterChoice::{BoolParam, Int64Param};
    ModelInferRequest {
        model_name: "accumulate".into(),
        id: id.into(),
        inputs: vec![InferInputTensor {
            name: "INPUT".into(),
            datatype: "INT32".into(),
            shape: vec![1, 1],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                int_contents: vec![value],
                ..Default::default()
            }),
        }],
        outputs: vec![model_infer_request::InferRequestedOutputTensor {
            name: "OUTPUT".into(),
            ..Default::default()
        }],
        parameters: [
            ("sequence_id".to_owned(), param(Int64Param(7))),
            ("sequence_start".to_owned(), param(BoolParam(start))),
            ("sequence_end".to_owned(), param(BoolParam(end))),
        ]
        .into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_on_one_stream_run_at_once_and_a_sequence_keeps_its_order() {
    let repo = temp_repository(&["simple", "slow", "accumulate"]);
    let s = TestServer::start(repo.path(), &[]);
    let mut c = client(&s).await;
    // Long requests first (1,024 rows through 100 chained 512x512 MatMuls on one thread),
    // then short ones: as on Triton they do not wait behind it. The sequence's requests,
    // sent back to back, still run in the order sent, each on the state the last one left.
    let rows = 1024;
    let slow = |id: &str| ModelInferRequest {
        model_name: "slow".into(),
        id: id.into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![rows, 512],
            ..Default::default()
        }],
        raw_input_contents: vec![vec![0u8; rows as usize * 512 * 4].into()],
        ..Default::default()
    };
    let mut fast = typed_simple_request();
    fast.id = "fast".into();
    // Two long ones, which the model's one instance runs one after the other.
    let requests = vec![
        slow("slow-a"),
        slow("slow-b"),
        accumulate_step("s1", 1, true, false),
        fast,
        accumulate_step("s2", 2, false, false),
        accumulate_step("s3", 3, false, true),
    ];
    let mut stream = c
        .model_stream_infer(tokio_stream::iter(requests))
        .await
        .unwrap()
        .into_inner();
    let mut order = Vec::new();
    let mut sums = std::collections::BTreeMap::new();
    while let Some(item) = stream.message().await.unwrap() {
        assert_eq!(item.error_message, "");
        let response = item.infer_response.unwrap();
        if response.model_name == "accumulate" {
            sums.insert(response.id.clone(), i32s(&response.raw_output_contents[0]));
        }
        order.push(response.id);
    }
    assert_eq!(order.len(), 6, "{order:?}");
    assert_eq!(
        order.last().map(String::as_str),
        Some("slow-b"),
        "{order:?}"
    );
    assert_eq!(sums["s1"], [101]);
    assert_eq!(sums["s2"], [103]);
    assert_eq!(sums["s3"], [106]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_are_gzipped_only_when_the_server_is_told_to() {
    use tonic::codec::CompressionEncoding::Gzip;
    let repo = temp_repository(&["simple"]);
    let level = ["--grpc-infer-response-compression-level", "high"];
    for (flags, expected) in [(&[][..], None), (&level[..], Some("gzip"))] {
        let s = TestServer::start(repo.path(), flags);
        // Like the stock clients, offer gzip, and send the request compressed too.
        let mut c = client(&s)
            .await
            .accept_compressed(Gzip)
            .send_compressed(Gzip);
        let resp = c.model_infer(typed_simple_request()).await.unwrap();
        let encoding = resp
            .metadata()
            .get("grpc-encoding")
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(encoding.as_deref(), expected, "flags {flags:?}");
        let out = resp.into_inner();
        assert_eq!(
            i32s(&out.raw_output_contents[0]),
            (2..18).collect::<Vec<_>>()
        );
    }
}

#[tokio::test]
async fn client_shared_memory_is_refused_unless_allowed() {
    // Triton's default since 2026: clients may register shared memory only with
    // --allow-client-shm=true.
    let (_repo, s) = server();
    let mut c = client(&s).await;
    let err = register_missing_region(&mut c).await;
    assert_eq!(err.code(), Code::Unavailable);
    assert!(
        err.message().contains("--allow-client-shm=true"),
        "{}",
        err.message()
    );
    let url = s.url("/v2/systemsharedmemory/region/r/register");
    let body = serde_json::json!({"key": "/k", "byte_size": 8});
    let (status, text) = tokio::task::spawn_blocking(move || {
        let r = reqwest::blocking::Client::new()
            .post(url)
            .json(&body)
            .send()
            .unwrap();
        (r.status().as_u16(), r.text().unwrap())
    })
    .await
    .unwrap();
    assert_eq!(status, 503, "{text}");
    assert!(text.contains("--allow-client-shm=true"), "{text}");
}
