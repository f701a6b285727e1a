//! The tensors one response of a sequence carries: its tokens, the recent tokens before them
//! for the detokenizer, and what the request asked to see (finish reason, log-probabilities,
//! counts).

use super::*;

/// A `[1, n]` tensor of 4-byte values.
pub(super) fn row_tensor<T: Copy>(
    name: &str,
    datatype: DataType,
    values: &[T],
    le: fn(T) -> [u8; 4],
) -> Tensor {
    Tensor {
        name: name.to_owned(),
        datatype,
        shape: vec![1, values.len() as i64],
        data: Bytes::from(values.iter().flat_map(|&v| le(v)).collect::<Vec<u8>>()),
    }
}

pub(super) fn fp32_tensor(name: &str, values: &[f32]) -> Tensor {
    row_tensor(name, DataType::Fp32, values, f32::to_le_bytes)
}

/// What one response says besides its tokens.
pub(super) struct Extras<'a> {
    /// Recent tokens before these, for the detokenizer.
    pub(super) context: &'a [u32],
    pub(super) finish: Option<Finish>,
    pub(super) prompt_tokens: usize,
    pub(super) generated_tokens: usize,
    /// These tokens' log-probabilities, and the sum over every token answered so far.
    pub(super) log_probs: &'a [f32],
    pub(super) cum_log_prob: f32,
    /// The generated tokens this response covers, their likeliest alternatives (`top_k` each)
    /// and what tokens spell, for `output_tokens`, `top_tokens` and `top_log_probs`.
    pub(super) new_tokens: &'a [u32],
    pub(super) top: &'a [Vec<(u32, f32)>],
    pub(super) top_k: usize,
    pub(super) text: Option<&'a TokenBytes>,
    /// The prompt and how likely each of its tokens was, on the response that carries them.
    pub(super) prompt: Option<(&'a [i64], &'a PromptLogProbs)>,
}

impl Extras<'_> {
    fn spelling(&self, token: u32) -> &[u8] {
        self.text.map_or(&[], |t| t.of(token))
    }

    fn strings<'b>(&self, name: &str, items: impl Iterator<Item = &'b [u8]>) -> Tensor {
        let mut data = Vec::new();
        let mut n = 0;
        for item in items {
            push_bytes_element(&mut data, item);
            n += 1;
        }
        Tensor {
            name: name.to_owned(),
            datatype: DataType::Bytes,
            shape: vec![1, n],
            data: Bytes::from(data),
        }
    }

    /// Each token's alternatives padded to `top_k` (an empty token at -inf).
    fn padded_top(&self) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
        padded(self.top, self.top_k)
    }

    /// The same for the prompt's tokens, when this response carries them.
    fn padded_prompt_top(&self) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
        padded(self.prompt.map_or(&[][..], |(_, p)| &p.top), self.top_k)
    }
}

/// Alternatives per token padded to `k` (an empty token at -inf): (token, log-probability,
/// whether real).
pub(super) fn padded(
    top: &[Vec<(u32, f32)>],
    k: usize,
) -> impl Iterator<Item = (u32, f32, bool)> + '_ {
    top.iter().flat_map(move |alternatives| {
        (0..k).map(move |i| match alternatives.get(i) {
            Some(&(t, l)) => (t, l, true),
            None => (0, f32::NEG_INFINITY, false),
        })
    })
}

impl Extras<'_> {
    fn spelled(&self, name: &str, top: impl Iterator<Item = (u32, f32, bool)>) -> Tensor {
        let spellings: Vec<&[u8]> = top
            .map(|(t, _, real)| if real { self.spelling(t) } else { &[][..] })
            .collect();
        self.strings(name, spellings.into_iter())
    }
}

pub(super) fn int32_tensor(name: &str, values: &[i32]) -> Tensor {
    row_tensor(name, DataType::Int32, values, i32::to_le_bytes)
}

/// One response's tensors, in the order asked for.
pub(super) fn response(outputs: &[String], tokens: &[u32], answer: &Extras) -> Vec<Tensor> {
    let ids = |t: &[u32]| t.iter().map(|&v| v as i32).collect::<Vec<i32>>();
    outputs
        .iter()
        .filter_map(|name| {
            Some(match name.as_str() {
                "output_ids" => int32_tensor(name, &ids(tokens)),
                "context_ids" => int32_tensor(name, &ids(answer.context)),
                "prompt_tokens" => int32_tensor(name, &[answer.prompt_tokens as i32]),
                "generated_tokens" => int32_tensor(name, &[answer.generated_tokens as i32]),
                "cum_log_probs" => fp32_tensor(name, &[answer.cum_log_prob]),
                "output_tokens" => {
                    let spellings: Vec<&[u8]> = answer
                        .new_tokens
                        .iter()
                        .map(|&t| answer.spelling(t))
                        .collect();
                    answer.strings(name, spellings.into_iter())
                }
                "top_tokens" => answer.spelled(name, answer.padded_top()),
                "prompt_top_tokens" => answer.spelled(name, answer.padded_prompt_top()),
                "prompt_top_log_probs" => {
                    let values: Vec<f32> = answer.padded_prompt_top().map(|(_, l, _)| l).collect();
                    fp32_tensor(name, &values)
                }
                "prompt_log_probs" => {
                    fp32_tensor(name, answer.prompt.map_or(&[][..], |(_, p)| &p.log_probs))
                }
                "prompt_token_texts" => {
                    let ids = answer.prompt.map_or(&[][..], |(ids, _)| ids);
                    let spellings: Vec<&[u8]> =
                        ids.iter().map(|&t| answer.spelling(t as u32)).collect();
                    answer.strings(name, spellings.into_iter())
                }
                "top_log_probs" => {
                    let values: Vec<f32> = answer.padded_top().map(|(_, l, _)| l).collect();
                    fp32_tensor(name, &values)
                }
                "output_log_probs" => fp32_tensor(name, answer.log_probs),
                "finish_reason" => {
                    let mut data = Vec::new();
                    push_bytes_element(
                        &mut data,
                        answer.finish.map_or("", Finish::as_str).as_bytes(),
                    );
                    Tensor {
                        name: name.clone(),
                        datatype: DataType::Bytes,
                        shape: vec![1, 1],
                        data: Bytes::from(data),
                    }
                }
                _ => return None,
            })
        })
        .collect()
}
