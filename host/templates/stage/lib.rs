//! {name}: OUTPUT0 = softmax(INPUT0 / temperature) over the last axis.
//!
//! Built by `wasmtron stage build` (cargo, target wasm32-wasip2). The guide: docs/stages.md, "Writing a
//! stage in Rust".

use wasmtron_guest::{export_stage, ops, Config, Error, Request, Result, Stage, Tensor};

struct Demo {
    temperature: f32,
}

impl Stage for Demo {
    fn init(config: &Config) -> Result<Self> {
        let temperature = config.parameter_or("temperature", 1.0f32)?;
        if temperature <= 0.0 {
            return Err(Error::invalid("parameter 'temperature' must be greater than 0"));
        }
        Ok(Demo { temperature })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let input = ops::array(request.input("INPUT0")?)?;
        let scaled = ops::normalize(&input, 1.0, &[0.0], &[self.temperature], -1)?;
        let probs = ops::softmax(&scaled, -1)?;
        request.select(vec![probs.to_tensor("OUTPUT0")])
    }
}

export_stage!(Demo);
