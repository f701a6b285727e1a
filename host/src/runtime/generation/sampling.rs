//! Choosing the next token from a row of logits: penalties, temperature, top-k, top-p, and a
//! random draw from a per-request generator (seeded: the same seed gives the same tokens).

use rand_chacha::{
    rand_core::{RngCore, SeedableRng},
    ChaCha8Rng,
};

use super::token_rules::TokenRules;

/// How one request samples. `temperature == 0` (the default) is greedy decoding, as
/// TensorRT-LLM does when no sampling parameter is given.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Divides the logits; 0 picks the most likely token.
    pub temperature: f32,
    /// Keeps the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keeps the smallest set of most likely tokens whose probability reaches `top_p`; 1 keeps all.
    pub top_p: f32,
    /// Seed of the request's generator; `None` draws one.
    pub seed: Option<u64>,
    /// Divides positive logits (multiplies negative ones) of tokens already in the sequence,
    /// as Hugging Face and TensorRT-LLM do; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once per earlier occurrence of a token among the generated ones (OpenAI).
    pub frequency_penalty: f32,
    /// Subtracted once from every token already generated (OpenAI).
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// One request's sampler.
pub struct Sampler {
    params: SamplingParams,
    rules: TokenRules,
    rng: ChaCha8Rng,
    /// Scratch: (token, logit) candidates.
    candidates: Vec<(u32, f32)>,
    /// Whether to work out each chosen token's log-probability.
    log_probs: bool,
    last_log_prob: f32,
    /// How many likeliest alternatives to report per token, with their log-probabilities.
    top: usize,
    last_top: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler; without a seed its generator is seeded from the clock and a counter.
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(fresh_seed);
        Self {
            params,
            rules: TokenRules::default(),
            rng: ChaCha8Rng::seed_from_u64(seed),
            candidates: Vec::new(),
            log_probs: false,
            last_log_prob: 0.0,
            top: 0,
            last_top: Vec::new(),
        }
    }

    /// The sampler with rules on which tokens may come.
    pub fn with_rules(mut self, rules: TokenRules) -> Self {
        self.rules = rules;
        self
    }

    /// The sampler working out the log-probability of each token it picks
    /// ([`Sampler::last_log_prob`]).
    pub fn with_log_probs(mut self, on: bool) -> Self {
        self.log_probs = on;
        self
    }

    /// The sampler reporting, per token, the `k` likeliest tokens and their log-probabilities
    /// ([`Sampler::last_top`]); implies [`Sampler::with_log_probs`].
    pub fn with_top_log_probs(mut self, k: usize) -> Self {
        self.top = k;
        self.log_probs |= k > 0;
        self
    }

    /// The likeliest tokens at the last pick, most likely first, with their log-probabilities
    /// (under the same distribution as [`Sampler::last_log_prob`]); empty unless asked for.
    pub fn last_top(&self) -> &[(u32, f32)] {
        &self.last_top
    }

    /// The natural-log probability of the last token picked, under the distribution it was
    /// drawn from before temperature, top-k and top-p (the logits after penalties and rules);
    /// 0 unless asked for.
    pub fn last_log_prob(&self) -> f32 {
        self.last_log_prob
    }

    /// Whether it always picks the likeliest token (after penalties and rules): what n-gram
    /// speculation can check a draft against without changing the answer.
    pub fn is_greedy(&self) -> bool {
        self.params.temperature <= 0.0 || self.params.top_k == 1
    }

    /// Picks the next token from `logits` (modified in place by the penalties and rules), given
    /// the prompt and the tokens generated so far.
    pub fn sample(&mut self, logits: &mut [f32], prompt: &[i64], generated: &[i64]) -> u32 {
        self.penalise(logits, prompt, generated);
        self.rules.apply(logits, generated);
        let token = self.pick(logits);
        if self.log_probs {
            let total = log_sum_exp(logits);
            self.last_log_prob = logits
                .get(token as usize)
                .map_or(f32::NEG_INFINITY, |&l| l - total);
            if self.top > 0 {
                self.last_top = likeliest(logits, self.top)
                    .into_iter()
                    .map(|(t, l)| (t, l - total))
                    .collect();
            }
        }
        token
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.candidates.len() {
            self.candidates
                .select_nth_unstable_by(p.top_k - 1, by_logit);
            self.candidates.truncate(p.top_k);
        }
        // Softmax over the candidates, most likely first (top-p needs them in order).
        self.candidates.sort_unstable_by(by_logit);
        let max = self.candidates.first().map_or(0.0, |c| c.1);
        let mut total = 0.0f64;
        for c in &mut self.candidates {
            c.1 = (c.1 - max).exp();
            total += f64::from(c.1);
        }
        let mut keep = self.candidates.len();
        if p.top_p < 1.0 {
            let mut mass = 0.0f64;
            for (i, c) in self.candidates.iter().enumerate() {
                mass += f64::from(c.1) / total;
                if mass >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f64 = self.candidates[..keep].iter().map(|c| f64::from(c.1)).sum();
        // A uniform draw in [0, kept) with 53 random bits.
        let draw = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * kept;
        let mut acc = 0.0f64;
        for c in &self.candidates[..keep] {
            acc += f64::from(c.1);
            if draw < acc {
                return c.0;
            }
        }
        self.candidates[keep - 1].0
    }

    fn penalise(&self, logits: &mut [f32], prompt: &[i64], generated: &[i64]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen = std::collections::HashSet::new();
            for &t in prompt.iter().chain(generated) {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                    if seen.insert(t) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<i64, u32>::new();
            for &t in generated {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(l) = usize::try_from(t).ok().and_then(|i| logits.get_mut(i)) {
                    *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
                }
            }
        }
    }
}

/// Each prompt token's log-probability given the tokens before it, as a prefill over the
/// whole prompt scores it.
#[derive(Debug, Clone, Default)]
pub struct PromptLogProbs {
    /// Per prompt token; the first has none (NaN).
    pub log_probs: Vec<f32>,
    /// Per prompt token, the likeliest tokens at its position (none for the first).
    pub top: Vec<Vec<(u32, f32)>>,
}

/// Scores each token of `prompt` by the logits after the token before it (`logits_after(i)`:
/// the row after token `i`), with the `k` likeliest tokens at each position.
pub fn score_prompt<'a>(
    prompt: &[i64],
    k: usize,
    logits_after: impl Fn(usize) -> Option<&'a [f32]>,
) -> PromptLogProbs {
    let mut scores = PromptLogProbs {
        log_probs: vec![f32::NAN],
        top: vec![Vec::new()],
    };
    for (i, &token) in prompt.iter().enumerate().skip(1) {
        let (log_prob, top) = logits_after(i - 1).map_or_else(
            || (f32::NAN, Vec::new()),
            |logits| scored(logits, token as u32, k),
        );
        scores.log_probs.push(log_prob);
        scores.top.push(top);
    }
    scores
}

/// The model's own natural-log probability of `token` under `logits` (no penalty, rule or
/// temperature) and the `k` likeliest tokens with theirs: what a prompt token is scored with.
fn scored(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let total = log_sum_exp(logits);
    let log_prob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| l - total);
    let top = likeliest(logits, k)
        .into_iter()
        .map(|(t, l)| (t, l - total))
        .collect();
    (log_prob, top)
}

/// `log(sum(exp(logits)))`, computed stably.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let total: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    max + total.ln() as f32
}

/// The `k` largest logits with their tokens, largest first (ties: the lower id first).
fn likeliest(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if best.len() == k && best.last().is_some_and(|&(_, worst)| l <= worst) {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (i as u32, l));
        best.truncate(k);
    }
    best
}

/// The index of the largest value (the first of equals).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.1, 2.0, 1.9, -1.0, 0.5, 1.0]
    }

    #[test]
    fn a_prompt_is_scored_token_by_token_from_the_logits_before_each() {
        // Rows after tokens 0 and 1: uniform over 4, then sure of token 3.
        let rows = [vec![0.0f32; 4], vec![-100.0, -100.0, -100.0, 0.0]];
        let scores = score_prompt(&[2, 1, 3], 2, |i| rows.get(i).map(Vec::as_slice));
        assert!(scores.log_probs[0].is_nan() && scores.top[0].is_empty());
        assert!((scores.log_probs[1] - 0.25f32.ln()).abs() < 1e-6);
        assert!(scores.log_probs[2].abs() < 1e-6);
        assert_eq!(
            scores.top[1].iter().map(|t| t.0).collect::<Vec<_>>(),
            [0, 1]
        );
        assert_eq!(scores.top[2][0].0, 3);
        // A position the run did not answer is unscored rather than wrong.
        let short = score_prompt(&[2, 1, 3], 0, |i| {
            rows.get(i).filter(|_| i == 0).map(Vec::as_slice)
        });
        assert!(short.log_probs[2].is_nan());
    }

    #[test]
    fn greedy_takes_the_largest() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut logits(), &[], &[]), 1);
    }

    #[test]
    fn the_same_seed_gives_the_same_draws() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..Default::default()
        };
        let draws = |params: &SamplingParams| {
            let mut s = Sampler::new(params.clone());
            (0..64)
                .map(|_| s.sample(&mut logits(), &[], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(&params), draws(&params));
        let other = SamplingParams {
            seed: Some(43),
            ..params.clone()
        };
        assert_ne!(draws(&params), draws(&other));
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likely_tokens() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(matches!(s.sample(&mut logits(), &[], &[]), 1 | 2));
        }
        // Token 1 alone holds more than 1% of the mass.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.01,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits(), &[], &[]), 1);
        }
    }

    #[test]
    fn the_likeliest_alternatives_come_most_likely_first() {
        let mut s = Sampler::new(SamplingParams::default()).with_top_log_probs(3);
        let token = s.sample(&mut logits(), &[], &[]);
        let top: Vec<u32> = s.last_top().iter().map(|t| t.0).collect();
        assert_eq!(top, [1, 2, 5]);
        assert_eq!(s.last_top()[0], (token, s.last_log_prob()));
        assert!(s.last_top().windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn log_probs_are_those_of_the_softmax() {
        let mut s = Sampler::new(SamplingParams::default()).with_log_probs(true);
        let token = s.sample(&mut logits(), &[], &[]);
        let l = logits();
        let total: f32 = l.iter().map(|v| v.exp()).sum();
        let expected = (l[token as usize].exp() / total).ln();
        assert!((s.last_log_prob() - expected).abs() < 1e-5);
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        // 2.0 / 2 = 1.0 < 1.9: the repeated token loses its lead.
        assert_eq!(s.sample(&mut logits(), &[1], &[]), 2);
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        });
        assert_eq!(s.sample(&mut logits(), &[], &[1]), 2);
    }
}
