//! The smallest useful stage, the Wasm counterpart of the `add_sub` model that introduces
//! Triton's python backend: `OUTPUT0 = INPUT0 + INPUT1`, `OUTPUT1 = INPUT0 - INPUT1`, FP32
//! vectors of equal shape. benches/side_by_side.sh measures it against that python model, so
//! what it shows is the cost of running user code at all.

use wasmtron_guest::{export_stage, Config, Error, Request, Result, Stage, Tensor};

struct AddSub;

impl Stage for AddSub {
    fn init(_config: &Config) -> Result<Self> {
        Ok(AddSub)
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let a = request.input("INPUT0")?;
        let b = request.input("INPUT1")?;
        if a.shape != b.shape {
            return Err(Error::invalid(format!(
                "INPUT0 has shape {:?} but INPUT1 has shape {:?}; they must match",
                a.shape, b.shape
            )));
        }
        let (x, y) = (a.to_f32()?, b.to_f32()?);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(p, q)| p + q).collect();
        let difference: Vec<f32> = x.iter().zip(&y).map(|(p, q)| p - q).collect();
        request.select(vec![
            Tensor::from_f32("OUTPUT0", &a.shape, &sum),
            Tensor::from_f32("OUTPUT1", &a.shape, &difference),
        ])
    }
}

export_stage!(AddSub);
