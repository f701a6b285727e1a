//! A generation model's metrics under the names vLLM (and Triton's vLLM backend) use: tokens,
//! time to first token, inter-token latency, the running batch, the requests waiting for room
//! in the key/value cache, how full that cache is, how often prompts' prefixes were found in
//! the prefix cache, speculation's drafts, the adapters in use; and the prefix cache's blocks
//! as its KV-cache events told them.

use std::{fmt::Write, sync::atomic::Ordering::Relaxed};

use super::stats::{GenerationStats, Histogram};
use crate::runtime::capabilities::{
    escape_label, MetricFamilies, PrefixCacheBlocks, ReportsMetrics,
};

/// Reads one of the numbers below.
type Read = fn(&GenerationStats) -> f64;

/// The gauges and counters that are one number per version: name, type, help, how to read it.
const SCALARS: [(&str, &str, &str, Read); 12] = [
    (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in the running batch.",
        |s| s.running.load(Relaxed) as f64,
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting for room in the KV cache.",
        |s| s.waiting.load(Relaxed) as f64,
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        GenerationStats::cache_usage,
    ),
    (
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        |s| s.prompt_tokens.load(Relaxed) as f64,
    ),
    (
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        |s| s.generation_tokens.load(Relaxed) as f64,
    ),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        |s| s.prefix_cache_queries.load(Relaxed) as f64,
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        |s| s.prefix_cache_hits.load(Relaxed) as f64,
    ),
    (
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemptions (a sequence taken out of the batch for a party \
     below its share of the rows).",
        |s| s.preemptions.load(Relaxed) as f64,
    ),
    (
        "vllm:spec_decode_num_drafts_total",
        "counter",
        "Number of spec decoding drafts.",
        |s| s.spec_drafts.load(Relaxed) as f64,
    ),
    (
        "vllm:spec_decode_num_draft_tokens_total",
        "counter",
        "Number of draft tokens.",
        |s| s.spec_draft_tokens.load(Relaxed) as f64,
    ),
    (
        "vllm:spec_decode_num_accepted_tokens_total",
        "counter",
        "Number of accepted tokens.",
        |s| s.spec_accepted_tokens.load(Relaxed) as f64,
    ),
    (
        "wasmtron:prefix_cache_tokens",
        "gauge",
        "Tokens of recent prompts held for prefix caching.",
        |s| s.prefix_cache_tokens.load(Relaxed) as f64,
    ),
];

impl ReportsMetrics for GenerationStats {
    fn report(&self, labels: &str, out: &mut MetricFamilies) {
        for (name, kind, help, read) in SCALARS {
            out.sample(name, kind, help, labels, read(self));
        }
        self.report_cache_config(labels, out);
        self.report_adapters(labels, out);
        self.report_finished(labels, out);
        self.report_latencies(labels, out);
    }
}

impl GenerationStats {
    /// The cache's shape as vLLM reports it (the endpoint pickers of the Gateway API
    /// Inference Extension read the block size and count from its labels).
    fn report_cache_config(&self, labels: &str, out: &mut MetricFamilies) {
        let s = self;
        let name = "vllm:cache_config_info";
        let block_size = s
            .lock_kv_blocks()
            .as_ref()
            .map_or(super::kv::events::DEFAULT_BLOCK_SIZE, |b| b.0);
        let _ = writeln!(
    out.family(name, "gauge", "Information of the KV cache (blocks of block_size tokens)."),
    "{name}{{{labels},block_size=\"{block_size}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\"}} 1",
    s.cache_capacity_tokens / block_size as u64,
    if s.prefix_cache_enabled { "True" } else { "False" },
);
        // The adapters in use, as vLLM reports them (its value: when they last changed).
    }

    /// The adapters in use, as vLLM reports them (its value: when they last changed).
    fn report_adapters(&self, labels: &str, out: &mut MetricFamilies) {
        let s = self;
        let name = "vllm:lora_requests_info";
        if let Some(usage) = s.lock_lora().clone() {
            let _ = writeln!(
        out.family(name, "gauge", "Running stats on lora requests."),
        "{name}{{{labels},max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
        usage.max,
        escape_label(&usage.running),
        escape_label(&usage.waiting),
        usage.since
    );
        }
    }

    /// Finished requests by finish reason.
    fn report_finished(&self, labels: &str, out: &mut MetricFamilies) {
        let s = self;
        let name = "vllm:request_success_total";
        for (reason, n) in [
            ("stop", &s.finished_stop),
            ("length", &s.finished_length),
            ("abort", &s.finished_cancelled),
        ] {
            out.sample(
                name,
                "counter",
                "Count of finished requests by finish reason (abort: the client went away).",
                &format!("{labels},finished_reason=\"{reason}\""),
                n.load(Relaxed),
            );
        }
    }

    /// Time to first token and inter-token latency, as histograms.
    fn report_latencies(&self, labels: &str, out: &mut MetricFamilies) {
        let s = self;
        type ReadHistogram = fn(&GenerationStats) -> &Histogram;
        let histograms: [(&str, &str, ReadHistogram); 2] = [
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                |s| &s.time_to_first_token,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                |s| &s.inter_token_latency,
            ),
        ];
        for (name, help, read) in histograms {
            histogram(out.family(name, "histogram", help), name, labels, read(s));
        }
    }
}

impl PrefixCacheBlocks for GenerationStats {
    fn blocks(&self) -> Option<(usize, Vec<u64>)> {
        self.lock_kv_blocks().clone()
    }
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let (buckets, sum, count) = h.snapshot();
    for (bound, n) in buckets {
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {n}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
    let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
}
