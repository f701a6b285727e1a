//! What a generation model reports: token counts, latencies per token, the batch and the
//! cache. Plain atomics, read by the metrics endpoint at scrape time.

use std::{
    sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed},
    time::Duration,
};

/// A latency histogram with fixed bucket bounds (seconds), cumulative at render time.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, value: Duration) {
        let secs = value.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| secs <= b) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        self.sum_ns
            .fetch_add(u64::try_from(value.as_nanos()).unwrap_or(u64::MAX), Relaxed);
        self.count.fetch_add(1, Relaxed);
    }

    /// (upper bound in seconds, observations at or below it) per bucket, then the sum in
    /// seconds and the count.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64, u64) {
        let mut acc = 0;
        let buckets = self
            .bounds
            .iter()
            .zip(&self.counts)
            .map(|(&b, c)| {
                acc += c.load(Relaxed);
                (b, acc)
            })
            .collect();
        (
            buckets,
            self.sum_ns.load(Relaxed) as f64 / 1e9,
            self.count.load(Relaxed),
        )
    }
}

/// vLLM's bucket bounds for time to first token, in seconds.
const TTFT_BOUNDS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
/// vLLM's bucket bounds for the time between output tokens, in seconds.
const ITL_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// The counters of one generation model.
#[derive(Debug)]
pub struct GenerationStats {
    /// Prompt tokens prefilled.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generation_tokens: AtomicU64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: AtomicU64,
    /// Prompt tokens found there (not prefilled again).
    pub prefix_cache_hits: AtomicU64,
    /// Tokens the prefix cache holds.
    pub prefix_cache_tokens: AtomicI64,
    /// Requests finished, by reason: stop (EOS or stop string), length, cancelled.
    pub finished_stop: AtomicU64,
    /// Requests that reached their token limit.
    pub finished_length: AtomicU64,
    /// Requests whose client went away.
    pub finished_cancelled: AtomicU64,
    /// Sequences taken out of the batch for a party below its share of the rows.
    pub preemptions: AtomicU64,
    /// Drafts run by n-gram speculation (one per sequence and step that had one).
    pub spec_drafts: AtomicU64,
    /// Draft tokens run.
    pub spec_draft_tokens: AtomicU64,
    /// Draft tokens accepted (the ones greedy decoding picked too).
    pub spec_accepted_tokens: AtomicU64,
    /// Sequences in the running batch.
    pub running: AtomicI64,
    /// Requests admitted by the scheduler but waiting for room in the cache.
    pub waiting: AtomicI64,
    /// Tokens the cache holds now (rows x columns, padding included).
    pub cache_used_tokens: AtomicI64,
    /// The cache's budget in tokens.
    pub cache_capacity_tokens: u64,
    /// Bytes one cached token takes (keys and values of every layer).
    pub bytes_per_token: u64,
    /// Prompts' caches are kept for later prompts (`prefix_cache_max_tokens` > 0).
    pub prefix_cache_enabled: bool,
    /// From arrival to the first generated token.
    pub time_to_first_token: Histogram,
    /// Between consecutive generated tokens of a request.
    pub inter_token_latency: Histogram,
    /// With KV-cache events on: tokens per block and the blocks the prefix cache holds.
    kv_blocks: std::sync::Mutex<Option<(usize, Vec<u64>)>>,
    /// For a decoder that takes LoRA adapters: which adapters run and wait.
    lora: std::sync::Mutex<Option<LoraUse>>,
}

/// The LoRA adapters a model's sequences use, as vLLM's `vllm:lora_requests_info` tells them
/// (what the Gateway API Inference Extension's endpoint picker routes adapters by).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraUse {
    /// Adapters loaded at most (`max_loras`).
    pub max: usize,
    /// Adapters of the running sequences, comma-separated, sorted.
    pub running: String,
    /// Adapters of the sequences waiting, comma-separated, sorted.
    pub waiting: String,
    /// Unix seconds of the last change (the gauge's value, as vLLM sets it).
    pub since: f64,
}

impl GenerationStats {
    /// Counters for a cache of `capacity` tokens of `bytes_per_token` each.
    pub fn new(capacity: u64, bytes_per_token: u64, prefix_cache_enabled: bool) -> Self {
        Self {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prefix_cache_tokens: AtomicI64::new(0),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            finished_cancelled: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            spec_drafts: AtomicU64::new(0),
            spec_draft_tokens: AtomicU64::new(0),
            spec_accepted_tokens: AtomicU64::new(0),
            running: AtomicI64::new(0),
            waiting: AtomicI64::new(0),
            cache_used_tokens: AtomicI64::new(0),
            cache_capacity_tokens: capacity,
            bytes_per_token,
            prefix_cache_enabled,
            time_to_first_token: Histogram::new(TTFT_BOUNDS),
            inter_token_latency: Histogram::new(ITL_BOUNDS),
            kv_blocks: std::sync::Mutex::new(None),
            lora: std::sync::Mutex::new(None),
        }
    }

    /// Reports LoRA adapters: at most `max` loaded, none in use yet.
    pub fn with_lora(self, max: usize) -> Self {
        *self.lock_lora() = Some(LoraUse {
            max,
            since: unix_now(),
            ..LoraUse::default()
        });
        self
    }

    /// The adapters in use, for a decoder that takes them.
    pub fn lock_lora(&self) -> std::sync::MutexGuard<'_, Option<LoraUse>> {
        self.lora
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the adapters the running and the waiting sequences use (names sorted, each
    /// once), if they changed.
    pub fn set_lora_use(&self, running: String, waiting: String) {
        if let Some(usage) = self.lock_lora().as_mut() {
            if usage.running != running || usage.waiting != waiting {
                usage.running = running;
                usage.waiting = waiting;
                usage.since = unix_now();
            }
        }
    }

    /// With KV-cache events on: tokens per block and the blocks the prefix cache holds
    /// (their hashes, increasing), as the events have told them.
    pub fn lock_kv_blocks(&self) -> std::sync::MutexGuard<'_, Option<(usize, Vec<u64>)>> {
        self.kv_blocks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The share of the cache in use, 0 to 1.
    pub fn cache_usage(&self) -> f64 {
        if self.cache_capacity_tokens == 0 {
            return 0.0;
        }
        self.cache_used_tokens.load(Relaxed).max(0) as f64 / self.cache_capacity_tokens as f64
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
