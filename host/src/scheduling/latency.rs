//! The latency metrics Triton's `--metrics-config` chooses: cumulative counters (on by default,
//! `counter_latencies`), the first-response histogram (`histogram_latencies=true`, its buckets
//! per model from `model_metrics`), and summaries with quantiles (`summary_latencies=true`,
//! `summary_quantiles`). As Triton's metric reporter: histogram values are whole milliseconds
//! from a request's start to its first response; summaries are in microseconds, their
//! quantiles over the last minute, their count and sum since the start.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Mutex,
    },
    time::{Duration, Instant},
};

use crate::proto::inference::{model_metrics::metric_control::MetricOptions, ModelConfig};

/// Triton's name for the first-response histogram, the one `model_metrics` may tune.
pub const FIRST_RESPONSE_HISTOGRAM: &str = "nv_inference_first_response_histogram_ms";

/// Triton's default buckets for the first-response histogram, in milliseconds.
pub const DEFAULT_FIRST_RESPONSE_BUCKETS: [f64; 4] = [100.0, 500.0, 2000.0, 5000.0];

/// Triton's default summary quantiles, as (quantile, allowed error).
pub const DEFAULT_QUANTILES: [(f64, f64); 5] = [
    (0.5, 0.05),
    (0.9, 0.01),
    (0.95, 0.001),
    (0.99, 0.001),
    (0.999, 0.001),
];

/// How long a summary's quantiles look back (prometheus-cpp's default `max_age`).
const SUMMARY_WINDOW: Duration = Duration::from_secs(60);

/// The most observations a summary keeps for its quantiles; past it the oldest go first, so
/// a flood of requests cannot grow a model's memory.
const SUMMARY_CAPACITY: usize = 8192;

/// The server's `--metrics-config` settings.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyMetrics {
    /// `counter_latencies` (default true): the `nv_inference_*_duration_us` counters.
    pub counters: bool,
    /// `histogram_latencies` (default false): `nv_inference_first_response_histogram_ms`.
    pub histograms: bool,
    /// `summary_latencies` (default false): the `nv_inference_*_summary_us` summaries.
    pub summaries: bool,
    /// `summary_quantiles`: (quantile, error) pairs.
    pub quantiles: Vec<(f64, f64)>,
}

impl Default for LatencyMetrics {
    fn default() -> Self {
        Self {
            counters: true,
            histograms: false,
            summaries: false,
            quantiles: DEFAULT_QUANTILES.to_vec(),
        }
    }
}

impl LatencyMetrics {
    /// Applies one `--metrics-config` value (`<setting>=<value>`); an unknown setting or a
    /// value that does not parse is refused with the reason.
    pub fn apply(&mut self, value: &str) -> Result<(), String> {
        let Some((key, v)) = value.split_once('=') else {
            return Err("expected <setting>=<value>".into());
        };
        let flag = || match v.trim() {
            "true" | "1" | "on" => Ok(true),
            "false" | "0" | "off" => Ok(false),
            other => Err(format!("'{key}' takes true or false, not '{other}'")),
        };
        match key.trim() {
            "counter_latencies" => self.counters = flag()?,
            "histogram_latencies" => self.histograms = flag()?,
            "summary_latencies" => self.summaries = flag()?,
            "summary_quantiles" => self.quantiles = parse_quantiles(v)?,
            other => {
                return Err(format!(
                    "unknown setting '{other}' (counter_latencies, histogram_latencies, \
                     summary_latencies, summary_quantiles)"
                ))
            }
        }
        Ok(())
    }
}

/// `0.5:0.05,0.9:0.01`: quantiles in (0, 1] with their errors.
fn parse_quantiles(text: &str) -> Result<Vec<(f64, f64)>, String> {
    let mut pairs = Vec::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let parsed = pair.split_once(':').and_then(|(q, e)| {
            let (q, e) = (q.trim().parse::<f64>().ok()?, e.trim().parse::<f64>().ok()?);
            (q > 0.0 && q <= 1.0 && (0.0..1.0).contains(&e)).then_some((q, e))
        });
        match parsed {
            Some(p) => pairs.push(p),
            None => {
                return Err(format!(
                    "summary_quantiles: '{pair}' is not <quantile>:<error> with a quantile in \
                     (0, 1]"
                ))
            }
        }
    }
    if pairs.is_empty() {
        return Err("summary_quantiles names no quantile".into());
    }
    Ok(pairs)
}

/// A histogram of observations: counts per upper bound, plus the total count and sum.
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    /// One count per bound, plus the observations above every bound.
    counts: Vec<AtomicU64>,
    sum: Mutex<f64>,
}

impl Histogram {
    /// A histogram with these upper bounds (ascending).
    pub fn new(bounds: Vec<f64>) -> Self {
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self {
            bounds,
            counts,
            sum: Mutex::new(0.0),
        }
    }

    /// Records one value.
    pub fn observe(&self, value: f64) {
        let slot = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[slot].fetch_add(1, Relaxed);
        if let Ok(mut sum) = self.sum.lock() {
            *sum += value;
        }
    }

    /// The upper bounds with the cumulative count at or under each, the total count and
    /// the sum.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, u64, f64) {
        let mut running = 0;
        let mut buckets = Vec::with_capacity(self.bounds.len());
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            running += count.load(Relaxed);
            buckets.push((*bound, running));
        }
        let total = running + self.counts.last().map_or(0, |c| c.load(Relaxed));
        let sum = self.sum.lock().map_or(0.0, |s| *s);
        (buckets, total, sum)
    }
}

/// A summary: quantiles over the last minute's observations, count and sum since the start.
#[derive(Debug)]
pub struct Summary {
    quantiles: Vec<(f64, f64)>,
    state: Mutex<SummaryState>,
}

#[derive(Debug, Default)]
struct SummaryState {
    recent: VecDeque<(Instant, f64)>,
    count: u64,
    sum: f64,
}

impl Summary {
    /// A summary reporting these quantiles.
    pub fn new(quantiles: Vec<(f64, f64)>) -> Self {
        Self {
            quantiles,
            state: Mutex::new(SummaryState::default()),
        }
    }

    /// Records one value.
    pub fn observe(&self, value: f64) {
        let Ok(mut s) = self.state.lock() else {
            return;
        };
        s.count += 1;
        s.sum += value;
        if s.recent.len() == SUMMARY_CAPACITY {
            s.recent.pop_front();
        }
        s.recent.push_back((Instant::now(), value));
    }

    /// Each quantile's value over the window (NaN with no recent observation, as Prometheus
    /// clients report it), the total count and the sum.
    pub fn snapshot(&self) -> (Vec<(f64, f64)>, u64, f64) {
        let Ok(mut s) = self.state.lock() else {
            return (Vec::new(), 0, 0.0);
        };
        let now = Instant::now();
        while s
            .recent
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > SUMMARY_WINDOW)
        {
            s.recent.pop_front();
        }
        let mut values: Vec<f64> = s.recent.iter().map(|(_, v)| *v).collect();
        values.sort_by(f64::total_cmp);
        let quantiles = self
            .quantiles
            .iter()
            .map(|&(q, _)| {
                let value = if values.is_empty() {
                    f64::NAN
                } else {
                    // The smallest value with at least q of the observations at or under it.
                    let rank = (q * values.len() as f64).ceil() as usize;
                    values[rank.clamp(1, values.len()) - 1]
                };
                (q, value)
            })
            .collect();
        (quantiles, s.count, s.sum)
    }
}

/// The latency summaries of one model version (`summary_latencies=true`).
#[derive(Debug)]
pub struct Summaries {
    /// Whole request durations (left out for models with the response cache, as on Triton).
    pub request: Option<Summary>,
    /// Queue durations.
    pub queue: Summary,
    /// Input preparation.
    pub compute_input: Summary,
    /// The engine's time.
    pub compute_infer: Summary,
    /// Output collection.
    pub compute_output: Summary,
    /// Cache lookups that hit (models with the response cache).
    pub cache_hit: Option<Summary>,
    /// Cache lookups that missed and the insertions after them.
    pub cache_miss: Option<Summary>,
}

/// The latency distributions one model version records: what the server's settings and the
/// model's `model_metrics` turn on.
#[derive(Debug, Default)]
pub struct ModelLatency {
    /// `nv_inference_first_response_histogram_ms`.
    pub first_response: Option<Histogram>,
    /// The `nv_inference_*_summary_us` summaries.
    pub summaries: Option<Summaries>,
    /// Whether the model answers 0..N times (its first response is timed as it is sent,
    /// not when the request ends).
    pub decoupled: bool,
}

impl ModelLatency {
    /// What `config` records under `settings`; a `model_metrics` entry this server cannot
    /// honour is refused naming the field. Returns the distributions and lines to log
    /// (families Triton does not let `model_metrics` tune, which it also only logs).
    pub fn for_model(
        config: &ModelConfig,
        settings: &LatencyMetrics,
        caches_responses: bool,
    ) -> Result<(Self, Vec<String>), String> {
        let mut buckets = DEFAULT_FIRST_RESPONSE_BUCKETS.to_vec();
        let mut notes = Vec::new();
        let controls = config.model_metrics.iter().flat_map(|m| &m.metric_control);
        for (i, control) in controls.enumerate() {
            let family = control
                .metric_identifier
                .as_ref()
                .map_or("", |id| id.family.as_str());
            if family != FIRST_RESPONSE_HISTOGRAM {
                notes.push(format!(
                    "field 'model_metrics.metric_control[{i}].metric_identifier.family': \
                     metric family '{family}' is not a customizable metric (only \
                     {FIRST_RESPONSE_HISTOGRAM} is, as on Triton); it has no effect"
                ));
                continue;
            }
            let Some(MetricOptions::HistogramOptions(options)) = &control.metric_options else {
                continue;
            };
            let ascending = options.buckets.windows(2).all(|w| w[0] < w[1]);
            if !ascending || options.buckets.iter().any(|b| !b.is_finite()) {
                return Err(format!(
                    "field 'model_metrics.metric_control[{i}].histogram_options.buckets': \
                     bucket bounds must be finite and ascending, got {:?}",
                    options.buckets
                ));
            }
            buckets = options.buckets.clone();
        }
        let summary = || Summary::new(settings.quantiles.clone());
        Ok((
            Self {
                first_response: settings.histograms.then(|| Histogram::new(buckets)),
                summaries: settings.summaries.then(|| Summaries {
                    request: (!caches_responses).then(summary),
                    queue: summary(),
                    compute_input: summary(),
                    compute_infer: summary(),
                    compute_output: summary(),
                    cache_hit: caches_responses.then(summary),
                    cache_miss: caches_responses.then(summary),
                }),
                decoupled: crate::runtime::is_decoupled(config),
            },
            notes,
        ))
    }

    /// A request answered: its durations into the summaries, its time to the (only) response
    /// into the histogram.
    pub fn record_success(
        &self,
        queue: Duration,
        input: Duration,
        infer: Duration,
        output: Duration,
        elapsed: Duration,
    ) {
        if !self.decoupled {
            self.record_first_response(elapsed);
        }
        if let Some(s) = &self.summaries {
            if let Some(request) = &s.request {
                request.observe(micros(elapsed));
            }
            s.queue.observe(micros(queue));
            s.compute_input.observe(micros(input));
            s.compute_infer.observe(micros(infer));
            s.compute_output.observe(micros(output));
        }
    }

    /// The first response of a request went out `elapsed` after the request started.
    pub fn record_first_response(&self, elapsed: Duration) {
        if let Some(h) = &self.first_response {
            // Whole milliseconds, as Triton divides nanoseconds by 1,000,000.
            h.observe((elapsed.as_nanos() / 1_000_000) as f64);
        }
    }

    /// A cache lookup: a hit (its lookup took `d`) or a miss (lookup and insertion).
    pub fn record_cache(&self, hit: bool, d: Duration) {
        let Some(s) = &self.summaries else {
            return;
        };
        let summary = if hit { &s.cache_hit } else { &s.cache_miss };
        if let Some(summary) = summary {
            summary.observe(micros(d));
        }
    }
}

fn micros(d: Duration) -> f64 {
    d.as_micros() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_with_an_overflow_count() {
        let h = Histogram::new(vec![1.0, 5.0]);
        for v in [0.0, 1.0, 3.0, 9.0, 9.0] {
            h.observe(v);
        }
        let (buckets, count, sum) = h.snapshot();
        assert_eq!(buckets, vec![(1.0, 2), (5.0, 3)]);
        assert_eq!((count, sum), (5, 22.0));
    }

    #[test]
    fn summary_quantiles_are_the_recent_observations_ranks() {
        let s = Summary::new(vec![(0.5, 0.05), (0.9, 0.01), (1.0, 0.0)]);
        assert!(s.snapshot().0[0].1.is_nan());
        for v in 1..=100 {
            s.observe(v as f64);
        }
        let (q, count, sum) = s.snapshot();
        assert_eq!(q, vec![(0.5, 50.0), (0.9, 90.0), (1.0, 100.0)]);
        assert_eq!((count, sum), (100, 5050.0));
    }

    #[test]
    fn settings_parse_as_tritons_and_refuse_by_name() {
        let mut m = LatencyMetrics::default();
        m.apply("summary_latencies=true").unwrap();
        m.apply("histogram_latencies=1").unwrap();
        m.apply("summary_quantiles=0.5:0.05,0.99:0.001").unwrap();
        assert!(m.summaries && m.histograms && m.counters);
        assert_eq!(m.quantiles, vec![(0.5, 0.05), (0.99, 0.001)]);
        assert!(m
            .apply("latency=true")
            .unwrap_err()
            .contains("unknown setting 'latency'"));
        assert!(m
            .apply("summary_quantiles=2:0.1")
            .unwrap_err()
            .contains("'2:0.1' is not <quantile>:<error>"));
    }

    #[test]
    fn model_metrics_set_the_first_response_buckets() {
        let text = "name: \"m\"\nmodel_metrics { metric_control [ { metric_identifier { family: \
                    \"nv_inference_first_response_histogram_ms\" } histogram_options { buckets: \
                    [ 1, 10 ] } }, { metric_identifier { family: \"nv_other\" } } ] }\n";
        let config =
            crate::repository::config::parse_text(text, std::path::Path::new("m")).unwrap();
        let settings = LatencyMetrics {
            histograms: true,
            ..Default::default()
        };
        let (latency, notes) = ModelLatency::for_model(&config, &settings, false).unwrap();
        let h = latency.first_response.unwrap();
        assert_eq!(h.snapshot().0, vec![(1.0, 0), (10.0, 0)]);
        assert!(notes[0].contains("'nv_other' is not a customizable metric"));
        let bad = text.replace("[ 1, 10 ]", "[ 10, 1 ]");
        let config =
            crate::repository::config::parse_text(&bad, std::path::Path::new("m")).unwrap();
        let e = ModelLatency::for_model(&config, &settings, false).unwrap_err();
        assert!(
            e.contains("histogram_options.buckets': bucket bounds must be finite and ascending")
        );
    }
}
