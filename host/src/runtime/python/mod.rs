//! Triton's Python backend, sandboxed: a model whose configuration says `backend: "python"`
//! is a Triton `model.py` (a `TritonPythonModel` class on `triton_python_backend_utils` and
//! numpy), run unchanged by a CPython interpreter compiled to WebAssembly
//! ([`interpreter`]). Each model instance owns one long-lived interpreter (as Triton gives
//! each instance a stub process), whose serving loop waits on a fiber and runs each batch on
//! the scheduler's worker thread of that instance (`instance.rs`), in-process and in the Wasm
//! sandbox:
//! the model reads its own folder and nothing else, has no network, no environment, a memory
//! cap and a deadline per call. A trap discards the interpreter; the next batch gets a fresh
//! one, loaded and initialised again.

mod background;
mod batch_calls;
mod call_stream;
mod instance;
pub mod interpreter;
pub mod metrics;
mod model;
mod packages;
pub mod protocol;
pub mod snapshot;

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use self::{
    background::BackgroundInstance, instance::PythonInstance, interpreter::Runtime,
    model::PythonModel,
};
use super::{
    backend::{InstanceHealth, LoadContext, LoadedBackend, ModelInstance},
    model_config::{instance_count, is_decoupled, model_file, model_file_name},
    sandbox::{limits::SandboxLimits, SandboxSettings},
};
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    repository::config::to_json,
};

/// The backend name in config.pbtxt.
pub const BACKEND: &str = "python";

/// Default file name of a model inside a version directory.
pub const DEFAULT_MODEL_FILENAME: &str = "model.py";
/// Whether a model with no backend named may be a Python-backend model: its version directory
/// has `model.py` (or the configured file name ends in `.py`). The dispatcher also asks that no
/// other backend's file is there, which is how Triton tells a configuration-less Python model.
pub fn owns(config: &ModelConfig, version_dir: &Path) -> bool {
    let file = model_file_name(config, DEFAULT_MODEL_FILENAME);
    file.ends_with(".py") && version_dir.join(file).is_file()
}
/// The Python backend's settings.
#[derive(Debug, Clone, Default)]
pub struct PythonSettings {
    /// The interpreter build (`--python-runtime`); `None`: the default place
    /// ([`interpreter::default_dir`]).
    pub runtime: Option<PathBuf>,
}

/// The interpreter build to serve with: `--python-runtime` or the default place.
fn runtime_dir(settings: &PythonSettings) -> PathBuf {
    settings
        .runtime
        .clone()
        .unwrap_or_else(interpreter::default_dir)
}

/// Loads a Python-backend model: the interpreter (compiled once per process), then one
/// instance per `instance_group` entry, the first started now so that a `model.py` that does
/// not import or whose `initialize` raises fails the load with its own message.
pub fn load(
    mut config: ModelConfig,
    version_dir: &Path,
    settings: &PythonSettings,
    sandbox: &SandboxSettings,
    load: &LoadContext,
) -> Result<LoadedBackend> {
    let name = config.name.clone();
    // A model.py with no configuration naming a backend is the Python backend's (as Triton
    // infers it), and says so in its configuration.
    config.backend = BACKEND.to_owned();
    refuse_unservable(&config)?;
    let path = model_file(&config, version_dir, DEFAULT_MODEL_FILENAME)?;
    let (mut limits, tenants_bound) = SandboxLimits::for_model(&config, load.tenancy.as_deref())?;
    if !config.parameters.contains_key("execution_timeout_ms") && !tenants_bound {
        // `import numpy` and a model's own imports take a few hundred milliseconds.
        limits.execution_timeout_ms = limits.execution_timeout_ms.max(30_000);
    }
    let cache = sandbox.compile_cache();
    let runtime = interpreter::runtime(&runtime_dir(settings), cache.as_deref())
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
    let repository_calls = RepositoryCalls::of(&config, load)?;
    let snapshots = switch(&config, INSTANCE_SNAPSHOT)?.unwrap_or(true);
    let packages = packages::of(&config, &model_dir, load.sent_by_client)?.map(Arc::new);
    let build = |config: &ModelConfig, runtime: Arc<Runtime>| {
        let count = instance_count(config);
        Arc::new(PythonModel {
            name: name.clone(),
            config_json: to_json(config).to_string(),
            health: Arc::new(InstanceHealth::new(limits.max_consecutive_failures)),
            limits,
            runtime,
            model_dir: model_dir.clone(),
            packages: packages.clone(),
            version: version.clone(),
            model_file: model_file.clone(),
            caller: load.model_caller.clone(),
            repository_calls,
            single_instance: count == 1,
            decoupled: is_decoupled(config),
            metrics_owner: metrics::owner(),
            has_is_ready: Default::default(),
            runs_in_background: Default::default(),
            iterative: matches!(
                &config.scheduling_choice,
                Some(crate::proto::inference::model_config::SchedulingChoice::SequenceBatching(
                    sb
                )) if sb.iterative_sequence
            ),
            snapshot: if snapshots {
                Default::default()
            } else {
                // Decided: no snapshot, every instance starts in full.
                std::sync::OnceLock::from(None)
            },
        })
    };
    let mut model = build(&config, runtime.clone());
    if !load.disable_auto_complete {
        config = model.auto_complete()?;
        model = build(&config, runtime);
    }
    let instances = start_instances(&model, instance_count(&config))?;
    Ok(LoadedBackend {
        health: model.health.clone(),
        checks_readiness: model.checks_readiness(),
        ..LoadedBackend::new(config, instances)
    })
}

/// What a configuration may ask of a Python model that the sandbox cannot give, refused by
/// name: GPU instances, no instance that takes requests.
fn refuse_unservable(config: &ModelConfig) -> Result<()> {
    let name = &config.name;
    crate::runtime::sandbox::refuse_gpu_instances(config, "Python models", "a model.py")?;
    if instance_count(config) == 0 {
        return Err(Error::invalid(format!(
            "model '{name}': every instance_group is passive, so no instance would take \
             requests; set passive: false on at least one"
        )));
    }
    Ok(())
}

/// `count` instances of `model`, the first started now, so that a model.py that fails fails
/// the load; the others start on their first batch.
fn start_instances(model: &Arc<PythonModel>, count: usize) -> Result<Vec<Box<dyn ModelInstance>>> {
    let mut instances: Vec<Box<dyn ModelInstance>> = Vec::with_capacity(count);
    for index in 0..count {
        let first = if index == 0 {
            Some(model.start(0)?)
        } else {
            None
        };
        if model.runs_in_background() {
            instances.push(Box::new(BackgroundInstance::new(
                model.clone(),
                index,
                first,
            )?));
        } else {
            instances.push(Box::new(PythonInstance::new(model.clone(), index, first)?));
        }
    }
    Ok(instances)
}

/// The model config parameter that switches a model's repository calls (`load_model`,
/// `unload_model`) off.
pub const REPOSITORY_CALLS: &str = "repository_calls";

/// The model config parameter that makes every instance of a model start in full (boot and
/// import) instead of from the snapshot taken after the first import ([`snapshot`]): for a
/// `model.py` whose import must run once per instance.
pub const INSTANCE_SNAPSHOT: &str = "instance_snapshot";

/// A model config parameter that is "on" or "off" ("true" / "false"), if set.
fn switch(config: &ModelConfig, key: &str) -> Result<Option<bool>> {
    let Some(p) = config.parameters.get(key) else {
        return Ok(None);
    };
    match p.string_value.trim() {
        "on" | "true" => Ok(Some(true)),
        "off" | "false" => Ok(Some(false)),
        other => Err(Error::invalid(format!(
            "model '{}': parameter '{key}' must be \"on\" or \"off\", got \"{other}\"",
            config.name
        ))),
    }
}

/// Whether a model may load and unload models from its code (Triton's model loading API).
/// On by default, as on Triton, where `pb_utils.load_model` works whenever the server's model
/// control mode is explicit: the calls are held to the rights of the batch's tenants (of
/// whoever loaded the model, in `initialize`), go through the same checks as the repository
/// API, and files they send are never converted or loaded as native code. Off for the whole
/// server (`--allow-model-repository-calls=false`) or for one model (`parameters { key:
/// "repository_calls" value: { string_value: "off" } }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RepositoryCalls {
    /// Allowed (held to the callers' rights).
    Allowed,
    /// Switched off for this model by its configuration.
    OffForModel,
    /// Switched off for the whole server.
    OffForServer,
}

impl RepositoryCalls {
    fn of(config: &ModelConfig, load: &LoadContext) -> Result<Self> {
        let per_model = switch(config, REPOSITORY_CALLS)?.unwrap_or(true);
        Ok(if load.forbid_repository_calls {
            Self::OffForServer
        } else if !per_model {
            Self::OffForModel
        } else {
            Self::Allowed
        })
    }

    /// The refusal of a call `what` by model `model`, when switched off.
    pub(crate) fn check(self, model: &str, what: &str) -> Result<()> {
        let why = match self {
            Self::Allowed => return Ok(()),
            Self::OffForModel => format!("its configuration's parameter '{REPOSITORY_CALLS}'"),
            Self::OffForServer => "the server's --allow-model-repository-calls=false".to_owned(),
        };
        Err(Error::permission_denied(format!(
            "model '{model}' may not call {what}: repository calls are switched off by {why}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(key: &str, value: &str) -> ModelConfig {
        let mut config = ModelConfig {
            name: "m".into(),
            ..Default::default()
        };
        config.parameters.insert(
            key.into(),
            crate::proto::inference::ModelParameter {
                string_value: value.into(),
            },
        );
        config
    }

    #[test]
    fn on_off_parameters_say_what_they_accept() {
        assert_eq!(
            switch(&ModelConfig::default(), INSTANCE_SNAPSHOT).unwrap(),
            None
        );
        assert_eq!(
            switch(&with(INSTANCE_SNAPSHOT, "off"), INSTANCE_SNAPSHOT).unwrap(),
            Some(false)
        );
        assert_eq!(
            switch(&with(INSTANCE_SNAPSHOT, " true"), INSTANCE_SNAPSHOT).unwrap(),
            Some(true)
        );
        let e = switch(&with(INSTANCE_SNAPSHOT, "sometimes"), INSTANCE_SNAPSHOT).unwrap_err();
        assert!(
            e.message
                .contains("'instance_snapshot' must be \"on\" or \"off\", got \"sometimes\""),
            "{}",
            e.message
        );
    }
}
