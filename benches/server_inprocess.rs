//! The floor for an in-process caller: `Server::infer` called from Rust on the server's own
//! runtime (the scheduler, batcher and backends, no protocol, no Python), for `simple` and the
//! `embed_text` ensemble (one sentence). `benches/python_inprocess.py` measures the same calls
//! from Python through the `wasmtron` package and over tritonclient; the difference is what
//! the Python layer adds (benches/README.md).
//!
//! Run: `make models && cargo bench -p wasmtron --bench server_inprocess`.

use std::{path::Path, time::Duration};

use criterion::{criterion_group, criterion_main, Criterion};
use wasmtron::{
    inference::InferRequest,
    scheduling::server::{ControlMode, Server, ServerOptions},
    tensor::{push_bytes_element, DataType, Tensor},
};

fn ints(name: &str) -> Tensor {
    Tensor {
        name: name.into(),
        datatype: DataType::Int32,
        shape: vec![1, 16],
        data: (0..16i32)
            .flat_map(|i| i.to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
    }
}

fn sentence() -> Tensor {
    let mut data = Vec::new();
    push_bytes_element(&mut data, b"wasmtron serves this sentence in process");
    Tensor {
        name: "TEXT".into(),
        datatype: DataType::Bytes,
        shape: vec![1, 1],
        data: data.into(),
    }
}

fn server_inprocess(c: &mut Criterion) {
    let repository = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("model_repository");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = runtime
        .block_on(Server::start(ServerOptions {
            model_repositories: vec![repository],
            control_mode: ControlMode::Explicit,
            load_models: vec!["simple".into(), "embed_text".into()],
            poll_interval: Duration::from_secs(5),
            ..ServerOptions::default()
        }))
        .expect("run `make models` first");
    let simple = InferRequest {
        model_name: "simple".into(),
        inputs: vec![ints("INPUT0"), ints("INPUT1")],
        ..Default::default()
    };
    let embed = InferRequest {
        model_name: "embed_text".into(),
        inputs: vec![sentence()],
        ..Default::default()
    };
    let mut group = c.benchmark_group("server_inprocess");
    for (name, request) in [("simple", simple), ("embed_text", embed)] {
        group.bench_function(name, |b| {
            b.iter(|| runtime.block_on(server.infer(request.clone())).unwrap())
        });
    }
    group.finish();
    runtime.block_on(server.drain(Duration::from_secs(10)));
}

criterion_group!(benches, server_inprocess);
criterion_main!(benches);
