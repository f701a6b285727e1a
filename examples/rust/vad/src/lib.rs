//! Streaming voice activity detection: each request is one 32 ms chunk (512 samples) of a
//! 16 kHz mono audio stream, and the answer is the probability that it holds speech.
//!
//! The detector, silero-vad, is recurrent and also looks at the 64 samples before each chunk.
//! Both carry over from one chunk to the next, so the stage is stateful; but it keeps nothing
//! itself. The model's `sequence_batching` declares the two states (CONTEXT and STATE) and the
//! server's sequence batcher hands this stream's values in with every request and keeps what
//! the stage returns, so any instance can serve any chunk of any stream, and a new stream (a
//! request with `sequence_start`) starts from zeros. The ONNX model runs on the host
//! (parameter `vad_model`, default `silero_vad`), called the way silero-vad's own ONNX wrapper
//! calls it: the context and the chunk as one row, the state, and the sample rate.

use wasmtron_guest::{export_stage, host, Config, Error, Request, Result, Stage, Tensor};

const CHUNK: usize = 512;
const CONTEXT: usize = 64;
const STATE: usize = 2 * 128;
const SAMPLE_RATE: i64 = 16_000;

struct Vad {
    model: String,
}

fn floats(request: &Request, name: &str, len: usize) -> Result<Vec<f32>> {
    let values = request.input(name)?.to_f32()?;
    if values.len() != len {
        return Err(Error::invalid(format!(
            "{name} holds {} values; expected {len}",
            values.len()
        )));
    }
    Ok(values)
}

impl Stage for Vad {
    fn init(config: &Config) -> Result<Self> {
        Ok(Self {
            model: config.parameter_or("vad_model", "silero_vad".to_owned())?,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let audio = floats(request, "AUDIO", CHUNK)?;
        let mut window = floats(request, "CONTEXT_IN", CONTEXT)?;
        let state = floats(request, "STATE_IN", STATE)?;
        window.extend_from_slice(&audio);
        let inputs = [
            Tensor::from_f32("input", &[1, (CONTEXT + CHUNK) as i64], &window),
            Tensor::from_f32("state", &[2, 1, 128], &state),
            Tensor::from_i64("sr", &[1], &[SAMPLE_RATE]),
        ];
        let outputs = host::infer(&self.model, None, &inputs, &["output", "stateN"])?;
        let [probability, next_state] = outputs.as_slice() else {
            return Err(Error::internal(format!(
                "model '{}' returned {} outputs; expected output and stateN",
                self.model,
                outputs.len()
            )));
        };
        let probability = probability.to_f32()?;
        let next_state = next_state.to_f32()?;
        if probability.len() != 1 || next_state.len() != STATE {
            return Err(Error::internal(format!(
                "model '{}' returned {} probabilities and {} state values; expected 1 and {STATE}",
                self.model,
                probability.len(),
                next_state.len()
            )));
        }
        request.select(vec![
            Tensor::from_f32("SPEECH_PROBABILITY", &[1], &probability),
            Tensor::from_f32("CONTEXT_OUT", &[CONTEXT as i64], &window[CHUNK..]),
            Tensor::from_f32("STATE_OUT", &[2, 128], &next_state),
        ])
    }
}

export_stage!(Vad);
