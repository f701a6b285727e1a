//! Models added in-process: a configuration and execution instances the embedding program
//! built (the Python package's bound functions), served like a repository's models (the same
//! scheduler, dynamic batcher, statistics and metrics) but read from no directory.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use super::{Executor, ModelEntry, ModelManager, ModelState, ModelVersion};
use crate::{
    error::{Code, Error, Result},
    proto::inference::ModelConfig,
    repository::{sequence::sequence_spec, validate::validate},
    runtime::{is_decoupled, ModelInstance},
    scheduling::{
        ensemble,
        queue::BatchPolicy,
        scheduler::{ExecutionLimits, Scheduler},
    },
};

/// The version an added model serves as.
pub const ADDED_VERSION: i64 = 1;

impl ModelManager {
    /// Serves `config` with `instances` as version 1 of `config.name`, until unloaded. The
    /// configuration gets the checks a repository's does (names, dims, batching); ensembles,
    /// sequence batching and decoupled models are refused, and so is a name that is loaded
    /// or in the repository.
    pub async fn add_model(
        &self,
        mut config: ModelConfig,
        instances: Vec<Box<dyn ModelInstance>>,
    ) -> Result<()> {
        let name = crate::names::ModelName::parse(&config.name)?.to_string();
        validate(
            &mut config,
            &name,
            &format!("the configuration of '{name}'"),
        )
        .map_err(|e| Error::invalid(e.to_string()))?;
        let refuse = |what: &str| {
            Err(Error::invalid(format!(
                "model '{name}': {what} cannot be served by an in-process function"
            )))
        };
        if ensemble::is_ensemble(&config) {
            return refuse("an ensemble");
        }
        if sequence_spec(&config).map_err(Error::invalid)?.is_some() {
            return refuse("sequence batching");
        }
        if is_decoupled(&config) {
            return refuse("a decoupled model");
        }
        if instances.is_empty() {
            return Err(Error::invalid(format!(
                "model '{name}': no instance to run it"
            )));
        }
        let _guard = self.lifecycle.lock().await;
        let taken = self
            .models
            .read()
            .map_err(|_| super::poisoned())?
            .get(&name)
            .is_some_and(|e| !e.versions.is_empty());
        if taken || self.repository.find(&name).is_ok() {
            return Err(Error::new(
                Code::AlreadyExists,
                format!("model '{name}' already exists (loaded, or in the model repository)"),
            ));
        }
        let stats = self.new_stats(&config)?;
        let scheduler = Scheduler::start(
            &name,
            ADDED_VERSION,
            instances,
            BatchPolicy::from_config(&config),
            self.options.queue_capacity,
            stats.clone(),
            ExecutionLimits {
                share: self.options.execution_share.clone(),
                claims: Vec::new(),
            },
        )?;
        let version = Arc::new(ModelVersion {
            name: name.clone(),
            version: ADDED_VERSION,
            config,
            stats,
            load_duration: Duration::ZERO,
            executor: Executor::Scheduler(scheduler),
            health: Default::default(),
            capabilities: Default::default(),
            labels: Default::default(),
            origin: None,
            // A function has no files to name its answers by: each addition is new.
            content: self
                .options
                .response_cache
                .as_ref()
                .map(|_| fresh_generation()),
            cache_misfit_logged: Default::default(),
            _staged: None,
        });
        let mut models = self.models.write().map_err(|_| super::poisoned())?;
        models.insert(
            name.clone(),
            ModelEntry {
                versions: BTreeMap::from([(ADDED_VERSION, version)]),
                state: ModelState::Ready,
                reason: String::new(),
                fingerprint: 0,
                added: true,
            },
        );
        tracing::info!(model = %name, "model added in-process");
        Ok(())
    }
}

/// A generation no other addition (in this process or another) has.
fn fresh_generation() -> [u8; 32] {
    use sha2::Digest;
    static ADDED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = sha2::Sha256::new();
    h.update(std::process::id().to_le_bytes());
    h.update(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
            .to_le_bytes(),
    );
    h.update(
        ADDED
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_le_bytes(),
    );
    h.finalize().into()
}
