//! Shape buckets: the few input shapes a model's executions are padded to. ONNX Runtime's CUDA
//! provider pays about 100 ms whenever a session's input shape differs from its last call's
//! (cuDNN algorithm search, memory planning), and a dynamic batcher hands it a new batch size
//! almost every call; padding each batch up to one of a few sizes, each served by a session
//! of its own and warmed at load, removes that cost. Padding rows are zeros (empty strings for
//! BYTES) and are cut off before any client sees an answer.
//!
//! Configured with `parameters` in config.pbtxt:
//! - `batch_buckets`: `on` (the `preferred_batch_size` list, else powers of two, up to
//!   `max_batch_size`), `off`, or the sizes themselves (`"1 4 16 32"`). Default: on for models
//!   with a GPU instance, off on the CPU, where a changing shape costs nothing extra.
//! - `pad_sequence_to_multiple`: N pads every variable dimension (`-1` in `dims`) of the
//!   inputs up to a multiple of N, so requests of nearby lengths batch together and share a
//!   shape; outputs' variable dimensions of the padded length are cut back to each request's
//!   own. Only for models that mask padding (an encoder's `attention_mask`), so off by default.
//! - `session_per_bucket`: one ONNX Runtime session per batch bucket, each always fed its
//!   own shape. Default: on with GPU instances (a CUDA session slows down whenever its shape
//!   changes, even among a few warmed ones), off on the CPU.

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::{model_config::SchedulingChoice, ModelConfig},
    tensor::{DataType, Tensor},
};

/// The parameter that sets the batch sizes.
pub const BATCH_BUCKETS: &str = "batch_buckets";
/// The parameter that pads variable dimensions.
pub const PAD_SEQUENCE: &str = "pad_sequence_to_multiple";
/// The parameter that gives every batch bucket its own session.
pub const SESSION_PER_BUCKET: &str = "session_per_bucket";

/// How one model's executions are padded.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ShapeBuckets {
    /// Batch sizes an execution is padded up to, ascending; the last is `max_batch_size`.
    /// Empty: batches run at their own size.
    pub batch: Vec<usize>,
    /// Variable dimensions are padded up to a multiple of this.
    pub sequence_multiple: Option<usize>,
    /// One session per batch bucket.
    pub session_per_bucket: bool,
    /// Whether every bucket runs once on every instance at load (GPU instances, and
    /// sessions per bucket: each shape is met before a client meets it).
    pub warm_each_bucket: bool,
    /// Per input: the positions (in the full shape, batch dimension included) of its
    /// variable dimensions.
    inputs: Vec<(String, Vec<usize>)>,
    /// Per output: the positions of its variable dimensions.
    outputs: Vec<(String, Vec<usize>)>,
}

fn parse_flag(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Some(true),
        "off" | "false" | "0" | "no" | "none" => Some(false),
        _ => None,
    }
}

/// Powers of two up to `max`, and `max` itself.
fn powers_of_two(max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = std::iter::successors(Some(1usize), |s| s.checked_mul(2))
        .take_while(|&s| s < max)
        .collect();
    sizes.push(max);
    sizes
}

/// Positions of the `-1` dims of `dims`, in the full shape (after the batch dimension when
/// `batching`).
fn variable_positions(dims: &[i64], batching: bool) -> Vec<usize> {
    let skip = usize::from(batching);
    dims.iter()
        .enumerate()
        .filter(|(_, &d)| d < 0)
        .map(|(i, _)| i + skip)
        .collect()
}

impl ShapeBuckets {
    /// The buckets `config` asks for; `on_gpu` when any of its instances runs on a GPU.
    /// `None` when executions run at their own shapes. Mistakes are named by parameter.
    pub fn from_config(config: &ModelConfig, on_gpu: bool) -> Result<Option<Self>> {
        let name = &config.name;
        let param = |key: &str| {
            config
                .parameters
                .get(key)
                .map(|p| p.string_value.trim().to_owned())
        };
        let invalid = |key: &str, msg: String| {
            Error::invalid(format!("model '{name}': parameter '{key}': {msg}"))
        };
        let max = usize::try_from(config.max_batch_size).unwrap_or(0);
        let sequence_batching = matches!(
            config.scheduling_choice,
            Some(SchedulingChoice::SequenceBatching(_))
        );
        let batch = match param(BATCH_BUCKETS) {
            None => {
                if on_gpu && max > 1 && !sequence_batching {
                    default_sizes(config, max)
                } else {
                    Vec::new()
                }
            }
            Some(value) => {
                let sizes = match parse_flag(&value) {
                    Some(false) => Vec::new(),
                    Some(true) if max == 0 => vec![1],
                    Some(true) => default_sizes(config, max),
                    None => parse_sizes(&value).map_err(|msg| invalid(BATCH_BUCKETS, msg))?,
                };
                if !sizes.is_empty() {
                    if max == 0 {
                        return Err(invalid(
                            BATCH_BUCKETS,
                            "the model does not batch (max_batch_size is 0)".to_owned(),
                        ));
                    }
                    if sequence_batching {
                        return Err(invalid(
                            BATCH_BUCKETS,
                            "not available with sequence_batching".to_owned(),
                        ));
                    }
                }
                if let Some(big) = sizes.iter().find(|&&s| s > max) {
                    return Err(invalid(
                        BATCH_BUCKETS,
                        format!("size {big} is larger than max_batch_size {max}"),
                    ));
                }
                let mut sizes = sizes;
                if !sizes.is_empty() && sizes.last() != Some(&max) {
                    // Every batch the batcher can form must fit in a bucket.
                    sizes.push(max);
                }
                sizes
            }
        };
        let sequence_multiple = match param(PAD_SEQUENCE) {
            None => None,
            Some(value) => match value.parse::<usize>() {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(invalid(
                        PAD_SEQUENCE,
                        format!("must be a non-negative integer, got \"{value}\""),
                    ))
                }
            },
        };
        let session_per_bucket = match param(SESSION_PER_BUCKET) {
            None => on_gpu && !batch.is_empty(),
            Some(value) => parse_flag(&value).ok_or_else(|| {
                invalid(
                    SESSION_PER_BUCKET,
                    format!("must be true or false, got \"{value}\""),
                )
            })?,
        };
        if session_per_bucket && batch.is_empty() {
            return Err(invalid(
                SESSION_PER_BUCKET,
                "needs batch buckets (set batch_buckets, and max_batch_size > 1)".to_owned(),
            ));
        }
        if batch.is_empty() && sequence_multiple.is_none() {
            return Ok(None);
        }
        let batching = max > 0;
        let inputs: Vec<(String, Vec<usize>)> = config
            .input
            .iter()
            .map(|i| (i.name.clone(), variable_positions(&i.dims, batching)))
            .collect();
        let outputs = config
            .output
            .iter()
            .map(|o| (o.name.clone(), variable_positions(&o.dims, batching)))
            .collect();
        if sequence_multiple.is_some() {
            if sequence_batching {
                return Err(invalid(
                    PAD_SEQUENCE,
                    "not available with sequence_batching".to_owned(),
                ));
            }
            if !inputs.iter().any(|(_, v)| !v.is_empty()) {
                return Err(invalid(
                    PAD_SEQUENCE,
                    "no input has a variable dimension (-1 in dims) to pad".to_owned(),
                ));
            }
            let bytes_with_variable = config
                .input
                .iter()
                .map(|i| (i.name.as_str(), i.data_type, &i.dims))
                .chain(
                    config
                        .output
                        .iter()
                        .map(|o| (o.name.as_str(), o.data_type, &o.dims)),
                )
                .find(|(_, t, dims)| {
                    DataType::from_config_value(*t) == Some(DataType::Bytes)
                        && dims.iter().any(|&d| d < 0)
                });
            if let Some((tensor, _, _)) = bytes_with_variable {
                return Err(invalid(
                    PAD_SEQUENCE,
                    format!("tensor '{tensor}' is TYPE_STRING with a variable dimension; only numeric tensors are padded"),
                ));
            }
            if let Some(i) = config.input.iter().find(|i| i.reshape.is_some()) {
                return Err(invalid(
                    PAD_SEQUENCE,
                    format!("input '{}' has a reshape; padding applies to inputs as declared, without reshape", i.name),
                ));
            }
        }
        Ok(Some(Self {
            warm_each_bucket: !batch.is_empty() && (on_gpu || session_per_bucket),
            batch,
            sequence_multiple,
            session_per_bucket,
            inputs,
            outputs,
        }))
    }

    /// The batch size an execution of `rows` rows runs at.
    pub fn batch_size(&self, rows: usize) -> usize {
        self.batch
            .iter()
            .copied()
            .find(|&b| b >= rows)
            .unwrap_or(rows)
    }

    /// The index of the bucket an execution of `rows` rows runs in (the last for anything
    /// larger); 0 without batch buckets.
    pub fn bucket_index(&self, rows: usize) -> usize {
        self.batch
            .iter()
            .position(|&b| b >= rows)
            .unwrap_or(self.batch.len().saturating_sub(1))
    }

    /// The length a variable dimension of length `len` is padded to.
    pub fn padded_len(&self, len: i64) -> i64 {
        match self.sequence_multiple {
            Some(m) if len > 0 => {
                let m = m as i64;
                ((len + m - 1) / m).saturating_mul(m)
            }
            _ => len,
        }
    }

    fn input_positions(&self, name: &str) -> &[usize] {
        self.inputs
            .iter()
            .find(|(n, _)| n == name)
            .map_or(&[], |(_, v)| v.as_slice())
    }

    /// The sequence length of a request when sequence padding applies to it: every variable
    /// dimension of every input has that one length. `None` (run at its own shape) otherwise.
    pub fn sequence_of(&self, request: &InferRequest) -> Option<i64> {
        self.sequence_multiple?;
        let mut len = None;
        for input in &request.inputs {
            for &at in self.input_positions(&input.name) {
                let d = *input.shape.get(at)?;
                if *len.get_or_insert(d) != d {
                    return None;
                }
            }
        }
        len.filter(|&l| l > 0)
    }

    /// `shape` of input `name` with its variable dimensions at `padded` (when given).
    pub fn padded_shape(&self, name: &str, shape: &[i64], padded: Option<i64>) -> Vec<i64> {
        let mut out = shape.to_vec();
        if let Some(p) = padded {
            for &at in self.input_positions(name) {
                if let Some(d) = out.get_mut(at) {
                    *d = p;
                }
            }
        }
        out
    }

    /// Whether two requests can share an execution once padded: the same inputs, datatypes
    /// and ranks, and the same shapes apart from the batch dimension after padding.
    pub fn compatible(&self, a: &InferRequest, b: &InferRequest) -> bool {
        let (pa, pb) = (
            self.sequence_of(a).map(|l| self.padded_len(l)),
            self.sequence_of(b).map(|l| self.padded_len(l)),
        );
        a.inputs.len() == b.inputs.len()
            && a.inputs.iter().zip(&b.inputs).all(|(x, y)| {
                x.name == y.name
                    && x.datatype == y.datatype
                    && x.shape.len() == y.shape.len()
                    && self.padded_shape(&x.name, &x.shape, pa).get(1..)
                        == self.padded_shape(&y.name, &y.shape, pb).get(1..)
            })
    }

    /// Cuts the variable dimensions of `outputs` that have the padded length back to `len`.
    pub fn crop_outputs(&self, outputs: &mut [Tensor], len: i64, padded: i64) -> Result<()> {
        if len == padded {
            return Ok(());
        }
        for output in outputs {
            let Some((_, positions)) = self.outputs.iter().find(|(n, _)| *n == output.name) else {
                continue;
            };
            let mut target = output.shape.clone();
            for &at in positions {
                if let Some(d) = target.get_mut(at).filter(|d| **d == padded) {
                    *d = len;
                }
            }
            if target == output.shape {
                continue;
            }
            let size = output.datatype.element_size().ok_or_else(|| {
                Error::internal(format!(
                    "output '{}': TYPE_STRING outputs cannot be cut back from padding",
                    output.name
                ))
            })?;
            let mut data = vec![0u8; element_total(&target) * size];
            copy_corner(
                &output.data,
                &dims(&output.shape),
                &mut data,
                &dims(&target),
                size,
            );
            output.data = data.into();
            output.shape = target;
        }
        Ok(())
    }
}

/// `preferred_batch_size` when given (with `max_batch_size` on top), else powers of two.
fn default_sizes(config: &ModelConfig, max: usize) -> Vec<usize> {
    if max == 0 {
        return Vec::new();
    }
    let preferred = match &config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => db.preferred_batch_size.clone(),
        _ => Vec::new(),
    };
    let mut sizes: Vec<usize> = preferred
        .iter()
        .filter_map(|&s| usize::try_from(s).ok())
        .filter(|&s| s > 0 && s <= max)
        .collect();
    if sizes.is_empty() {
        return powers_of_two(max);
    }
    sizes.push(max);
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

fn parse_sizes(value: &str) -> std::result::Result<Vec<usize>, String> {
    let mut sizes = Vec::new();
    for item in value.split([',', ' ']).filter(|s| !s.is_empty()) {
        match item.parse::<usize>() {
            Ok(n) if n > 0 => sizes.push(n),
            _ => {
                return Err(format!(
                    "\"{item}\" is not a batch size; give on, off, or positive sizes such as \"1 2 4 8\""
                ))
            }
        }
    }
    if sizes.is_empty() {
        return Err("give on, off, or positive sizes such as \"1 2 4 8\"".to_owned());
    }
    sizes.sort_unstable();
    sizes.dedup();
    Ok(sizes)
}

/// A shape as sizes (negative dims count as 0).
pub fn dims(shape: &[i64]) -> Vec<usize> {
    shape
        .iter()
        .map(|&d| usize::try_from(d).unwrap_or(0))
        .collect()
}

/// Elements in a shape (negative dims count as 0).
fn element_total(shape: &[i64]) -> usize {
    dims(shape).iter().product()
}

/// Copies the leading corner that `src` (shape `src_dims`) and `dst` (shape `dst_dims`, the
/// same rank) have in common, row-major, elements of `size` bytes: with a larger `dst` this
/// pads (what is not copied keeps its zeros), with a smaller one it crops.
pub fn copy_corner(
    src: &[u8],
    src_dims: &[usize],
    dst: &mut [u8],
    dst_dims: &[usize],
    size: usize,
) {
    let Some((&s0, s_rest)) = src_dims.split_first() else {
        dst[..size].copy_from_slice(&src[..size]);
        return;
    };
    let (&d0, d_rest) = dst_dims.split_first().unwrap_or((&0, &[]));
    let s_inner: usize = s_rest.iter().product::<usize>() * size;
    let d_inner: usize = d_rest.iter().product::<usize>() * size;
    let rows = s0.min(d0);
    if s_rest == d_rest {
        // Whole rows line up: one copy.
        dst[..rows * d_inner].copy_from_slice(&src[..rows * s_inner]);
        return;
    }
    for r in 0..rows {
        copy_corner(
            &src[r * s_inner..(r + 1) * s_inner],
            s_rest,
            &mut dst[r * d_inner..(r + 1) * d_inner],
            d_rest,
            size,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelDynamicBatching, ModelInput, ModelOutput, ModelParameter};

    fn config(max: i32, params: &[(&str, &str)], dims: &[i64]) -> ModelConfig {
        ModelConfig {
            name: "m".into(),
            max_batch_size: max,
            input: vec![ModelInput {
                name: "ids".into(),
                data_type: DataType::Int64.config_value(),
                dims: dims.to_vec(),
                ..Default::default()
            }],
            output: vec![ModelOutput {
                name: "out".into(),
                data_type: DataType::Fp32.config_value(),
                dims: [dims, &[2]].concat(),
                ..Default::default()
            }],
            parameters: params
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        ModelParameter {
                            string_value: v.to_string(),
                        },
                    )
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn sizes_follow_preferred_then_powers_of_two_and_gpu_turns_them_on() {
        let c = config(32, &[], &[4]);
        assert_eq!(ShapeBuckets::from_config(&c, false).unwrap(), None);
        let b = ShapeBuckets::from_config(&c, true).unwrap().unwrap();
        assert_eq!(b.batch, [1, 2, 4, 8, 16, 32]);
        assert!(b.session_per_bucket);
        assert_eq!((b.batch_size(5), b.bucket_index(5)), (8, 3));
        let mut c = config(24, &[(BATCH_BUCKETS, "on")], &[4]);
        c.scheduling_choice = Some(SchedulingChoice::DynamicBatching(ModelDynamicBatching {
            preferred_batch_size: vec![4, 8],
            ..Default::default()
        }));
        let b = ShapeBuckets::from_config(&c, false).unwrap().unwrap();
        assert_eq!(b.batch, [4, 8, 24]);
        assert!(!b.session_per_bucket, "CPU default");
        let c = config(
            12,
            &[(BATCH_BUCKETS, "3, 6"), (SESSION_PER_BUCKET, "true")],
            &[4],
        );
        let b = ShapeBuckets::from_config(&c, false).unwrap().unwrap();
        assert_eq!(
            (b.batch.as_slice(), b.session_per_bucket),
            (&[3, 6, 12][..], true)
        );
        let c = config(8, &[(BATCH_BUCKETS, "off")], &[4]);
        assert_eq!(ShapeBuckets::from_config(&c, true).unwrap(), None);
    }

    #[test]
    fn mistakes_are_named_by_parameter() {
        let cases = [
            (
                config(8, &[(BATCH_BUCKETS, "1 x")], &[4]),
                "'batch_buckets': \"x\" is not",
            ),
            (
                config(8, &[(BATCH_BUCKETS, "16")], &[4]),
                "size 16 is larger than max_batch_size 8",
            ),
            (config(0, &[(BATCH_BUCKETS, "on")], &[4]), "does not batch"),
            (
                config(8, &[(PAD_SEQUENCE, "x")], &[-1]),
                "'pad_sequence_to_multiple': must be",
            ),
            (
                config(8, &[(PAD_SEQUENCE, "8")], &[4]),
                "no input has a variable dimension",
            ),
            (
                config(8, &[(SESSION_PER_BUCKET, "maybe")], &[4]),
                "must be true or false",
            ),
            (
                config(8, &[(SESSION_PER_BUCKET, "true")], &[4]),
                "needs batch buckets",
            ),
        ];
        for (c, want) in cases {
            let err = ShapeBuckets::from_config(&c, false).unwrap_err();
            assert!(err.message.contains(want), "{}", err.message);
            assert!(
                err.message.starts_with("model 'm': parameter '"),
                "{}",
                err.message
            );
        }
    }

    fn request(shape: &[i64]) -> InferRequest {
        let n = element_total(shape);
        InferRequest {
            inputs: vec![Tensor {
                name: "ids".into(),
                datatype: DataType::Int64,
                shape: shape.to_vec(),
                data: vec![1u8; n * 8].into(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn nearby_lengths_share_a_padded_shape() {
        let c = config(8, &[(PAD_SEQUENCE, "8")], &[-1]);
        let b = ShapeBuckets::from_config(&c, false).unwrap().unwrap();
        assert!(b.batch.is_empty());
        assert_eq!(b.sequence_of(&request(&[1, 5])), Some(5));
        assert_eq!(b.padded_len(5), 8);
        assert_eq!(b.padded_len(16), 16);
        assert!(b.compatible(&request(&[1, 5]), &request(&[2, 8])));
        assert!(!b.compatible(&request(&[1, 5]), &request(&[1, 9])));
    }

    #[test]
    fn outputs_are_cut_back_to_the_request_length() {
        let c = config(8, &[(PAD_SEQUENCE, "4")], &[-1]);
        let b = ShapeBuckets::from_config(&c, false).unwrap().unwrap();
        // [1, 4, 2] padded from length 3: the last position goes.
        let values: Vec<u8> = (0u8..8).flat_map(|v| f32::from(v).to_le_bytes()).collect();
        let mut outputs = vec![Tensor {
            name: "out".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 4, 2],
            data: values.into(),
        }];
        b.crop_outputs(&mut outputs, 3, 4).unwrap();
        assert_eq!(outputs[0].shape, [1, 3, 2]);
        let got: Vec<f32> = outputs[0]
            .data
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    }

    #[test]
    fn corners_pad_with_zeros_and_crop() {
        let src = [1u8, 2, 3, 4, 5, 6]; // [2, 3]
        let mut dst = [0u8; 8]; // [2, 4]
        copy_corner(&src, &[2, 3], &mut dst, &[2, 4], 1);
        assert_eq!(dst, [1, 2, 3, 0, 4, 5, 6, 0]);
        let mut back = [0u8; 6];
        copy_corner(&dst, &[2, 4], &mut back, &[2, 3], 1);
        assert_eq!(back, src);
        let mut taller = [0u8; 9]; // [3, 3]
        copy_corner(&src, &[2, 3], &mut taller, &[3, 3], 1);
        assert_eq!(taller, [1, 2, 3, 4, 5, 6, 0, 0, 0]);
    }
}
