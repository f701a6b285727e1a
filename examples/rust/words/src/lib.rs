//! A decoupled (streaming) stage: `TEXT` (BYTES [1]) in, one response per word out —
//! `WORD` (BYTES [1]) and `POSITION` (INT64 [1]) — sent with `host::respond` as soon as each
//! word is found, the way a generator emits tokens. `execute` then returns no outputs, which
//! ends the request. A text with no words gets no response at all.
//! Parameter in config.pbtxt: `max_words` (default 64) caps the responses per request.

use wasmtron_guest::{export_stage, host, Config, Error, Request, Result, Stage, Tensor};

struct Words {
    max_words: usize,
}

impl Stage for Words {
    fn init(config: &Config) -> Result<Self> {
        let max_words = match config.parameter("max_words") {
            None => 64,
            Some(text) => text.parse().map_err(|_| {
                Error::invalid(format!("parameter 'max_words' is not a count: {text}"))
            })?,
        };
        Ok(Words { max_words })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let text = request.input("TEXT")?.bytes_elements()?;
        let text = std::str::from_utf8(text.first().copied().unwrap_or_default())
            .map_err(|_| Error::invalid("TEXT must be UTF-8"))?;
        for (position, word) in text.split_whitespace().take(self.max_words).enumerate() {
            host::respond(&request.select(vec![
                Tensor::from_bytes_elements("WORD", &[1], [word]),
                Tensor::from_i64("POSITION", &[1], &[position as i64]),
            ])?)?;
        }
        Ok(Vec::new())
    }
}

export_stage!(Words);
