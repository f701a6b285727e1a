//! Loading a model's versions from its files: the configuration read (or given), completed
//! and checked, each version's backend loaded with its scheduler, sequence batcher or
//! ensemble plan, statistics and rate-limiter claims, and files sent with a load request
//! staged in a folder the server owns.

use super::*;

impl ModelManager {
    /// What each of a version's instances needs from the rate limiter (none without
    /// `--rate-limit=execution_count`, where a `rate_limiter` is logged as having no effect,
    /// as Triton ignores it then; none for generation models, which batch in one loop).
    fn rate_limiter_claims(
        &self,
        config: &ModelConfig,
        instances: usize,
    ) -> Result<Vec<Arc<crate::scheduling::rate_limiter::Claim>>> {
        let limited = config
            .instance_group
            .iter()
            .any(|g| g.rate_limiter.is_some());
        match &self.options.rate_limiter {
            Some(_) if crate::runtime::family(config) == config_fields::Family::Generation => {
                Ok(Vec::new())
            }
            Some(limiter) => limiter.claims(config, instances).map_err(Error::invalid),
            None => {
                if limited {
                    tracing::warn!(
                        model = %config.name,
                        "field 'instance_group.rate_limiter' has no effect without \
                         --rate-limit=execution_count (Triton ignores it then too)"
                    );
                }
                Ok(Vec::new())
            }
        }
    }

    /// Fresh counters for a version of `config`, recording the latency distributions the
    /// server's `--metrics-config` and the model's `model_metrics` ask for.
    pub(super) fn new_stats(&self, config: &ModelConfig) -> Result<Arc<ModelStats>> {
        let caches =
            self.options.response_cache.is_some() && crate::runtime::caches_responses(config);
        let (latency, notes) = crate::scheduling::latency::ModelLatency::for_model(
            config,
            &self.options.latency_metrics,
            caches,
        )
        .map_err(|e| Error::invalid(format!("model '{}': {e}", config.name)))?;
        for note in notes {
            tracing::warn!(model = %config.name, "{note}");
        }
        Ok(Arc::new(ModelStats::with_latency(latency)))
    }

    /// `response_cache { enable: true }`: refused where Triton refuses it (decoupled and
    /// sequence models); without a server cache it has no effect, as on Triton, and says so.
    fn check_response_cache(&self, name: &str, config: &ModelConfig, file: &str) -> Result<()> {
        if !runtime::caches_responses(config) {
            return Ok(());
        }
        let refuse = |why: &str| {
            Err(Error::invalid(format!(
                "model '{name}': {file}: field 'response_cache.enable': {why}"
            )))
        };
        if runtime::is_decoupled(config) {
            return refuse(
                "a decoupled model's answers are not cached (0..N responses per request)",
            );
        }
        if sequence_spec(config).ok().flatten().is_some() {
            return refuse(
                "a stateful (sequence) model's answers depend on its state and are not cached",
            );
        }
        if self.options.response_cache.is_none() {
            tracing::warn!(
                model = name,
                "{file}: field 'response_cache.enable' has no effect here: the server was \
                 started without --cache-config (as on Triton)"
            );
        }
        Ok(())
    }

    /// Reads the model's files and loads every version its policy selects. Returns the
    /// fingerprint of the files it read along with the outcome.
    pub(super) fn load_versions(
        &self,
        name: &str,
        overrides: &LoadOverride,
    ) -> (u64, Result<BTreeMap<i64, Arc<ModelVersion>>>) {
        let source = if overrides.files.is_empty() {
            self.repository
                .find(name)
                .map_err(repo_error)
                .map(|s| (s, None))
        } else {
            stage_files(name, &overrides.files).map(|staging| {
                let folder = self.repository.split_key(name).map_or(name, |(f, _)| f);
                let source = ModelSource {
                    name: folder.to_owned(),
                    dir: staging.path().to_path_buf(),
                    repository: staging.path().to_path_buf(),
                };
                (source, Some(Arc::new(staging)))
            })
        };
        let (source, staged) = match source {
            Ok(s) => s,
            Err(e) => return (0, Err(e)),
        };
        (
            source.fingerprint(),
            self.load_source(name, &source, overrides, staged),
        )
    }

    fn load_source(
        &self,
        name: &str,
        source: &ModelSource,
        overrides: &LoadOverride,
        staged: Option<Arc<ScratchDir>>,
    ) -> Result<BTreeMap<i64, Arc<ModelVersion>>> {
        let config_file = source.config_path();
        let config_file = config_file.display().to_string();
        let (mut config, text) = match &overrides.config_json {
            Some(json) => (
                config::parse_json(json)
                    .map_err(|e| Error::invalid(format!("model '{name}': {e}")))?,
                None,
            ),
            None => source
                .read_config_and_text()
                .map_err(|e| Error::invalid(e.to_string()))?,
        };
        // Every field set is honoured, refused by name, or logged as having no effect here.
        let described = match &overrides.config_json {
            Some(_) => format!("the configuration given for '{name}'"),
            None => config_file.clone(),
        };
        let quiet = config_fields::check(&config, family(&config), text.as_deref(), &described)
            .map_err(|e| Error::invalid(format!("model '{name}': {e}")))?;
        for field in quiet {
            tracing::warn!(
                model = name,
                "{}: field '{}' has no effect here: {}",
                field.at,
                field.path,
                field.why
            );
        }
        validate(&mut config, &source.name, &config_file)
            .map_err(|e| Error::invalid(e.to_string()))?;
        // With namespacing, the model is known by its key (`name@n`) from here on: in its
        // statistics, metrics and metadata, as in the requests that name it so.
        config.name = name.to_owned();
        // The checksum agent runs before anything of the model is read, as on Triton.
        checksum::verify(&config, &source.dir)
            .map_err(|e| Error::invalid(format!("model '{name}': {config_file}: {e}")))?;
        self.check_response_cache(name, &config, &config_file)?;
        let labels = crate::classification::read_labels(&config, &source.dir)
            .map(Arc::new)
            .map_err(|e| Error::invalid(format!("model '{name}': {config_file}: {e}")))?;
        let content = self.content_digest(name, source, overrides)?;
        let available = source.available_versions();
        let chosen = select_versions(config.version_policy.as_ref(), &available);
        if chosen.is_empty() {
            return Err(Error::invalid(format!(
                "model '{name}': no version to load in '{}' (found versions {:?}; a version is a numeric folder such as {name}/1/ holding the model file)",
                source.dir.display(),
                available
            )));
        }
        let mut versions = BTreeMap::new();
        if ensemble::is_ensemble(&config) {
            let plan = Ensemble::plan(&config, |model, version| {
                let key = self.step_key(name, model)?;
                self.get(&key, version)
                    .map(|m| (key.clone(), m.config.clone()))
                    .map_err(|_| self.unavailable_reason(&key, version))
            })?;
            if plan.is_decoupled() {
                // It answers 0..N times, as its decoupled step does: say so in its config.
                config.model_transaction_policy =
                    Some(crate::proto::inference::ModelTransactionPolicy { decoupled: true });
            }
            for version in chosen {
                versions.insert(
                    version,
                    Arc::new(ModelVersion {
                        name: name.to_owned(),
                        version,
                        config: config.clone(),
                        stats: self.new_stats(&config)?,
                        load_duration: Duration::ZERO,
                        executor: Executor::Ensemble(plan.clone()),
                        health: Default::default(),
                        capabilities: Default::default(),
                        labels: labels.clone(),
                        origin: None,
                        content,
                        cache_misfit_logged: Default::default(),
                        _staged: None,
                    }),
                );
            }
            return Ok(versions);
        }
        super::super::ensemble_defaults::refuse_outside_ensembles(&config)?;
        // A configuration or files from a load request are the client's: the backends make
        // no native code run from them.
        let sent_by_client = overrides.config_json.is_some() || !overrides.files.is_empty();
        let runtime_options = if sent_by_client {
            let mut options = self.options.runtime.clone();
            options.load.sent_by_client = true;
            std::borrow::Cow::Owned(options)
        } else {
            std::borrow::Cow::Borrowed(&self.options.runtime)
        };
        for version in chosen {
            let started = Instant::now();
            let dir = source.dir.join(version.to_string());
            let loaded = runtime::load(config.clone(), &dir, &runtime_options)
                .map_err(|e| Error::new(e.code, format!("{} (version {version})", e.message)))?;
            let stats = self.new_stats(&loaded.config)?;
            if let Some(w) = loaded.warmup {
                stats.warmup.record_many(w.runs, w.duration);
            }
            let health = loaded.health.clone();
            let capabilities = loaded.capabilities.clone();
            let policy = BatchPolicy {
                padding: loaded.buckets.clone(),
                ..BatchPolicy::from_config(&loaded.config)
            };
            let claims = self.rate_limiter_claims(&loaded.config, loaded.instances.len())?;
            tracing::debug!(
                model = name,
                version,
                instances = loaded.instances.len(),
                rate_limited = !claims.is_empty(),
                ms = started.elapsed().as_millis() as u64,
                "version ready to schedule"
            );
            let scheduler = Scheduler::start(
                name,
                version,
                loaded.instances,
                policy,
                self.options.queue_capacity,
                stats.clone(),
                // A model that runs all its requests in one loop of its own (a generation
                // model's batch): held back by the share, a tenant would get one request at a
                // time instead of the batch.
                ExecutionLimits {
                    share: if capabilities.batches_alone {
                        Arc::new(ExecutionShare::new(0))
                    } else {
                        self.options.execution_share.clone()
                    },
                    claims,
                },
            )?;
            if loaded.checks_readiness {
                scheduler.enable_readiness_checks();
            }
            let executor = match sequence_spec(&loaded.config).map_err(Error::invalid)? {
                Some(spec) => Executor::Sequence(Box::new(SequenceBatcher::new(
                    name,
                    loaded.config.max_batch_size,
                    spec,
                    &source.dir,
                    scheduler,
                    stats.clone(),
                )?)),
                None => Executor::Scheduler(scheduler),
            };
            versions.insert(
                version,
                Arc::new(ModelVersion {
                    name: name.to_owned(),
                    version,
                    config: loaded.config,
                    stats,
                    load_duration: started.elapsed(),
                    executor,
                    health,
                    capabilities,
                    labels: labels.clone(),
                    origin: loaded.origin,
                    content,
                    cache_misfit_logged: Default::default(),
                    _staged: staged.clone(),
                }),
            );
        }
        Ok(versions)
    }
}

impl ModelManager {
    /// What the response cache keeps a version's answers under: SHA-256 of the model folder's
    /// files and of a configuration sent with the load; `None` when the server has no cache.
    fn content_digest(
        &self,
        name: &str,
        source: &ModelSource,
        overrides: &LoadOverride,
    ) -> Result<Option<[u8; 32]>> {
        use sha2::Digest;
        if self.options.response_cache.is_none() {
            return Ok(None);
        }
        let mut h = sha2::Sha256::new();
        h.update(overrides.config_json.as_deref().unwrap_or("").as_bytes());
        h.update([0]);
        crate::content_hash::add(&mut h, &source.dir).map_err(|e| {
            Error::invalid(format!(
                "model '{name}': cannot read '{}': {e}",
                source.dir.display()
            ))
        })?;
        Ok(Some(h.finalize().into()))
    }
}

/// How the field table reads `config`: as an ensemble, or as its backend's model.
fn family(config: &ModelConfig) -> config_fields::Family {
    if ensemble::is_ensemble(config) {
        config_fields::Family::Ensemble
    } else {
        runtime::family(config)
    }
}

/// Writes the files given to the load API into a new private scratch directory, which lives
/// as long as the versions loaded from it.
fn stage_files(name: &str, files: &[(ModelFilePath, Vec<u8>)]) -> Result<ScratchDir> {
    let staging = ScratchDir::new("wasmtron-load-").map_err(|e| {
        Error::internal(format!("model '{name}': cannot make a staging folder: {e}"))
    })?;
    for (path, content) in files {
        staging.write_new(path.parts(), content).map_err(|e| {
            use std::io::ErrorKind as Kind;
            // Two keys that collide (`file:1` and `file:1/model.onnx`) are the request's fault.
            let code = match e.kind() {
                Kind::AlreadyExists
                | Kind::PermissionDenied
                | Kind::NotADirectory
                | Kind::IsADirectory => Code::InvalidArg,
                _ => Code::Internal,
            };
            Error::new(
                code,
                format!("load parameter 'file:{path}': cannot stage it: {e}"),
            )
        })?;
    }
    Ok(staging)
}
