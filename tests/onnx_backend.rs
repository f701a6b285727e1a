//! The ONNX backend in-process, below the server: what an execution hands back stays as it was
//! while later executions run (answers hold ONNX Runtime's output memory without copying it),
//! and a batch of requests answers each with its own rows.

use std::path::Path;

use wasmtron::{
    inference::InferRequest,
    repository::config::parse_text,
    runtime::{self, ModelInstance, RuntimeOptions},
    tensor::{DataType, Tensor},
};

fn simple() -> Box<dyn ModelInstance> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("model_repository/simple");
    let text = std::fs::read_to_string(dir.join("config.pbtxt")).unwrap();
    let config = parse_text(&text, Path::new("config.pbtxt")).unwrap();
    let loaded = runtime::load(config, &dir.join("1"), &RuntimeOptions::default()).unwrap();
    loaded.instances.into_iter().next().unwrap()
}

fn ints(name: &str, rows: usize, values: impl Fn(usize) -> i32) -> Tensor {
    Tensor {
        name: name.into(),
        datatype: DataType::Int32,
        shape: vec![rows as i64, 16],
        data: (0..rows * 16)
            .flat_map(|i| values(i).to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
    }
}

fn request(rows: usize, base: i32) -> InferRequest {
    InferRequest {
        inputs: vec![
            ints("INPUT0", rows, |i| base + i as i32),
            ints("INPUT1", rows, |_| 1),
        ],
        ..Default::default()
    }
}

fn decode(t: &Tensor) -> Vec<i32> {
    t.data
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn answers_keep_their_values_while_later_executions_run() {
    let mut instance = simple();
    let both = vec!["OUTPUT0".to_owned(), "OUTPUT1".to_owned()];
    let (first, _) = instance.execute(&request(2, 100), &both).unwrap();
    let kept: Vec<Vec<i32>> = first.iter().map(decode).collect();
    assert_eq!(kept[0], (0..32).map(|i| 101 + i).collect::<Vec<_>>());
    assert_eq!(kept[1], (0..32).map(|i| 99 + i).collect::<Vec<_>>());
    // Same shape, other values, several times: the first answer must not change.
    for base in [1000, 2000, 3000] {
        let (later, _) = instance.execute(&request(2, base), &both).unwrap();
        assert_eq!(decode(&later[0])[0], base + 1);
    }
    assert_eq!(first.iter().map(decode).collect::<Vec<_>>(), kept);
}

#[test]
fn only_the_requested_outputs_come_back_and_batches_split_by_request() {
    let mut instance = simple();
    let (one, _) = instance
        .execute(&request(1, 5), &["OUTPUT1".to_owned()])
        .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(one[0].name, "OUTPUT1");
    assert_eq!(decode(&one[0]), (0..16).map(|i| 4 + i).collect::<Vec<_>>());

    let (a, b) = (request(1, 0), request(3, 500));
    let (results, _) = instance.execute_batch(&[&a, &b], &["OUTPUT0".to_owned()]);
    let results: Vec<Vec<Tensor>> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(results[0][0].shape, vec![1, 16]);
    assert_eq!(results[1][0].shape, vec![3, 16]);
    assert_eq!(decode(&results[0][0]), (1..17).collect::<Vec<_>>());
    assert_eq!(decode(&results[1][0]), (501..549).collect::<Vec<_>>());
}
