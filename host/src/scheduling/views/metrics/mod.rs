//! The server's metrics in the Prometheus text format, with Triton's names and labels,
//! rendered when they are read from the same counters that feed the statistics extension:
//! the models' ([`render`]), the tenants' ([`render_tenants`]), the host's CPU ([`cpu`]) and
//! GPUs ([`gpu`]), latency summaries ([`latency`]) and the families a backend reports of its
//! own models ([`backend_families`]: a generation model's vLLM metrics).

pub mod cpu;
pub mod gpu;
pub mod latency;

use std::sync::atomic::Ordering::Relaxed;

use prometheus::{
    core::Collector, proto::MetricFamily, Encoder, GaugeVec, IntCounterVec, IntGaugeVec, Opts,
    TextEncoder,
};

use crate::{
    scheduling::{server::Server, stats::FailureReason},
    tenancy::Tenancy,
};

/// Everything the metrics endpoint serves: the models' metrics, the host's CPU (`cpu`) and
/// GPUs (`gpu`, `cuda` builds; NVML's calls block, so call this off the async runtime when
/// `gpu` is set), Python models' own families (under the names they chose), and with
/// `tenancy` each tenant's.
pub fn text(server: &Server, tenancy: Option<&Tenancy>, cpu: bool, gpu: bool) -> String {
    let mut text = render(server);
    if cpu {
        text.push_str(&self::cpu::render());
    }
    if gpu {
        text.push_str(&self::gpu::render());
    }
    text.push_str(&crate::runtime::process_metrics());
    if let Some(tenancy) = tenancy {
        text.push_str(&render_tenants(tenancy));
    }
    text
}

/// Each tenant's inference requests by model and outcome, and what it has in flight.
pub fn render_tenants(tenancy: &Tenancy) -> String {
    let tm = ["tenant", "model"];
    let (Some(success), Some(failure), Some(duration), Ok(in_flight)) = (
        counter("wasmtron_tenant_request_success", "Successful inference requests per tenant and model", &tm),
        counter(
            "wasmtron_tenant_request_failure",
            "Failed inference requests per tenant, model (empty: a name the tenant may not use or that does not exist) and reason",
            &["tenant", "model", "reason"],
        ),
        counter("wasmtron_tenant_request_duration_us", "Cumulative duration of successful inference requests per tenant and model, in microseconds", &tm),
        IntGaugeVec::new(
            Opts::new("wasmtron_tenant_requests_in_flight", "Inference requests a tenant has in the server now"),
            &["tenant"],
        ),
    ) else {
        return String::new();
    };
    for usage in tenancy.usage() {
        let tenant = usage.tenant.as_str();
        in_flight
            .with_label_values(&[tenant])
            .set(i64::try_from(usage.in_flight).unwrap_or(i64::MAX));
        for (model, u) in &usage.models {
            let l = [tenant, model.as_str()];
            success.with_label_values(&l).inc_by(u.success);
            duration.with_label_values(&l).inc_by(u.success_us);
            for (reason, n) in &u.failures {
                failure
                    .with_label_values(&[tenant, model.as_str(), reason])
                    .inc_by(*n);
            }
        }
    }
    let mut families = Vec::new();
    for c in [&success, &failure, &duration] {
        families.extend(c.collect());
    }
    families.extend(in_flight.collect());
    encode(families)
}

fn counter(name: &str, help: &str, labels: &[&str]) -> Option<IntCounterVec> {
    IntCounterVec::new(Opts::new(name, help), labels).ok()
}

/// Renders every metric in the Prometheus text format.
pub fn render(server: &Server) -> String {
    let mut text = encode(collect(server));
    text.push_str(&backend_families(server));
    text
}

/// The metric families backends report of the versions loaded now (those with the
/// [`ReportsMetrics`](crate::runtime::capabilities::ReportsMetrics) capability), each family
/// once with every version's samples, labelled by model and version.
pub fn backend_families(server: &Server) -> String {
    use crate::runtime::capabilities::{escape_label, MetricFamilies};
    let mut families = MetricFamilies::default();
    for version in server.models().loaded() {
        if let Some(metrics) = &version.capabilities.metrics {
            let labels = format!(
                "model=\"{}\",version=\"{}\"",
                escape_label(&version.name),
                version.version
            );
            metrics.report(&labels, &mut families);
        }
    }
    families.render()
}

fn encode(mut families: Vec<MetricFamily>) -> String {
    // With no model loaded the vectors are empty, which the encoder refuses.
    families.retain(|f| !f.get_metric().is_empty());
    let mut out = Vec::new();
    if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
        tracing::error!("cannot render metrics: {e}");
        return String::new();
    }
    String::from_utf8(out).unwrap_or_default()
}

fn collect(server: &Server) -> Vec<MetricFamily> {
    let mv = ["model", "version"];
    let (Some(success), Some(failure), Some(count), Some(exec), Some(req_us), Some(queue_us), Some(in_us), Some(infer_us), Some(out_us)) = (
        counter("nv_inference_request_success", "Number of successful inference requests, all batch sizes", &mv),
        counter("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", &["model", "version", "reason"]),
        counter("nv_inference_count", "Number of inferences performed (does not include cached requests)", &mv),
        counter("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)", &mv),
        counter("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (includes cached requests)", &mv),
        counter("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds (includes cached requests)", &mv),
        counter("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds (does not include cached requests)", &mv),
        counter("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds (does not include cached requests)", &mv),
        counter("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds (does not include cached requests)", &mv),
    ) else {
        return vec![];
    };
    let Ok(pending) = IntGaugeVec::new(
        Opts::new(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
        ),
        &mv,
    ) else {
        return vec![];
    };
    let (Some(restarts), Ok(healthy)) = (
        counter(
            "wasmtron_instance_restarts",
            "Model instances replaced after a crash (trap, deadline, memory cap)",
            &mv,
        ),
        IntGaugeVec::new(
            Opts::new(
                "wasmtron_model_healthy",
                "1 while the model's instances are not crash-looping",
            ),
            &mv,
        ),
    ) else {
        return vec![];
    };
    let Ok(load) = GaugeVec::new(
        Opts::new("nv_model_load_duration_secs", "Model load time in seconds"),
        &mv,
    ) else {
        return vec![];
    };
    let (Some(padded), Ok(warmup)) = (
        counter(
            "wasmtron_inference_padded_rows",
            "Rows of zeros executions ran with to reach a batch bucket (never answered, not counted as inferences)",
            &mv,
        ),
        GaugeVec::new(
            Opts::new(
                "wasmtron_model_warmup_duration_secs",
                "Time the model's warm-up took at load, in seconds (part of the load time)",
            ),
            &mv,
        ),
    ) else {
        return vec![];
    };
    for m in server.models().loaded() {
        let version = m.version.to_string();
        let l = [m.name.as_str(), version.as_str()];
        let s = &m.stats;
        success.with_label_values(&l).inc_by(s.success.count());
        for reason in FailureReason::ALL {
            failure
                .with_label_values(&[m.name.as_str(), version.as_str(), reason.label()])
                .inc_by(s.failures(reason));
        }
        count
            .with_label_values(&l)
            .inc_by(s.inference_count.load(Relaxed));
        exec.with_label_values(&l)
            .inc_by(s.execution_count.load(Relaxed));
        req_us.with_label_values(&l).inc_by(s.success.ns() / 1000);
        queue_us.with_label_values(&l).inc_by(s.queue.ns() / 1000);
        in_us
            .with_label_values(&l)
            .inc_by(s.compute_input.ns() / 1000);
        infer_us
            .with_label_values(&l)
            .inc_by(s.compute_infer.ns() / 1000);
        out_us
            .with_label_values(&l)
            .inc_by(s.compute_output.ns() / 1000);
        pending.with_label_values(&l).set(s.pending.load(Relaxed));
        load.with_label_values(&l)
            .set(m.load_duration.as_secs_f64());
        padded
            .with_label_values(&l)
            .inc_by(s.padded_rows.load(Relaxed));
        warmup.with_label_values(&l).set(s.warmup.ns() as f64 / 1e9);
        restarts.with_label_values(&l).inc_by(m.health.restarts());
        healthy
            .with_label_values(&l)
            .set(i64::from(m.health.is_healthy()));
    }
    let mut families = Vec::new();
    for c in [&success, &failure, &count, &exec] {
        families.extend(c.collect());
    }
    // `--metrics-config counter_latencies=false` leaves the duration counters out, as Triton.
    let counters = server.latency_metrics().counters;
    if counters {
        for c in [&req_us, &queue_us, &in_us, &infer_us, &out_us] {
            families.extend(c.collect());
        }
    }
    families.extend(pending.collect());
    families.extend(restarts.collect());
    families.extend(healthy.collect());
    families.extend(load.collect());
    families.extend(padded.collect());
    families.extend(warmup.collect());
    if server.response_cache().is_some() {
        families.extend(cache_metrics(server, counters));
    }
    families.extend(latency::families(server));
    add_metric_tags(server, &mut families);
    families
}

/// Triton's per-model response cache metrics (only with a cache, as on Triton); the duration
/// counters only with `counters` (`counter_latencies`).
fn cache_metrics(server: &Server, counters: bool) -> Vec<MetricFamily> {
    let mv = ["model", "version"];
    let (Some(hits), Some(misses), Some(hit_us), Some(miss_us)) = (
        counter(
            "nv_cache_num_hits_per_model",
            "Number of cache hits per model",
            &mv,
        ),
        counter(
            "nv_cache_num_misses_per_model",
            "Number of cache misses per model",
            &mv,
        ),
        counter(
            "nv_cache_hit_duration_per_model",
            "Total cache hit duration per model, in microseconds",
            &mv,
        ),
        counter(
            "nv_cache_miss_duration_per_model",
            "Total cache miss (insert + lookup) duration per model, in microseconds",
            &mv,
        ),
    ) else {
        return vec![];
    };
    for m in server.models().loaded() {
        if !crate::runtime::caches_responses(&m.config) {
            continue;
        }
        let version = m.version.to_string();
        let l = [m.name.as_str(), version.as_str()];
        hits.with_label_values(&l).inc_by(m.stats.cache_hit.count());
        misses
            .with_label_values(&l)
            .inc_by(m.stats.cache_miss.count());
        hit_us
            .with_label_values(&l)
            .inc_by(m.stats.cache_hit.ns() / 1000);
        miss_us
            .with_label_values(&l)
            .inc_by(m.stats.cache_miss.ns() / 1000);
    }
    let mut kept = vec![hits, misses];
    if counters {
        kept.extend([hit_us, miss_us]);
    }
    kept.iter().flat_map(|c| c.collect()).collect()
}

/// A model's `metric_tags` as extra labels `_<key>` on each of its metrics, as Triton's
/// reporter names them (keys checked at load).
fn add_metric_tags(server: &Server, families: &mut [MetricFamily]) {
    let tags: std::collections::HashMap<String, Vec<(String, String)>> = server
        .models()
        .loaded()
        .iter()
        .filter(|m| !m.config.metric_tags.is_empty())
        .map(|m| {
            let mut pairs: Vec<(String, String)> = m
                .config
                .metric_tags
                .iter()
                .map(|(k, v)| (format!("_{k}"), v.clone()))
                .collect();
            pairs.sort();
            (m.name.clone(), pairs)
        })
        .collect();
    if tags.is_empty() {
        return;
    }
    for family in families.iter_mut() {
        for metric in family.mut_metric() {
            let model = metric
                .get_label()
                .iter()
                .find(|l| l.name() == "model")
                .map(|l| l.value().to_owned());
            let Some(pairs) = model.and_then(|m| tags.get(&m)) else {
                continue;
            };
            let mut labels = metric.take_label();
            for (name, value) in pairs {
                let mut pair = prometheus::proto::LabelPair::default();
                pair.set_name(name.clone());
                pair.set_value(value.clone());
                labels.push(pair);
            }
            metric.set_label(labels);
        }
    }
}
