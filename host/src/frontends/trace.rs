//! Request tracing as Triton configures it (`--trace-config`, `/v2/trace/setting`, the gRPC
//! `TraceSetting` RPC): which requests are traced (`trace_level`, `trace_rate`, `trace_count`,
//! globally or per model), and the span each traced request starts, continuing the W3C trace
//! context (`traceparent`) its client sent. The spans themselves are `tracing` spans on
//! [`crate::inference::TRACE_TARGET`]; with the `otel` feature the binary exports them over OTLP.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, PoisonError},
};

use super::{
    trace_file::{Stream, TraceFile},
    trace_settings::{self, Changes, Specified, Values},
};
use crate::{
    error::{Error, Result},
    inference::Trace,
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
        // Triton's words for this API, then ours.
        return Err(Error::not_found(format!(
            "Request for unknown model : {name} (not served and not in the repository)"
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
    file: Option<Arc<TraceFile>>,
    levels: Mutex<Levels>,
}

/// The global setting and the models' own, over what the server started with.
#[derive(Debug)]
struct Levels {
    startup: Values,
    global: Level,
    models: HashMap<String, Level>,
}

/// One level's own fields and the setting they put in force.
#[derive(Debug)]
struct Level {
    specified: Specified,
    active: Arc<Active>,
}

/// A setting in force (Triton's `TraceSetting`): replaced, with counters of its own, whenever
/// it or what it falls back on changes.
#[derive(Debug)]
struct Active {
    values: Values,
    sampling: Mutex<Sampling>,
    /// Where its traces are collected (Triton's mode).
    stream: Option<Arc<Stream>>,
    file: Option<Arc<TraceFile>>,
}

impl Drop for Active {
    fn drop(&mut self) {
        if let (Some(stream), Some(file)) = (self.stream.take(), &self.file) {
            file.retire(stream);
        }
    }
}

#[derive(Debug)]
struct Sampling {
    /// Requests seen while traces could still be taken.
    seen: u64,
    /// Traces still allowed (-1: no limit).
    remaining: i32,
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
        Self::starting(exporting, None, trace_settings::DEFAULT)
    }

    /// Settings at Triton's defaults, with traces written to `file` (Triton's trace mode),
    /// `log_frequency` traces per indexed file.
    pub fn to_file(file: Arc<TraceFile>, log_frequency: u64) -> Self {
        // The traces' clock starts now, before the first request's timestamps.
        crate::inference::trace_ns(std::time::Instant::now());
        let startup = Values {
            log_frequency: u32::try_from(log_frequency).unwrap_or(u32::MAX),
            ..trace_settings::DEFAULT
        };
        Self::starting(true, Some(file), startup)
    }

    fn starting(exporting: bool, file: Option<Arc<TraceFile>>, startup: Values) -> Self {
        let global = Level {
            specified: Specified::default(),
            active: activate(file.as_ref(), startup),
        };
        Self {
            exporting,
            file,
            levels: Mutex::new(Levels {
                startup,
                global,
                models: HashMap::new(),
            }),
        }
    }

    /// Applies a `--trace-config` setting given at start (`level=`, `rate=`, `count=`): what
    /// clearing a global field at run time falls back to.
    pub fn configure(&self, key: &str, value: &str) -> Result<()> {
        let mut levels = lock(&self.levels);
        let mut startup = levels.startup;
        trace_settings::configure(&mut startup, key, value)?;
        levels.startup = startup;
        let values = levels.global.specified.over(startup);
        levels.global.active = activate(self.file.as_ref(), values);
        Ok(())
    }

    /// The setting a request to `model` is traced by.
    fn active(&self, model: &str) -> Arc<Active> {
        let levels = lock(&self.levels);
        levels
            .models
            .get(model)
            .unwrap_or(&levels.global)
            .active
            .clone()
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
        let active = self.active(model);
        let Values { level, rate, .. } = active.values;
        if !level.is_on() || !active.sample(rate) {
            return Trace::default();
        }
        let span = tracing::info_span!(
            target: "wasmtron::trace",
            "infer",
            model = %model,
            protocol = protocol,
            stream = active.stream.as_ref().map_or(0, |s| s.id())
        );
        continue_trace(&span, header);
        Trace(span, level)
    }

    /// The settings as Triton reports them (a model's view includes what it falls back on;
    /// `trace_count` is what is left of it).
    pub fn settings(&self, model: Option<&str>) -> BTreeMap<String, Vec<String>> {
        let active = self.active(model.unwrap_or_default());
        let values = active.live_values();
        let mut out = BTreeMap::from([
            (
                "trace_level".to_owned(),
                trace_settings::level_names(values.level),
            ),
            ("trace_rate".to_owned(), vec![values.rate.to_string()]),
            ("trace_count".to_owned(), vec![values.count.to_string()]),
            (
                "trace_mode".to_owned(),
                vec![if self.exporting && self.file.is_none() {
                    "opentelemetry"
                } else {
                    "triton"
                }
                .to_owned()],
            ),
        ]);
        // As on Triton, the file and its frequency belong to Triton's mode only.
        if !(self.exporting && self.file.is_none()) {
            out.insert(
                "log_frequency".to_owned(),
                vec![values.log_frequency.to_string()],
            );
            out.insert(
                "trace_file".to_owned(),
                vec![self
                    .file
                    .as_ref()
                    .map(|f| f.path().display().to_string())
                    .unwrap_or_default()],
            );
        }
        out
    }

    /// Changes settings, globally or for one model; a `None` value (or an empty list) clears
    /// a field, which then falls back (a model's to the global setting, a global one to the
    /// server's start). Every change puts a new setting in force, with fresh counters; a
    /// global change does so for the models that fall back on it. Returns the settings after
    /// the change.
    pub fn update(
        &self,
        model: Option<&str>,
        changes: BTreeMap<String, Option<Vec<String>>>,
    ) -> Result<BTreeMap<String, Vec<String>>> {
        let changes = Changes::parse(changes)?;
        let file = self.file.as_ref();
        {
            let mut levels = lock(&self.levels);
            match model {
                Some(m) => {
                    let current = levels.models.get(m).map(|l| l.specified);
                    let specified = changes.apply(current.unwrap_or_default());
                    let values = specified.over(levels.global.active.live_values());
                    trace_settings::check(&values)?;
                    if specified.is_empty() {
                        levels.models.remove(m);
                    } else {
                        let active = activate(file, values);
                        levels
                            .models
                            .insert(m.to_owned(), Level { specified, active });
                    }
                }
                None => {
                    let specified = changes.apply(levels.global.specified);
                    let values = specified.over(levels.startup);
                    trace_settings::check(&values)?;
                    let global = activate(file, values);
                    let base = global.live_values();
                    for level in levels.models.values_mut() {
                        level.active = activate(file, level.specified.over(base));
                    }
                    levels.global = Level {
                        specified,
                        active: global,
                    };
                }
            }
        }
        Ok(self.settings(model))
    }
}

/// A setting put in force with `values` (its traces collected in `file`, when there is one).
fn activate(file: Option<&Arc<TraceFile>>, values: Values) -> Arc<Active> {
    Arc::new(Active {
        values,
        sampling: Mutex::new(Sampling {
            seen: 0,
            remaining: values.count,
        }),
        stream: file.map(|f| f.stream(u64::from(values.log_frequency), values.count >= 0)),
        file: file.cloned(),
    })
}

impl Active {
    /// Counts a request and says whether it is traced: one in `rate` while the count lasts.
    fn sample(&self, rate: u32) -> bool {
        let mut s = lock(&self.sampling);
        if s.remaining == 0 {
            return false;
        }
        s.seen += 1;
        if !s.seen.is_multiple_of(u64::from(rate.max(1))) {
            return false;
        }
        if s.remaining > 0 {
            s.remaining -= 1;
        }
        if let Some(stream) = &self.stream {
            stream.started(s.remaining == 0);
        }
        true
    }

    /// The values with the count that is left.
    fn live_values(&self) -> Values {
        Values {
            count: lock(&self.sampling).remaining,
            ..self.values
        }
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
        let both = BTreeMap::from([(
            "trace_level".to_owned(),
            Some(vec!["TIMESTAMPS".to_owned(), "TENSORS".to_owned()]),
        )]);
        assert_eq!(
            t.update(None, both).unwrap()["trace_level"],
            ["TIMESTAMPS", "TENSORS"]
        );
        let err = t
            .update(None, set(&[("trace_rate", Some("0"))]))
            .unwrap_err();
        assert!(err.message.contains("sample rate must be non-zero"));
    }

    #[test]
    fn a_cleared_global_field_returns_to_the_start_and_models_follow_the_global() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tracing::to_file(Arc::new(TraceFile::new(dir.path().join("t.json"))), 0);
        t.configure("level", "TIMESTAMPS").unwrap();
        t.configure("rate", "1").unwrap();
        t.update(
            Some("m"),
            set(&[("trace_rate", Some("12")), ("log_frequency", Some("34"))]),
        )
        .unwrap();
        t.update(
            None,
            set(&[
                ("trace_rate", Some("56")),
                ("trace_count", Some("78")),
                ("trace_level", Some("OFF")),
            ]),
        )
        .unwrap();
        let global = t
            .update(None, set(&[("trace_rate", None), ("trace_count", None)]))
            .unwrap();
        assert_eq!(
            (
                &global["trace_level"][0],
                &global["trace_rate"][0],
                &global["trace_count"][0]
            ),
            (&"OFF".to_owned(), &"1".to_owned(), &"-1".to_owned())
        );
        let model = t.settings(Some("m"));
        assert_eq!(
            (
                &model["trace_level"][0],
                &model["trace_rate"][0],
                &model["log_frequency"][0]
            ),
            (&"OFF".to_owned(), &"12".to_owned(), &"34".to_owned())
        );
        let cleared = t
            .update(
                Some("m"),
                set(&[("trace_rate", None), ("trace_level", None)]),
            )
            .unwrap();
        assert_eq!(cleared["trace_rate"], ["1"]);
        assert_eq!(cleared["log_frequency"], ["34"]);
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
