//! Warm-up at load, as Triton's `model_warmup`: each sample (zero, random or file data,
//! `batch_size` rows, `count` times) runs on every instance before the version is READY, so
//! the first real request does not pay for lazy initialisation. Models padded to batch
//! buckets on a GPU, or with a session per bucket, also run every bucket once on every
//! instance: each session meets its shape before any client does. A sample that fails
//! fails the load, naming the sample and the instance.

use std::{
    path::{Component, Path},
    time::Instant,
};

use bytes::Bytes;

use super::backend::{LoadedBackend, WarmupReport};
use crate::{
    error::{Error, Result},
    inference::InferRequest,
    proto::inference::{model_warmup::input::InputDataType, ModelConfig, ModelInput},
    tensor::{element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// One warm-up request, checked against the configuration.
struct Sample {
    /// What messages call it.
    label: String,
    request: InferRequest,
    /// Times it runs on each instance.
    count: u32,
}

/// Runs the configured samples, then the batch buckets that want warming, on every instance.
/// `None` when there is nothing to warm up.
pub fn run(loaded: &mut LoadedBackend, version_dir: &Path) -> Result<Option<WarmupReport>> {
    let mut samples = configured(&loaded.config, version_dir)?;
    if let Some(b) = loaded.buckets.as_deref().filter(|b| b.warm_each_bucket) {
        for &rows in &b.batch {
            let mut request = zero_request(&loaded.config, rows, b.sequence_multiple)?;
            request.model_name = loaded.config.name.clone();
            samples.push(Sample {
                label: format!("batch bucket {rows}"),
                request,
                count: 1,
            });
        }
    }
    if samples.is_empty() {
        return Ok(None);
    }
    let outputs: Vec<String> = loaded
        .config
        .output
        .iter()
        .map(|o| o.name.clone())
        .collect();
    let started = Instant::now();
    let name = &loaded.config.name;
    let samples = &samples;
    let outputs = &outputs;
    // Instances warm up side by side: each runs on its own device or cores.
    let results: Vec<Result<u64>> = std::thread::scope(|scope| {
        let running: Vec<_> = loaded
            .instances
            .iter_mut()
            .enumerate()
            .map(|(index, instance)| {
                scope.spawn(move || {
                    let mut runs = 0;
                    for sample in samples {
                        for _ in 0..sample.count.max(1) {
                            let (mut results, _) =
                                instance.execute_batch(&[&sample.request], outputs);
                            if let Some(Err(e)) = results.pop() {
                                return Err(Error::invalid(format!(
                                    "model '{name}': warm-up {} failed on instance {index}: {}",
                                    sample.label, e.message
                                )));
                            }
                            runs += 1;
                        }
                    }
                    Ok(runs)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::internal(format!(
                        "model '{name}': an instance panicked while warming up"
                    )))
                })
            })
            .collect()
    });
    let mut runs = 0;
    for r in results {
        runs += r?;
    }
    let report = WarmupReport {
        runs,
        duration: started.elapsed(),
    };
    tracing::info!(
        model = %name,
        runs,
        "warmed up in {:.1} ms",
        report.duration.as_secs_f64() * 1e3
    );
    Ok(Some(report))
}

/// A request of `rows` rows of zeros (empty strings for BYTES); variable dimensions get
/// `sequence` (or 1).
fn zero_request(
    config: &ModelConfig,
    rows: usize,
    sequence: Option<usize>,
) -> Result<InferRequest> {
    let inputs = config
        .input
        .iter()
        .map(|input| {
            let dims: Vec<i64> = input
                .dims
                .iter()
                .map(|&d| {
                    if d < 0 {
                        sequence.unwrap_or(1) as i64
                    } else {
                        d
                    }
                })
                .collect();
            let datatype = datatype_of(config, input)?;
            let one = element_count(&dims).unwrap_or(0);
            let row = match datatype.element_size() {
                Some(size) => vec![0u8; one * size],
                None => strings(one, |_| Vec::new()),
            };
            Ok(tensor(config, input, datatype, &dims, &row, rows))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(InferRequest {
        inputs,
        ..Default::default()
    })
}

fn datatype_of(config: &ModelConfig, input: &ModelInput) -> Result<DataType> {
    DataType::from_config_value(input.data_type).ok_or_else(|| {
        Error::invalid(format!(
            "model '{}': input '{}' has no supported data_type",
            config.name, input.name
        ))
    })
}

/// An input tensor of `rows` copies of `row` (the model's batch dimension first when it
/// batches).
fn tensor(
    config: &ModelConfig,
    input: &ModelInput,
    datatype: DataType,
    dims: &[i64],
    row: &[u8],
    rows: usize,
) -> Tensor {
    let batching = config.max_batch_size > 0;
    let shape = if batching {
        std::iter::once(rows as i64)
            .chain(dims.iter().copied())
            .collect()
    } else {
        dims.to_vec()
    };
    let copies = if batching { rows } else { 1 };
    Tensor {
        name: input.name.clone(),
        datatype,
        shape,
        data: Bytes::from(row.repeat(copies)),
    }
}

/// The `model_warmup` samples of `config`, checked: every input named and of the declared
/// type and dims, one data source each, files inside the model's `warmup/` directory and of
/// the right size. Mistakes are named by field.
fn configured(config: &ModelConfig, version_dir: &Path) -> Result<Vec<Sample>> {
    let name = &config.name;
    let model_dir = version_dir.parent().unwrap_or(version_dir);
    let mut samples = Vec::with_capacity(config.model_warmup.len());
    for (k, warmup) in config.model_warmup.iter().enumerate() {
        let field = if warmup.name.is_empty() {
            format!("model_warmup[{k}]")
        } else {
            format!("model_warmup[{k}] ('{}')", warmup.name)
        };
        let invalid = |msg: String| Error::invalid(format!("model '{name}': {field}: {msg}"));
        let rows = warmup.batch_size as usize;
        if rows == 0 {
            return Err(invalid("batch_size must be at least 1".to_owned()));
        }
        if config.max_batch_size <= 0 && rows != 1 {
            return Err(invalid(format!(
                "batch_size is {rows}, but the model does not batch (max_batch_size 0): use 1"
            )));
        }
        if config.max_batch_size > 0 && rows > config.max_batch_size as usize {
            return Err(invalid(format!(
                "batch_size {rows} is larger than max_batch_size {}",
                config.max_batch_size
            )));
        }
        let mut names: Vec<&String> = warmup.inputs.keys().collect();
        names.sort();
        if let Some(unknown) = names
            .iter()
            .find(|n| !config.input.iter().any(|i| &i.name == **n))
        {
            let known: Vec<&str> = config.input.iter().map(|i| i.name.as_str()).collect();
            return Err(invalid(format!(
                "inputs names '{unknown}', which is not an input of the model (its inputs are: {})",
                known.join(", ")
            )));
        }
        let mut inputs = Vec::with_capacity(config.input.len());
        for input in &config.input {
            let Some(given) = warmup.inputs.get(&input.name) else {
                if input.optional {
                    continue;
                }
                return Err(invalid(format!(
                    "inputs has no entry for input '{}'",
                    input.name
                )));
            };
            let at = |msg: String| invalid(format!("inputs['{}']: {msg}", input.name));
            let datatype = datatype_of(config, input)?;
            if given.data_type != input.data_type {
                let said = DataType::from_config_value(given.data_type)
                    .map_or("TYPE_INVALID", |d| d.config_name());
                return Err(at(format!(
                    "data_type is {said}, but the input is {}",
                    datatype.config_name()
                )));
            }
            let fits = given.dims.len() == input.dims.len()
                && given
                    .dims
                    .iter()
                    .zip(&input.dims)
                    .all(|(&g, &d)| g > 0 && (d < 0 || g == d));
            if !fits {
                return Err(at(format!(
                    "dims {} do not fit the input's dims {} (without the batch dimension; \
                     a -1 takes any positive size)",
                    shape_string(&given.dims),
                    shape_string(&input.dims)
                )));
            }
            let elements = element_count(&given.dims).unwrap_or(0);
            let row = match &given.input_data_type {
                Some(InputDataType::ZeroData(true)) => match datatype.element_size() {
                    Some(size) => vec![0u8; elements * size],
                    None => strings(elements, |_| Vec::new()),
                },
                Some(InputDataType::RandomData(true)) => {
                    let mut random = Random::new(k as u64 + 1);
                    match datatype.element_size() {
                        Some(size) => random_values(&mut random, datatype, elements, size),
                        None => strings(elements, |_| random.text(8)),
                    }
                }
                Some(InputDataType::InputDataFile(file)) => {
                    let bytes = read_data_file(model_dir, file).map_err(&at)?;
                    match datatype.element_size() {
                        Some(size) if bytes.len() != elements * size => {
                            return Err(at(format!(
                                "input_data_file '{file}' has {} bytes; dims {} of {} need {}",
                                bytes.len(),
                                shape_string(&given.dims),
                                datatype.config_name(),
                                elements * size
                            )))
                        }
                        Some(_) => bytes,
                        // For strings the file is each element's content.
                        None => strings(elements, |_| bytes.clone()),
                    }
                }
                _ => {
                    return Err(at(
                        "sets none of zero_data, random_data, input_data_file".to_owned()
                    ))
                }
            };
            inputs.push(tensor(config, input, datatype, &given.dims, &row, rows));
        }
        samples.push(Sample {
            label: format!(
                "sample '{}'",
                if warmup.name.is_empty() {
                    &field
                } else {
                    &warmup.name
                }
            ),
            request: InferRequest {
                model_name: name.clone(),
                inputs,
                ..Default::default()
            },
            count: warmup.count,
        });
    }
    Ok(samples)
}

/// `n` BYTES elements, each `element(i)`, length-prefixed as on the wire.
fn strings(n: usize, mut element: impl FnMut(usize) -> Vec<u8>) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        push_bytes_element(&mut out, &element(i));
    }
    out
}

/// Reads `<model dir>/warmup/<file>`, refusing paths that leave that directory.
fn read_data_file(model_dir: &Path, file: &str) -> std::result::Result<Vec<u8>, String> {
    let relative = Path::new(file);
    if file.is_empty()
        || !relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err(format!(
            "input_data_file '{file}' must be a path inside the model's warmup/ directory"
        ));
    }
    let path = model_dir.join("warmup").join(relative);
    std::fs::read(&path).map_err(|e| {
        format!(
            "input_data_file '{file}' cannot be read at '{}': {e}",
            path.display()
        )
    })
}

/// A small deterministic generator (xorshift64*): warm-up data need not be unpredictable,
/// only varied, and the same on every load.
struct Random(u64);

impl Random {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Lowercase ASCII (valid UTF-8 for string tensors).
    fn text(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| b'a' + (self.next() % 26) as u8).collect()
    }
}

/// `n` values of `datatype`: floats in [0, 1), integers and booleans of any small value.
fn random_values(random: &mut Random, datatype: DataType, n: usize, size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * size);
    for _ in 0..n {
        let unit = (random.next() >> 11) as f64 / (1u64 << 53) as f64;
        match datatype {
            DataType::Fp32 => out.extend_from_slice(&(unit as f32).to_le_bytes()),
            DataType::Fp64 => out.extend_from_slice(&unit.to_le_bytes()),
            DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(unit).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(unit).to_le_bytes()),
            DataType::Bool => out.push((random.next() & 1) as u8),
            // Small non-negative integers: valid ids and indices for most models.
            _ => {
                let v = (random.next() % 100).to_le_bytes();
                out.extend_from_slice(&v[..size]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{
        model_warmup::Input as WarmupInput, ModelInput, ModelOutput, ModelWarmup,
    };

    fn config(warmup: ModelWarmup) -> ModelConfig {
        ModelConfig {
            name: "m".into(),
            max_batch_size: 4,
            input: vec![ModelInput {
                name: "x".into(),
                data_type: DataType::Fp32.config_value(),
                dims: vec![-1, 2],
                ..Default::default()
            }],
            output: vec![ModelOutput {
                name: "y".into(),
                data_type: DataType::Fp32.config_value(),
                dims: vec![-1, 2],
                ..Default::default()
            }],
            model_warmup: vec![warmup],
            ..Default::default()
        }
    }

    fn sample(dims: &[i64], data: InputDataType) -> ModelWarmup {
        ModelWarmup {
            name: "s".into(),
            batch_size: 2,
            inputs: [(
                "x".to_owned(),
                WarmupInput {
                    data_type: DataType::Fp32.config_value(),
                    dims: dims.to_vec(),
                    input_data_type: Some(data),
                },
            )]
            .into(),
            count: 3,
        }
    }

    #[test]
    fn samples_become_requests_of_their_batch_size() {
        let dir = Path::new("/nonexistent/m/1");
        let got = configured(
            &config(sample(&[3, 2], InputDataType::RandomData(true))),
            dir,
        )
        .unwrap();
        let x = &got[0].request.inputs[0];
        assert_eq!(
            (x.shape.as_slice(), x.data.len(), got[0].count),
            (&[2, 3, 2][..], 48, 3)
        );
        assert!(
            x.data.chunks(4).any(|c| c != [0; 4]),
            "random data is not all zeros"
        );
    }

    #[test]
    fn mistakes_are_named_by_field() {
        let dir = std::env::temp_dir().join(format!("wasmtron-warmup-{}", std::process::id()));
        let version = dir.join("1");
        std::fs::create_dir_all(dir.join("warmup")).unwrap();
        std::fs::write(dir.join("warmup/short.bin"), [0u8; 5]).unwrap();
        let mut unknown = sample(&[1, 2], InputDataType::ZeroData(true));
        let x = unknown.inputs.remove("x").unwrap();
        unknown.inputs.insert("z".into(), x);
        let mut wrong_type = sample(&[1, 2], InputDataType::ZeroData(true));
        wrong_type.inputs.get_mut("x").unwrap().data_type = DataType::Int32.config_value();
        let mut none = sample(&[1, 2], InputDataType::ZeroData(true));
        none.inputs.get_mut("x").unwrap().input_data_type = None;
        let mut big = sample(&[1, 2], InputDataType::ZeroData(true));
        big.batch_size = 9;
        let cases = [
            (
                unknown,
                "inputs names 'z', which is not an input of the model (its inputs are: x)",
            ),
            (
                wrong_type,
                "inputs['x']: data_type is TYPE_INT32, but the input is TYPE_FP32",
            ),
            (
                sample(&[1, 3], InputDataType::ZeroData(true)),
                "inputs['x']: dims [1,3] do not fit",
            ),
            (none, "sets none of zero_data, random_data, input_data_file"),
            (big, "batch_size 9 is larger than max_batch_size 4"),
            (
                sample(&[1, 2], InputDataType::InputDataFile("gone.bin".into())),
                "input_data_file 'gone.bin' cannot be read",
            ),
            (
                sample(&[1, 2], InputDataType::InputDataFile("short.bin".into())),
                "input_data_file 'short.bin' has 5 bytes; dims [1,2] of TYPE_FP32 need 8",
            ),
            (
                sample(
                    &[1, 2],
                    InputDataType::InputDataFile("../config.pbtxt".into()),
                ),
                "must be a path inside the model's warmup/ directory",
            ),
        ];
        for (warmup, want) in cases {
            let err = configured(&config(warmup), &version).err().unwrap();
            assert!(
                err.message
                    .starts_with("model 'm': model_warmup[0] ('s'): "),
                "{}",
                err.message
            );
            assert!(err.message.contains(want), "{}", err.message);
        }
        std::fs::write(dir.join("warmup/ok.bin"), [0u8; 8]).unwrap();
        let ok = configured(
            &config(sample(
                &[1, 2],
                InputDataType::InputDataFile("ok.bin".into()),
            )),
            &version,
        )
        .unwrap();
        assert_eq!(ok[0].request.inputs[0].shape, [2, 1, 2]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
