//! Token embeddings → one sentence embedding, the last step of the `embed_text` pipeline:
//! the mean of the token vectors the attention mask keeps, then (parameter `normalize`,
//! default true) scaled to unit length, as sentence-transformers' Pooling + Normalize do.

use wasmtron_guest::{export_stage, Config, Error, Request, Result, Stage, Tensor};

struct MeanPool {
    normalize: bool,
}

impl Stage for MeanPool {
    fn init(config: &Config) -> Result<Self> {
        Ok(Self {
            normalize: config.parameter_or("normalize", true)?,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let hidden = request.input("last_hidden_state")?;
        let mask = request.input("attention_mask")?;
        // [N, L, H] with mask [N, L], or one sentence: [L, H] with [L].
        let (rows, length, width, out_shape) = match (hidden.shape.as_slice(), mask.shape.as_slice()) {
            ([n, l, h], [m, k]) if n == m && l == k => (*n, *l, *h, vec![*n, *h]),
            ([l, h], [k]) if l == k => (1, *l, *h, vec![*h]),
            (h, m) => {
                return Err(Error::invalid(format!(
                    "last_hidden_state {h:?} and attention_mask {m:?} do not match: expected [N, L, H] and [N, L]"
                )))
            }
        };
        let (rows, length, width) = (rows as usize, length as usize, width as usize);
        let values = hidden.to_f32()?;
        let keep = mask.to_i64()?;
        let mut pooled = vec![0f32; rows * width];
        for (row, out) in pooled.chunks_exact_mut(width.max(1)).enumerate() {
            let mut kept = 0f32;
            for t in 0..length {
                if keep[row * length + t] == 0 {
                    continue;
                }
                kept += 1.0;
                let token = &values[(row * length + t) * width..][..width];
                for (o, v) in out.iter_mut().zip(token) {
                    *o += v;
                }
            }
            let scale = 1.0 / kept.max(1e-9);
            out.iter_mut().for_each(|o| *o *= scale);
            if self.normalize {
                let norm = out.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                out.iter_mut().for_each(|o| *o /= norm);
            }
        }
        request.select(vec![Tensor::from_f32("EMBEDDING", &out_shape, &pooled)])
    }
}

export_stage!(MeanPool);
