//! Ragged batching, as Triton's backends do it: requests whose `allow_ragged_batch` inputs
//! differ in shape still run as one batch. A backend that runs one big tensor (ONNX Runtime)
//! takes a ragged input as the 1-D concatenation of every request's elements, plus the
//! `batch_input` tensors that say where each request's part lies (element counts, their running
//! sums, item shapes), and gives a `batch_output` back to each request in the shape of its own
//! source input (`BATCH_SCATTER_WITH_INPUT_SHAPE`). The meanings follow `model_config.proto`
//! and Triton's backend input collector; checks follow Triton's `ValidateBatchIO`.

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::{batch_input, batch_output, ModelConfig},
    tensor::{element_count, DataType, Tensor},
};

/// What a batch input describes, per `model_config.proto`'s `BatchInput.Kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchInputKind {
    /// Each request's element count of the source input: shape `[requests]`.
    ElementCount,
    /// The running sum of those counts: shape `[requests]`.
    AccumulatedElementCount,
    /// The running sum after a leading 0: shape `[requests + 1]`.
    AccumulatedElementCountWithZero,
    /// Shape `[largest element count]`; the model reads the shape, not the (zero) data.
    MaxElementCountAsShape,
    /// Each batch item's shape without the batch dimension: `[rows, dims]`.
    ItemShape,
    /// The same values flattened: `[rows * dims]`.
    ItemShapeFlatten,
}

/// One `batch_input` of the configuration.
#[derive(Debug, Clone)]
pub struct BatchInputSpec {
    /// What it describes.
    pub kind: BatchInputKind,
    /// The model inputs that receive it (each gets the same tensor).
    pub targets: Vec<String>,
    /// `TYPE_INT32` or `TYPE_FP32`.
    pub datatype: DataType,
    /// The configured input it is derived from.
    pub source: String,
}

/// One `batch_output` (`BATCH_SCATTER_WITH_INPUT_SHAPE`, the only kind).
#[derive(Debug, Clone)]
pub struct BatchOutputSpec {
    /// The model outputs it applies to.
    pub targets: Vec<String>,
    /// The input whose shape, per request, gives each `-1` of `shape`.
    pub source: String,
    /// `[-1]` (batching models) followed by the output's dims (or its reshape).
    pub shape: Vec<i64>,
}

/// A model's ragged batching: which inputs may differ in shape within a batch, and the batch
/// inputs and outputs the backend adds and scatters.
#[derive(Debug, Clone, Default)]
pub struct RaggedBatching {
    /// Inputs with `allow_ragged_batch: true`.
    pub inputs: Vec<String>,
    /// The configuration's `batch_input` entries.
    pub batch_inputs: Vec<BatchInputSpec>,
    /// The configuration's `batch_output` entries.
    pub batch_outputs: Vec<BatchOutputSpec>,
}

impl RaggedBatching {
    /// Reads and checks a configuration's ragged inputs, batch inputs and batch outputs;
    /// `None` when it has none. Messages name the field and the value at fault.
    pub fn from_config(config: &ModelConfig) -> Result<Option<Self>> {
        let model = &config.name;
        let invalid = |field: String, why: String| {
            Error::invalid(format!("model '{model}': field '{field}': {why}"))
        };
        let input_names: Vec<&str> = config.input.iter().map(|i| i.name.as_str()).collect();
        let known_input = |field: String, name: &str| {
            if input_names.contains(&name) {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!(
                        "unknown source input name '{name}' (the inputs are: {})",
                        input_names.join(", ")
                    ),
                ))
            }
        };
        let mut ragged = Self {
            inputs: config
                .input
                .iter()
                .filter(|i| i.allow_ragged_batch)
                .map(|i| i.name.clone())
                .collect(),
            ..Self::default()
        };
        for (i, input) in config.input.iter().enumerate() {
            if input.allow_ragged_batch && input.optional {
                return Err(invalid(
                    format!("input[{i}].allow_ragged_batch"),
                    format!(
                        "input '{}' is optional; a ragged input cannot be (as on Triton)",
                        input.name
                    ),
                ));
            }
        }
        for (i, b) in config.batch_input.iter().enumerate() {
            let field = |f: &str| format!("batch_input[{i}].{f}");
            let kind = match batch_input::Kind::try_from(b.kind) {
                Ok(batch_input::Kind::BatchElementCount) => BatchInputKind::ElementCount,
                Ok(batch_input::Kind::BatchAccumulatedElementCount) => {
                    BatchInputKind::AccumulatedElementCount
                }
                Ok(batch_input::Kind::BatchAccumulatedElementCountWithZero) => {
                    BatchInputKind::AccumulatedElementCountWithZero
                }
                Ok(batch_input::Kind::BatchMaxElementCountAsShape) => {
                    BatchInputKind::MaxElementCountAsShape
                }
                Ok(batch_input::Kind::BatchItemShape) => BatchInputKind::ItemShape,
                Ok(batch_input::Kind::BatchItemShapeFlatten) => BatchInputKind::ItemShapeFlatten,
                Err(_) => return Err(invalid(field("kind"), format!("unknown kind {}", b.kind))),
            };
            let [source] = b.source_input.as_slice() else {
                return Err(invalid(
                    field("source_input"),
                    format!(
                        "batch input kind '{}' expects 1 source input, got {}",
                        kind_name(b.kind),
                        b.source_input.len()
                    ),
                ));
            };
            known_input(field("source_input"), source)?;
            let datatype = match DataType::from_config_value(b.data_type) {
                Some(d @ (DataType::Int32 | DataType::Fp32)) => d,
                _ => {
                    return Err(invalid(
                        field("data_type"),
                        "batch input data type must be TYPE_INT32 or TYPE_FP32".into(),
                    ))
                }
            };
            if b.target_name.is_empty() {
                return Err(invalid(field("target_name"), "names no model input".into()));
            }
            for target in &b.target_name {
                if input_names.contains(&target.as_str()) {
                    return Err(invalid(
                        field("target_name"),
                        format!(
                            "'{target}' is also a configured input; a batch input is made by \
                             the server, never sent by clients"
                        ),
                    ));
                }
            }
            ragged.batch_inputs.push(BatchInputSpec {
                kind,
                targets: b.target_name.clone(),
                datatype,
                source: source.clone(),
            });
        }
        for (i, b) in config.batch_output.iter().enumerate() {
            let field = |f: &str| format!("batch_output[{i}].{f}");
            if batch_output::Kind::try_from(b.kind).is_err() {
                return Err(invalid(field("kind"), format!("unknown kind {}", b.kind)));
            }
            let [source] = b.source_input.as_slice() else {
                return Err(invalid(
                    field("source_input"),
                    format!(
                        "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source \
                         input, got {}",
                        b.source_input.len()
                    ),
                ));
            };
            known_input(field("source_input"), source)?;
            let mut shape = None;
            for (t, target) in b.target_name.iter().enumerate() {
                if b.target_name[..t].contains(target) {
                    return Err(invalid(
                        field("target_name"),
                        format!("target output name '{target}' is given more than once"),
                    ));
                }
                let Some(output) = config.output.iter().find(|o| &o.name == target) else {
                    return Err(invalid(
                        field("target_name"),
                        format!("unknown target output name '{target}'"),
                    ));
                };
                if DataType::from_config_value(output.data_type)
                    .and_then(DataType::element_size)
                    .is_none()
                {
                    return Err(invalid(
                        field("target_name"),
                        format!(
                            "output '{target}' is TYPE_STRING; batch outputs are scattered by \
                             fixed-size elements, as on Triton"
                        ),
                    ));
                }
                // Triton takes the shape from the first target.
                if shape.is_none() {
                    let dims = output.reshape.as_ref().map_or(&output.dims, |r| &r.shape);
                    let batch = (config.max_batch_size > 0).then_some(-1);
                    shape = Some(batch.into_iter().chain(dims.iter().copied()).collect());
                }
            }
            ragged.batch_outputs.push(BatchOutputSpec {
                targets: b.target_name.clone(),
                source: source.clone(),
                shape: shape.unwrap_or_default(),
            });
        }
        let none = ragged.inputs.is_empty()
            && ragged.batch_inputs.is_empty()
            && ragged.batch_outputs.is_empty();
        Ok((!none).then_some(ragged))
    }

    /// Whether `name` is a ragged input.
    pub fn is_ragged(&self, name: &str) -> bool {
        self.inputs.iter().any(|n| n == name)
    }

    /// The model inputs the server makes (never sent by clients).
    pub fn batch_input_targets(&self) -> impl Iterator<Item = &str> {
        self.batch_inputs
            .iter()
            .flat_map(|b| b.targets.iter().map(String::as_str))
    }

    /// The batch output `name` belongs to, if any.
    pub fn batch_output(&self, name: &str) -> Option<&BatchOutputSpec> {
        self.batch_outputs
            .iter()
            .find(|b| b.targets.iter().any(|t| t == name))
    }

    /// A ragged input of the whole batch: every request's elements, one after another, as a
    /// 1-D tensor.
    pub fn concatenate(parts: &[&Tensor]) -> Result<Tensor> {
        let Some(first) = parts.first() else {
            return Err(Error::internal("no ragged input to concatenate"));
        };
        let mut elements = 0usize;
        let mut data = Vec::with_capacity(parts.iter().map(|t| t.data.len()).sum());
        for t in parts {
            elements += element_count(&t.shape).unwrap_or(0);
            data.extend_from_slice(&t.data);
        }
        Ok(Tensor {
            name: first.name.clone(),
            datatype: first.datatype,
            shape: vec![elements as i64],
            data: data.into(),
        })
    }

    /// Every batch input for `requests`, one tensor per target, in configuration order.
    pub fn make_batch_inputs(&self, requests: &[&InferRequest]) -> Result<Vec<Tensor>> {
        let mut made = Vec::new();
        for spec in &self.batch_inputs {
            let shapes = requests
                .iter()
                .map(|r| {
                    r.inputs
                        .iter()
                        .find(|t| t.name == spec.source)
                        .map(|t| t.shape.as_slice())
                        .ok_or_else(|| {
                            Error::invalid(format!(
                                "batch input '{}' needs input '{}', which the request lacks",
                                spec.targets[0], spec.source
                            ))
                        })
                })
                .collect::<Result<Vec<&[i64]>>>()?;
            let (shape, values) = batch_input_values(spec.kind, &shapes);
            let data: Vec<u8> = match spec.datatype {
                DataType::Fp32 => values
                    .iter()
                    .flat_map(|&v| (v as f32).to_le_bytes())
                    .collect(),
                _ => values
                    .iter()
                    .flat_map(|&v| (v as i32).to_le_bytes())
                    .collect(),
            };
            let data = bytes::Bytes::from(data);
            for target in &spec.targets {
                made.push(Tensor {
                    name: target.clone(),
                    datatype: spec.datatype,
                    shape: shape.clone(),
                    data: data.clone(),
                });
            }
        }
        Ok(made)
    }

    /// Cuts a batch's outputs back into one list per request: a batch output into pieces of
    /// each request's own shape (the output's `-1`s taken from its source input), any other
    /// output by the requests' rows.
    pub fn split(
        &self,
        model: &str,
        outputs: Vec<Tensor>,
        requests: &[&InferRequest],
        rows: &[usize],
    ) -> Result<Vec<Vec<Tensor>>> {
        let mut per_request: Vec<Vec<Tensor>> =
            vec![Vec::with_capacity(outputs.len()); requests.len()];
        let mut plain = Vec::new();
        let mut order = Vec::new();
        for output in outputs {
            match self.batch_output(&output.name) {
                Some(spec) => {
                    order.push(true);
                    for (i, piece) in scatter(model, spec, output, requests)?
                        .into_iter()
                        .enumerate()
                    {
                        per_request[i].push(piece);
                    }
                }
                None => {
                    order.push(false);
                    plain.push(output);
                }
            }
        }
        if plain.is_empty() {
            return Ok(per_request);
        }
        let mut split_plain = if let [_] = requests {
            vec![plain]
        } else {
            super::batch::split(model, plain, rows)?
        };
        // Keep the requested order: plain outputs go back between the scattered ones.
        for (i, tensors) in per_request.iter_mut().enumerate() {
            let mut scattered = std::mem::take(tensors).into_iter();
            let mut rest = std::mem::take(&mut split_plain[i]).into_iter();
            *tensors = order
                .iter()
                .filter_map(|&is_batch| {
                    if is_batch {
                        scattered.next()
                    } else {
                        rest.next()
                    }
                })
                .collect();
        }
        Ok(per_request)
    }
}

/// The shape and values of one batch input, from each request's source input shape.
fn batch_input_values(kind: BatchInputKind, shapes: &[&[i64]]) -> (Vec<i64>, Vec<i64>) {
    let count = |s: &[i64]| element_count(s).unwrap_or(0) as i64;
    let requests = shapes.len() as i64;
    match kind {
        BatchInputKind::ElementCount => (vec![requests], shapes.iter().map(|s| count(s)).collect()),
        BatchInputKind::AccumulatedElementCount
        | BatchInputKind::AccumulatedElementCountWithZero => {
            let mut sum = 0;
            let mut values = Vec::with_capacity(shapes.len() + 1);
            if kind == BatchInputKind::AccumulatedElementCountWithZero {
                values.push(0);
            }
            for s in shapes {
                sum += count(s);
                values.push(sum);
            }
            (vec![values.len() as i64], values)
        }
        BatchInputKind::MaxElementCountAsShape => {
            let max = shapes.iter().map(|s| count(s)).max().unwrap_or(0);
            (vec![max], vec![0; max as usize])
        }
        BatchInputKind::ItemShape | BatchInputKind::ItemShapeFlatten => {
            // Every row of a request has the request's shape without its batch dimension.
            let dims = shapes.first().map_or(0, |s| s.len().saturating_sub(1));
            let mut values = Vec::new();
            let mut rows = 0;
            for s in shapes {
                let (n, item) = s.split_first().map_or((1, &[][..]), |(n, rest)| (*n, rest));
                for _ in 0..n {
                    values.extend_from_slice(item);
                }
                rows += n;
            }
            let shape = if kind == BatchInputKind::ItemShape {
                vec![rows, dims as i64]
            } else {
                vec![values.len() as i64]
            };
            (shape, values)
        }
    }
}

/// One batch output cut into each request's piece: the output's shape with every `-1` taken
/// from the request's source input, the bytes in request order.
fn scatter(
    model: &str,
    spec: &BatchOutputSpec,
    output: Tensor,
    requests: &[&InferRequest],
) -> Result<Vec<Tensor>> {
    let size = output.datatype.element_size().ok_or_else(|| {
        Error::internal(format!(
            "model '{model}': batch output '{}' is not of a fixed-size type",
            output.name
        ))
    })?;
    let mut offset = 0usize;
    let mut pieces = Vec::with_capacity(requests.len());
    for request in requests {
        let source = request
            .inputs
            .iter()
            .find(|t| t.name == spec.source)
            .map(|t| t.shape.as_slice())
            .unwrap_or_default();
        let shape: Vec<i64> = spec
            .shape
            .iter()
            .enumerate()
            .map(|(i, &d)| {
                if d == -1 {
                    source.get(i).copied().unwrap_or(0)
                } else {
                    d
                }
            })
            .collect();
        let bytes = element_count(&shape).unwrap_or(0) * size;
        let end = offset + bytes;
        if end > output.data.len() {
            return Err(Error::internal(format!(
                "model '{model}': batch output '{}' holds {} bytes, fewer than its requests' \
                 source input '{}' shapes need ({end} so far)",
                output.name,
                output.data.len(),
                spec.source
            )));
        }
        pieces.push(Tensor {
            name: output.name.clone(),
            datatype: output.datatype,
            shape,
            data: output.data.slice(offset..end),
        });
        offset = end;
    }
    Ok(pieces)
}

fn kind_name(kind: i32) -> &'static str {
    batch_input::Kind::try_from(kind).map_or("?", |k| k.as_str_name())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp32(name: &str, shape: &[i64], values: &[f32]) -> Tensor {
        Tensor {
            name: name.into(),
            datatype: DataType::Fp32,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    fn ints(t: &Tensor) -> Vec<i32> {
        t.data
            .chunks(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    fn request(shape: &[i64]) -> InferRequest {
        let n = element_count(shape).unwrap();
        InferRequest {
            inputs: vec![fp32("x", shape, &vec![1.0; n])],
            ..Default::default()
        }
    }

    fn spec(kind: BatchInputKind) -> RaggedBatching {
        RaggedBatching {
            inputs: vec!["x".into()],
            batch_inputs: vec![BatchInputSpec {
                kind,
                targets: vec!["b".into()],
                datatype: DataType::Int32,
                source: "x".into(),
            }],
            batch_outputs: vec![],
        }
    }

    /// The examples of model_config.proto: a batch-2 request of shape [2, 2] (two elements per
    /// row... four in all) and others, as Triton's backend input collector counts them.
    #[test]
    fn batch_inputs_count_as_triton_counts() {
        let (a, b, c) = (request(&[1, 3]), request(&[1, 4]), request(&[1, 5]));
        let batch = [&a, &b, &c];
        let made = |kind| spec(kind).make_batch_inputs(&batch).unwrap().remove(0);
        let t = made(BatchInputKind::ElementCount);
        assert_eq!((t.shape.clone(), ints(&t)), (vec![3], vec![3, 4, 5]));
        let t = made(BatchInputKind::AccumulatedElementCount);
        assert_eq!((t.shape.clone(), ints(&t)), (vec![3], vec![3, 7, 12]));
        let t = made(BatchInputKind::AccumulatedElementCountWithZero);
        assert_eq!((t.shape.clone(), ints(&t)), (vec![4], vec![0, 3, 7, 12]));
        let t = made(BatchInputKind::MaxElementCountAsShape);
        assert_eq!(t.shape, vec![5]);
        // "one batch-2 input with shape [3, 1] and batch-1 input with shape [2, 2]"
        let (d, e) = (request(&[2, 3, 1]), request(&[1, 2, 2]));
        let batch = [&d, &e];
        let made = |kind| spec(kind).make_batch_inputs(&batch).unwrap().remove(0);
        let t = made(BatchInputKind::ItemShape);
        assert_eq!(
            (t.shape.clone(), ints(&t)),
            (vec![3, 2], vec![3, 1, 3, 1, 2, 2])
        );
        let t = made(BatchInputKind::ItemShapeFlatten);
        assert_eq!(
            (t.shape.clone(), ints(&t)),
            (vec![6], vec![3, 1, 3, 1, 2, 2])
        );
    }

    #[test]
    fn ragged_inputs_concatenate_and_batch_outputs_scatter_by_source_shape() {
        let a = InferRequest {
            inputs: vec![fp32("x", &[1, 2], &[1.0, 2.0])],
            ..Default::default()
        };
        let b = InferRequest {
            inputs: vec![fp32("x", &[1, 3], &[3.0, 4.0, 5.0])],
            ..Default::default()
        };
        assert!(!super::super::batch::compatible(&a, &b));
        assert!(super::super::batch::compatible_but(&a, &b, &["x".into()]));
        let merged = RaggedBatching::concatenate(&[&a.inputs[0], &b.inputs[0]]).unwrap();
        assert_eq!(merged.shape, [5]);
        let ragged = RaggedBatching {
            inputs: vec!["x".into()],
            batch_inputs: vec![],
            batch_outputs: vec![BatchOutputSpec {
                targets: vec!["y".into()],
                source: "x".into(),
                shape: vec![-1, -1],
            }],
        };
        let y = fp32("y", &[5], &[2.0, 4.0, 6.0, 8.0, 10.0]);
        let rows_out = fp32("r", &[2, 1], &[7.0, 8.0]);
        let parts = ragged
            .split("m", vec![rows_out, y], &[&a, &b], &[1, 1])
            .unwrap();
        assert_eq!(parts[0][0], fp32("r", &[1, 1], &[7.0]));
        assert_eq!(parts[0][1], fp32("y", &[1, 2], &[2.0, 4.0]));
        assert_eq!(parts[1][1], fp32("y", &[1, 3], &[6.0, 8.0, 10.0]));
        let short = fp32("y", &[4], &[2.0, 4.0, 6.0, 8.0]);
        let err = ragged
            .split("m", vec![short], &[&a, &b], &[1, 1])
            .unwrap_err();
        assert!(
            err.message.contains("batch output 'y' holds 16 bytes"),
            "{}",
            err.message
        );
    }

    #[test]
    fn configurations_are_checked_as_triton_checks_them() {
        let config = |extra: &str| {
            let text = format!(
                "name: \"m\"\nmax_batch_size: 8\ninput [ {{ name: \"x\", data_type: TYPE_FP32, \
                 dims: [ -1 ], allow_ragged_batch: true }} ]\noutput [ {{ name: \"y\", \
                 data_type: TYPE_FP32, dims: [ -1 ] }} ]\n{extra}"
            );
            crate::repository::config::parse_text(&text, std::path::Path::new("m/config.pbtxt"))
                .unwrap()
        };
        let ok = RaggedBatching::from_config(&config(
            "batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT, target_name: \"idx\", \
             data_type: TYPE_INT32, source_input: \"x\" } ]\nbatch_output [ { target_name: \
             \"y\", kind: BATCH_SCATTER_WITH_INPUT_SHAPE, source_input: \"x\" } ]",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(ok.batch_outputs[0].shape, [-1, -1]);
        let err = |extra: &str| {
            RaggedBatching::from_config(&config(extra))
                .unwrap_err()
                .message
        };
        assert!(err(
            "batch_input [ { kind: BATCH_ELEMENT_COUNT, target_name: \"n\", data_type: \
                     TYPE_INT64, source_input: \"x\" } ]"
        )
        .contains("field 'batch_input[0].data_type': batch input data type must be TYPE_INT32"));
        assert!(err(
            "batch_input [ { kind: BATCH_ELEMENT_COUNT, target_name: \"n\", data_type: \
                     TYPE_INT32, source_input: \"z\" } ]"
        )
        .contains("unknown source input name 'z'"));
        assert!(
            err("batch_output [ { target_name: \"q\", source_input: \"x\" } ]")
                .contains("unknown target output name 'q'")
        );
        assert!(err(
            "batch_input [ { kind: BATCH_ELEMENT_COUNT, target_name: \"n\", data_type: \
                     TYPE_INT32, source_input: [\"x\", \"x\"] } ]"
        )
        .contains("expects 1 source input, got 2"));
    }
}
