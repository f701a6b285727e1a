//! The WebAssembly backend: a model whose configuration says `backend: "wasm"` is a component
//! targeting the `wasmtron:stage` world (`wit/stage.wit`). Each execution instance owns a
//! sandboxed store; a trap (panic, deadline, memory cap) discards it and the next request
//! gets a fresh, re-initialised instance.

mod convert;
mod host_imports;
mod ops;
pub mod state;

use std::{path::Path, sync::Arc};

use wasmtime::{
    component::{HasSelf, Linker},
    Store,
};

use self::convert::*;
use self::state::StageState;
use super::{
    backend::{ExecTimings, InstanceHealth, LoadContext, LoadedBackend, ModelInstance},
    model_config::{instance_count, model_file},
    request_check::check_outputs,
    sandbox::{engine, guest_calls, limits::SandboxLimits, traps, SandboxSettings},
};
use crate::{
    cancellation::Cancellation,
    error::{Code, Error, Result},
    inference::{InferRequest, ParamValue},
    proto::inference::ModelConfig,
    repository::config::to_json,
    tensor::{DataType, Tensor},
};

/// Generated from `wit/stage.wit`.
mod bindings {
    #![allow(missing_docs)]
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "stage",
        with: { "wasmtron:stage/ops.array": crate::runtime::tensor_ops::Array },
    });
}

use bindings::wasmtron::stage::{host as wit_host, types as wit};

/// Default file name of a stage inside a version directory.
pub const DEFAULT_MODEL_FILENAME: &str = "model.wasm";

/// The backend name in config.pbtxt.
pub const BACKEND: &str = "wasm";

/// What every instance of one stage model shares.
struct StageModel {
    name: String,
    config: ModelConfig,
    config_json: String,
    parameters: Vec<(String, String)>,
    limits: SandboxLimits,
    pre: bindings::StagePre<StageState>,
    caller: Option<Arc<dyn super::backend::ModelCaller>>,
    health: Arc<InstanceHealth>,
    /// The version directory, which the stage may read (state::MODEL_FILES_DIR).
    files: std::path::PathBuf,
    single_instance: bool,
    decoupled: bool,
}

type Live = (Store<StageState>, bindings::Stage);

impl StageModel {
    /// Starts the clock of one `init` or `execute` call: the deadline at which the epoch
    /// callback interrupts the guest, and the wall-clock deadline that calls into other
    /// models inherit. Calls end a little earlier (a tenth of the timeout, at most 100 ms),
    /// so that a stage whose call timed out can still answer with that error.
    fn arm_deadline(&self, store: &mut Store<StageState>) {
        let timeout = std::time::Duration::from_millis(self.limits.execution_timeout_ms);
        let ends = std::time::Instant::now() + timeout;
        let margin = (timeout / 10).min(std::time::Duration::from_millis(100));
        store.data_mut().execution_ends = ends;
        store.data_mut().call_deadline = Some(ends - margin);
        store.set_epoch_deadline(1);
    }

    /// Counts the crash and explains it ([`traps::explain`]).
    fn trap_error(&self, store: &Store<StageState>, err: &wasmtime::Error, during: &str) -> Error {
        let stopped = traps::Stopped {
            who: format!("stage '{}'", self.name),
            limits: &self.limits,
            health: &self.health,
            memory_exceeded: store.data().limits.exceeded,
            printed: store.data().printed(),
        };
        traps::explain(stopped, err, during)
    }

    fn instantiate(&self) -> Result<Live> {
        let engine = engine::engine()?;
        let mut store = Store::new(
            engine,
            StageState::new(&self.name, &self.limits, self.caller.clone(), &self.files)?,
        );
        store.limiter(|s| &mut s.limits);
        // Every epoch tick the guest is interrupted if its batch was cancelled or its time is
        // up: a stage whose client left stops within a tick, not at its deadline.
        store.epoch_deadline_callback(|store| {
            let state = store.data();
            let abandoned = state
                .cancel
                .as_ref()
                .is_some_and(Cancellation::is_cancelled);
            match traps::interruption(abandoned, state.execution_ends) {
                Some(stop) => Err(stop),
                None => Ok(wasmtime::UpdateDeadline::Continue(1)),
            }
        });
        store.data_mut().single_instance = self.single_instance;
        self.arm_deadline(&mut store);
        let stage = self
            .pre
            .instantiate(&mut store)
            .map_err(|e| self.trap_error(&store, &e, "instantiation"))?;
        match stage.wasmtron_stage_model().call_init(
            &mut store,
            &self.config_json,
            &self.parameters,
        ) {
            Ok(Ok(())) => Ok((store, stage)),
            Ok(Err(e)) => Err(from_wit_error(
                &self.name,
                wit::Error {
                    message: format!("init failed: {}", e.message),
                    ..e
                },
            )),
            Err(e) => Err(self.trap_error(&store, &e, "init")),
        }
    }
}

/// One execution instance of a stage.
struct StageInstance {
    model: Arc<StageModel>,
    live: Option<Live>,
    /// Its guest crashed and no replacement is up yet (counted in the model's health).
    down: bool,
}

/// The outputs the stage set through `ops.set-output` during the batch, per request; the
/// bytes they held are no longer counted against its memory.
fn take_set_outputs(store: &mut Store<StageState>, requests: usize) -> Vec<Vec<Tensor>> {
    let set_outputs = std::mem::take(&mut store.data_mut().set_outputs);
    let set_bytes: usize = set_outputs.iter().map(|(_, t)| t.data.len()).sum();
    let held = &mut store.data_mut().limits.held_bytes;
    *held = held.saturating_sub(set_bytes);
    let mut per_request: Vec<Vec<Tensor>> = vec![Vec::new(); requests];
    for (index, tensor) in set_outputs {
        if let Some(slot) = per_request.get_mut(index as usize) {
            slot.push(tensor);
        }
    }
    per_request
}

impl StageInstance {
    /// What the store holds for one batch: its deadline (no later than a calling stage's),
    /// the responder of a decoupled stage, the callers whose rights its calls carry, the
    /// batch's cancellation and its inputs.
    fn prepare(
        &self,
        store: &mut Store<StageState>,
        requests: &[&InferRequest],
        outputs: &[String],
    ) {
        self.model.arm_deadline(store);
        // Work done for a stage that called us must not outlive that caller's wait.
        if let Some(inherited) = requests.iter().filter_map(|r| r.deadline).min() {
            let own = &mut store.data_mut().call_deadline;
            *own = Some(own.map_or(inherited, |d| d.min(inherited)));
        }
        if self.model.decoupled {
            store.data_mut().respond = Some(self.responder(requests, outputs));
        }
        let mut callers: Vec<_> = requests.iter().flat_map(|r| r.callers.clone()).collect();
        callers.dedup();
        store.data_mut().callers = callers;
        store.data_mut().cancel = Some(Cancellation::child_of_all(
            requests.iter().map(|r| r.cancel.clone()),
        ));
        store.data_mut().batch_inputs = Some(requests.iter().map(|r| r.inputs.clone()).collect());
    }

    /// A live guest: the one kept, or a new one (which ends a crash's downtime).
    fn take_live(&mut self) -> Result<Live> {
        if let Some(live) = self.live.take() {
            return Ok(live);
        }
        let live = self.model.instantiate()?;
        if std::mem::take(&mut self.down) {
            self.model.health.record_up();
        }
        Ok(live)
    }

    /// The guest crashed: the model is not ready until a new one is up.
    fn crashed(&mut self, err: &Error) {
        if err.code != Code::Cancelled && !self.down {
            self.down = true;
            self.model.health.record_down();
        }
    }

    /// What `host.respond` does during one `execute` of a decoupled model: check the outputs
    /// like a final response, then send them down the request's stream.
    fn responder(&self, requests: &[&InferRequest], outputs: &[String]) -> state::Responder {
        let model = self.model.clone();
        let outputs = outputs.to_vec();
        let targets: Vec<(Option<crate::inference::ResponseSink>, Option<i64>)> = requests
            .iter()
            .map(|r| {
                let batch = (model.config.max_batch_size > 0)
                    .then(|| r.inputs.first().and_then(|t| t.shape.first()).copied())
                    .flatten();
                (r.responses.clone(), batch)
            })
            .collect();
        let deadline = std::time::Instant::now()
            + std::time::Duration::from_millis(model.limits.execution_timeout_ms);
        Box::new(move |index, tensors| {
            let Some((sink, batch)) = targets.get(index as usize) else {
                return Err(Error::invalid(format!(
                    "stage '{}': respond to request {index}, but the batch has {} requests",
                    model.name,
                    targets.len()
                )));
            };
            let Some(sink) = sink else {
                return Err(Error::invalid(format!(
                    "stage '{}': request {index} does not take streamed responses",
                    model.name
                )));
            };
            let max_bytes = usize::try_from(model.limits.max_output_mb.saturating_mul(1 << 20))
                .unwrap_or(usize::MAX);
            let tensors = check_outputs(&model.config, &outputs, tensors, *batch, max_bytes)
                .map_err(|e| Error::new(e.code, format!("stage '{}' {}", model.name, e.message)))?;
            sink.send_blocking(tensors, Some(deadline))
        })
    }

    /// Checks one result of `execute`, with the outputs the stage set through
    /// `ops.set-output`, against the configuration.
    fn finish(
        &self,
        request: &InferRequest,
        outputs: &[String],
        result: std::result::Result<Vec<wit::Tensor>, wit::Error>,
        set: Vec<Tensor>,
        max_bytes: usize,
    ) -> Result<Vec<Tensor>> {
        let returned = result.map_err(|e| from_wit_error(&self.model.name, e))?;
        if self.model.decoupled && returned.is_empty() && set.is_empty() {
            // A decoupled request may end without a last response.
            return Ok(Vec::new());
        }
        let mut tensors: Vec<Tensor> = returned.into_iter().map(from_wit_tensor).collect();
        for t in set {
            if !tensors.iter().any(|r| r.name == t.name) {
                tensors.push(t);
            }
        }
        let batch = if self.model.config.max_batch_size > 0 {
            request
                .inputs
                .first()
                .and_then(|t| t.shape.first())
                .copied()
        } else {
            None
        };
        check_outputs(&self.model.config, outputs, tensors, batch, max_bytes)
            .map_err(|e| Error::new(e.code, format!("stage '{}' {}", self.model.name, e.message)))
    }
}

impl ModelInstance for StageInstance {
    /// A crashed stage's replacement, instantiated (and initialised) now.
    fn recover(&mut self) {
        if self.down && self.live.is_none() {
            match self.take_live() {
                Ok(live) => self.live = Some(live),
                Err(e) => tracing::warn!(model = %self.model.name, "{}", e.message),
            }
        }
    }

    /// A batch reaches the stage as a list of requests, like Triton's `execute(requests)`:
    /// each keeps its own shapes, parameters and result.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let all = |e: Error| vec![Err(e); requests.len()];
        let _span = crate::trace_span!(
            parent: &tracing::Span::current(),
            "wasm.call",
            stage = %self.model.name
        )
        .entered();
        let start = std::time::Instant::now();
        let (mut store, stage) = match self.take_live() {
            Ok(live) => live,
            Err(e) => return (all(e), ExecTimings::default()),
        };
        self.prepare(&mut store, requests, outputs);
        let wit_requests: Vec<wit::Request> = requests
            .iter()
            .map(|request| wit::Request {
                id: request.id.clone(),
                inputs: request.inputs.iter().map(to_wit_tensor).collect(),
                requested_outputs: outputs.to_vec(),
                parameters: wit_parameters(request),
            })
            .collect();
        let prepared = std::time::Instant::now();
        let result = stage
            .wasmtron_stage_model()
            .call_execute(&mut store, &wit_requests);
        let ran = std::time::Instant::now();
        // Dropping the senders lets each response stream end once its request is answered.
        store.data_mut().respond = None;
        store.data_mut().cancel = None;
        store.data_mut().callers.clear();
        store.data_mut().batch_inputs = None;
        let refused_call = store.data_mut().refused_call.take();
        let set_per_request = take_set_outputs(&mut store, requests.len());
        let results = match result {
            Ok(results) => results,
            // The store is dropped here: a trapped instance is never entered again.
            Err(e) => {
                let err = self.model.trap_error(&store, &e, "execute");
                self.crashed(&err);
                return (all(err), ExecTimings::default());
            }
        };
        if store.data().limits.nearly_full() {
            tracing::debug!(
                model = %self.model.name,
                "stage instance replaced: its linear memory passed 3/4 of memory_limit_mb"
            );
        } else if !self.model.limits.fresh_instance_per_request {
            self.live = Some((store, stage));
        }
        self.model.health.record_success();
        if let Some(err) = refused_call {
            return (all(err), ExecTimings::default());
        }
        if results.len() != requests.len() {
            let err = Error::internal(format!(
                "stage '{}' returned {} results for {} requests",
                self.model.name,
                results.len(),
                requests.len()
            ));
            return (all(err), ExecTimings::default());
        }
        let max_bytes = usize::try_from(self.model.limits.max_output_mb.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX);
        let answers = requests
            .iter()
            .zip(results)
            .zip(set_per_request)
            .map(|((request, result), set)| self.finish(request, outputs, result, set, max_bytes))
            .collect();
        let timings = ExecTimings {
            compute_input: prepared - start,
            compute_infer: ran - prepared,
            compute_output: ran.elapsed(),
            padded_rows: 0,
        };
        (answers, timings)
    }
}

/// Loads a stage: compiles (or loads from cache) the component, links the sandbox, and
/// creates the instances, initialising the first one so that a broken `init` fails the load.
pub fn load(
    config: ModelConfig,
    version_dir: &Path,
    sandbox: &SandboxSettings,
    load: &LoadContext,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    if config.input.is_empty() || config.output.is_empty() {
        return Err(Error::invalid(format!(
            "model '{name}': a wasm stage must declare its inputs and outputs in config.pbtxt"
        )));
    }
    super::sandbox::refuse_gpu_instances(&config, "Wasm stages", "a stage")?;
    let path = model_file(&config, version_dir, DEFAULT_MODEL_FILENAME)?;
    let (limits, _) = SandboxLimits::for_model(&config, load.tenancy.as_deref())?;
    if engine::options().pooling_instances > 0 && limits.memory_limit_mb > engine::POOLING_MEMORY_MB
    {
        return Err(Error::invalid(format!(
            "model '{}': parameter memory_limit_mb is {} but the pooling allocator \
             (--wasm-pooling-instances) gives each instance at most {} MiB",
            config.name,
            limits.memory_limit_mb,
            engine::POOLING_MEMORY_MB
        )));
    }
    let engine = engine::engine()?;
    let started = std::time::Instant::now();
    let cache = sandbox.compile_cache();
    let (component, source) = engine::load_component(engine, &path, cache.as_deref())
        .map_err(|e| Error::invalid(format!("model '{name}': {}", e.message)))?;
    let how = match source {
        engine::CompileSource::Cache => "loaded from cache",
        engine::CompileSource::Compiled => "compiled",
    };
    tracing::info!(model = %name, ms = started.elapsed().as_millis() as u64, "stage component {how}");
    let mut linker = Linker::<StageState>::new(engine);
    let link = |e: wasmtime::Error| {
        Error::internal(format!("model '{name}': cannot set up the sandbox: {e}"))
    };
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(link)?;
    bindings::Stage::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s).map_err(link)?;
    let pre = linker
        .instantiate_pre(&component)
        .and_then(bindings::StagePre::new)
        .map_err(|e| {
            Error::invalid(format!(
                "model '{name}': '{}' does not fit the wasmtron:stage world (it must export wasmtron:stage/model and import only wasmtron:stage/host and WASI 0.2): {e:#}",
                path.display()
            ))
        })?;
    let parameters = config
        .parameters
        .iter()
        .map(|(k, v)| (k.clone(), v.string_value.clone()))
        .collect();
    let model = Arc::new(StageModel {
        name: name.clone(),
        config_json: to_json(&config).to_string(),
        config: config.clone(),
        parameters,
        health: Arc::new(InstanceHealth::new(limits.max_consecutive_failures)),
        files: version_dir.to_path_buf(),
        limits,
        pre,
        caller: load.model_caller.clone(),
        single_instance: instance_count(&config) == 1,
        decoupled: config
            .model_transaction_policy
            .as_ref()
            .is_some_and(|p| p.decoupled),
    });
    let health = model.health.clone();
    let count = instance_count(&config);
    if count == 0 {
        return Err(Error::invalid(format!(
            "model '{name}': every instance_group is passive, so no instance would take \
             requests; set passive: false on at least one"
        )));
    }
    let mut instances: Vec<Box<dyn ModelInstance>> = Vec::with_capacity(count);
    let first = model.instantiate()?;
    instances.push(Box::new(StageInstance {
        model: model.clone(),
        live: Some(first),
        down: false,
    }));
    for _ in 1..count {
        instances.push(Box::new(StageInstance {
            model: model.clone(),
            live: None,
            down: false,
        }));
    }
    Ok(LoadedBackend {
        health,
        ..LoadedBackend::new(config, instances)
    })
}
