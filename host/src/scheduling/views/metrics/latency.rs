//! The latency histogram and summaries models record (`--metrics-config`), as Prometheus
//! families under Triton's names and help texts.

use prometheus::proto::{
    Bucket, Histogram, LabelPair, Metric, MetricFamily, MetricType, Quantile, Summary,
};

use crate::scheduling::{
    latency::{self, Summaries},
    server::Server,
};

/// Triton's summary families: name, help, and which of a model's summaries it reports.
type Pick = fn(&Summaries) -> Option<&latency::Summary>;
const SUMMARIES: [(&str, &str, Pick); 7] = [
    (
        "nv_inference_request_summary_us",
        "Summary of inference request duration in microseconds (includes cached requests)",
        |s| s.request.as_ref(),
    ),
    (
        "nv_inference_queue_summary_us",
        "Summary of inference queuing duration in microseconds (includes cached requests)",
        |s| Some(&s.queue),
    ),
    (
        "nv_inference_compute_input_summary_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
        |s| Some(&s.compute_input),
    ),
    (
        "nv_inference_compute_infer_summary_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
        |s| Some(&s.compute_infer),
    ),
    (
        "nv_inference_compute_output_summary_us",
        "Cumulative inference compute output duration in microseconds (does not include cached \
         requests)",
        |s| Some(&s.compute_output),
    ),
    (
        "nv_cache_hit_summary_per_model",
        "Summary of cache hit counts/durations per model, in microseconds.",
        |s| s.cache_hit.as_ref(),
    ),
    (
        "nv_cache_miss_summary_per_model",
        "Summary of cache miss counts/durations per model, in microseconds.",
        |s| s.cache_miss.as_ref(),
    ),
];

/// The first-response histogram and the summaries of every loaded model that records them.
pub fn families(server: &Server) -> Vec<MetricFamily> {
    let models = server.models().loaded();
    let labels = |name: &str, version: i64| {
        [("model", name.to_owned()), ("version", version.to_string())]
            .into_iter()
            .map(|(k, v)| {
                let mut pair = LabelPair::default();
                pair.set_name(k.to_owned());
                pair.set_value(v);
                pair
            })
            .collect::<Vec<_>>()
    };
    let mut histograms = Vec::new();
    for m in &models {
        let Some(h) = &m.stats.latency.first_response else {
            continue;
        };
        let (bounds, count, sum) = h.snapshot();
        let mut histogram = Histogram::default();
        histogram.set_sample_count(count);
        histogram.set_sample_sum(sum);
        histogram.set_bucket(
            bounds
                .into_iter()
                .map(|(bound, n)| {
                    let mut b = Bucket::default();
                    b.set_upper_bound(bound);
                    b.set_cumulative_count(n);
                    b
                })
                .collect(),
        );
        let mut metric = Metric::from_label(labels(&m.name, m.version));
        metric.set_histogram(histogram);
        histograms.push(metric);
    }
    let mut families = vec![family(
        latency::FIRST_RESPONSE_HISTOGRAM,
        "Duration from request to first response in milliseconds",
        MetricType::HISTOGRAM,
        histograms,
    )];
    for (name, help, pick) in SUMMARIES {
        let mut metrics = Vec::new();
        for m in &models {
            let Some(s) = m.stats.latency.summaries.as_ref().and_then(pick) else {
                continue;
            };
            let (quantiles, count, sum) = s.snapshot();
            let mut summary = Summary::default();
            summary.set_sample_count(count);
            summary.set_sample_sum(sum);
            summary.set_quantile(
                quantiles
                    .into_iter()
                    .map(|(q, v)| {
                        let mut quantile = Quantile::default();
                        quantile.set_quantile(q);
                        quantile.set_value(v);
                        quantile
                    })
                    .collect(),
            );
            let mut metric = Metric::from_label(labels(&m.name, m.version));
            metric.set_summary(summary);
            metrics.push(metric);
        }
        families.push(family(name, help, MetricType::SUMMARY, metrics));
    }
    // Families without a model that records them are left out, as on Triton.
    families.retain(|f| !f.get_metric().is_empty());
    families
}

fn family(name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) -> MetricFamily {
    let mut f = MetricFamily::default();
    f.set_name(name.to_owned());
    f.set_help(help.to_owned());
    f.set_field_type(kind);
    f.set_metric(metrics);
    f
}
