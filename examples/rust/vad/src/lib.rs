//! Streaming voice activity detection: each request is one 32 ms chunk (512 samples) of a
//! 16 kHz mono audio stream, and the answer is the probability that it holds speech.
//!
//! The detector, silero-vad, is recurrent and also looks at the 64 samples before each chunk.
//! Both carry over from one chunk to the next, so the stage is stateful; but it keeps nothing
//! itself. The model's `sequence_batching` declares the two states (CONTEXT and STATE) and the
//! server's sequence batcher hands this stream's values in with every request and keeps what
//! the stage returns, so any instance can serve any chunk of any stream, and a new stream (a
//! request with `sequence_start`) starts from zeros.
//!
//! Chunks of different streams that the server batches together go to the ONNX model
//! (parameter `vad_model`, default `silero_vad`) in one call: row b of `input` is stream b's
//! context and chunk, and its state is column b of the model's [2, N, 128] state, the way
//! silero-vad's own ONNX wrapper runs a batch.

use wasmtron_guest::{export_stage, host, Config, Error, Request, Result, Stage, Tensor};

const CHUNK: usize = 512;
const CONTEXT: usize = 64;
const WINDOW: usize = CONTEXT + CHUNK;
const WIDTH: usize = 128;
const SAMPLE_RATE: i64 = 16_000;

struct Vad {
    model: String,
}

/// One stream's chunk: the context and the chunk as one window, and its recurrent state.
struct Row {
    /// Leading dimensions of the request's tensors: `[1]` with batching, else none.
    batch: Vec<i64>,
    window: Vec<f32>,
    /// [2, 128].
    state: Vec<f32>,
}

fn floats(request: &Request, name: &str, len: usize) -> Result<(Vec<i64>, Vec<f32>)> {
    let tensor = request.input(name)?;
    let values = tensor.to_f32()?;
    if values.len() != len {
        return Err(Error::invalid(format!(
            "{name} holds {} values; expected {len}",
            values.len()
        )));
    }
    Ok((tensor.shape.clone(), values))
}

fn read(request: &Request) -> Result<Row> {
    let (shape, audio) = floats(request, "AUDIO", CHUNK)?;
    let (_, mut window) = floats(request, "CONTEXT_IN", CONTEXT)?;
    let (_, state) = floats(request, "STATE_IN", 2 * WIDTH)?;
    window.extend_from_slice(&audio);
    Ok(Row {
        batch: shape[..shape.len().saturating_sub(1)].to_vec(),
        window,
        state,
    })
}

impl Vad {
    /// Runs the detector on `rows`: their probabilities and next states ([2, 128] each).
    fn detect(&self, rows: &[&Row]) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let n = rows.len();
        let windows: Vec<f32> = rows.iter().flat_map(|r| r.window.iter().copied()).collect();
        // The model's state is [2, N, 128]: layer-major, streams inside.
        let mut state = vec![0f32; 2 * n * WIDTH];
        for (b, row) in rows.iter().enumerate() {
            for layer in 0..2 {
                state[(layer * n + b) * WIDTH..][..WIDTH]
                    .copy_from_slice(&row.state[layer * WIDTH..][..WIDTH]);
            }
        }
        let inputs = [
            Tensor::from_f32("input", &[n as i64, WINDOW as i64], &windows),
            Tensor::from_f32("state", &[2, n as i64, WIDTH as i64], &state),
            Tensor::from_i64("sr", &[1], &[SAMPLE_RATE]),
        ];
        let outputs = host::infer(&self.model, None, &inputs, &["output", "stateN"])?;
        let [probabilities, next] = outputs.as_slice() else {
            return Err(Error::internal(format!(
                "model '{}' returned {} outputs; expected output and stateN",
                self.model,
                outputs.len()
            )));
        };
        let (probabilities, next) = (probabilities.to_f32()?, next.to_f32()?);
        if probabilities.len() != n || next.len() != 2 * n * WIDTH {
            return Err(Error::internal(format!(
                "model '{}' returned {} probabilities and {} state values for {n} streams",
                self.model,
                probabilities.len(),
                next.len()
            )));
        }
        let states = (0..n)
            .map(|b| {
                (0..2)
                    .flat_map(|layer| next[(layer * n + b) * WIDTH..][..WIDTH].iter().copied())
                    .collect()
            })
            .collect();
        Ok((probabilities, states))
    }
}

impl Stage for Vad {
    fn init(config: &Config) -> Result<Self> {
        Ok(Self {
            model: config.parameter_or("vad_model", "silero_vad".to_owned())?,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let mut results = self.execute_batch(std::slice::from_ref(request));
        results
            .pop()
            .unwrap_or_else(|| Err(Error::internal("no result")))
    }

    fn execute_batch(&mut self, requests: &[Request]) -> Vec<Result<Vec<Tensor>>> {
        let rows: Vec<Result<Row>> = requests.iter().map(read).collect();
        let good: Vec<&Row> = rows.iter().filter_map(|r| r.as_ref().ok()).collect();
        let detected = if good.is_empty() {
            Ok((Vec::new(), Vec::new()))
        } else {
            self.detect(&good)
        };
        let mut b = 0;
        requests
            .iter()
            .zip(&rows)
            .map(|(request, row)| {
                let row = row.as_ref().map_err(Clone::clone)?;
                let (probabilities, states) = detected.as_ref().map_err(Clone::clone)?;
                let shape = |dims: &[i64]| [row.batch.as_slice(), dims].concat();
                let outputs = vec![
                    Tensor::from_f32("SPEECH_PROBABILITY", &shape(&[1]), &[probabilities[b]]),
                    Tensor::from_f32(
                        "CONTEXT_OUT",
                        &shape(&[CONTEXT as i64]),
                        &row.window[CHUNK..],
                    ),
                    Tensor::from_f32("STATE_OUT", &shape(&[2, WIDTH as i64]), &states[b]),
                ];
                b += 1;
                request.select(outputs)
            })
            .collect()
    }
}

export_stage!(Vad);
