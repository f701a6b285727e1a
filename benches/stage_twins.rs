//! The same stage written in Rust, Python and JavaScript on the host tensor operations, per
//! request, in-process on the backend (no protocol): `preprocess` (PNG/JPEG → normalised
//! [3,224,224]) as the Rust stage on host ops, the Rust stage computing inside Wasm
//! (`host_ops=false`, its previous form) and the Python twin; `topk` as the Rust stage and the
//! JavaScript twin. The limits in the same run: the host operations called natively, with no
//! stage at all. The peer (Triton's python backend running Pillow + NumPy on the same images)
//! is `benches/twin_peers.py`.
//!
//! Run: `make stages && cargo bench -p wasmtron --bench stage_twins`

use std::hint::black_box;

#[path = "stage_loading.rs"]
mod stage_loading;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use stage_loading::{load, workspace};
use wasmtron::{
    inference::InferRequest,
    runtime::tensor_ops::{self as ops, Budget},
    tensor::{push_bytes_element, DataType, Tensor},
};

/// A 640x480 photograph-like image (smooth shapes and sensor noise) as JPEG, quality 90.
pub fn photo_jpeg() -> Vec<u8> {
    let mut noise = 0x2545_f491_u32;
    let img = image::RgbImage::from_fn(640, 480, |x, y| {
        let mut px = [0u8; 3];
        for (c, v) in px.iter_mut().enumerate() {
            noise ^= noise << 13;
            noise ^= noise >> 17;
            noise ^= noise << 5;
            let base =
                128.0 + 90.0 * ((x as f32 / 37.0 + c as f32).sin() * (y as f32 / 23.0).cos());
            *v = (base + (noise % 21) as f32 - 10.0).clamp(0.0, 255.0) as u8;
        }
        image::Rgb(px)
    });
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
        .encode_image(&img)
        .unwrap();
    out
}

fn image_request(bytes: &[u8]) -> InferRequest {
    let mut data = Vec::new();
    push_bytes_element(&mut data, bytes);
    InferRequest {
        inputs: vec![Tensor {
            name: "IMAGE".into(),
            datatype: DataType::Bytes,
            shape: vec![1, 1],
            data: data.into(),
        }],
        ..Default::default()
    }
}

/// What the stages do, as native calls of the host operations: the floor for any stage.
fn native_preprocess(bytes: &[u8]) -> ops::Array {
    let budget = &mut Budget::unlimited();
    let image = ops::decode_image(bytes, ops::Color::Rgb, 0, budget).unwrap();
    let image = ops::resize(&image, 224, 224, ops::Filter::Bilinear, budget).unwrap();
    let mean = [0.485, 0.456, 0.406];
    let std = [0.229, 0.224, 0.225];
    let pixels = ops::normalize(&image, 1.0 / 255.0, &mean, &std, -1, budget).unwrap();
    let chw = ops::transpose(&pixels, &[2, 0, 1], budget).unwrap();
    ops::stack(&[&chw], budget).unwrap()
}

fn preprocess(c: &mut Criterion) {
    let photo = photo_jpeg();
    // The same bytes for the peer's timing (benches/twin_peers.py).
    let results = workspace().join("benches/results");
    std::fs::create_dir_all(&results).unwrap();
    std::fs::write(results.join("photo_640x480.jpg"), &photo).unwrap();
    let images = [
        (
            "png_128x96",
            std::fs::read(workspace().join("tests/fixtures/lines_down.png")).unwrap(),
        ),
        ("jpeg_640x480", photo),
    ];
    let mut rust = load("model_repository/preprocess", "preprocess", "");
    let mut in_wasm = load(
        "model_repository/preprocess",
        "preprocess_in_wasm",
        "parameters [ { key: \"host_ops\", value: { string_value: \"false\" } } ]\n",
    );
    let mut python = load("model_repository/preprocess_py", "preprocess_py", "");
    let outputs = vec!["PIXELS".to_owned()];
    let mut group = c.benchmark_group("preprocess_twins");
    group.sample_size(30);
    for (label, bytes) in &images {
        let req = image_request(bytes);
        group.bench_with_input(
            BenchmarkId::new("native_ops_limit", label),
            bytes,
            |b, bytes| b.iter(|| native_preprocess(black_box(bytes))),
        );
        group.bench_with_input(BenchmarkId::new("rust_host_ops", label), &req, |b, req| {
            b.iter(|| rust.execute(black_box(req), &outputs).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("rust_in_wasm", label), &req, |b, req| {
            b.iter(|| in_wasm.execute(black_box(req), &outputs).unwrap())
        });
        group.bench_with_input(
            BenchmarkId::new("python_host_ops", label),
            &req,
            |b, req| b.iter(|| python.execute(black_box(req), &outputs).unwrap()),
        );
    }
    group.finish();
}

fn topk(c: &mut Criterion) {
    let mut rust = load("model_repository/topk", "topk", "");
    let mut js = load("model_repository/topk_js", "topk_js", "");
    let outputs = vec!["LABELS".to_owned(), "INDICES".to_owned()];
    let mut group = c.benchmark_group("topk_twins");
    group.sample_size(30);
    for (rows, classes) in [(1usize, 4usize), (8, 1000)] {
        let label = format!("{rows}x{classes}");
        let values: Vec<f32> = (0..rows * classes)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0)
            .collect();
        let scores = Tensor {
            name: "SCORES".into(),
            datatype: DataType::Fp32,
            shape: vec![rows as i64, classes as i64],
            data: values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
        };
        let req = InferRequest {
            inputs: vec![scores],
            ..Default::default()
        };
        let array = ops::Array::from_f32(vec![rows, classes], &values);
        group.bench_with_input(
            BenchmarkId::new("native_ops_limit", &label),
            &array,
            |b, a| b.iter(|| ops::top_k(black_box(a), 2, -1, &mut Budget::unlimited()).unwrap()),
        );
        group.bench_with_input(BenchmarkId::new("rust", &label), &req, |b, req| {
            b.iter(|| rust.execute(black_box(req), &outputs).unwrap())
        });
        group.bench_with_input(BenchmarkId::new("js_host_ops", &label), &req, |b, req| {
            b.iter(|| js.execute(black_box(req), &outputs).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, preprocess, topk);
criterion_main!(benches);
