//! Request tracing as Triton configures it (`--trace-config`, `/v2/trace/setting`, the gRPC
//! `TraceSetting` RPC): which requests are traced (`trace_level`, `trace_rate`, `trace_count`,
//! globally or per model), and the span each traced request starts, continuing the W3C trace
//! context (`traceparent`) its client sent. The spans themselves are `tracing` spans on
//! [`crate::inference::TRACE_TARGET`]; with the `otel` feature the binary exports them over OTLP.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, PoisonError,
    },
};

use crate::{
    error::{Error, Result},
    inference::Trace,
};

/// One level of settings: global, or a model's overrides.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Settings {
    /// `trace_level`: traced (`TIMESTAMPS`) or not (`OFF`).
    on: Option<bool>,
    /// `trace_rate`: one request in this many is traced.
    rate: Option<u64>,
    /// `trace_count`: how many more requests may be traced (-1: no limit).
    count: Option<i64>,
}

/// Triton's defaults: level OFF, rate 1000, count -1.
const DEFAULT: Settings = Settings {
    on: Some(false),
    rate: Some(1000),
    count: Some(-1),
};

/// The model a per-model trace settings request names, checked once for both protocols: a
/// malformed name is refused (400), a model the server neither serves nor finds in its
/// repositories is not found (404), so settings are kept only for models that exist; `None`
/// (the global settings) passes.
pub fn model_of<'a>(
    server: &crate::scheduling::server::Server,
    model: Option<&'a str>,
) -> Result<Option<&'a str>> {
    let Some(name) = model else {
        return Ok(None);
    };
    crate::names::ModelName::parse(name)?;
    let models = server.models();
    if models.get(name, None).is_err() && models.repository().find(name).is_err() {
        return Err(Error::not_found(format!(
            "Request for unknown model: '{name}' is not found"
        )));
    }
    Ok(Some(name))
}

/// The trace settings of a server and the requests they select.
#[derive(Debug)]
pub struct Tracing {
    /// Whether traces go anywhere (`--trace-config mode=opentelemetry` in an `otel` build, or
    /// a trace file); without it every request is untraced, whatever the settings say.
    exporting: bool,
    /// The trace file, in Triton's mode (`--trace-config triton,file=…`).
    file: Option<std::sync::Arc<super::trace_file::TraceFile>>,
    global: Mutex<Settings>,
    models: Mutex<HashMap<String, Settings>>,
    seen: AtomicU64,
}

impl Default for Tracing {
    fn default() -> Self {
        Self::new(false)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Tracing {
    /// Settings at Triton's defaults; `exporting` says whether traces leave the process.
    pub fn new(exporting: bool) -> Self {
        Self {
            exporting,
            file: None,
            global: Mutex::new(DEFAULT),
            models: Mutex::default(),
            seen: AtomicU64::new(0),
        }
    }

    /// Settings at Triton's defaults, with traces written to `file` (Triton's trace mode).
    pub fn to_file(file: std::sync::Arc<super::trace_file::TraceFile>) -> Self {
        // The traces' clock starts now, before the first request's timestamps.
        crate::inference::trace_ns(std::time::Instant::now());
        Self {
            file: Some(file),
            ..Self::new(true)
        }
    }

    /// Applies `--trace-config` settings that are not about the exporter (`level=`, `rate=`,
    /// `count=`).
    pub fn configure(&self, key: &str, value: &str) -> Result<()> {
        let name = match key {
            "level" => "trace_level",
            "rate" => "trace_rate",
            "count" => "trace_count",
            other => {
                return Err(Error::invalid(format!(
                    "--trace-config {other}: unknown setting"
                )))
            }
        };
        self.update(
            None,
            BTreeMap::from([(name.to_owned(), Some(vec![value.to_owned()]))]),
        )
        .map(|_| ())
    }

    fn effective(&self, model: &str) -> (bool, u64, i64) {
        let global = lock(&self.global).clone();
        let own = lock(&self.models).get(model).cloned().unwrap_or_default();
        (
            own.on.or(global.on).unwrap_or(false),
            own.rate.or(global.rate).unwrap_or(1000).max(1),
            own.count.or(global.count).unwrap_or(-1),
        )
    }

    /// The span of a new request to `model`, or a disabled one when the settings do not pick
    /// it. `header` reads the request's headers or metadata (for `traceparent`).
    pub fn request_span(
        &self,
        model: &str,
        protocol: &'static str,
        header: &dyn Fn(&str) -> Option<String>,
    ) -> Trace {
        if !self.exporting {
            return Trace::default();
        }
        let (on, rate, count) = self.effective(model);
        if !on
            || count == 0
            || !self
                .seen
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(rate)
        {
            return Trace::default();
        }
        if count > 0 {
            self.take_one(model);
        }
        let span = tracing::info_span!(
            target: "wasmtron::trace",
            "infer",
            model = %model,
            protocol = protocol
        );
        continue_trace(&span, header);
        Trace(span)
    }

    /// One trace of a limited `trace_count` used up (the model's own count if it has one).
    fn take_one(&self, model: &str) {
        let mut models = lock(&self.models);
        if let Some(c) = models.get_mut(model).and_then(|s| s.count.as_mut()) {
            *c = (*c - 1).max(0);
            return;
        }
        drop(models);
        if let Some(c) = lock(&self.global).count.as_mut() {
            if *c > 0 {
                *c -= 1;
            }
        }
    }

    /// The settings as Triton reports them (a model's view includes its overrides).
    pub fn settings(&self, model: Option<&str>) -> BTreeMap<String, Vec<String>> {
        let (on, rate, count) = self.effective(model.unwrap_or_default());
        BTreeMap::from([
            (
                "trace_level".to_owned(),
                vec![if on { "TIMESTAMPS" } else { "OFF" }.to_owned()],
            ),
            ("trace_rate".to_owned(), vec![rate.to_string()]),
            ("trace_count".to_owned(), vec![count.to_string()]),
            (
                "log_frequency".to_owned(),
                vec![self
                    .file
                    .as_ref()
                    .map_or(0, |f| f.log_frequency())
                    .to_string()],
            ),
            (
                "trace_file".to_owned(),
                vec![self
                    .file
                    .as_ref()
                    .map(|f| f.path().display().to_string())
                    .unwrap_or_default()],
            ),
            (
                "trace_mode".to_owned(),
                vec![if self.exporting && self.file.is_none() {
                    "opentelemetry"
                } else {
                    "triton"
                }
                .to_owned()],
            ),
        ])
    }

    /// Changes settings, globally or for one model; a `None` value clears a model's override
    /// (or resets a global one to Triton's default). Returns the settings after the change.
    pub fn update(
        &self,
        model: Option<&str>,
        changes: BTreeMap<String, Option<Vec<String>>>,
    ) -> Result<BTreeMap<String, Vec<String>>> {
        let mut next = match model {
            Some(m) => lock(&self.models).get(m).cloned().unwrap_or_default(),
            None => lock(&self.global).clone(),
        };
        for (key, value) in &changes {
            let value = match value.as_deref() {
                None | Some([]) => None,
                Some([one]) => Some(one.trim()),
                Some(_) if key == "trace_level" => {
                    return Err(Error::invalid(
                        "trace_level: give one of OFF or TIMESTAMPS (TENSORS is not supported)",
                    ))
                }
                Some(_) => {
                    return Err(Error::invalid(format!("{key}: give a single value")));
                }
            };
            fn reset<T>(model: Option<&str>, default: Option<T>) -> Option<T> {
                if model.is_some() {
                    None
                } else {
                    default
                }
            }
            match key.as_str() {
                "trace_level" => {
                    next.on = match value {
                        None => reset(model, DEFAULT.on),
                        Some("OFF") => Some(false),
                        Some("TIMESTAMPS") => Some(true),
                        Some(other) => {
                            return Err(Error::invalid(format!(
                                "trace_level '{other}' is not supported (OFF or TIMESTAMPS)"
                            )))
                        }
                    }
                }
                "trace_rate" => {
                    next.rate = match value {
                        None => reset(model, DEFAULT.rate),
                        Some(v) => Some(v.parse().ok().filter(|&r| r > 0).ok_or_else(|| {
                            Error::invalid(format!("trace_rate '{v}' must be a positive integer"))
                        })?),
                    }
                }
                "trace_count" => {
                    next.count = match value {
                        None => reset(model, DEFAULT.count),
                        Some(v) => Some(v.parse().ok().filter(|&c| c >= -1).ok_or_else(|| {
                            Error::invalid(format!("trace_count '{v}' must be -1 or more"))
                        })?),
                    }
                }
                "log_frequency" | "trace_file" | "trace_mode" => {
                    return Err(Error::invalid(format!(
                        "{key} cannot be changed while the server runs: set it with \
                         --trace-config at start"
                    )))
                }
                other => {
                    return Err(Error::invalid(format!(
                        "unknown trace setting '{other}' (trace_level, trace_rate, trace_count)"
                    )))
                }
            }
        }
        match model {
            Some(m) => {
                let mut models = lock(&self.models);
                if next == Settings::default() {
                    models.remove(m);
                } else {
                    models.insert(m.to_owned(), next);
                }
            }
            None => *lock(&self.global) = next,
        }
        Ok(self.settings(model))
    }
}

/// Makes `span` a child of the W3C trace context in the request's `traceparent` (and
/// `tracestate`), when there is one.
#[cfg(feature = "otel")]
fn continue_trace(span: &tracing::Span, header: &dyn Fn(&str) -> Option<String>) {
    use opentelemetry::propagation::{Extractor, TextMapPropagator};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    struct Headers(Vec<(&'static str, String)>);
    impl Extractor for Headers {
        fn get(&self, key: &str) -> Option<&str> {
            self.0
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.as_str())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.iter().map(|(k, _)| *k).collect()
        }
    }
    let headers = Headers(
        ["traceparent", "tracestate"]
            .into_iter()
            .filter_map(|k| Some((k, header(k)?)))
            .collect(),
    );
    if headers.0.is_empty() {
        return;
    }
    let context = opentelemetry_sdk::propagation::TraceContextPropagator::new().extract(&headers);
    let _ = span.set_parent(context);
}

#[cfg(not(feature = "otel"))]
fn continue_trace(_: &tracing::Span, _: &dyn Fn(&str) -> Option<String>) {}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(pairs: &[(&str, Option<&str>)]) -> BTreeMap<String, Option<Vec<String>>> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.map(|v| vec![v.to_owned()])))
            .collect()
    }

    #[test]
    fn settings_follow_triton_and_model_overrides_fall_back_to_global() {
        let t = Tracing::new(true);
        assert_eq!(t.settings(None)["trace_level"], ["OFF"]);
        assert_eq!(t.settings(None)["trace_rate"], ["1000"]);
        t.update(
            None,
            set(&[
                ("trace_level", Some("TIMESTAMPS")),
                ("trace_rate", Some("1")),
            ]),
        )
        .unwrap();
        let m = t
            .update(Some("m"), set(&[("trace_rate", Some("5"))]))
            .unwrap();
        assert_eq!(
            (m["trace_level"].clone(), m["trace_rate"].clone()),
            (vec!["TIMESTAMPS".to_owned()], vec!["5".to_owned()])
        );
        t.update(Some("m"), set(&[("trace_rate", None)])).unwrap();
        assert_eq!(t.settings(Some("m"))["trace_rate"], ["1"]);
        for (bad, says) in [
            (
                set(&[("trace_level", Some("TENSORS"))]),
                "'TENSORS' is not supported",
            ),
            (set(&[("trace_rate", Some("0"))]), "positive integer"),
            (set(&[("trace_file", Some("/tmp/x"))]), "cannot be changed"),
            (
                set(&[("trace_colour", Some("red"))]),
                "unknown trace setting",
            ),
        ] {
            let err = t.update(None, bad).unwrap_err();
            assert!(err.message.contains(says), "{}", err.message);
        }
    }

    #[test]
    fn count_limits_the_traces_taken() {
        let t = Tracing::new(true);
        t.update(
            None,
            set(&[
                ("trace_level", Some("TIMESTAMPS")),
                ("trace_rate", Some("1")),
                ("trace_count", Some("2")),
            ]),
        )
        .unwrap();
        let none = |_: &str| None;
        // No subscriber here records spans, so count what the settings let through instead.
        for _ in 0..5 {
            let _ = t.request_span("m", "http", &none);
        }
        assert_eq!(t.settings(None)["trace_count"], ["0"]);
        let off = Tracing::new(false);
        assert!(!off.request_span("m", "http", &none).is_traced());
    }
}
