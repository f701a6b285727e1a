//! Metrics of generation models under the names vLLM (and Triton's vLLM backend) use, labelled
//! by model and version: tokens, time to first token, inter-token latency, the running batch,
//! the requests waiting for room in the key/value cache, and how full that cache is.

use std::{fmt::Write, sync::atomic::Ordering::Relaxed};

use crate::{runtime::generation::stats::Histogram, scheduling::server::Server};

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
    let mut family = |name: &str, kind: &str, help: &str, lines: &mut dyn FnMut(&mut String)| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        lines(&mut out);
    };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in the running batch.",
        &mut |o| {
            for (m, v, s) in &models {
                let _ = writeln!(
                    o,
                    "vllm:num_requests_running{{{}}} {}",
                    labels(m, *v),
                    s.running.load(Relaxed)
                );
            }
        },
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting for room in the KV cache.",
        &mut |o| {
            for (m, v, s) in &models {
                let _ = writeln!(
                    o,
                    "vllm:num_requests_waiting{{{}}} {}",
                    labels(m, *v),
                    s.waiting.load(Relaxed)
                );
            }
        },
    );
    family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &mut |o| {
            for (m, v, s) in &models {
                let _ = writeln!(
                    o,
                    "vllm:kv_cache_usage_perc{{{}}} {}",
                    labels(m, *v),
                    s.cache_usage()
                );
            }
        },
    );
    family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &mut |o| {
            for (m, v, s) in &models {
                let _ = writeln!(
                    o,
                    "vllm:prompt_tokens_total{{{}}} {}",
                    labels(m, *v),
                    s.prompt_tokens.load(Relaxed)
                );
            }
        },
    );
    family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &mut |o| {
            for (m, v, s) in &models {
                let _ = writeln!(
                    o,
                    "vllm:generation_tokens_total{{{}}} {}",
                    labels(m, *v),
                    s.generation_tokens.load(Relaxed)
                );
            }
        },
    );
    family(
        "vllm:request_success_total",
        "counter",
        "Count of finished requests by finish reason (abort: the client went away).",
        &mut |o| {
            for (m, v, s) in &models {
                for (reason, n) in [
                    ("stop", &s.finished_stop),
                    ("length", &s.finished_length),
                    ("abort", &s.finished_cancelled),
                ] {
                    let _ = writeln!(
                        o,
                        "vllm:request_success_total{{{},finished_reason=\"{reason}\"}} {}",
                        labels(m, *v),
                        n.load(Relaxed)
                    );
                }
            }
        },
    );
    family(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        &mut |o| {
            for (m, v, s) in &models {
                histogram(
                    o,
                    "vllm:time_to_first_token_seconds",
                    &labels(m, *v),
                    &s.time_to_first_token,
                );
            }
        },
    );
    family(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        &mut |o| {
            for (m, v, s) in &models {
                histogram(
                    o,
                    "vllm:inter_token_latency_seconds",
                    &labels(m, *v),
                    &s.inter_token_latency,
                );
            }
        },
    );
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
