//! Triton's Python backend, sandboxed: a model whose configuration says `backend: "python"`
//! is a Triton `model.py` (a `TritonPythonModel` class on `triton_python_backend_utils` and
//! numpy), run unchanged by a CPython interpreter compiled to WebAssembly
//! ([`interpreter`]). Each model instance owns one long-lived interpreter on a thread of its
//! own, as Triton gives each instance a stub process, but in-process and in the Wasm sandbox:
//! the model reads its own folder and nothing else, has no network, no environment, a memory
//! cap and a deadline per call. A trap discards the interpreter; the next batch gets a fresh
//! one, loaded and initialised again.

mod door;
pub mod interpreter;
pub mod metrics;
pub mod protocol;

use std::{
    path::{Path, PathBuf},
    sync::{mpsc, Arc},
    time::{Duration, Instant},
};

use self::{
    door::BatchDoor,
    interpreter::{Interpreter, Runtime, TurnCancelled},
    protocol::{Frame, ResponseHeader},
};
use super::{
    instance_count, wasm::sandbox::SandboxLimits, ExecTimings, InstanceHealth, LoadedBackend,
    ModelInstance, RuntimeOptions,
};
use crate::{
    error::{Code, Error, Result},
    inference::InferRequest,
    proto::inference::ModelConfig,
    repository::config::to_json,
    tensor::Tensor,
};

/// The backend name in config.pbtxt.
pub const BACKEND: &str = "python";

/// Default file name of a model inside a version directory.
pub const DEFAULT_MODEL_FILENAME: &str = "model.py";

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

/// Whether a model with no backend named is a Python-backend model: its version directory has
/// `model.py` (or the configured file name ends in `.py`) and no `model.onnx`, which is how
/// Triton tells a configuration-less Python model.
pub fn owns(config: &ModelConfig, version_dir: &Path) -> bool {
    let file = super::model_file_name(config, DEFAULT_MODEL_FILENAME);
    file.ends_with(".py")
        && version_dir.join(file).is_file()
        && !version_dir
            .join(super::onnx::DEFAULT_MODEL_FILENAME)
            .exists()
}

/// The guest sources, run in every new interpreter.
const PB_UTILS: &str = include_str!("guest/triton_python_backend_utils.py");
const BACKEND_PY: &str = include_str!("guest/backend.py");

/// What every instance of one Python model shares.
pub(crate) struct PythonModel {
    name: String,
    config_json: String,
    limits: SandboxLimits,
    runtime: Arc<Runtime>,
    /// The model's folder (parent of the version directory), readable by the guest.
    model_dir: PathBuf,
    version: String,
    model_file: String,
    caller: Option<Arc<dyn super::ModelCaller>>,
    health: Arc<InstanceHealth>,
    single_instance: bool,
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

impl PythonModel {
    fn timeout(&self) -> Duration {
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

    /// Explains a trap (deadline, memory cap, or what the interpreter printed) and counts
    /// the crash; an interpreter stopped because nobody waits for its batch did not crash.
    fn trap_error(
        &self,
        interp: Option<&Interpreter>,
        err: &wasmtime::Error,
        during: &str,
    ) -> Error {
        if err.downcast_ref::<TurnCancelled>().is_some() {
            return Error::new(
                Code::Cancelled,
                format!(
                    "model '{}' was interrupted during {during}: nobody waits for its answer \
                     any more; the instance was discarded",
                    self.name
                ),
            );
        }
        self.health.record_crash();
        let printed = interp.map(Interpreter::printed).unwrap_or_default();
        let detail = if printed.is_empty() {
            String::new()
        } else {
            format!("; output: {printed}")
        };
        let reason = if matches!(
            err.downcast_ref::<wasmtime::Trap>(),
            Some(wasmtime::Trap::Interrupt)
        ) {
            format!(
                "exceeded its execution deadline of {} ms (parameter execution_timeout_ms)",
                self.limits.execution_timeout_ms
            )
        } else if interp.is_some_and(Interpreter::memory_exceeded) {
            format!(
                "exceeded its memory limit of {} MiB (parameter memory_limit_mb)",
                self.limits.memory_limit_mb
            )
        } else {
            format!("trapped: {}", err.root_cause())
        };
        Error::internal(format!(
            "Python model '{}' {reason} during {during}; the instance was discarded{detail}",
            self.name
        ))
    }

    /// One turn with a door; a trap is an error (the interpreter must be discarded).
    fn turn(
        self: &Arc<Self>,
        interp: &mut Interpreter,
        source: &str,
        door: BatchDoor,
        during: &str,
    ) -> std::result::Result<BatchDoor, Error> {
        let (tx, rx) = mpsc::channel();
        let cancel = door.cancel.clone();
        let boxed = Box::new(Returning {
            door: Some(door),
            tx,
        });
        match interp.turn(source, boxed, self.timeout(), cancel) {
            Ok(0) => rx
                .recv()
                .map_err(|_| Error::internal("the Python backend lost its door")),
            Ok(_) => Err(Error::internal(format!(
                "Python model '{}': the backend's own code failed during {during}: {}",
                self.name,
                interp.printed()
            ))),
            Err(e) => Err(self.trap_error(Some(interp), &e, during)),
        }
    }

    /// The guest paths of `model.py` and of its version directory.
    fn guest_paths(&self) -> (String, String) {
        let version_dir = format!("{}/{}", guest_model_dir(&self.name), self.version);
        (format!("{version_dir}/{}", self.model_file), version_dir)
    }

    /// A fresh interpreter with `triton_python_backend_utils` and the backend's driver.
    fn boot(self: &Arc<Self>) -> Result<(Interpreter, BatchDoor)> {
        let mounts = [(self.model_dir.clone(), guest_model_dir(&self.name))];
        let mut interp = Interpreter::start(&self.runtime, &mounts, self.limits.memory_bytes())
            .map_err(|e| self.trap_error(None, &e, "instantiation"))?;
        let door = BatchDoor::idle(self.clone());
        let door = self.turn(&mut interp, &setup_source(), door, "set-up")?;
        let door = self.turn(&mut interp, BACKEND_PY, door, "set-up")?;
        Ok((interp, door))
    }

    /// A fresh interpreter with `model.py` loaded and `initialize(args)` run.
    fn start(self: &Arc<Self>, instance: usize) -> Result<Interpreter> {
        let started = Instant::now();
        let (mut interp, door) = self.boot()?;
        let (model_file, version_dir) = self.guest_paths();
        let load = format!(
            "_wasmtron.load({}, {}, {})",
            json_literal(&self.args(instance)),
            json_literal(&model_file),
            json_literal(&version_dir),
        );
        let door = self.turn(&mut interp, &load, door, "initialize")?;
        if let Some(failure) = door.failure {
            return Err(Error::invalid(format!(
                "Python model '{}' failed to load: {failure}",
                self.name
            )));
        }
        tracing::debug!(model = %self.name, instance, ms = started.elapsed().as_millis() as u64, "Python instance started");
        Ok(interp)
    }

    /// The configuration after `TritonPythonModel.auto_complete_config(config)`, run in an
    /// interpreter of its own before any instance starts (the model's class need not define it).
    fn auto_complete(self: &Arc<Self>) -> Result<ModelConfig> {
        let (mut interp, door) = self.boot()?;
        let (model_file, version_dir) = self.guest_paths();
        let call = format!(
            "_wasmtron.auto_complete({}, {}, {})",
            json_literal(&self.config_json),
            json_literal(&model_file),
            json_literal(&version_dir),
        );
        let door = self.turn(&mut interp, &call, door, "auto_complete_config")?;
        if let Some(failure) = door.failure {
            return Err(Error::invalid(format!(
                "Python model '{}': auto_complete_config failed: {failure}",
                self.name
            )));
        }
        let json = door.completed.unwrap_or_default();
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
    fn outputs(&self, requested: &[String], mut tensors: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let max = usize::try_from(self.limits.max_output_mb.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(requested.len());
        let mut total = 0usize;
        for name in requested {
            let i = tensors
                .iter()
                .position(|t| &t.name == name)
                .ok_or_else(|| {
                    Error::internal(format!(
                        "Python model '{}' did not return the requested output '{name}'",
                        self.name
                    ))
                })?;
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

/// Hands the door back after the turn (the interpreter owns it during the turn).
struct Returning {
    door: Option<BatchDoor>,
    tx: mpsc::Sender<BatchDoor>,
}

impl interpreter::Door for Returning {
    fn call(&mut self, frame: &[u8]) -> Vec<u8> {
        match self.door.as_mut() {
            Some(door) => door.call(frame),
            None => Vec::new(),
        }
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        if let Some(door) = self.door.take() {
            let _ = self.tx.send(door);
        }
    }
}

/// Work for an instance's thread.
type Job = Box<dyn FnOnce(&mut Option<Interpreter>) + Send>;

/// One execution instance: a thread that owns the interpreter.
struct PythonInstance {
    model: Arc<PythonModel>,
    index: usize,
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PythonInstance {
    fn new(model: Arc<PythonModel>, index: usize, live: Option<Interpreter>) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let owner = model.clone();
        let thread = std::thread::Builder::new()
            .name(format!("python-{index}"))
            .stack_size(interpreter::THREAD_STACK_BYTES)
            .spawn(move || {
                let mut live = live;
                while let Ok(job) = rx.recv() {
                    job(&mut live);
                }
                // Unloaded: `finalize()` within the deadline, then the interpreter is dropped.
                if let Some(mut interp) = live.take() {
                    let door = BatchDoor::idle(owner.clone());
                    match owner.turn(&mut interp, "_wasmtron.finalize()", door, "finalize") {
                        Ok(door) => {
                            if let Some(f) = door.failure {
                                tracing::warn!(model = %owner.name, "finalize raised: {f}");
                            }
                        }
                        Err(e) => tracing::warn!(model = %owner.name, "{}", e.message),
                    }
                }
            })
            .map_err(|e| Error::internal(format!("cannot start a Python instance thread: {e}")))?;
        Ok(Self {
            model,
            index,
            jobs: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for PythonInstance {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The header of the guest's [`protocol::Op::Responses`] frame.
#[derive(serde::Deserialize)]
struct ResponsesHeader {
    #[serde(default)]
    responses: Option<Vec<Option<ResponseHeader>>>,
}

impl ModelInstance for PythonInstance {
    fn execute(
        &mut self,
        request: &InferRequest,
        outputs: &[String],
    ) -> Result<(Vec<Tensor>, ExecTimings)> {
        let (mut results, timings) = self.execute_batch(&[request], outputs);
        let result = results
            .pop()
            .unwrap_or_else(|| Err(Error::internal("the Python model gave no result")));
        result.map(|t| (t, timings))
    }

    /// A batch reaches `execute(requests)` as a list of requests, each with its own shapes,
    /// parameters and response.
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        let n = requests.len();
        let all = |e: Error| vec![Err(e); n];
        let model = self.model.clone();
        let start = Instant::now();
        let deadline = requests.iter().filter_map(|r| r.deadline).min();
        let own = start + model.timeout();
        let deadline = Some(deadline.map_or(own, |d| d.min(own)));
        let door = BatchDoor::for_batch(model.clone(), requests, outputs, deadline);
        let index = self.index;
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |live: &mut Option<Interpreter>| {
            let result = (|| {
                let mut interp = match live.take() {
                    Some(i) => i,
                    None => model.start(index)?,
                };
                let door = match model.turn(&mut interp, "_wasmtron.execute()", door, "execute") {
                    Ok(door) => door,
                    // The interpreter is dropped: a trapped instance is never entered again.
                    Err(e) => return Err(e),
                };
                if interp.nearly_full() {
                    tracing::debug!(model = %model.name, "Python instance replaced: its memory passed 3/4 of memory_limit_mb");
                } else if !model.limits.fresh_instance_per_request {
                    *live = Some(interp);
                }
                model.health.record_success();
                Ok(door)
            })();
            let _ = tx.send(result);
        });
        let sent = self
            .jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(job).is_ok());
        if !sent {
            return (
                all(Error::internal("the Python instance has stopped")),
                ExecTimings::default(),
            );
        }
        let door = match rx.recv() {
            Ok(Ok(door)) => door,
            Ok(Err(e)) => return (all(e), ExecTimings::default()),
            Err(_) => {
                return (
                    all(Error::internal("the Python instance has stopped")),
                    ExecTimings::default(),
                )
            }
        };
        let ran = Instant::now();
        if let Some(err) = door.refused_call {
            return (all(err), ExecTimings::default());
        }
        let answers = match self.answers(door.responses.as_deref(), n, outputs) {
            Ok(answers) => answers,
            Err(e) => all(e),
        };
        let timings = ExecTimings {
            compute_input: Duration::ZERO,
            compute_infer: ran - start,
            compute_output: ran.elapsed(),
            padded_rows: 0,
        };
        (answers, timings)
    }
}

impl PythonInstance {
    /// Each request's answer from the guest's responses frame.
    fn answers(
        &self,
        frame: Option<&[u8]>,
        n: usize,
        outputs: &[String],
    ) -> Result<Vec<Result<Vec<Tensor>>>> {
        let model = &self.model;
        let frame = frame.ok_or_else(|| {
            Error::internal(format!("Python model '{}' sent no responses", model.name))
        })?;
        let frame = Frame::<ResponsesHeader>::parse(frame)?;
        let Some(responses) = &frame.header.responses else {
            // A decoupled model answers through its response senders only.
            return Ok((0..n).map(|_| Ok(Vec::new())).collect());
        };
        if responses.len() != n {
            return Err(Error::internal(format!(
                "Python model '{}' returned {} responses for {n} requests",
                model.name,
                responses.len()
            )));
        }
        Ok(responses
            .iter()
            .map(|r| {
                let Some(r) = r else {
                    return Err(Error::internal(format!(
                        "Python model '{}' returned None instead of an InferenceResponse",
                        model.name
                    )));
                };
                if let Some(e) = &r.error {
                    return Err(protocol::from_triton_code(&e.code, e.message.clone()));
                }
                let tensors = r
                    .outputs
                    .iter()
                    .map(|t| frame.tensor(t))
                    .collect::<Result<Vec<_>>>()?;
                model.outputs(outputs, tensors)
            })
            .collect())
    }
}

/// The interpreter build to serve with: `--python-runtime` or the default place.
fn runtime_dir(options: &RuntimeOptions) -> PathBuf {
    options
        .python_runtime
        .clone()
        .unwrap_or_else(interpreter::default_dir)
}

/// Runs `f` on a thread with the interpreter's deep stack and waits for it.
fn on_own_thread<T: Send + 'static>(
    model: Arc<PythonModel>,
    f: impl FnOnce(&Arc<PythonModel>) -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("python-load".into())
        .stack_size(interpreter::THREAD_STACK_BYTES)
        .spawn(move || {
            let _ = tx.send(f(&model));
        })
        .map_err(|e| Error::internal(format!("cannot start a Python load thread: {e}")))?;
    rx.recv()
        .map_err(|_| Error::internal("the Python load thread died"))?
}

/// Loads a Python-backend model: the interpreter (compiled once per process), then one
/// instance per `instance_group` entry, the first started now so that a `model.py` that does
/// not import or whose `initialize` raises fails the load with its own message.
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    options: &RuntimeOptions,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    // A model.py with no configuration naming a backend is the Python backend's (as Triton
    // infers it), and says so in its configuration.
    config.backend = BACKEND.to_owned();
    if let Some(i) = config
        .instance_group
        .iter()
        .position(|g| g.kind == crate::proto::inference::model_instance_group::Kind::Gpu as i32)
    {
        return Err(Error::invalid(format!(
            "model '{name}': instance_group[{i}] is KIND_GPU, but Python models run on the CPU \
             in the sandbox; use kind: KIND_CPU (the ONNX models a model.py calls may run on GPUs)"
        )));
    }
    if let Some(p) = config.parameters.get("EXECUTION_ENV_PATH") {
        return Err(Error::invalid(format!(
            "model '{name}': parameter 'EXECUTION_ENV_PATH' (\"{}\") names a conda environment, \
             which the sandboxed interpreter cannot run: its packages are numpy, scipy, pandas, \
             Pillow and scikit-learn and the standard library; call an ONNX model with BLS for \
             the rest",
            p.string_value
        )));
    }
    let path = super::model_file(&config, version_dir, DEFAULT_MODEL_FILENAME)?;
    let tenant_limits = options
        .tenancy
        .as_ref()
        .map(|t| t.stage_limits(&config.name))
        .unwrap_or_default();
    let mut limits = SandboxLimits::from_config_within(&config, &tenant_limits)?;
    if !config.parameters.contains_key("execution_timeout_ms") && tenant_limits.is_empty() {
        // `import numpy` and a model's own imports take a few hundred milliseconds.
        limits.execution_timeout_ms = limits.execution_timeout_ms.max(30_000);
    }
    let cache = options.wasm_cache_dir.as_deref().and_then(|dir| {
        super::wasm::compile_cache::CompileCache::open(
            dir,
            options
                .wasm_cache_max_bytes
                .unwrap_or(super::wasm::compile_cache::DEFAULT_MAX_BYTES),
        )
    });
    let runtime = interpreter::runtime(&runtime_dir(options), cache.as_deref())
        .map_err(|e| Error::invalid(format!("model '{name}': {}", e.message)))?;
    let model_dir = version_dir
        .parent()
        .ok_or_else(|| Error::internal(format!("model '{name}': version directory has no parent")))?
        .to_path_buf();
    let version = version_dir
        .file_name()
        .map(|v| v.to_string_lossy().into_owned())
        .unwrap_or_default();
    let model_file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| DEFAULT_MODEL_FILENAME.to_owned());
    if instance_count(&config) == 0 {
        return Err(Error::invalid(format!(
            "model '{name}': every instance_group is passive, so no instance would take \
             requests; set passive: false on at least one"
        )));
    }
    let build = |config: &ModelConfig, runtime: Arc<Runtime>| {
        let count = instance_count(config);
        Arc::new(PythonModel {
            name: name.clone(),
            config_json: to_json(config).to_string(),
            health: Arc::new(InstanceHealth::new(limits.max_consecutive_failures)),
            limits,
            runtime,
            model_dir: model_dir.clone(),
            version: version.clone(),
            model_file: model_file.clone(),
            caller: options.model_caller.clone(),
            single_instance: count == 1,
        })
    };
    let mut model = build(&config, runtime.clone());
    if !options.disable_auto_complete {
        config = on_own_thread(model.clone(), |m| m.auto_complete())?;
        model = build(&config, runtime);
    }
    let count = instance_count(&config);
    let health = model.health.clone();
    let mut instances: Vec<Box<dyn ModelInstance>> = Vec::with_capacity(count);
    for index in 0..count {
        // The first starts now, so that a model.py that fails fails the load.
        let first = if index == 0 {
            Some(on_own_thread(model.clone(), |m| m.start(0))?)
        } else {
            None
        };
        instances.push(Box::new(PythonInstance::new(model.clone(), index, first)?));
    }
    Ok(LoadedBackend {
        config,
        instances,
        health,
        buckets: None,
        warmup: None,
        generation: None,
    })
}
