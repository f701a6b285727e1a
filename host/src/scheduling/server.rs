//! The server core the frontends share: liveness and readiness, the model manager, the
//! inference entry point with request checks, and the drain on shutdown.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::sync::Notify;

pub use super::options::{ControlMode, ServerOptions};
use super::{
    ensemble::StepRunner,
    execution_share::ExecutionShare,
    model_manager::{Executor, LoadOverride, ManagerOptions, ModelManager, ModelVersion},
    response_cache::{Key, ResponseCache},
    stats::FailureReason,
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, StepDurations},
    limits::RequestLimits,
    repository::ModelRepository,
    runtime::{
        request_check::{check_request, convert_integer_inputs},
        ModelCaller, ModelLoad,
    },
    tenancy::{Caller, ModelAction},
};

/// Lets stages call models through the server's normal path (BLS). Holds the server weakly so
/// that the server can be dropped.
#[derive(Debug)]
struct ServerCaller {
    server: std::sync::Weak<Server>,
    runtime: tokio::runtime::Handle,
}

impl ServerCaller {
    fn server(&self) -> Result<Arc<Server>> {
        self.server
            .upgrade()
            .ok_or_else(|| Error::unavailable("the server is shutting down"))
    }
}

impl ModelCaller for ServerCaller {
    fn infer_watching(
        &self,
        request: InferRequest,
        cancel: crate::cancellation::Cancellation,
    ) -> Result<InferResponse> {
        let server = self.server()?;
        // Called on a model worker thread, never on the async runtime. The wait ends at the
        // caller's deadline even if the target never gets to the request (e.g. a cycle of
        // stages calling each other with every instance busy), and as soon as nobody waits
        // for the caller's answer (dropping the call cancels the work it started).
        let model = request.model_name.clone();
        let deadline = request.deadline;
        self.runtime.block_on(async {
            let expired = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                result = server.infer(request) => result,
                () = cancel.cancelled() => Err(Error::new(
                    crate::error::Code::Cancelled,
                    format!("the call to model '{model}' was cancelled: nobody waits for the \
                             calling stage's answer any more"),
                )),
                () = expired => Err(Error::unavailable(format!(
                    "model '{model}' did not answer before the calling stage's deadline"
                ))),
            }
        })
    }
    fn is_ready(&self, model: &str, version: Option<i64>) -> bool {
        self.server
            .upgrade()
            .is_some_and(|s| s.models().is_ready(model, version))
    }

    fn load(&self, by: &str, callers: &[Caller], load: ModelLoad) -> Result<()> {
        let server = self.server()?;
        server.check_model_control()?;
        let mut overrides = LoadOverride {
            config_json: load.config_json,
            ..LoadOverride::default()
        };
        for (key, content) in load.files {
            let path = key.strip_prefix("file:").ok_or_else(|| {
                Error::invalid(format!(
                    "failed to load '{}': file key '{key}' must start with 'file:'",
                    load.model
                ))
            })?;
            overrides.add_file(path, content)?;
        }
        if !overrides.files.is_empty() && overrides.config_json.is_none() {
            return Err(Error::invalid(format!(
                "failed to load '{}': files need a config as well",
                load.model
            )));
        }
        // On behalf of the batch's tenants, each of which must be allowed the load; in
        // `initialize` (no requests) with the rights of whoever loaded the calling model.
        for caller in callers {
            server
                .models()
                .check_load(caller, &load.model, &overrides)?;
        }
        self.runtime
            .block_on(server.models().load_for_model(by, &load.model, overrides))
    }

    fn unload(
        &self,
        by: &str,
        callers: &[Caller],
        model: &str,
        unload_dependents: bool,
    ) -> Result<()> {
        let server = self.server()?;
        server.check_model_control()?;
        for caller in callers {
            server
                .models()
                .check_unload(caller, model, unload_dependents)?;
        }
        self.runtime.block_on(
            server
                .models()
                .unload_for_model(by, model, unload_dependents),
        )
    }
}

impl StepRunner for Server {
    fn run_step(
        &self,
        request: InferRequest,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<InferResponse>> + Send + '_>>
    {
        // The ensemble's own right covers its steps: a tenant may run an ensemble of models
        // it may not call one by one.
        Box::pin(async move {
            let model = self
                .models()
                .get(&request.model_name, request.model_version)?;
            self.infer_with(model, request).await
        })
    }
}

/// Shared state behind every frontend.
pub struct Server {
    manager: Arc<ModelManager>,
    pub(super) options: ServerOptions,
    started: AtomicBool,
    /// Readiness turned off ahead of a shutdown; requests are still served.
    unready: AtomicBool,
    stopping: AtomicBool,
    in_flight: AtomicUsize,
    idle: Notify,
    /// The response cache (`--cache-config local,size=N`), for models that enable it.
    cache: Option<Arc<ResponseCache>>,
}

/// Decrements the in-flight count when a request ends, however it ends.
struct InFlight<'a>(&'a Server);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Server {
    /// Creates the server and loads the initial models according to the control mode.
    pub async fn start(options: ServerOptions) -> Result<Arc<Self>> {
        let repository = ModelRepository::new(options.model_repositories.clone())
            .with_mirrors(options.remote_repositories.clone())
            .with_namespacing(options.model_namespacing);
        for root in repository.roots() {
            if !root.is_dir() {
                return Err(Error::invalid(format!(
                    "model repository '{}' is not a directory",
                    root.display()
                )));
            }
        }
        let runtime = tokio::runtime::Handle::current();
        let cache = match &options.response_cache_redis {
            Some(redis) => Some(Arc::new(ResponseCache::redis(redis.clone()))),
            None => (options.response_cache_bytes > 0)
                .then(|| Arc::new(ResponseCache::local(options.response_cache_bytes))),
        };
        let server = Arc::new_cyclic(|weak| {
            let mut runtime_options = options.runtime.clone();
            runtime_options.load.model_caller = Some(Arc::new(ServerCaller {
                server: weak.clone(),
                runtime,
            }));
            let manager = Arc::new(ModelManager::new(
                repository,
                ManagerOptions {
                    runtime: runtime_options,
                    queue_capacity: options.queue_capacity,
                    execution_share: Arc::new(ExecutionShare::new(options.execution_slots)),
                    load_threads: options.load_threads,
                    response_cache: cache.clone(),
                    latency_metrics: options.latency_metrics.clone(),
                    rate_limiter: options.rate_limiter.clone(),
                },
            ));
            Self {
                manager,
                options,
                started: AtomicBool::new(false),
                unready: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
                in_flight: AtomicUsize::new(0),
                idle: Notify::new(),
                cache,
            }
        });
        let manager = &server.manager;
        match server.options.control_mode {
            ControlMode::None | ControlMode::Poll => manager.load_all().await?,
            ControlMode::Explicit => {
                if server.options.load_models.iter().any(|m| m == "*") {
                    manager.load_all().await?;
                } else {
                    manager.load_many(&server.options.load_models).await;
                }
            }
        }
        server.started.store(true, Ordering::Release);
        if server.options.control_mode == ControlMode::Poll {
            let poller = server.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(poller.options.poll_interval);
                tick.tick().await;
                while !poller.stopping.load(Ordering::Acquire) {
                    tick.tick().await;
                    poller.manager.poll().await;
                }
            });
        }
        Ok(server)
    }

    /// The server's identifier (`--id`): the `name` its metadata answers.
    pub fn id(&self) -> &str {
        &self.options.server_id
    }

    /// The request limits every frontend applies.
    pub fn limits(&self) -> &RequestLimits {
        &self.options.limits
    }

    /// The model manager.
    pub fn models(&self) -> &Arc<ModelManager> {
        &self.manager
    }

    /// The model control mode.
    pub fn control_mode(&self) -> ControlMode {
        self.options.control_mode
    }

    /// Live: the process answers.
    pub fn is_live(&self) -> bool {
        true
    }

    /// Ready: started, not draining, and (with strict readiness) every model ready.
    pub fn is_ready(&self) -> bool {
        self.started.load(Ordering::Acquire)
            && !self.unready.load(Ordering::Acquire)
            && !self.stopping.load(Ordering::Acquire)
            && (!self.options.strict_readiness || self.manager.all_ready())
    }

    /// Refuses model control in modes that do not allow it.
    pub fn check_model_control(&self) -> Result<()> {
        // Triton's words and code (UNAVAILABLE) in both other modes; ours say which it is.
        let mode = match self.options.control_mode {
            ControlMode::Explicit => return Ok(()),
            ControlMode::None => "none",
            ControlMode::Poll => "poll",
        };
        Err(Error::unavailable(format!(
            "explicit model load / unload is not allowed if polling is enabled (the server's \
             --model-control-mode is {mode}; load and unload need --model-control-mode=explicit)"
        )))
    }

    /// Runs one inference: picks the version, checks the request, queues it. A tenant whose
    /// requests to the model keep failing in it is held back for a while (see
    /// [`crate::tenancy::Caller::check_backoff`]).
    ///
    /// Dropping the returned future before it ends cancels the request (its
    /// [`InferRequest::cancel`]): the work stops wherever it is (see [`crate::cancellation`]).
    ///
    /// A request by name (a stage's call, an ensemble's step) is made on behalf of its
    /// `callers`: each must be allowed to run the model ([`Server::lookup_for`]).
    pub async fn infer(&self, request: InferRequest) -> Result<InferResponse> {
        let model =
            self.lookup_for(&request.callers, &request.model_name, request.model_version)?;
        self.infer_with(model, request).await
    }

    /// The door for requests made by name on behalf of `callers` (a stage's calls, the
    /// in-process package): every caller must be allowed to run the model, which is then
    /// looked up once.
    pub fn lookup_for(
        &self,
        callers: &[Caller],
        model: &str,
        version: Option<i64>,
    ) -> Result<Arc<ModelVersion>> {
        for caller in callers {
            caller.require(ModelAction::Infer, model)?;
        }
        self.models().get(model, version)
    }

    /// Runs `request` on `model`, the version it resolved to.
    pub(super) async fn infer_with(
        &self,
        model: Arc<ModelVersion>,
        request: InferRequest,
    ) -> Result<InferResponse> {
        let waiting = request.cancel.cancel_on_drop();
        let trace = request.trace.clone();
        let result = self.infer_for_callers(model, request).await;
        trace.mark("REQUEST_END");
        waiting.disarm();
        result
    }

    async fn infer_for_callers(
        &self,
        model: Arc<ModelVersion>,
        request: InferRequest,
    ) -> Result<InferResponse> {
        if request.callers.is_empty() {
            return self.run(model, request).await;
        }
        for caller in &request.callers {
            caller.check_backoff(&request.model_name)?;
        }
        let (callers, name) = (request.callers.clone(), request.model_name.clone());
        let result = self.run(model, request).await;
        for caller in &callers {
            caller.record_outcome(&name, result.as_ref().map(|_| ()));
        }
        result
    }

    async fn run(
        &self,
        model: Arc<ModelVersion>,
        mut request: InferRequest,
    ) -> Result<InferResponse> {
        let received = Instant::now();
        if self.stopping.load(Ordering::Acquire) {
            return Err(Error::unavailable("the server is shutting down"));
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let _guard = InFlight(self);
        request.trace.start(model.version, &request.id, received);
        let (batch_size, classes) = match admit(&self.options.limits, &model, &mut request) {
            Ok(admitted) => admitted,
            Err(err) => {
                model
                    .stats
                    .record_failure(FailureReason::Other, received.elapsed());
                return Err(err);
            }
        };
        let outputs: Vec<String> = if request.outputs.is_empty() {
            model.config.output.iter().map(|o| o.name.clone()).collect()
        } else {
            request.outputs.iter().map(|o| o.name.clone()).collect()
        };
        let cached = self.cache_key(&model, &request);
        // What a kept answer must hold (the request is the executor's once it runs).
        let expected = Expected {
            outputs: cached.as_ref().map(|_| outputs.clone()).unwrap_or_default(),
            batch_size,
            classes: &classes,
        };
        if let Some((cache, key)) = &cached {
            let hit = self.cached_answer(&model, (cache, key), &request, &expected, received);
            if let Some(hit) = hit.await {
                return Ok(hit);
            }
        }
        let result = match &model.executor {
            Executor::Scheduler(scheduler) => {
                scheduler
                    .infer(request, outputs, batch_size as u64, received)
                    .await
            }
            Executor::Sequence(sequences) => {
                sequences
                    .infer(request, outputs, batch_size as u64, received)
                    .await
            }
            Executor::Ensemble(plan) => {
                self.run_ensemble(&model, plan, request, &outputs, batch_size, received)
                    .await
            }
        };
        let result = result.and_then(|response| classify(&model, &classes, response));
        if let (Some((cache, key)), Ok(response)) = (&cached, &result) {
            let storing = Instant::now();
            if self.fits_config(&model, &expected, response, "an answer") {
                cache.insert(*key, response);
            }
            model.stats.cache_miss.record(storing.elapsed());
            model.stats.latency.record_cache(false, storing.elapsed());
        }
        result
    }

    /// A kept answer to `request`, counted as a success (not an inference, as on Triton),
    /// when the cache has one that fits the configuration.
    async fn cached_answer(
        &self,
        model: &ModelVersion,
        (cache, key): (&Arc<ResponseCache>, &Key),
        request: &InferRequest,
        expected: &Expected<'_>,
        received: Instant,
    ) -> Option<InferResponse> {
        let looked = Instant::now();
        let mut hit = cache
            .get(key)
            .await
            .filter(|hit| self.fits_config(model, expected, hit, "a cached answer"))?;
        hit.id = request.id.clone();
        hit.model_name = model.name.clone();
        hit.model_version = model.version;
        model.stats.cache_hit.record(looked.elapsed());
        model.stats.latency.record_cache(true, looked.elapsed());
        model.stats.success.record(received.elapsed());
        model
            .stats
            .latency
            .record_first_response(received.elapsed());
        model.stats.touch();
        Some(hit)
    }

    /// Runs an ensemble's steps for `request`. Like Triton, an ensemble reports its steps'
    /// queue and compute time summed (perf_analyzer reads the ensemble's queue count to find
    /// its statistics), and its answer carries the request's sequence parameters back.
    async fn run_ensemble(
        &self,
        model: &ModelVersion,
        plan: &super::ensemble::Ensemble,
        mut request: InferRequest,
        outputs: &[String],
        batch_size: usize,
        received: Instant,
    ) -> Result<InferResponse> {
        let id = request.id.clone();
        let parameters = sequence_echo(&request.parameters);
        let parent = request.step_durations.take();
        let durations = StepDurations::default();
        match plan.run(self, request, outputs, &durations).await {
            Ok(tensors) => {
                let stats = &model.stats;
                let totals = durations.totals();
                let [queue, input, infer, output] = totals;
                stats.record_execution(batch_size as u64, input, infer, output);
                stats.record_success(queue, input, infer, output, received.elapsed());
                if let Some(parent) = parent {
                    parent.add(totals);
                }
                Ok(InferResponse {
                    model_name: model.name.clone(),
                    model_version: model.version,
                    id,
                    parameters,
                    outputs: tensors,
                    last: false,
                })
            }
            Err(err) => {
                model
                    .stats
                    .record_failure(FailureReason::Backend, received.elapsed());
                Err(err)
            }
        }
    }

    /// The response cache and the key of `request` when `model` caches its answers: it says
    /// `response_cache { enable: true }`, answers once per request (not decoupled) and keeps
    /// no sequence state. The key includes the callers' tenants.
    fn cache_key(
        &self,
        model: &ModelVersion,
        request: &InferRequest,
    ) -> Option<(Arc<ResponseCache>, Key)> {
        let cache = self.cache.as_ref()?;
        let enabled = crate::runtime::caches_responses(&model.config)
            && !crate::runtime::is_decoupled(&model.config)
            && !matches!(model.executor, Executor::Sequence(_));
        if !enabled {
            return None;
        }
        let tenants: Vec<String> = request
            .callers
            .iter()
            .filter_map(|c| c.tenant().map(str::to_owned))
            .collect();
        let key = super::response_cache::key(
            &model.name,
            model.version,
            &self.answers_digest(model)?,
            request,
            &tenants,
        );
        Some((cache.clone(), key))
    }

    /// What `model`'s answers depend on: its own content, and for an ensemble the content of
    /// each step's model as loaded now (a step loaded again changes the ensemble's answers).
    fn answers_digest(&self, model: &ModelVersion) -> Option<[u8; 32]> {
        use sha2::Digest;
        let own = model.content?;
        let Executor::Ensemble(plan) = &model.executor else {
            return Some(own);
        };
        let mut h = sha2::Sha256::new();
        h.update(own);
        for (step, version) in plan.model_versions() {
            let step = self.models().get(step, version).ok()?;
            h.update(self.answers_digest(&step)?);
        }
        Some(h.finalize().into())
    }

    /// Whether `answer` is what `model`'s configuration says it answers to a request for
    /// `outputs` of `batch_size` rows (see [`super::response_cache::fits`]); the first answer
    /// that is not is logged, once per version. A cached one that is not is a miss; a fresh one
    /// is not kept.
    fn fits_config(
        &self,
        model: &ModelVersion,
        expected: &Expected<'_>,
        answer: &InferResponse,
        what: &str,
    ) -> bool {
        let Expected {
            outputs,
            batch_size,
            classes,
        } = expected;
        match super::response_cache::fits(&model.config, outputs, answer, *batch_size, classes) {
            Ok(()) => true,
            Err(why) => {
                if !model
                    .cache_misfit_logged
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        model = %model.name,
                        "the response cache does not serve or keep {what} that does not fit \
                         the model's configuration: {why}"
                    );
                }
                false
            }
        }
    }

    /// The latency metrics models record (`--metrics-config`).
    pub fn latency_metrics(&self) -> &super::latency::LatencyMetrics {
        &self.options.latency_metrics
    }

    /// The response cache, when the server has one.
    pub fn response_cache(&self) -> Option<&ResponseCache> {
        self.cache.as_deref()
    }

    /// Turns readiness off while still serving (the drain delay before a shutdown).
    pub fn mark_unready(&self) {
        self.unready.store(true, Ordering::Release);
    }

    /// Flips readiness off and waits (up to `timeout`) for in-flight inferences to finish.
    /// Returns true when everything finished in time.
    pub async fn drain(&self, timeout: Duration) -> bool {
        self.stopping.store(true, Ordering::Release);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.idle.notified();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.in_flight.load(Ordering::Acquire) == 0;
            }
        }
    }

    /// Whether a shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }
}

/// What a request's answer must hold to be kept in (or served from) the response cache.
struct Expected<'a> {
    outputs: Vec<String>,
    batch_size: usize,
    classes: &'a [(String, usize)],
}

/// The checks a request passes before it runs, each naming what was wrong: the request
/// limits, a decoupled model asked outside a stream, its inputs against the configuration
/// (integer inputs converted to the declared type when every value fits), and the classes it
/// asks for. Gives its batch size and the outputs asked for as classes.
fn admit(
    limits: &RequestLimits,
    model: &ModelVersion,
    request: &mut InferRequest,
) -> Result<(usize, Vec<(String, usize)>)> {
    limits.check_request(request)?;
    if request.responses.is_none() && crate::runtime::is_decoupled(&model.config) {
        return Err(Error::invalid(format!(
            "model '{}' is decoupled (0..N responses per request): use the gRPC stream \
             (ModelStreamInfer) or POST /v2/models/{}/generate_stream",
            model.name, model.name
        )));
    }
    convert_integer_inputs(&model.config, request)?;
    let batch_size = check_request(&model.config, request)?;
    let classes = crate::classification::requested(request)
        .and_then(|classes| crate::classification::check_types(&model.config, classes))?;
    Ok((batch_size, classes))
}

/// The classification extension: the outputs asked for as classes become them.
fn classify(
    model: &ModelVersion,
    classes: &[(String, usize)],
    mut response: InferResponse,
) -> Result<InferResponse> {
    let batched = model.config.max_batch_size > 0;
    for (name, count) in classes {
        if let Some(tensor) = response.outputs.iter_mut().find(|t| t.name == *name) {
            let labels = model.labels.get(name).map(|l| &l[..]);
            *tensor = crate::classification::classify(tensor, *count, batched, labels)?;
        }
    }
    Ok(response)
}

/// The sequence parameters a request carried (`sequence_id`, `sequence_start`,
/// `sequence_end`), as an ensemble's answer carries them back on Triton (its QA suite's
/// `test_ensemble_sequence_flags`): the id as given, the flags as booleans. None without them.
fn sequence_echo(parameters: &crate::inference::Parameters) -> crate::inference::Parameters {
    use crate::inference::ParamValue;
    const KEYS: [&str; 3] = ["sequence_id", "sequence_start", "sequence_end"];
    let mut echo = crate::inference::Parameters::new();
    if !KEYS.iter().any(|k| parameters.contains_key(*k)) {
        return echo;
    }
    if let Some(id) = parameters.get("sequence_id") {
        echo.insert("sequence_id".into(), id.clone());
    }
    for flag in ["sequence_start", "sequence_end"] {
        let on = matches!(parameters.get(flag), Some(ParamValue::Bool(true)));
        echo.insert(flag.into(), ParamValue::Bool(on));
    }
    echo
}
