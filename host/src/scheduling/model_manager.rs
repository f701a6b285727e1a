//! The model lifecycle: loads versions from the repository through the backends, serves the
//! table of loaded models, and swaps a model atomically on reload. In-flight requests hold an
//! `Arc` of the version they started on, so an unload or reload never cuts them off; a failed
//! reload leaves the old versions serving.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use super::{
    ensemble::{self, Ensemble},
    execution_share::ExecutionShare,
    queue::BatchPolicy,
    scheduler::{ExecutionLimits, Scheduler},
    sequence::SequenceBatcher,
    stats::ModelStats,
};
use crate::{
    error::{Code, Error, Result},
    names::{ModelFilePath, ModelName},
    private_dir::ScratchDir,
    proto::inference::ModelConfig,
    repository::{
        checksum, config, config_fields, select_versions, sequence::sequence_spec,
        validate::validate, ModelRepository, ModelSource, RepositoryError,
    },
    runtime::{self, RuntimeOptions},
};

/// Reason recorded for a model that was unloaded on purpose (it does not count against
/// strict readiness).
const UNLOADED: &str = "unloaded";
/// The parameter in which a stage names the models it calls (loaded with it).
const STAGE_CALLS: &str = "composing_models";

/// One loaded, servable model version.
pub struct ModelVersion {
    /// Model name.
    pub name: String,
    /// Version number.
    pub version: i64,
    /// Completed configuration.
    pub config: ModelConfig,
    /// Counters for statistics and metrics.
    pub stats: Arc<ModelStats>,
    /// How long loading took.
    pub load_duration: Duration,
    /// What executes its requests.
    pub executor: Executor,
    /// Crash accounting of the instances.
    pub health: Arc<crate::runtime::InstanceHealth>,
    /// What only some backends have: metrics of their own, a prefix cache's blocks, adapters.
    pub capabilities: crate::runtime::capabilities::Capabilities,
    /// Its outputs' labels (`label_filename`), for the classification extension.
    pub labels: Arc<crate::classification::Labels>,
    /// Where the served model came from when not the version's own file (a PyTorch or
    /// TensorFlow model's conversion): the version's status line in the repository index.
    pub origin: Option<String>,
    /// SHA-256 of what it was loaded from (the model folder's files and a configuration sent
    /// with the load), when the server has a response cache: its answers are kept under it.
    pub content: Option<[u8; 32]>,
    /// A cached answer that did not fit the configuration was logged (once per version).
    pub cache_misfit_logged: std::sync::atomic::AtomicBool,
    /// The files given to the load API, kept while the version lives: its backends may open
    /// them again later (a new stage instance), and nobody else can swap them in between.
    /// Held only to keep the folder; removed with the last version that uses it.
    _staged: Option<Arc<ScratchDir>>,
}

/// What executes a model version's requests.
pub enum Executor {
    /// A backend's instances behind a queue.
    Scheduler(Scheduler),
    /// A stateful model: the sequence batcher in front of its queue.
    Sequence(Box<SequenceBatcher>),
    /// Other models, called step by step.
    Ensemble(Ensemble),
}

impl ModelVersion {
    /// Stops taking requests (queued ones still run); ensembles hold no queue.
    fn close(&self) {
        match &self.executor {
            Executor::Scheduler(s) => s.close(),
            Executor::Sequence(s) => s.scheduler().close(),
            Executor::Ensemble(_) => {}
        }
    }

    /// Whether this version is an ensemble that calls `model`.
    fn uses(&self, model: &str) -> bool {
        matches!(&self.executor, Executor::Ensemble(e) if e.models().any(|m| m == model))
    }
}

/// Lifecycle state of a model, as the repository index reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelState {
    /// Serving.
    Ready,
    /// Being loaded for the first time.
    Loading,
    /// Not serving: never loaded, unloaded or failed.
    Unavailable,
}

impl ModelState {
    /// Triton's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelState::Ready => "READY",
            ModelState::Loading => "LOADING",
            ModelState::Unavailable => "UNAVAILABLE",
        }
    }
}

struct ModelEntry {
    versions: BTreeMap<i64, Arc<ModelVersion>>,
    state: ModelState,
    reason: String,
    fingerprint: u64,
    /// Added in-process ([`ModelManager::add_model`]), not read from a repository: poll mode
    /// leaves it alone.
    added: bool,
}

/// One line of the repository index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    /// Model name.
    pub name: String,
    /// Version, when the entry is about a loaded version.
    pub version: Option<i64>,
    /// Lifecycle state.
    pub state: ModelState,
    /// Why it is in that state (load errors).
    pub reason: String,
}

/// Replacement content given to the load API.
#[derive(Debug, Default, Clone)]
pub struct LoadOverride {
    /// A configuration in JSON, used instead of `config.pbtxt`.
    pub config_json: Option<String>,
    /// Files by path relative to the model directory (`1/model.onnx`), used instead of the
    /// repository's directory.
    pub files: Vec<(ModelFilePath, Vec<u8>)>,
}

impl LoadOverride {
    /// Adds the file of a `file:<path>` load parameter (`key` is what follows `file:`),
    /// refusing a path that is not a plain relative one or that was given twice. As on Triton,
    /// which joins the key to the model's folder, a leading `/` names the same file
    /// (`file:/1/model.py` is `file:1/model.py`).
    pub fn add_file(&mut self, key: &str, content: Vec<u8>) -> Result<()> {
        let path = ModelFilePath::parse(key.trim_start_matches('/'))?;
        if self.files.iter().any(|(p, _)| *p == path) {
            return Err(Error::invalid(format!(
                "load parameter 'file:{path}' is given twice"
            )));
        }
        self.files.push((path, content));
        Ok(())
    }
}

/// Settings of the model manager.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// Backend settings.
    pub runtime: RuntimeOptions,
    /// Queue capacity per model version.
    pub queue_capacity: usize,
    /// The server's executions, shared among tenants.
    pub execution_share: Arc<ExecutionShare>,
    /// Models loaded at once when several load together (start-up, poll): Triton's
    /// `--model-load-thread-count`.
    pub load_threads: usize,
    /// The server's response cache (`--cache-config`), if any: a model's answers there are
    /// dropped when it is loaded again or unloaded.
    pub response_cache: Option<Arc<super::response_cache::ResponseCache>>,
    /// The rate limiter (`--rate-limit=execution_count`), if on.
    pub rate_limiter: Option<Arc<super::rate_limiter::RateLimiter>>,
    /// The latency metrics each model records (`--metrics-config`).
    pub latency_metrics: super::latency::LatencyMetrics,
}

/// The table of models and the operations that change it.
pub struct ModelManager {
    repository: ModelRepository,
    options: ManagerOptions,
    models: RwLock<HashMap<String, ModelEntry>>,
    // Loads and unloads run one at a time so that a reload never races another.
    lifecycle: tokio::sync::Mutex<()>,
    /// Models whose versions are being read and initialized now, under the lifecycle lock
    /// (see `asked_by_models.rs`).
    loading: std::sync::Mutex<HashSet<String>>,
    /// Adapters loaded with files a load request sent, by the model holding them: applied
    /// again to the model's new versions when it reloads (`adapters.rs`).
    sent_adapters: std::sync::Mutex<adapters::SentAdapters>,
}

fn repo_error(err: RepositoryError) -> Error {
    match err {
        RepositoryError::NotFound(_) => Error::not_found(err.to_string()),
        _ => Error::invalid(err.to_string()),
    }
}

impl ModelManager {
    /// A manager over `repository` with nothing loaded yet.
    pub fn new(repository: ModelRepository, options: ManagerOptions) -> Self {
        Self {
            repository,
            options,
            models: RwLock::new(HashMap::new()),
            lifecycle: tokio::sync::Mutex::new(()),
            loading: Default::default(),
            sent_adapters: Default::default(),
        }
    }

    /// The repositories served.
    pub fn repository(&self) -> &ModelRepository {
        &self.repository
    }

    /// The version that serves a request: the given one, or the highest loaded. Every path
    /// that names a model comes through here: a malformed name is refused (400) before it is
    /// looked up, an unknown one is not found (404).
    pub fn get(&self, name: &str, version: Option<i64>) -> Result<Arc<ModelVersion>> {
        ModelName::parse(name)?;
        let models = self.models.read().map_err(|_| poisoned())?;
        let key = self.resolve_in(&models, name)?;
        let entry = models
            .get(key.as_ref())
            .filter(|e| !e.versions.is_empty())
            .ok_or_else(|| {
                Error::not_found(format!("Request for unknown model: '{name}' is not found"))
            })?;
        match version {
            None => entry.versions.values().next_back().cloned(),
            Some(v) => entry.versions.get(&v).cloned(),
        }
        .ok_or_else(|| {
            Error::not_found(format!(
                "Request for unknown model: '{name}' version {} is not found",
                version.unwrap_or_default()
            ))
        })
    }

    /// Whether the model (version) is loaded and its instances are not crash-looping.
    pub fn is_ready(&self, name: &str, version: Option<i64>) -> bool {
        self.get(name, version).is_ok_and(|m| m.health.is_healthy())
    }

    /// [`is_ready`](Self::is_ready), then the model's own readiness check where it has one
    /// (a `model.py`'s `is_ready()`, run on an instance; "not ready" past its timeout), as
    /// Triton answers a model readiness request.
    pub async fn check_ready(&self, name: &str, version: Option<i64>) -> bool {
        let Ok(model) = self.get(name, version) else {
            return false;
        };
        if !model.health.is_healthy() {
            return false;
        }
        match &model.executor {
            Executor::Scheduler(scheduler) => scheduler.check_readiness().await.unwrap_or(true),
            _ => true,
        }
    }

    /// Versions loaded for `name`, ascending.
    pub fn versions(&self, name: &str) -> Vec<i64> {
        self.models
            .read()
            .map(|m| {
                self.resolve_in(&m, name)
                    .ok()
                    .and_then(|key| m.get(key.as_ref()))
                    .map(|e| e.versions.keys().copied().collect())
                    .unwrap_or_default()
            })
            .unwrap_or_default()
    }

    /// Every loaded version of every model.
    pub fn loaded(&self) -> Vec<Arc<ModelVersion>> {
        let Ok(models) = self.models.read() else {
            return vec![];
        };
        let mut all: Vec<Arc<ModelVersion>> = models
            .values()
            .flat_map(|e| e.versions.values().cloned())
            .collect();
        all.sort_by(|a, b| (&a.name, a.version).cmp(&(&b.name, b.version)));
        all
    }

    /// True when every model the manager knows of is ready.
    pub fn all_ready(&self) -> bool {
        self.models
            .read()
            .map(|m| {
                m.values().all(|e| {
                    (e.state == ModelState::Ready
                        && e.versions.values().all(|v| v.health.is_healthy()))
                        || e.reason == UNLOADED
                })
            })
            .unwrap_or(false)
    }

    /// The repository index: every model in the repositories, loaded or not.
    pub fn index(&self, ready_only: bool) -> Vec<IndexEntry> {
        let mut out: BTreeMap<(String, Option<i64>), IndexEntry> = BTreeMap::new();
        if let Ok(found) = self.repository.discover() {
            for name in found.into_keys() {
                out.insert(
                    (name.clone(), None),
                    IndexEntry {
                        name,
                        version: None,
                        state: ModelState::Unavailable,
                        reason: String::new(),
                    },
                );
            }
        }
        if let Ok(models) = self.models.read() {
            for (name, entry) in models.iter() {
                if entry.versions.is_empty() {
                    out.insert(
                        (name.clone(), None),
                        IndexEntry {
                            name: name.clone(),
                            version: None,
                            state: entry.state,
                            reason: entry.reason.clone(),
                        },
                    );
                    continue;
                }
                out.remove(&(name.clone(), None));
                for (v, loaded) in entry.versions.iter() {
                    // A version whose instances crashed is not ready until they are back.
                    let (state, reason) = match loaded.health.unhealthy_reason() {
                        Some(why) => (ModelState::Unavailable, why),
                        None => (ModelState::Ready, loaded.origin.clone().unwrap_or_default()),
                    };
                    out.insert(
                        (name.clone(), Some(*v)),
                        IndexEntry {
                            name: name.clone(),
                            version: Some(*v),
                            state,
                            reason,
                        },
                    );
                    // Its adapters, each as `model:adapter` (the name requests use).
                    let adapters = loaded.capabilities.adapters.as_ref();
                    for adapter in adapters.map(|a| a.names()).unwrap_or_default() {
                        let full = format!("{name}:{adapter}");
                        out.insert(
                            (full.clone(), None),
                            IndexEntry {
                                name: full,
                                version: None,
                                state: ModelState::Ready,
                                reason: format!("adapter of model '{name}'"),
                            },
                        );
                    }
                }
            }
        }
        out.into_values()
            .filter(|e| !ready_only || e.state == ModelState::Ready)
            .collect()
    }

    /// Loads (or reloads) a model from the repository, or from the override content.
    /// An ensemble's composing models that are not loaded yet are loaded first, as in Triton.
    /// `model:adapter` loads a LoRA adapter of a loaded generation model instead
    /// ([`ModelManager::adapter_ref`]).
    pub async fn load(self: &Arc<Self>, name: &str, overrides: LoadOverride) -> Result<()> {
        let name = ModelName::parse(name)?;
        // A load request reads the repository as it is now (remote copies brought up to date).
        self.repository.refresh().await;
        if let Some((model, adapter)) = self.adapter_ref(name.as_str()) {
            return self.load_adapter(model, adapter, overrides).await;
        }
        // With namespacing, a plain name loads every repository's model of that name.
        for key in self.load_keys(name.as_str())? {
            self.load_as_is(&key, overrides.clone()).await?;
        }
        Ok(())
    }

    /// The models a load of `name` would load besides it: the composing models of an
    /// ensemble (and theirs) that are not loaded now. A tenant's load must be allowed for each.
    pub fn would_also_load(&self, name: &str, overrides: &LoadOverride) -> Vec<String> {
        let mut found = Vec::new();
        // A configuration naming bad models fails the load itself; nothing more is loaded.
        let keys = self.load_keys(name).unwrap_or_default();
        let mut todo: Vec<(String, String)> = keys
            .iter()
            .flat_map(|key| {
                let calls = self.composing_of(key, overrides).unwrap_or_default();
                calls.into_iter().map(move |m| (key.clone(), m))
            })
            .collect();
        while let Some((caller, model)) = todo.pop() {
            let model = self.composing_key(&caller, &model);
            if keys.contains(&model) || found.contains(&model) || self.get(&model, None).is_ok() {
                continue;
            }
            let calls = self
                .composing_of(&model, &LoadOverride::default())
                .unwrap_or_default();
            todo.extend(calls.into_iter().map(|m| (model.clone(), m)));
            found.push(model);
        }
        found
    }

    /// [`ModelManager::load`] from the repository as last refreshed.
    async fn load_as_is(self: &Arc<Self>, name: &str, overrides: LoadOverride) -> Result<()> {
        let _guard = self.lifecycle.lock().await;
        self.load_with_composing(name, overrides, &mut HashSet::new())
            .await
    }

    /// Loads `name` after the composing models it needs (if it is an ensemble); `done` holds
    /// the models loaded by this call so far, so that none loads twice.
    fn load_with_composing<'a>(
        self: &'a Arc<Self>,
        name: &'a str,
        overrides: LoadOverride,
        done: &'a mut HashSet<String>,
    ) -> futures::future::BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            done.insert(name.to_owned());
            for model in self.composing_of(name, &overrides)? {
                let model = self.composing_key(name, &model);
                if !done.contains(&model) && self.get(&model, None).is_err() {
                    // A failure shows in the ensemble's own error, which names the step.
                    let _ = self
                        .load_with_composing(&model, LoadOverride::default(), done)
                        .await;
                }
            }
            self.load_locked(name, overrides).await
        })
    }

    /// The models an ensemble calls, or those a stage declares it calls in its
    /// `composing_models` parameter (names separated by commas); none for other models or an
    /// unreadable config.
    fn composing_of(&self, name: &str, overrides: &LoadOverride) -> Result<Vec<String>> {
        let config = match &overrides.config_json {
            Some(json) => config::parse_json(json).ok(),
            None => self
                .repository
                .find(name)
                .ok()
                .and_then(|s| s.read_config().ok()),
        };
        let Some(config) = config else {
            return Ok(Vec::new());
        };
        let names: Vec<String> = if ensemble::is_ensemble(&config) {
            ensemble::composing_models(&config)
                .into_iter()
                .map(|(m, _)| m)
                .collect()
        } else {
            // A stage that calls models (BLS) may name them, so that loading it in explicit
            // mode loads them too, as an ensemble's.
            config
                .parameters
                .get(STAGE_CALLS)
                .map(|names| {
                    names
                        .string_value
                        .split(',')
                        .map(str::trim)
                        .filter(|n| !n.is_empty() && *n != name)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        // The names come from a configuration a load request may send: each passes the check
        // every requested name passes before anything is looked up.
        for model in &names {
            ModelName::parse(model).map_err(|e| {
                Error::invalid(format!(
                    "model '{name}': a model it calls (ensemble step or parameter \
                     '{STAGE_CALLS}'): {}",
                    e.message
                ))
            })?;
        }
        Ok(names)
    }

    /// Why a model cannot serve: not in the repositories, or its load error.
    fn unavailable_reason(&self, name: &str, version: Option<i64>) -> Error {
        let reason = self
            .models
            .read()
            .ok()
            .and_then(|m| m.get(name).map(|e| e.reason.clone()))
            .filter(|r| !r.is_empty());
        match (reason, version) {
            (Some(r), _) => Error::invalid(format!("model '{name}' is not available: {r}")),
            // A failed load of a name the repository does not hold leaves no entry behind.
            (None, _) if self.repository.find(name).is_err() => Error::invalid(format!(
                "model '{name}' is not available: the model repository has no model of that name"
            )),
            (None, Some(v)) => Error::invalid(format!("model '{name}' version {v} is not loaded")),
            (None, None) => Error::invalid(format!("model '{name}' is not loaded")),
        }
    }

    async fn load_locked(self: &Arc<Self>, name: &str, overrides: LoadOverride) -> Result<()> {
        // Every load passes here, an ensemble's composing models (named by a configuration)
        // included.
        ModelName::parse(name)?;
        {
            let mut models = self.models.write().map_err(|_| poisoned())?;
            let entry = models.entry(name.to_owned()).or_insert_with(|| ModelEntry {
                versions: BTreeMap::new(),
                state: ModelState::Loading,
                reason: String::new(),
                fingerprint: 0,
                added: false,
            });
            if entry.versions.is_empty() {
                entry.state = ModelState::Loading;
            }
        }
        tracing::info!(model = name, "loading model");
        let this = self.clone();
        let model = name.to_owned();
        let loading = Loading::start(self, name);
        let (fingerprint, outcome) = tokio::task::spawn_blocking(move || {
            let (fingerprint, outcome) = this.load_versions(&model, &overrides);
            // A reload keeps the adapters clients loaded into the versions it replaces.
            if let Ok(versions) = &outcome {
                this.reapply_adapters(&model, versions);
            }
            (fingerprint, outcome)
        })
        .await
        .unwrap_or_else(|e| {
            let err = Error::internal(format!("model '{name}': load panicked: {e}"));
            (0, Err(err))
        });
        drop(loading);
        let mut models = self.models.write().map_err(|_| poisoned())?;
        let Some(entry) = models.get_mut(name) else {
            return Err(Error::internal(format!(
                "model '{name}' vanished during load"
            )));
        };
        // Remembered on failure too, so that poll mode retries only after the files change.
        entry.fingerprint = fingerprint;
        match outcome {
            Ok(versions) => {
                tracing::info!(model = name, versions = ?versions.keys().collect::<Vec<_>>(), "model loaded");
                self.forget_answers(name);
                entry.versions = versions;
                entry.state = ModelState::Ready;
                entry.reason.clear();
                Ok(())
            }
            Err(err) => {
                tracing::error!(model = name, error = %err, "model load failed");
                if entry.versions.is_empty() && !entry.added && self.repository.find(name).is_err()
                {
                    // Not in the repository and nothing loaded: the index keeps no trace of
                    // it (else every load of a made-up name would grow it for good).
                    models.remove(name);
                    return Err(err);
                }
                if entry.versions.is_empty() {
                    entry.state = ModelState::Unavailable;
                    entry.reason = err.message.clone();
                } else {
                    tracing::warn!(model = name, "keeping the versions already serving");
                }
                Err(err)
            }
        }
    }

    /// Unloads every version of a model; requests already running finish first. A model that
    /// a loaded ensemble calls is refused; with `unload_dependents`, unloading an ensemble
    /// also unloads the models it calls (those no other loaded ensemble needs), as in Triton.
    /// `model:adapter` unloads a LoRA adapter ([`ModelManager::adapter_ref`]).
    pub async fn unload(&self, name: &str, unload_dependents: bool) -> Result<()> {
        ModelName::parse(name)?;
        if let Some((model, adapter)) = self.adapter_ref(name) {
            return self.unload_adapter(model, adapter);
        }
        let _guard = self.lifecycle.lock().await;
        // With namespacing, a plain name unloads every loaded model of that name.
        for key in self.unload_keys(name)? {
            self.unload_locked(&key, unload_dependents)?;
        }
        Ok(())
    }

    /// [`ModelManager::unload`] with the lifecycle lock held (or its holder waiting on this).
    fn unload_locked(&self, name: &str, unload_dependents: bool) -> Result<()> {
        ModelName::parse(name)?;
        let mut models = self.models.write().map_err(|_| poisoned())?;
        let users = |models: &HashMap<String, ModelEntry>, model: &str, except: &str| {
            let mut users: Vec<String> = models
                .iter()
                .filter(|(n, e)| n.as_str() != except && e.versions.values().any(|v| v.uses(model)))
                .map(|(n, _)| n.clone())
                .collect();
            users.sort();
            users
        };
        let using = users(&models, name, name);
        if !using.is_empty() {
            return Err(Error::invalid(format!(
                "failed to unload '{name}': the loaded ensemble(s) {} call it; unload them first \
                 (with unload_dependents to take their models along)",
                using.join(", ")
            )));
        }
        if unload_dependents {
            let composing: HashSet<String> = models
                .get(name)
                .map(|e| {
                    e.versions
                        .values()
                        .filter_map(|v| match &v.executor {
                            Executor::Ensemble(plan) => Some(plan.models().map(str::to_owned)),
                            Executor::Scheduler(_) | Executor::Sequence(_) => None,
                        })
                        .flatten()
                        .collect()
                })
                .unwrap_or_default();
            for model in composing {
                if users(&models, &model, name).is_empty() {
                    if let Some(entry) = models.get_mut(&model) {
                        Self::unload_entry(&model, entry);
                        self.forget_answers(&model);
                        self.forget_adapters(&model);
                    }
                }
            }
        }
        match models.get_mut(name) {
            Some(entry) if !entry.versions.is_empty() => {
                Self::unload_entry(name, entry);
                self.forget_answers(name);
                self.forget_adapters(name);
                Ok(())
            }
            _ => Err(Error::new(
                Code::InvalidArg,
                format!("failed to unload '{name}', no version is available"),
            )),
        }
    }

    /// Drops the response cache's answers of `name` kept in memory (Redis keeps them under the
    /// old content's key, which no request of the new content finds).
    fn forget_answers(&self, name: &str) {
        if let Some(local) = self
            .options
            .response_cache
            .as_deref()
            .and_then(super::response_cache::ResponseCache::as_local)
        {
            local.forget_model(name);
        }
    }

    fn unload_entry(name: &str, entry: &mut ModelEntry) {
        for version in std::mem::take(&mut entry.versions).into_values() {
            version.close();
        }
        entry.state = ModelState::Unavailable;
        entry.reason = UNLOADED.to_owned();
        tracing::info!(model = name, "model unloaded");
    }
}

mod adapters;
mod asked_by_models;
mod bulk;
use asked_by_models::Loading;
mod in_process;
mod namespaces;
mod rights;
mod versions;

fn poisoned() -> Error {
    Error::internal("model table lock poisoned")
}
