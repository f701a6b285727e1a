//! Metrics of generation models under the names vLLM (and Triton's vLLM backend) use, labelled
//! by model and version: tokens, time to first token, inter-token latency, the running batch,
//! the requests waiting for room in the key/value cache, how full that cache is, and how often
//! prompts' prefixes were found in the prefix cache.

use std::{fmt::Write, sync::atomic::Ordering::Relaxed};

use crate::{
    runtime::generation::stats::{GenerationStats, Histogram},
    scheduling::server::Server,
};

/// The text-format lines of every loaded generation model's metrics (empty without one).
pub fn render(server: &Server) -> String {
    let models: Vec<_> = server
        .models()
        .loaded()
        .into_iter()
        .filter_map(|m| Some((m.name.clone(), m.version, m.generation.clone()?)))
        .collect();
    if models.is_empty() {
        return String::new();
    }
    let mut out = String::new();
    let labels =
        |name: &str, version: i64| format!("model=\"{}\",version=\"{version}\"", escape(name));
    type Read = fn(&GenerationStats) -> f64;
    let scalars: [(&str, &str, &str, Read); 12] = [
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
    for (name, kind, help, read) in scalars {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (m, v, s) in &models {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(m, *v), read(s));
        }
    }
    // The cache's shape as vLLM reports it (the endpoint pickers of the Gateway API
    // Inference Extension read the block size and count from its labels): blocks of the KV
    // events' size (vLLM's default 16 without them).
    let name = "vllm:cache_config_info";
    let _ = writeln!(
        out,
        "# HELP {name} Information of the KV cache (blocks of block_size tokens).\n# TYPE {name} gauge"
    );
    for (m, v, s) in &models {
        let block_size = s.lock_kv_blocks().as_ref().map_or(
            crate::runtime::generation::kv::events::DEFAULT_BLOCK_SIZE,
            |b| b.0,
        );
        let _ = writeln!(
            out,
            "{name}{{{},block_size=\"{block_size}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\"}} 1",
            labels(m, *v),
            s.cache_capacity_tokens / block_size as u64,
            if s.prefix_cache_enabled { "True" } else { "False" },
        );
    }
    // The adapters in use, as vLLM reports them (its value: when they last changed).
    let name = "vllm:lora_requests_info";
    let _ = writeln!(
        out,
        "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge"
    );
    for (m, v, s) in &models {
        if let Some(usage) = s.lock_lora().clone() {
            let _ = writeln!(
                out,
                "{name}{{{},max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
                labels(m, *v),
                usage.max,
                escape(&usage.running),
                escape(&usage.waiting),
                usage.since
            );
        }
    }
    let name = "vllm:request_success_total";
    let _ = writeln!(out, "# HELP {name} Count of finished requests by finish reason (abort: the client went away).\n# TYPE {name} counter");
    for (m, v, s) in &models {
        for (reason, n) in [
            ("stop", &s.finished_stop),
            ("length", &s.finished_length),
            ("abort", &s.finished_cancelled),
        ] {
            let _ = writeln!(
                out,
                "{name}{{{},finished_reason=\"{reason}\"}} {}",
                labels(m, *v),
                n.load(Relaxed)
            );
        }
    }
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
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (m, v, s) in &models {
            histogram(&mut out, name, &labels(m, *v), read(s));
        }
    }
    out
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

fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
