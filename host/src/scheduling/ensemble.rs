//! Ensembles (`platform: "ensemble"`): a graph of steps, each a model called through its own
//! scheduler (so composing models keep batching their traffic), wired by `input_map` /
//! `output_map` through named ensemble tensors. The graph is checked when the ensemble loads,
//! against the composing models' configurations, with messages that name the step and tensor;
//! at run time a step starts as soon as its inputs exist.

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    pin::Pin,
    sync::Arc,
};

use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, RequestedOutput, StepDurations},
    proto::inference::{model_config::SchedulingChoice, ModelConfig},
    tensor::{shape_string, DataType, Tensor},
};

/// The platform name of ensembles.
pub const PLATFORM: &str = "ensemble";

/// Whether a configuration describes an ensemble.
pub fn is_ensemble(config: &ModelConfig) -> bool {
    config.platform == PLATFORM
}

/// The models an ensemble's steps call, as `(name, version)` (`None` = latest).
pub fn composing_models(config: &ModelConfig) -> Vec<(String, Option<i64>)> {
    match &config.scheduling_choice {
        Some(SchedulingChoice::EnsembleScheduling(e)) => e
            .step
            .iter()
            .map(|s| {
                (
                    s.model_name.clone(),
                    (s.model_version >= 0).then_some(s.model_version),
                )
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// How an ensemble reaches the models of its steps: the server's own inference path.
pub trait StepRunner: Send + Sync {
    /// Runs one request through the target model's normal path.
    fn run_step(
        &self,
        request: InferRequest,
    ) -> Pin<Box<dyn Future<Output = Result<InferResponse>> + Send + '_>>;
}

#[derive(Debug, Clone)]
struct Step {
    model: String,
    version: Option<i64>,
    /// (composing model tensor, ensemble tensor)
    inputs: Vec<(String, String)>,
    /// (composing model tensor, ensemble tensor)
    outputs: Vec<(String, String)>,
    /// `max_inflight_requests`: how many of the ensemble's requests may be in this step at
    /// once (shared by all of them); a request waits for a turn before the step starts.
    inflight: Option<Arc<Semaphore>>,
}

/// A validated ensemble, ready to run.
#[derive(Debug, Clone)]
pub struct Ensemble {
    name: String,
    steps: Vec<Step>,
    /// The step whose model is decoupled, if one is: the steps after it run once per
    /// response it sends, and the ensemble answers as many times (as Triton's ensembles of
    /// TensorRT-LLM models stream).
    decoupled: Option<usize>,
    /// The ensemble's inputs: one the client leaves out (an optional one) is left out of the
    /// steps that read it, unless the configuration gives it a default.
    inputs: HashSet<String>,
    /// The defaults of optional inputs (`input_default:<input>` parameters).
    defaults: Vec<Tensor>,
}

/// Datatype and full shape (batch dimension included as -1) of a tensor.
#[derive(Debug, Clone, PartialEq)]
struct Signature {
    datatype: i32,
    shape: Vec<i64>,
}

impl Signature {
    fn new(datatype: i32, dims: &[i64], max_batch_size: i32) -> Self {
        let mut shape = Vec::with_capacity(dims.len() + 1);
        if max_batch_size > 0 {
            shape.push(-1);
        }
        shape.extend_from_slice(dims);
        Self { datatype, shape }
    }

    fn type_name(&self) -> &'static str {
        DataType::from_config_value(self.datatype).map_or("TYPE_INVALID", |d| d.config_name())
    }

    fn fits(&self, other: &Signature) -> bool {
        self.shape.len() == other.shape.len()
            && self
                .shape
                .iter()
                .zip(&other.shape)
                .all(|(a, b)| *a == -1 || *b == -1 || a == b)
    }
}

/// Who writes an ensemble tensor.
#[derive(Debug, Clone)]
enum Producer {
    Input,
    Step(usize),
}

fn describe(p: &Producer) -> String {
    match p {
        Producer::Input => "the ensemble's input".to_owned(),
        Producer::Step(i) => format!("step {i}"),
    }
}

impl Ensemble {
    /// Checks an ensemble configuration against the composing models' configurations
    /// (`lookup` finds a loaded model by a step's name: the key it is called by, and its
    /// configuration) and returns the runnable plan.
    pub fn plan(
        config: &ModelConfig,
        lookup: impl Fn(&str, Option<i64>) -> Result<(String, ModelConfig)>,
    ) -> Result<Self> {
        let name = &config.name;
        let invalid = |msg: String| Error::invalid(format!("ensemble '{name}': {msg}"));
        let Some(SchedulingChoice::EnsembleScheduling(sched)) = &config.scheduling_choice else {
            return Err(invalid(
                "platform \"ensemble\" needs an 'ensemble_scheduling' section with its steps"
                    .into(),
            ));
        };
        if sched.step.is_empty() {
            return Err(invalid(
                "field 'ensemble_scheduling.step' is empty: an ensemble needs at least one step"
                    .into(),
            ));
        }
        // Every ensemble tensor: its signature and who writes it.
        let mut tensors = Tensors::new();
        for input in &config.input {
            let sig = Signature::new(input.data_type, &input.dims, config.max_batch_size);
            tensors.insert(input.name.clone(), (sig, Producer::Input));
        }
        let mut steps = Vec::with_capacity(sched.step.len());
        let mut decoupled = None;
        let mut composing = Vec::with_capacity(sched.step.len());
        for (i, s) in sched.step.iter().enumerate() {
            let (step, model) = Self::plan_step(config, sched, i, s, &lookup, &mut tensors)?;
            if crate::runtime::is_decoupled(&model) {
                if let Some(other) = decoupled {
                    return Err(invalid(format!(
                        "step {i} (model '{}'): step {other} is decoupled already; an ensemble \
                         may have one decoupled step (the steps after it run once per response)",
                        s.model_name
                    )));
                }
                decoupled = Some(i);
            }
            steps.push(step);
            composing.push(model);
        }
        let read = check_reads(name, &steps, &composing, &tensors)?;
        check_outputs(config, &tensors)?;
        check_all_read(config, &steps, &tensors, &read)?;
        let plan = Self {
            name: name.clone(),
            steps,
            decoupled,
            inputs: config.input.iter().map(|i| i.name.clone()).collect(),
            defaults: super::ensemble_defaults::of(config)?,
        };
        plan.check_acyclic(&tensors)?;
        Ok(plan)
    }

    /// Step `i` of the ensemble: its model (looked up), its input and output maps checked
    /// against the model's signature, its outputs recorded as ensemble tensors.
    fn plan_step(
        config: &ModelConfig,
        sched: &crate::proto::inference::ModelEnsembling,
        i: usize,
        s: &crate::proto::inference::model_ensembling::Step,
        lookup: &impl Fn(&str, Option<i64>) -> Result<(String, ModelConfig)>,
        tensors: &mut Tensors,
    ) -> Result<(Step, ModelConfig)> {
        let name = &config.name;
        let invalid = |msg: String| Error::invalid(format!("ensemble '{name}': {msg}"));
        let at = |msg: String| invalid(format!("step {i} (model '{}'): {msg}", s.model_name));
        if s.model_name.is_empty() {
            return Err(invalid(format!("step {i}: field 'model_name' is empty")));
        }
        if s.model_name == *name {
            return Err(at("an ensemble cannot call itself".into()));
        }
        let version = (s.model_version >= 0).then_some(s.model_version);
        let (key, model) = lookup(&s.model_name, version).map_err(|e| {
            at(format!(
                "{} (composing models load before the ensemble)",
                e.message
            ))
        })?;
        if config.max_batch_size > model.max_batch_size && model.max_batch_size > 0 {
            return Err(at(format!(
                "max_batch_size {} is smaller than the ensemble's {}",
                model.max_batch_size, config.max_batch_size
            )));
        }
        let mut inputs: Vec<(String, String)> = s
            .input_map
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        inputs.sort();
        let mut outputs: Vec<(String, String)> = s
            .output_map
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        outputs.sort();
        for (model_tensor, _) in &inputs {
            if !model.input.iter().any(|t| t.name == *model_tensor) {
                let names: Vec<&str> = model.input.iter().map(|t| t.name.as_str()).collect();
                return Err(at(format!(
                    "input_map names '{model_tensor}', which is not an input of '{}' (its inputs: {})",
                    s.model_name,
                    names.join(", ")
                )));
            }
        }
        for input in model.input.iter().filter(|t| !t.optional) {
            if !inputs.iter().any(|(k, _)| *k == input.name) {
                return Err(at(format!(
                    "input '{}' of '{}' is not in input_map",
                    input.name, s.model_name
                )));
            }
        }
        for (model_tensor, ensemble_tensor) in &outputs {
            let Some(out) = model.output.iter().find(|t| t.name == *model_tensor) else {
                let names: Vec<&str> = model.output.iter().map(|t| t.name.as_str()).collect();
                return Err(at(format!(
                    "output_map names '{model_tensor}', which is not an output of '{}' (its outputs: {})",
                    s.model_name,
                    names.join(", ")
                )));
            };
            let sig = Signature::new(out.data_type, &out.dims, model.max_batch_size);
            if let Some((_, other)) = tensors.get(ensemble_tensor) {
                return Err(at(format!(
                    "ensemble tensor '{ensemble_tensor}' is written by {} already; each \
                     tensor has one producer",
                    describe(other)
                )));
            }
            tensors.insert(ensemble_tensor.clone(), (sig, Producer::Step(i)));
        }
        if key == *name {
            return Err(at("an ensemble cannot call itself".into()));
        }
        let step = Step {
            model: key,
            version,
            inputs,
            outputs,
            inflight: (sched.max_inflight_requests > 0)
                .then(|| Arc::new(Semaphore::new(sched.max_inflight_requests as usize))),
        };
        Ok((step, model))
    }

    /// Steps can all run in some order: otherwise some of them wait on each other.
    fn check_acyclic(&self, tensors: &HashMap<String, (Signature, Producer)>) -> Result<()> {
        let mut available: HashSet<&str> = tensors
            .iter()
            .filter(|(_, (_, p))| matches!(p, Producer::Input))
            .map(|(k, _)| k.as_str())
            .collect();
        let mut left: Vec<usize> = (0..self.steps.len()).collect();
        loop {
            let ready: Vec<usize> = left
                .iter()
                .copied()
                .filter(|i| {
                    self.steps[*i]
                        .inputs
                        .iter()
                        .all(|(_, t)| available.contains(t.as_str()))
                })
                .collect();
            if ready.is_empty() {
                break;
            }
            for i in &ready {
                for (_, t) in &self.steps[*i].outputs {
                    available.insert(t);
                }
            }
            left.retain(|i| !ready.contains(i));
        }
        if left.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = left
            .iter()
            .map(|i| format!("step {i} (model '{}')", self.steps[*i].model))
            .collect();
        Err(Error::invalid(format!(
            "ensemble '{}': {} wait on each other's outputs (a cycle)",
            self.name,
            names.join(", ")
        )))
    }

    /// Runs the steps, each as soon as its inputs exist, and returns the ensemble's `outputs`
    /// in that order. Request parameters and the deadline go to every step; the first failing
    /// step ends the run (steps not started yet never start).
    ///
    /// With a decoupled step, every response it sends runs the steps after it and becomes a
    /// response of the ensemble, sent to the request's response stream; the ensemble's own
    /// final answer is then empty.
    pub async fn run(
        &self,
        runner: &dyn StepRunner,
        mut request: InferRequest,
        outputs: &[String],
        durations: &StepDurations,
    ) -> Result<Vec<Tensor>> {
        let mut tensors: HashMap<String, Tensor> = std::mem::take(&mut request.inputs)
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        for default in &self.defaults {
            tensors
                .entry(default.name.clone())
                .or_insert_with(|| default.clone());
        }
        let Some(d) = self.decoupled else {
            // As on Triton, only the steps the requested outputs depend on run.
            let needed = self.steps_for(outputs);
            self.run_steps(runner, &request, &needed, &mut tensors, durations)
                .await?;
            return self.collect(outputs, tensors);
        };
        let Some(sink) = request.responses.take() else {
            return Err(Error::invalid(format!(
                "ensemble '{}' is decoupled (step {d}, model '{}', answers 0..N times): use \
                 the gRPC stream (ModelStreamInfer) or POST /v2/models/{}/generate_stream",
                self.name, self.steps[d].model, self.name
            )));
        };
        let after = self.downstream_of(d);
        let before: Vec<usize> = (0..self.steps.len())
            .filter(|i| *i != d && !after.contains(i))
            .collect();
        self.run_steps(runner, &request, &before, &mut tensors, durations)
            .await?;
        let (step_sink, mut produced) = crate::inference::ResponseSink::channel(16, sink.stall());
        let mut step_request = self.step_request(d, &request, &tensors, durations);
        step_request.responses = Some(step_sink);
        let answer = |outputs_of_step: Vec<Tensor>| {
            let mut tensors = tensors.clone();
            let after = &after;
            let request = &request;
            let sink = &sink;
            async move {
                self.take_outputs(d, outputs_of_step, &mut tensors);
                self.run_steps(runner, request, after, &mut tensors, durations)
                    .await?;
                let answer = self.collect(outputs, tensors)?;
                sink.send(answer).await
            }
        };
        let last = {
            let step = async {
                let _turn = self.turn(d).await;
                runner.run_step(step_request).await
            };
            tokio::pin!(step);
            loop {
                tokio::select! {
                    Some(step_reply) = produced.recv() => match step_reply.error {
                        Some(e) => return Err(self.step_error(d, e)),
                        None => answer(step_reply.outputs).await?,
                    },
                    result = &mut step => break result,
                }
            }
        };
        // Until every sender is gone: a step that answers in the background (a decoupled
        // `async def execute`) sends after its execution has returned.
        while let Some(step_reply) = produced.recv().await {
            if let Some(e) = step_reply.error {
                return Err(self.step_error(d, e));
            }
            answer(step_reply.outputs).await?;
        }
        let last = last.map_err(|e| self.step_error(d, e))?;
        if !last.outputs.is_empty() {
            answer(last.outputs).await?;
        }
        Ok(Vec::new())
    }

    /// Waits for a turn in step `i` under `max_inflight_requests`; `None` without a limit.
    async fn turn(&self, i: usize) -> Option<OwnedSemaphorePermit> {
        let limit = self.steps[i].inflight.clone()?;
        // The semaphore is never closed, so this waits for a permit and gets one.
        limit.acquire_owned().await.ok()
    }

    /// The steps that read, directly or not, what step `d` writes.
    fn downstream_of(&self, d: usize) -> Vec<usize> {
        let mut written: HashSet<&str> = self.steps[d]
            .outputs
            .iter()
            .map(|(_, t)| t.as_str())
            .collect();
        let mut found = Vec::new();
        loop {
            let more: Vec<usize> = (0..self.steps.len())
                .filter(|i| *i != d && !found.contains(i))
                .filter(|i| {
                    self.steps[*i]
                        .inputs
                        .iter()
                        .any(|(_, t)| written.contains(t.as_str()))
                })
                .collect();
            if more.is_empty() {
                found.sort_unstable();
                return found;
            }
            for i in more {
                written.extend(self.steps[i].outputs.iter().map(|(_, t)| t.as_str()));
                found.push(i);
            }
        }
    }

    fn step_error(&self, i: usize, e: Error) -> Error {
        e.within(format_args!(
            "ensemble '{}' step {i} (model '{}')",
            self.name, self.steps[i].model
        ))
    }

    /// The request for step `i`, from the ensemble tensors it reads.
    fn step_request(
        &self,
        i: usize,
        request: &InferRequest,
        tensors: &HashMap<String, Tensor>,
        durations: &StepDurations,
    ) -> InferRequest {
        let step = &self.steps[i];
        let inputs = step
            .inputs
            .iter()
            .filter_map(|(model_tensor, ensemble_tensor)| {
                let t = tensors.get(ensemble_tensor)?;
                Some(Tensor {
                    name: model_tensor.clone(),
                    ..t.clone()
                })
            })
            .collect();
        InferRequest {
            reply_parameters: Default::default(),
            reschedule: Default::default(),
            // A sequence's next request on a stream follows once this step has its place.
            sequence_queued: request.sequence_queued.clone(),
            model_name: step.model.clone(),
            model_version: step.version,
            id: request.id.clone(),
            parameters: request.parameters.clone(),
            inputs,
            outputs: step
                .outputs
                .iter()
                .map(|(name, _)| RequestedOutput {
                    name: name.clone(),
                    parameters: Default::default(),
                })
                .collect(),
            deadline: request.deadline,
            responses: None,
            step_durations: Some(durations.clone()),
            callers: request.callers.clone(),
            from_stage: request.from_stage,
            trace: request.trace.child(crate::trace_span!(
                parent: &request.trace.0,
                "ensemble.step",
                model = %step.model
            )),
            cancel: request.cancel.child(),
        }
    }

    /// Files step `i`'s outputs under the ensemble tensors they map to.
    fn take_outputs(&self, i: usize, outputs: Vec<Tensor>, tensors: &mut HashMap<String, Tensor>) {
        let step = &self.steps[i];
        for out in outputs {
            if let Some((_, ensemble_tensor)) = step.outputs.iter().find(|(m, _)| *m == out.name) {
                tensors.insert(
                    ensemble_tensor.clone(),
                    Tensor {
                        name: ensemble_tensor.clone(),
                        ..out
                    },
                );
            }
        }
    }

    /// The steps whose outputs `outputs` depend on, in step order.
    fn steps_for(&self, outputs: &[String]) -> Vec<usize> {
        let mut needed: HashSet<&str> = outputs.iter().map(String::as_str).collect();
        let mut chosen = vec![false; self.steps.len()];
        loop {
            let mut grew = false;
            for (i, step) in self.steps.iter().enumerate() {
                if !chosen[i]
                    && step
                        .outputs
                        .iter()
                        .any(|(_, t)| needed.contains(t.as_str()))
                {
                    chosen[i] = true;
                    grew = true;
                    needed.extend(step.inputs.iter().map(|(_, t)| t.as_str()));
                }
            }
            if !grew {
                break;
            }
        }
        (0..self.steps.len()).filter(|&i| chosen[i]).collect()
    }

    /// The ensemble's `outputs`, in that order; one its steps did not give (a step that
    /// answered without it) is left out of the answer, as on Triton.
    fn collect(
        &self,
        outputs: &[String],
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Vec<Tensor>> {
        Ok(outputs
            .iter()
            .filter_map(|name| {
                let tensor = tensors.remove(name);
                if tensor.is_none() {
                    // Triton's words (its QA suite looks for them in the log).
                    tracing::debug!(
                        ensemble = %self.name,
                        "Composing models did not output tensor {name}"
                    );
                }
                tensor
            })
            .collect())
    }

    /// Runs `which` steps, each as soon as its inputs exist in `tensors`, adding their outputs.
    async fn run_steps(
        &self,
        runner: &dyn StepRunner,
        request: &InferRequest,
        which: &[usize],
        tensors: &mut HashMap<String, Tensor>,
        durations: &StepDurations,
    ) -> Result<()> {
        let mut waiting: Vec<usize> = which.to_vec();
        let mut running = FuturesUnordered::new();
        loop {
            let (ready, still): (Vec<usize>, Vec<usize>) = waiting.iter().partition(|i| {
                self.steps[**i]
                    .inputs
                    .iter()
                    .all(|(_, t)| tensors.contains_key(t) || self.inputs.contains(t))
            });
            waiting = still;
            for i in ready {
                let step_request = self.step_request(i, request, tensors, durations);
                running.push(async move {
                    let _turn = self.turn(i).await;
                    (i, runner.run_step(step_request).await)
                });
            }
            let Some((i, result)) = running.next().await else {
                break;
            };
            let response = result.map_err(|e| self.step_error(i, e))?;
            self.take_outputs(i, response.outputs, tensors);
        }
        Ok(())
    }

    /// Whether a step is decoupled (the ensemble then answers 0..N times).
    pub fn is_decoupled(&self) -> bool {
        self.decoupled.is_some()
    }

    /// The models this ensemble calls, step by step (by key: see `ModelRepository`).
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.steps.iter().map(|s| s.model.as_str())
    }

    /// The models this ensemble calls, step by step, with the version each step asks for.
    pub fn model_versions(&self) -> impl Iterator<Item = (&str, Option<i64>)> {
        self.steps.iter().map(|s| (s.model.as_str(), s.version))
    }
}

/// Every ensemble tensor: its signature and who writes it.
type Tensors = HashMap<String, (Signature, Producer)>;

/// Every step input reads an ensemble tensor that exists, of its datatype and a fitting
/// shape; answers the tensors read.
fn check_reads<'a>(
    name: &str,
    steps: &'a [Step],
    composing: &[ModelConfig],
    tensors: &Tensors,
) -> Result<HashSet<&'a str>> {
    let invalid = |msg: String| Error::invalid(format!("ensemble '{name}': {msg}"));
    // Every read has a producer of the same type and a fitting shape.
    let mut read: HashSet<&str> = HashSet::new();
    for (i, (step, model)) in steps.iter().zip(composing).enumerate() {
        for (model_tensor, ensemble_tensor) in &step.inputs {
            let at = |msg: String| invalid(format!("step {i} (model '{}'): {msg}", step.model));
            let Some((sig, producer)) = tensors.get(ensemble_tensor) else {
                return Err(at(format!(
                    "input '{model_tensor}' reads ensemble tensor '{ensemble_tensor}', which \
                     is neither an ensemble input nor any step's output"
                )));
            };
            read.insert(ensemble_tensor);
            let wanted = model.input.iter().find(|t| t.name == *model_tensor);
            let Some(wanted) = wanted else { continue };
            let want = Signature::new(wanted.data_type, &wanted.dims, model.max_batch_size);
            if want.datatype != sig.datatype {
                return Err(at(format!(
                    "input '{model_tensor}' is {} but ensemble tensor '{ensemble_tensor}' \
                     (from {}) is {}",
                    want.type_name(),
                    describe(producer),
                    sig.type_name()
                )));
            }
            if !want.fits(sig) {
                return Err(at(format!(
                    "input '{model_tensor}' has shape {} but ensemble tensor \
                     '{ensemble_tensor}' (from {}) has shape {}",
                    shape_string(&want.shape),
                    describe(producer),
                    shape_string(&sig.shape)
                )));
            }
        }
    }
    Ok(read)
}

/// Every ensemble output is written by a step, as declared.
fn check_outputs(config: &ModelConfig, tensors: &Tensors) -> Result<()> {
    let name = &config.name;
    let invalid = |msg: String| Error::invalid(format!("ensemble '{name}': {msg}"));
    for output in &config.output {
        let want = Signature::new(output.data_type, &output.dims, config.max_batch_size);
        let Some((sig, producer)) = tensors.get(&output.name) else {
            return Err(invalid(format!(
                "output '{}' is not written by any step's output_map",
                output.name
            )));
        };
        if !matches!(producer, Producer::Step(_)) {
            continue;
        }
        if want.datatype != sig.datatype || !want.fits(sig) {
            return Err(invalid(format!(
                "output '{}' is declared {} {} but {} writes {} {}",
                output.name,
                want.type_name(),
                shape_string(&want.shape),
                describe(producer),
                sig.type_name(),
                shape_string(&sig.shape)
            )));
        }
    }
    Ok(())
}

/// Every ensemble tensor is read by a step or answered.
fn check_all_read(
    config: &ModelConfig,
    steps: &[Step],
    tensors: &Tensors,
    read: &HashSet<&str>,
) -> Result<()> {
    let name = &config.name;
    let invalid = |msg: String| Error::invalid(format!("ensemble '{name}': {msg}"));
    let outputs: HashSet<&str> = config.output.iter().map(|o| o.name.as_str()).collect();
    for (tensor, (_, producer)) in tensors {
        if !read.contains(tensor.as_str()) && !outputs.contains(tensor.as_str()) {
            return Err(invalid(match producer {
                Producer::Input => format!("input '{tensor}' is not read by any step"),
                Producer::Step(i) => format!(
                    "step {i} (model '{}') writes ensemble tensor '{tensor}', which no step \
                     reads and is not an ensemble output",
                    steps[*i].model
                ),
            }));
        }
    }
    Ok(())
}
