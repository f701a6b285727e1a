//! The contract between a backend and the layers above it: an execution instance
//! ([`ModelInstance`]) and what one execution reports, a version ready to serve
//! ([`LoadedBackend`]) with its crash accounting and optional capabilities, and how a backend
//! reaches other models ([`ModelCaller`]). It names no backend; `runtime/mod.rs` dispatches a
//! configuration to the backend that loads it, and every backend imports only this (and the
//! shared plumbing beside it), never the dispatcher.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};
use std::time::Duration;

use super::{buckets, capabilities};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    proto::inference::ModelConfig,
    tensor::Tensor,
};

/// What one execution reports: the time spent in the three phases Triton reports, and the
/// rows of padding it ran with.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExecTimings {
    /// Preparing inputs for the engine.
    pub compute_input: Duration,
    /// The engine's run.
    pub compute_infer: Duration,
    /// Collecting outputs from the engine.
    pub compute_output: Duration,
    /// Rows of zeros added to reach a batch bucket ([`buckets`]); never answered.
    pub padded_rows: u64,
}

/// One execution instance of a model (an ONNX Runtime session, a Wasm stage instance).
pub trait ModelInstance: Send {
    /// Runs the requests of one batch ([`super::batch::compatible`], or ragged-compatible) as one
    /// execution and answers each, in order; `outputs` applies to all of them. Backends that
    /// run one merged tensor use [`super::batch::execute_merged`].
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings);

    /// Runs one validated request and returns the named outputs, in that order: a batch of
    /// one.
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        execute_alone(self, request, outputs)
    }

    /// The model's own readiness check (a `model.py`'s `is_ready()`), run between batches
    /// when a client asks whether the model is ready; `None`: the model has none, and its
    /// readiness is its instances' health.
    fn check_ready(&mut self) -> Option<bool> {
        None
    }

    /// Called between batches, after the last one's answers left: an instance whose guest
    /// crashed (and was discarded) starts its replacement now, so that the model is ready
    /// again without waiting for traffic ([`InstanceHealth::record_down`]).
    fn recover(&mut self) {}
}

/// [`ModelInstance::execute`]'s default: the request as a batch of one.
pub fn execute_alone<I: ModelInstance + ?Sized>(
    instance: &mut I,
    request: &InferRequest,
    outputs: &[String],
) -> Result<(Vec<Tensor>, ExecTimings)> {
    let (mut results, timings) = instance.execute_batch(&[request], outputs);
    let result = results.pop().unwrap_or_else(|| {
        Err(Error::internal(format!(
            "model '{}' gave no result",
            request.model_name
        )))
    });
    result.map(|tensors| (tensors, timings))
}

/// How a backend reaches other models (a stage's `infer` import) without knowing the layers
/// above it: the scheduling layer provides the implementation. Blocking; called from model
/// worker threads only.
pub trait ModelCaller: Send + Sync + std::fmt::Debug {
    /// Runs a request through the target model's normal scheduling and waits for the result;
    /// the wait ends early once the request's own cancellation fires.
    fn infer(&self, request: InferRequest) -> Result<InferResponse> {
        let watch = request.cancel.clone();
        self.infer_watching(request, watch)
    }

    /// [`Self::infer`] whose wait ends early once `watch` fires (not the request's own
    /// cancellation, which the called model sees and may answer as it chooses).
    fn infer_watching(
        &self,
        request: InferRequest,
        watch: crate::cancellation::Cancellation,
    ) -> Result<InferResponse>;

    /// Whether `model` (at `version`; `None`: the policy's) is loaded and ready.
    fn is_ready(&self, model: &str, version: Option<i64>) -> bool;

    /// Loads (or reloads) a model as the repository API does, asked by model `by` for its
    /// `callers` (explicit model control mode; each caller must be allowed the load).
    fn load(&self, by: &str, callers: &[crate::tenancy::Caller], load: ModelLoad) -> Result<()>;

    /// Unloads a model as the repository API does, asked by model `by` for its `callers`.
    fn unload(
        &self,
        by: &str,
        callers: &[crate::tenancy::Caller],
        model: &str,
        unload_dependents: bool,
    ) -> Result<()>;
}

/// A load a model asks for (Triton's Python `pb_utils.load_model`).
#[derive(Debug, Default)]
pub struct ModelLoad {
    /// The model.
    pub model: String,
    /// A configuration in JSON used instead of its `config.pbtxt`.
    pub config_json: Option<String>,
    /// Its files by `file:` key (`file:1/model.onnx`), which need `config_json`.
    pub files: Vec<(String, Vec<u8>)>,
}

/// A model version ready to serve: its completed configuration and its instances.
pub struct LoadedBackend {
    /// The configuration after auto-completion from the model file.
    pub config: ModelConfig,
    /// One entry per execution instance.
    pub instances: Vec<Box<dyn ModelInstance>>,
    /// Crash accounting shared by the instances.
    pub health: Arc<InstanceHealth>,
    /// The shapes its executions are padded to, if any: the scheduler batches requests
    /// whose padded shapes agree.
    pub buckets: Option<Arc<buckets::ShapeBuckets>>,
    /// What warming up the instances took, if the model was warmed up.
    pub warmup: Option<WarmupReport>,
    /// What only some backends have (metrics of their own, adapters, …).
    pub capabilities: capabilities::Capabilities,
    /// Where the served model came from when it is not the version's own file (a
    /// conversion), shown as the version's status.
    pub origin: Option<String>,
    /// The model has a readiness check of its own ([`ModelInstance::check_ready`]).
    pub checks_readiness: bool,
}

impl LoadedBackend {
    /// `instances` serving `config`, with nothing else: no padding buckets, warm-up, optional
    /// capabilities, origin or readiness check of its own (a backend sets what it has).
    pub fn new(config: ModelConfig, instances: Vec<Box<dyn ModelInstance>>) -> Self {
        Self {
            config,
            instances,
            health: Arc::default(),
            buckets: None,
            warmup: None,
            capabilities: capabilities::Capabilities::default(),
            origin: None,
            checks_readiness: false,
        }
    }
}

/// Crash accounting for a model version: instances that trap are replaced, and a version
/// whose instances keep trapping reports itself unhealthy (not ready) instead of flapping
/// silently. One success makes it healthy again.
#[derive(Debug)]
pub struct InstanceHealth {
    consecutive_failures: AtomicU64,
    restarts: AtomicU64,
    /// Instances whose guest crashed and whose replacement is not up yet.
    down: AtomicU64,
    threshold: u64,
}

impl InstanceHealth {
    /// Unhealthy after `threshold` consecutive crashes (0 never).
    pub fn new(threshold: u64) -> Self {
        Self {
            consecutive_failures: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            down: AtomicU64::new(0),
            threshold,
        }
    }
    /// An instance crashed and will be replaced.
    pub fn record_crash(&self) {
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed);
        self.restarts.fetch_add(1, Ordering::Relaxed);
    }
    /// An execution succeeded.
    pub fn record_success(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }
    /// Instances replaced after a crash so far.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
    /// Crashes since the last success.
    pub fn consecutive_failures(&self) -> u64 {
        self.consecutive_failures.load(Ordering::Relaxed)
    }
    /// An instance lost its guest to a crash: the model is not ready until the replacement
    /// is up ([`Self::record_up`]).
    pub fn record_down(&self) {
        self.down.fetch_add(1, Ordering::AcqRel);
    }
    /// A crashed instance's replacement is up.
    pub fn record_up(&self) {
        let _ = self
            .down
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
    /// Instances down now (crashed, their replacement not up).
    pub fn instances_down(&self) -> u64 {
        self.down.load(Ordering::Acquire)
    }
    /// Why the version is not healthy, in words for the repository index; `None` when it is.
    pub fn unhealthy_reason(&self) -> Option<String> {
        let down = self.instances_down();
        let failures = self.consecutive_failures();
        if down > 0 {
            Some(format!(
                "{down} instance(s) crashed and their replacement is starting ({} restarts so \
                 far)",
                self.restarts()
            ))
        } else if self.threshold > 0 && failures >= self.threshold {
            Some(format!(
                "{failures} crashes in a row (max_consecutive_failures {}): not ready until an \
                 execution succeeds",
                self.threshold
            ))
        } else {
            None
        }
    }
    /// False while an instance is down, and once the crashes since the last success reach
    /// the threshold.
    pub fn is_healthy(&self) -> bool {
        self.instances_down() == 0
            && (self.threshold == 0 || self.consecutive_failures() < self.threshold)
    }
}

impl Default for InstanceHealth {
    fn default() -> Self {
        Self::new(0)
    }
}

/// What warming a model version up took ([`super::warmup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WarmupReport {
    /// Executions run, over all instances.
    pub runs: u64,
    /// Wall time of the whole warm-up.
    pub duration: Duration,
}

/// What every backend's load receives beside its own settings: how its models reach other
/// models, the tenants, and where the model came from.
#[derive(Debug, Clone, Default)]
pub struct LoadContext {
    /// Lets guest code (Wasm stages, `model.py` files) call other models.
    pub model_caller: Option<Arc<dyn ModelCaller>>,
    /// The tenants, whose `[tenant.wasm]` limits bound the guest code they may load.
    pub tenancy: Option<Arc<crate::tenancy::Tenancy>>,
    /// Fill inputs, outputs and `max_batch_size` from the model when the config omits them
    /// (`--disable-auto-complete-config` turns it off).
    pub disable_auto_complete: bool,
    /// The model's configuration or files came with a load request (a client's, or a
    /// sandboxed model's `load_model`), not from the repository the operator placed: nothing
    /// of it may make native code run (no conversion unless `--convert-uploaded-models`, no
    /// custom operator libraries). Set per load by the model manager.
    pub sent_by_client: bool,
    /// Models may not load or unload models from their code (`--allow-model-repository-calls
    /// =false`); per model, the `repository_calls` parameter says the same.
    pub forbid_repository_calls: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_is_unhealthy_while_an_instance_is_down_or_crashes_loop() {
        let health = InstanceHealth::new(3);
        assert!(health.is_healthy() && health.unhealthy_reason().is_none());
        health.record_crash();
        health.record_down();
        assert!(!health.is_healthy());
        assert!(health
            .unhealthy_reason()
            .is_some_and(|r| r.contains("replacement is starting")));
        health.record_up();
        health.record_up(); // never below zero
        assert!(health.is_healthy(), "one crash, replaced: ready");
        health.record_crash();
        health.record_crash();
        assert!(health
            .unhealthy_reason()
            .is_some_and(|r| r.contains("3 crashes in a row")));
        health.record_success();
        assert!(health.is_healthy());
    }
}
