//! What every instance of one Python model shares ([`PythonModel`]): its configuration,
//! limits and interpreter build, and the turns that start an interpreter, load `model.py`, run
//! `auto_complete_config` and check what it returns.

use std::{
    path::PathBuf,
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use super::{
    batch_calls::BatchCalls,
    interpreter::{self, Interpreter, Runtime},
    snapshot::MemorySnapshot,
    BACKEND,
};
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    runtime::{
        backend::InstanceHealth,
        sandbox::{limits::SandboxLimits, traps},
    },
    tensor::Tensor,
};

/// Where the guest sees the model's folder (read-only): `/models/<name>`, so that
/// `args["model_repository"]` and `args["model_version"]` lead to `model.py` and the files
/// beside it as they do on Triton.
fn guest_model_dir(name: &str) -> String {
    format!("/models/{name}")
}

/// A string as a Python literal (JSON's string syntax is Python's).
fn json_literal(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// Where the guest sees a model's own packages (`EXECUTION_ENV_PATH`), read-only.
const PACKAGES_DIR: &str = "/packages";

/// The guest sources, run in every new interpreter.
const PB_UTILS: &str = include_str!("guest/triton_python_backend_utils.py");
const BACKEND_PY: &str = include_str!("guest/backend.py");

/// What every instance of one Python model shares.
pub(crate) struct PythonModel {
    pub(super) name: String,
    pub(super) config_json: String,
    pub(super) limits: SandboxLimits,
    pub(super) runtime: Arc<Runtime>,
    /// The model's folder (parent of the version directory), readable by the guest.
    pub(super) model_dir: PathBuf,
    /// Its own packages (`EXECUTION_ENV_PATH`), readable by the guest at [`PACKAGES_DIR`].
    pub(super) packages: Option<Arc<super::packages::Packages>>,
    pub(super) version: String,
    pub(super) model_file: String,
    pub(super) caller: Option<Arc<dyn crate::runtime::backend::ModelCaller>>,
    /// Whether its code may load and unload models.
    pub(super) repository_calls: super::RepositoryCalls,
    pub(super) health: Arc<InstanceHealth>,
    pub(super) single_instance: bool,
    /// Answers through response senders (`model_transaction_policy.decoupled`).
    pub(super) decoupled: bool,
    /// Names this loaded version's custom metric families, released when it goes.
    pub(super) metrics_owner: u64,
    /// `TritonPythonModel` defines `is_ready()` (learnt when the first instance loads).
    pub(super) has_is_ready: std::sync::atomic::AtomicBool,
    /// A decoupled model whose `execute` is `async def`: its batches run in the background
    /// ([`super::background`]; learnt when the first instance loads).
    pub(super) runs_in_background: std::sync::atomic::AtomicBool,
    /// Requests may be released for rescheduling (`sequence_batching { iterative_sequence:
    /// true }`).
    pub(super) iterative: bool,
    /// The interpreter after `model.py` was imported, which instances start from: set by the
    /// first start, `None` when that import left something a snapshot cannot hold
    /// ([`super::snapshot`]; every instance then starts in full).
    pub(super) snapshot: std::sync::OnceLock<Option<Arc<MemorySnapshot>>>,
}

/// Turns that set up an interpreter: the utilities module, then the backend's driver.
fn setup_source() -> String {
    let pb = serde_json::to_string(PB_UTILS).unwrap_or_default();
    format!(
        "import sys as _s, types as _t\n\
         _m = _t.ModuleType('triton_python_backend_utils')\n\
         _m.__file__ = '<wasmtron>/triton_python_backend_utils.py'\n\
         exec(compile({pb}, _m.__file__, 'exec'), _m.__dict__)\n\
         _s.modules['triton_python_backend_utils'] = _m\n\
         del _s, _t, _m\n"
    )
}

impl Drop for PythonModel {
    fn drop(&mut self) {
        super::metrics::release(self.metrics_owner);
    }
}

impl PythonModel {
    /// Whether readiness checks run the model's own `is_ready()`.
    pub(super) fn checks_readiness(&self) -> bool {
        self.has_is_ready.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether batches run in the background (a decoupled `async def execute`).
    pub(super) fn runs_in_background(&self) -> bool {
        self.runs_in_background
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.limits.execution_timeout_ms)
    }

    /// Triton's `args` for `initialize`: every value a string, the configuration as JSON.
    fn args(&self, instance: usize) -> String {
        serde_json::json!({
            "model_config": self.config_json,
            "model_instance_kind": "CPU",
            "model_instance_name": format!("{}_0_{instance}", self.name),
            "model_instance_device_id": "0",
            "model_repository": guest_model_dir(&self.name),
            "model_version": self.version,
            "model_name": self.name,
        })
        .to_string()
    }

    /// Counts the crash and explains it ([`traps::explain`]).
    fn trap_error(
        &self,
        interp: Option<&Interpreter>,
        err: &wasmtime::Error,
        during: &str,
    ) -> Error {
        let stopped = traps::Stopped {
            who: format!("Python model '{}'", self.name),
            limits: &self.limits,
            health: &self.health,
            memory_exceeded: interp.is_some_and(Interpreter::memory_exceeded),
            printed: interp.map(Interpreter::printed).unwrap_or_default(),
        };
        traps::explain(stopped, err, during)
    }

    /// One turn with a host side, which comes back whatever happened (`None` only if the
    /// interpreter lost it); a trap is an error (the interpreter must be discarded).
    pub(super) fn turn_with<D: interpreter::HostCalls + 'static>(
        self: &Arc<Self>,
        interp: &mut Interpreter,
        source: &str,
        calls: D,
        cancel: Option<crate::cancellation::Cancellation>,
        during: &str,
    ) -> (std::result::Result<(), Error>, Option<D>) {
        interpreter::block_on(self.turn_with_async(interp, source, calls, cancel, during))
    }

    /// [`turn_with`](Self::turn_with) as a future: pending while the host side holds a frame back.
    pub(super) async fn turn_with_async<D: interpreter::HostCalls + 'static>(
        self: &Arc<Self>,
        interp: &mut Interpreter,
        source: &str,
        calls: D,
        cancel: Option<crate::cancellation::Cancellation>,
        during: &str,
    ) -> (std::result::Result<(), Error>, Option<D>) {
        let (tx, rx) = mpsc::channel();
        let boxed = Box::new(Returning {
            calls: Some(calls),
            tx,
        });
        let result = interp
            .turn_async(source, boxed, self.timeout(), cancel)
            .await;
        self.turn_result(interp, rx, result, during)
    }

    fn turn_result<D>(
        &self,
        interp: &Interpreter,
        rx: mpsc::Receiver<D>,
        result: wasmtime::Result<i32>,
        during: &str,
    ) -> (std::result::Result<(), Error>, Option<D>) {
        let calls = rx.try_recv().ok();
        let result = match result {
            Ok(0) => Ok(()),
            Ok(_) => Err(Error::internal(format!(
                "Python model '{}': the backend's own code failed during {during}: {}",
                self.name,
                interp.printed()
            ))),
            Err(e) => Err(self.trap_error(Some(interp), &e, during)),
        };
        (result, calls)
    }

    /// One turn with a batch's host side; a trap is an error (the interpreter must be discarded).
    pub(super) fn turn(
        self: &Arc<Self>,
        interp: &mut Interpreter,
        source: &str,
        calls: BatchCalls,
        during: &str,
    ) -> std::result::Result<BatchCalls, Error> {
        let cancel = calls.cancel.clone();
        match self.turn_with(interp, source, calls, cancel, during) {
            (Ok(()), Some(calls)) => Ok(calls),
            (Ok(()), None) => Err(Error::internal("the Python backend lost its calls")),
            (Err(e), _) => Err(e),
        }
    }

    /// The guest paths of `model.py` and of its version directory.
    fn guest_paths(&self) -> (String, String) {
        let version_dir = format!("{}/{}", guest_model_dir(&self.name), self.version);
        (format!("{version_dir}/{}", self.model_file), version_dir)
    }

    /// The folders the guest sees besides the standard library, in the order they are opened.
    fn mounts(&self) -> Vec<(PathBuf, String)> {
        let mut mounts = vec![(self.model_dir.clone(), guest_model_dir(&self.name))];
        if let Some(packages) = &self.packages {
            mounts.push((packages.folder.clone(), PACKAGES_DIR.to_owned()));
        }
        mounts
    }

    /// A fresh interpreter with `triton_python_backend_utils` and the backend's driver.
    fn boot(self: &Arc<Self>) -> Result<(Interpreter, BatchCalls)> {
        let mounts = self.mounts();
        let mut interp = Interpreter::start(&self.runtime, &mounts, self.limits.memory_bytes())
            .map_err(|e| self.trap_error(None, &e, "instantiation"))?;
        let calls = BatchCalls::idle(self.clone());
        let calls = self.turn(&mut interp, &setup_source(), calls, "set-up")?;
        let mut calls = self.turn(&mut interp, BACKEND_PY, calls, "set-up")?;
        if self.packages.is_some() {
            // Checked and put on sys.path as the model is imported (load, auto-complete).
            let set = format!("_wasmtron.packages = {}", json_literal(PACKAGES_DIR));
            calls = self.turn(&mut interp, &set, calls, "set-up")?;
        }
        Ok((interp, calls))
    }

    /// A fresh interpreter with `model.py` loaded and `initialize(args)` run: from the
    /// model's snapshot when it has one, else booted and imported (the first start takes the
    /// snapshot).
    pub(super) fn start(self: &Arc<Self>, instance: usize) -> Result<Interpreter> {
        let started = Instant::now();
        let (mut interp, calls, from) = match self.snapshot.get() {
            Some(Some(snapshot)) => {
                let (interp, calls) = self.restore(snapshot)?;
                (interp, calls, "snapshot")
            }
            _ => {
                let (interp, calls) = self.import()?;
                (interp, calls, "import")
            }
        };
        let (model_file, version_dir) = self.guest_paths();
        let load = format!(
            "_wasmtron.load({}, {}, {})",
            json_literal(&self.args(instance)),
            json_literal(&model_file),
            json_literal(&version_dir),
        );
        let calls = self.turn(&mut interp, &load, calls, "initialize")?;
        if let Some(failure) = calls.failure {
            // An instance that cannot start again after a crash is one more crash in a row:
            // the model reports not ready once they reach max_consecutive_failures.
            self.health.record_crash();
            return Err(Error::invalid(format!(
                "Python model '{}' failed to load: {failure}",
                self.name
            )));
        }
        // The guest says what its class defines once `initialize` has run.
        if let Some(said) = &calls.completed {
            let said = serde_json::from_slice::<serde_json::Value>(said).unwrap_or_default();
            let says = |key: &str| said.get(key).and_then(|r| r.as_bool()).unwrap_or(false);
            self.has_is_ready
                .store(says("is_ready"), std::sync::atomic::Ordering::Relaxed);
            self.runs_in_background.store(
                self.decoupled && says("background"),
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        let us = started.elapsed().as_micros() as u64;
        tracing::debug!(model = %self.name, instance, from, us, "Python instance started");
        Ok(interp)
    }

    /// A booted interpreter with `model.py` imported; the first one keeps a snapshot of it
    /// for later starts, and is itself replaced by a start from that snapshot, so that every
    /// instance shares the pages it does not write.
    fn import(self: &Arc<Self>) -> Result<(Interpreter, BatchCalls)> {
        let (mut interp, calls) = self.boot()?;
        let (model_file, version_dir) = self.guest_paths();
        let prepare = format!(
            "_wasmtron.prepare({}, {})",
            json_literal(&model_file),
            json_literal(&version_dir)
        );
        let mut calls = self.turn(&mut interp, &prepare, calls, "import")?;
        if let Some(failure) = calls.failure.take() {
            self.health.record_crash();
            return Err(Error::invalid(format!(
                "Python model '{}' failed to load: {failure}",
                self.name
            )));
        }
        let said = calls.completed.take().unwrap_or_default();
        let said = serde_json::from_slice::<serde_json::Value>(&said).unwrap_or_default();
        let descriptors = said.get("descriptors").and_then(|d| d.as_u64());
        // The standard library's folder and the mounts; anything more is a file left open.
        let opened = 1 + self.mounts().len() as u64;
        if self.snapshot.get().is_some() {
            return Ok((interp, calls));
        }
        let snapshot = if descriptors == Some(opened) {
            match interp.snapshot() {
                Ok(s) => Some(Arc::new(s)),
                Err(e) => {
                    tracing::warn!(model = %self.name, "{}; instances start in full", e.message);
                    None
                }
            }
        } else {
            tracing::info!(
                model = %self.name,
                "model.py's import leaves {} file(s) open: instances start in full, not \
                 from a snapshot",
                descriptors.unwrap_or_default().saturating_sub(opened)
            );
            None
        };
        match self.snapshot.set(snapshot) {
            Ok(()) => match self.snapshot.get() {
                Some(Some(snapshot)) => self.restore(snapshot),
                _ => Ok((interp, calls)),
            },
            // Another start took one first.
            Err(_) => Ok((interp, calls)),
        }
    }

    /// An interpreter started from `snapshot`, its random generators reseeded.
    fn restore(self: &Arc<Self>, snapshot: &MemorySnapshot) -> Result<(Interpreter, BatchCalls)> {
        let mut interp = Interpreter::restore(
            &self.runtime,
            &self.mounts(),
            self.limits.memory_bytes(),
            snapshot,
        )
        .map_err(|e| self.trap_error(None, &e, "instantiation"))?;
        let calls = BatchCalls::idle(self.clone());
        let calls = self.turn(&mut interp, "_wasmtron.reseed()", calls, "set-up")?;
        Ok((interp, calls))
    }

    /// The configuration after `TritonPythonModel.auto_complete_config(config)`, run in an
    /// interpreter of its own before any instance starts (the model's class need not define it).
    pub(super) fn auto_complete(self: &Arc<Self>) -> Result<ModelConfig> {
        let (mut interp, calls) = self.boot()?;
        let (model_file, version_dir) = self.guest_paths();
        let call = format!(
            "_wasmtron.auto_complete({}, {}, {})",
            json_literal(&self.config_json),
            json_literal(&model_file),
            json_literal(&version_dir),
        );
        let calls = self.turn(&mut interp, &call, calls, "auto_complete_config")?;
        if let Some(failure) = calls.failure {
            return Err(Error::invalid(format!(
                "Python model '{}': auto_complete_config failed: {failure}",
                self.name
            )));
        }
        let json = calls.completed.unwrap_or_default();
        let mut config = crate::repository::config::parse_json(&String::from_utf8_lossy(&json))
            .map_err(|e| {
                Error::invalid(format!(
                    "Python model '{}': auto_complete_config returned a configuration that \
                     does not parse: {e}",
                    self.name
                ))
            })?;
        config.name = self.name.clone();
        config.backend = BACKEND.to_owned();
        Ok(config)
    }

    /// The outputs of one response: the requested ones, in order, each well-formed and
    /// together within `max_output_mb`. Types and shapes are the model's own, as on Triton
    /// (which passes what `model.py` returns through unchecked).
    pub(super) fn outputs(
        &self,
        requested: &[String],
        mut tensors: Vec<Tensor>,
    ) -> Result<Vec<Tensor>> {
        let max = usize::try_from(self.limits.max_output_mb.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(requested.len());
        let mut total = 0usize;
        for name in requested {
            // As in Triton's Python backend, a response may leave an output out: the client
            // (or the ensemble step) gets the outputs the model returned.
            let Some(i) = tensors.iter().position(|t| &t.name == name) else {
                continue;
            };
            let t = tensors.swap_remove(i);
            t.validate_size().map_err(|e| {
                Error::internal(format!(
                    "Python model '{}' returned a malformed output: {}",
                    self.name, e.message
                ))
            })?;
            total = total.saturating_add(t.data.len());
            if total > max {
                return Err(Error::internal(format!(
                    "Python model '{}' returned more than {} MiB of outputs (parameter max_output_mb)",
                    self.name, self.limits.max_output_mb
                )));
            }
            out.push(t);
        }
        Ok(out)
    }
}

/// Hands the host side back after the turn (the interpreter owns it during the turn).
struct Returning<D> {
    calls: Option<D>,
    tx: mpsc::Sender<D>,
}

impl<D: interpreter::HostCalls> interpreter::HostCalls for Returning<D> {
    fn poll_ready(&mut self, frame: &[u8], cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.calls.as_mut() {
            Some(calls) => calls.poll_ready(frame, cx),
            None => std::task::Poll::Ready(()),
        }
    }

    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        match self.calls.as_mut() {
            Some(calls) => calls.call(frame),
            None => Vec::new(),
        }
    }

    fn memory(&mut self, nearly_full: bool) {
        if let Some(calls) = self.calls.as_mut() {
            calls.memory(nearly_full);
        }
    }

    fn rearm(&mut self) -> Option<(Instant, Option<crate::cancellation::Cancellation>)> {
        self.calls.as_mut().and_then(|d| d.rearm())
    }
}

impl<D> Drop for Returning<D> {
    fn drop(&mut self) {
        if let Some(calls) = self.calls.take() {
            let _ = self.tx.send(calls);
        }
    }
}
