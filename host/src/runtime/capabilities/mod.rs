//! What only some backends have, behind traits: the layers above use a loaded model's
//! capabilities without knowing which backend it runs on, and a backend without one leaves it
//! out ([`Capabilities::default`]). A new capability is a field here and a trait; no other
//! backend changes.

use std::{fmt::Write as _, path::Path, sync::Arc};

pub mod kv_events;

use crate::error::Result;

/// The optional capabilities of a loaded model version.
#[derive(Clone, Default)]
pub struct Capabilities {
    /// Metrics of its own, beside the ones every model has.
    pub metrics: Option<Arc<dyn ReportsMetrics>>,
    /// A prefix cache whose blocks it publishes (vLLM's KV-cache events).
    pub prefix_cache: Option<Arc<dyn PrefixCacheBlocks>>,
    /// Adapters it loads at run time.
    pub adapters: Option<Arc<dyn AdapterStore>>,
    /// It runs every request in one loop of its own (a generation model's running batch): a
    /// tenant's execution share would hold it to one request at a time, so none applies.
    pub batches_alone: bool,
}

impl std::fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capabilities")
            .field("metrics", &self.metrics.is_some())
            .field("prefix_cache", &self.prefix_cache.is_some())
            .field("adapters", &self.adapters.is_some())
            .field("batches_alone", &self.batches_alone)
            .finish()
    }
}

/// Metrics a backend reports of one loaded version.
pub trait ReportsMetrics: Send + Sync {
    /// Adds the version's samples to `out`; `labels` are its `model="…",version="…"` labels.
    fn report(&self, labels: &str, out: &mut MetricFamilies);
}

/// The blocks of a prefix cache, as its KV-cache events told them.
pub trait PrefixCacheBlocks: Send + Sync {
    /// Tokens per block and the blocks' hashes, increasing; `None` when it publishes no events.
    fn blocks(&self) -> Option<(usize, Vec<u64>)>;
}

/// Adapters a loaded model takes at run time (a generation model's LoRA adapters): named
/// bundles of files, read from a folder of the model's or sent with a load request.
pub trait AdapterStore: Send + Sync {
    /// The folder, inside the model's folder, that holds its adapters (one folder each).
    fn folder(&self) -> &'static str;
    /// The files an adapter is made of, in the order [`AdapterStore::load`] takes them.
    fn files(&self) -> &'static [&'static str];
    /// The adapters loaded now.
    fn names(&self) -> Vec<String>;
    /// Reads an adapter's files from `dir`.
    fn read(&self, dir: &Path) -> Result<Vec<Vec<u8>>>;
    /// Loads adapter `name` from its files' contents, replacing one of that name.
    fn load(&self, name: &str, files: &[Vec<u8>]) -> Result<()>;
    /// Drops adapter `name` (requests running with it finish with it).
    fn unload(&self, name: &str) -> Result<()>;
}

/// Metric families in Prometheus' text format: each family declared once, with the samples of
/// every version that reports it, in the order families first appear.
#[derive(Debug, Default)]
pub struct MetricFamilies {
    families: Vec<(String, String)>,
}

impl MetricFamilies {
    /// The sample lines of family `name` (declared with `kind` and `help` on first use), to
    /// write lines into.
    pub fn family(&mut self, name: &str, kind: &str, help: &str) -> &mut String {
        let at = match self.families.iter().position(|(n, _)| n == name) {
            Some(at) => at,
            None => {
                self.families.push((
                    name.to_owned(),
                    format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"),
                ));
                self.families.len() - 1
            }
        };
        &mut self.families[at].1
    }

    /// One sample `name{labels} value` of family `name`.
    pub fn sample(
        &mut self,
        name: &str,
        kind: &str,
        help: &str,
        labels: &str,
        value: impl std::fmt::Display,
    ) {
        let _ = writeln!(self.family(name, kind, help), "{name}{{{labels}}} {value}");
    }

    /// The families' text.
    pub fn render(&self) -> String {
        self.families
            .iter()
            .map(|(_, text)| text.as_str())
            .collect()
    }
}

/// A label value escaped for the text format.
pub fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_is_declared_once_with_every_versions_samples() {
        let mut out = MetricFamilies::default();
        out.sample("a_total", "counter", "As.", "model=\"m\"", 1);
        out.sample("b", "gauge", "Bs.", "model=\"m\"", 0.5);
        out.sample("a_total", "counter", "As.", "model=\"n\"", 2);
        assert_eq!(
            out.render(),
            "# HELP a_total As.\n# TYPE a_total counter\na_total{model=\"m\"} 1\n\
             a_total{model=\"n\"} 2\n# HELP b Bs.\n# TYPE b gauge\nb{model=\"m\"} 0.5\n"
        );
        assert_eq!(escape_label("a\"b\\"), "a\\\"b\\\\");
    }
}
