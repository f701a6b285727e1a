//! Postprocessing stage: turns classifier logits or probabilities (`SCORES`, FP32 [batch, C])
//! into the top-k classes per row, as Triton's classification extension formats them
//! (`"score:index:label"` in `LABELS`, BYTES [batch, k]) and as indices (`INDICES`, INT64
//! [batch, k]). Parameters in config.pbtxt: `k` (default 1) and `labels` (comma-separated).

use wasmtron_guest::{export_stage, Config, Error, Request, Result, Stage, Tensor};

struct TopK {
    k: usize,
    labels: Vec<String>,
}

impl Stage for TopK {
    fn init(config: &Config) -> Result<Self> {
        let k = match config.parameter("k") {
            Some(v) => v.trim().parse().ok().filter(|k| *k > 0).ok_or_else(|| {
                Error::invalid(format!(
                    "parameter 'k' must be a positive integer, got \"{v}\""
                ))
            })?,
            None => 1,
        };
        let labels = config
            .parameter("labels")
            .map(|l| l.split(',').map(|s| s.trim().to_owned()).collect())
            .unwrap_or_default();
        Ok(TopK { k, labels })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let scores = request.input("SCORES")?;
        let values = scores.to_f32()?;
        let (rows, classes) = match scores.shape.as_slice() {
            [rows, classes] => (*rows as usize, *classes as usize),
            _ => return Err(Error::invalid("SCORES must be [batch, classes]")),
        };
        let k = self.k.min(classes);
        let mut labels = Vec::with_capacity(rows * k);
        let mut indices = Vec::with_capacity(rows * k);
        for row in values.chunks_exact(classes.max(1)).take(rows) {
            let mut order: Vec<usize> = (0..classes).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &i in order.iter().take(k) {
                let label = self.labels.get(i).map(String::as_str).unwrap_or("");
                labels.push(format!("{:.6}:{i}:{label}", row[i]));
                indices.push(i as i64);
            }
        }
        let shape = [rows as i64, k as i64];
        request.select(vec![
            Tensor::from_bytes_elements("LABELS", &shape, &labels),
            Tensor::from_i64("INDICES", &shape, &indices),
        ])
    }
}

export_stage!(TopK);
