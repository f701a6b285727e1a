//! What a Wasm stage costs per request, measured in-process on the backend (no protocol):
//! a call on a live instance, a call on a fresh instance (instantiate + `init` + call), and
//! moving 1 KiB / 150 KiB / 600 KiB tensors across the boundary, for the Rust probe stage
//! (echo) and the Python (tokenize), JavaScript (scores_json) and C (softmax) examples. The
//! baseline in the same run is the native work the echo stands for: copying the same tensor on
//! the host.
//!
//! Run: `make stages && cargo bench -p wasmtron --bench wasm_stage`

use std::hint::black_box;

#[path = "stage_loading.rs"]
mod stage_loading;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use stage_loading::load;
use wasmtron::{
    inference::InferRequest,
    tensor::{push_bytes_element, DataType, Tensor},
};

fn request(tensor: Tensor) -> InferRequest {
    InferRequest {
        inputs: vec![tensor],
        ..Default::default()
    }
}

fn fp32(bytes: usize) -> Tensor {
    let n = bytes / 4;
    Tensor {
        name: "INPUT0".into(),
        datatype: DataType::Fp32,
        shape: vec![1, n as i64],
        data: vec![0u8; n * 4].into(),
    }
}

fn text(bytes: usize) -> Tensor {
    let words = "the quick brown fox jumps over the lazy dog ".repeat(bytes / 44 + 1);
    let mut data = Vec::new();
    push_bytes_element(&mut data, &words.as_bytes()[..bytes]);
    Tensor {
        name: "TEXT".into(),
        datatype: DataType::Bytes,
        shape: vec![1, 1],
        data: data.into(),
    }
}

const SIZES: [(usize, &str); 3] = [
    (1 << 10, "1KiB"),
    (150 << 10, "150KiB"),
    (600 << 10, "600KiB"),
];

fn rust_stage(c: &mut Criterion) {
    let raw = "parameters [ { key: \"mode\", value: { string_value: \"raw_echo\" } } ]\n";
    let mut live = load("tests/models/probe", "echo", raw);
    let mut fresh = load(
        "tests/models/probe",
        "echo_fresh",
        &format!("{raw}parameters [ {{ key: \"fresh_instance_per_request\", value: {{ string_value: \"true\" }} }} ]\n"),
    );
    let outputs = vec!["OUTPUT0".to_owned()];
    let mut group = c.benchmark_group("rust_echo");
    for (bytes, label) in SIZES {
        let req = request(fp32(bytes));
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(
            BenchmarkId::new("native_copy_baseline", label),
            &req,
            |b, req| b.iter(|| black_box(req.inputs[0].data.to_vec())),
        );
        group.bench_with_input(BenchmarkId::new("live_instance", label), &req, |b, req| {
            b.iter(|| live.execute(black_box(req), &outputs).unwrap())
        });
    }
    let small = request(fp32(1 << 10));
    group.bench_function("fresh_instance/1KiB", |b| {
        b.iter(|| fresh.execute(black_box(&small), &outputs).unwrap())
    });
    group.finish();
}

/// Live and fresh-instance calls on one of the example stages in `model_repository/`.
fn example_stage(
    c: &mut Criterion,
    group_name: &str,
    model: &str,
    input: fn(usize) -> Tensor,
    output: &str,
    sizes: &[(usize, &str)],
) {
    let dir = format!("model_repository/{model}");
    let mut live = load(&dir, model, "");
    let mut fresh = load(
        &dir,
        &format!("{model}_fresh"),
        "parameters [ { key: \"fresh_instance_per_request\", value: { string_value: \"true\" } } ]\n",
    );
    let outputs = vec![output.to_owned()];
    let mut group = c.benchmark_group(group_name);
    group.sample_size(20);
    for &(bytes, label) in sizes {
        let req = request(input(bytes));
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_with_input(BenchmarkId::new("live_instance", label), &req, |b, req| {
            b.iter(|| live.execute(black_box(req), &outputs).unwrap())
        });
    }
    let small = request(input(1 << 10));
    group.bench_function("fresh_instance/1KiB", |b| {
        b.iter(|| fresh.execute(black_box(&small), &outputs).unwrap())
    });
    group.finish();
}

fn named(mut tensor: Tensor, name: &str) -> Tensor {
    tensor.name = name.into();
    tensor
}

fn python_stage(c: &mut Criterion) {
    example_stage(
        c,
        "python_tokenize",
        "tokenize",
        text,
        "TOKEN_COUNT",
        &SIZES,
    );
}

fn javascript_stage(c: &mut Criterion) {
    let scores = |bytes| named(fp32(bytes), "SCORES");
    example_stage(
        c,
        "js_scores_json",
        "scores_json",
        scores,
        "JSON",
        &SIZES[..1],
    );
}

fn c_stage(c: &mut Criterion) {
    let logits = |bytes| named(fp32(bytes), "LOGITS");
    example_stage(c, "c_softmax", "softmax", logits, "PROBS", &SIZES);
}

criterion_group!(benches, rust_stage, python_stage, javascript_stage, c_stage);
criterion_main!(benches);
