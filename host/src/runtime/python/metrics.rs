//! Custom metrics of Python models (`pb_utils.MetricFamily` / `Metric`), exposed on the
//! server's `/metrics` as Triton exposes them: one family per name (a second registration of
//! the same name and kind, from another instance or model, shares it), one series per label
//! set (instances that ask for the same labels share one counter), `# HELP` and `# TYPE`
//! lines, labels sorted by name. A family goes when the last model version that registered it
//! is unloaded, as Triton drops a family with the last `MetricFamily` object.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    sync::{Mutex, OnceLock, PoisonError},
};

use serde::Deserialize;

use crate::error::{Error, Result};

/// The kinds Triton's Python backend offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Set to any value.
    Gauge,
    /// Observations counted into buckets.
    Histogram,
}

#[derive(Debug, Default)]
struct Series {
    value: f64,
    /// Histograms: the upper bounds and the count of observations at or under each.
    buckets: Vec<(f64, u64)>,
    count: u64,
}

#[derive(Debug)]
struct Family {
    description: String,
    kind: Kind,
    series: BTreeMap<Vec<(String, String)>, Series>,
    /// The loaded model versions ([`owner`]) that registered it.
    owners: std::collections::BTreeSet<u64>,
}

/// A number naming one loaded model version, for [`handle`] and [`release`].
pub fn owner() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Forgets what `owner` registered: families no other loaded version registered go.
pub fn release(owner: u64) {
    let mut all = families().lock().unwrap_or_else(PoisonError::into_inner);
    all.retain(|_, f| {
        f.owners.remove(&owner);
        !f.owners.is_empty()
    });
}

fn families() -> &'static Mutex<HashMap<String, Family>> {
    static FAMILIES: OnceLock<Mutex<HashMap<String, Family>>> = OnceLock::new();
    FAMILIES.get_or_init(Default::default)
}

/// One request from a guest's `MetricFamily` or `Metric`.
#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    /// Registers a family (or finds the one of that name and kind).
    Family {
        /// Its name.
        name: String,
        /// Its `# HELP` text.
        description: String,
        /// Its kind.
        kind: Kind,
    },
    /// Registers a series of a family (or finds it).
    Metric {
        /// The family.
        family: String,
        /// The series' labels.
        labels: BTreeMap<String, String>,
        /// Histogram bucket bounds.
        #[serde(default)]
        buckets: Option<Vec<f64>>,
    },
    /// Adds to a counter or gauge.
    Increment {
        /// The family.
        family: String,
        /// The labels.
        labels: BTreeMap<String, String>,
        /// How much.
        value: f64,
    },
    /// Sets a gauge.
    Set {
        /// The family.
        family: String,
        /// The labels.
        labels: BTreeMap<String, String>,
        /// The value.
        value: f64,
    },
    /// Adds an observation to a histogram.
    Observe {
        /// The family.
        family: String,
        /// The labels.
        labels: BTreeMap<String, String>,
        /// The observation.
        value: f64,
    },
    /// Reads a counter or gauge.
    Value {
        /// The family.
        family: String,
        /// The labels.
        labels: BTreeMap<String, String>,
    },
}

/// Families the process keeps at most, and series over all of them: a model cannot grow the
/// server's memory or its scrape without bound.
const MAX_FAMILIES: usize = 1_000;
const MAX_SERIES: usize = 100_000;
/// Labels of one series, bytes of one label value and buckets of one histogram, at most.
const MAX_LABELS: usize = 32;
const MAX_LABEL_BYTES: usize = 1_024;
const MAX_BUCKETS: usize = 1_000;

/// Name prefixes of the server's own metrics, which a model may not shadow (two families of
/// one name would break every scrape).
const RESERVED_PREFIXES: &[&str] = &["nv_", "wasmtron_"];

/// A metric name as Prometheus allows it.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// The series of `family` with `labels`, and the family's kind.
fn series<'a>(
    all: &'a mut HashMap<String, Family>,
    family: &str,
    labels: BTreeMap<String, String>,
) -> Result<(Kind, &'a mut Series)> {
    let f = all
        .get_mut(family)
        .ok_or_else(|| Error::invalid(format!("metric family '{family}' is not registered")))?;
    let key: Vec<_> = labels.into_iter().collect();
    let kind = f.kind;
    let s = f.series.get_mut(&key).ok_or_else(|| {
        Error::invalid(format!("metric '{family}' has no series with these labels"))
    })?;
    Ok((kind, s))
}

/// Answers one request of the model version `owner`: the series' value where there is one.
pub fn handle(request: Request, owner: u64) -> Result<serde_json::Value> {
    let mut all = families().lock().unwrap_or_else(PoisonError::into_inner);
    match request {
        Request::Family {
            name,
            description,
            kind,
        } => {
            if !valid_name(&name) {
                return Err(Error::invalid(format!(
                    "'{name}' is not a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)"
                )));
            }
            if let Some(p) = RESERVED_PREFIXES.iter().find(|p| name.starts_with(*p)) {
                return Err(Error::invalid(format!(
                    "metric name '{name}': the prefix '{p}' is the server's own"
                )));
            }
            if !all.contains_key(&name) && all.len() >= MAX_FAMILIES {
                return Err(Error::unavailable(format!(
                    "the server holds {MAX_FAMILIES} custom metric families already"
                )));
            }
            let f = all.entry(name.clone()).or_insert_with(|| Family {
                description,
                kind,
                series: BTreeMap::new(),
                owners: Default::default(),
            });
            if f.kind != kind {
                return Err(Error::invalid(format!(
                    "metric family '{name}' is already registered as a {:?}",
                    f.kind
                )));
            }
            f.owners.insert(owner);
            Ok(serde_json::Value::Null)
        }
        Request::Metric {
            family,
            labels,
            buckets,
        } => {
            let total: usize = all.values().map(|f| f.series.len()).sum();
            let f = all.get_mut(&family).ok_or_else(|| {
                Error::invalid(format!("metric family '{family}' is not registered"))
            })?;
            if let Some(bad) = labels.keys().find(|k| !valid_name(k) || k.contains(':')) {
                return Err(Error::invalid(format!("'{bad}' is not a valid label name")));
            }
            if labels.len() > MAX_LABELS
                || labels.values().any(|v| v.len() > MAX_LABEL_BYTES)
                || buckets.as_ref().is_some_and(|b| b.len() > MAX_BUCKETS)
            {
                return Err(Error::invalid(format!(
                    "metric '{family}': at most {MAX_LABELS} labels of {MAX_LABEL_BYTES} bytes \
                     and {MAX_BUCKETS} buckets"
                )));
            }
            let histogram = f.kind == Kind::Histogram;
            let bounds = match (histogram, buckets) {
                (true, Some(b)) => b,
                (true, None) => {
                    return Err(Error::invalid(format!(
                        "histogram '{family}' needs buckets for each metric"
                    )))
                }
                (false, _) => Vec::new(),
            };
            let key: Vec<(String, String)> = labels.into_iter().collect();
            if !f.series.contains_key(&key) && total >= MAX_SERIES {
                return Err(Error::unavailable(format!(
                    "the server holds {MAX_SERIES} custom metric series already"
                )));
            }
            f.series.entry(key).or_insert_with(|| Series {
                buckets: bounds.into_iter().map(|b| (b, 0)).collect(),
                ..Default::default()
            });
            Ok(serde_json::Value::Null)
        }
        Request::Increment {
            family,
            labels,
            value,
        } => {
            let (kind, s) = series(&mut all, &family, labels)?;
            match kind {
                Kind::Counter if value < 0.0 => Err(Error::invalid(format!(
                    "counter '{family}' cannot be incremented by a negative value"
                ))),
                Kind::Histogram => Err(Error::invalid(format!(
                    "'{family}' is a histogram: observe() it"
                ))),
                _ => {
                    s.value += value;
                    Ok(serde_json::Value::from(s.value))
                }
            }
        }
        Request::Set {
            family,
            labels,
            value,
        } => {
            let (kind, s) = series(&mut all, &family, labels)?;
            if kind != Kind::Gauge {
                return Err(Error::invalid(format!(
                    "'{family}' is not a gauge: only gauges can be set"
                )));
            }
            s.value = value;
            Ok(serde_json::Value::from(value))
        }
        Request::Observe {
            family,
            labels,
            value,
        } => {
            let (kind, s) = series(&mut all, &family, labels)?;
            if kind != Kind::Histogram {
                return Err(Error::invalid(format!("'{family}' is not a histogram")));
            }
            s.value += value;
            s.count += 1;
            for (bound, n) in &mut s.buckets {
                if value <= *bound {
                    *n += 1;
                }
            }
            Ok(serde_json::Value::Null)
        }
        Request::Value { family, labels } => {
            let (_, s) = series(&mut all, &family, labels)?;
            Ok(serde_json::Value::from(s.value))
        }
    }
}

fn render_labels(labels: &[(String, String)], extra: Option<(&str, String)>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
        .collect();
    if let Some((k, v)) = extra {
        parts.push(format!("{k}=\"{v}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The families in Prometheus' text format, sorted by name.
pub fn render() -> String {
    let all = families().lock().unwrap_or_else(PoisonError::into_inner);
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let mut out = String::new();
    for name in names {
        let f = &all[name];
        if f.series.is_empty() {
            continue;
        }
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(out, "# HELP {name} {}", escape(&f.description));
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (labels, s) in &f.series {
            if f.kind == Kind::Histogram {
                for (bound, n) in &s.buckets {
                    let le = render_labels(labels, Some(("le", bound.to_string())));
                    let _ = writeln!(out, "{name}_bucket{le} {n}");
                }
                let inf = render_labels(labels, Some(("le", "+Inf".into())));
                let _ = writeln!(out, "{name}_bucket{inf} {}", s.count);
                let plain = render_labels(labels, None);
                let _ = writeln!(out, "{name}_sum{plain} {}", s.value);
                let _ = writeln!(out, "{name}_count{plain} {}", s.count);
            } else {
                let _ = writeln!(out, "{name}{} {}", render_labels(labels, None), s.value);
            }
        }
    }
    out
}
