//! What every field of `config.pbtxt` means here, per backend: honoured with Triton's meaning,
//! refused at load naming the field, file and line, or — only where Triton ignores it too for
//! that backend (a TensorRT setting on an ONNX model, an ensemble's instances) — accepted with
//! one log line saying it has no effect. [`FIELDS`] is the one table that decides it; a test
//! holds it to the schema (every field has a row) and the manual's configuration reference is
//! checked against it.

use prost_reflect::{DynamicMessage, Value};

use super::config::{model_config_descriptor, ConfigError};
use crate::proto::inference::ModelConfig;

/// The kinds of model a configuration can describe, each with its own reading of the fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `backend: "onnxruntime"` / `platform: "onnxruntime_onnx"` (the default).
    Onnx,
    /// `backend: "wasm"`: a WebAssembly stage.
    Stage,
    /// `backend: "generation"`: text generation with in-flight batching.
    Generation,
    /// `platform: "ensemble"`.
    Ensemble,
}

impl Family {
    fn column(self) -> usize {
        self as usize
    }

    /// The name the manual's table uses for this family.
    pub fn label(self) -> &'static str {
        match self {
            Family::Onnx => "onnxruntime",
            Family::Stage => "wasm",
            Family::Generation => "generation",
            Family::Ensemble => "ensemble",
        }
    }

    /// Every family, in the table's column order.
    pub const ALL: [Family; 4] = [
        Family::Onnx,
        Family::Stage,
        Family::Generation,
        Family::Ensemble,
    ];
}

/// How one field is treated for one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Treatment {
    /// Means what it means on Triton.
    Honoured,
    /// A message whose own fields are judged one by one.
    Container,
    /// Refused at load; the text says why.
    Refused(&'static str),
    /// Accepted with one log line: Triton ignores it too for this backend; the text says why.
    NoEffect(&'static str),
}

/// One row of the table: a field's dotted path (list and map entries add no segment) and its
/// treatment for each [`Family`].
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// e.g. `optimization.graph.level`.
    pub path: &'static str,
    /// Indexed by [`Family`]'s order.
    pub by_family: [Treatment; 4],
}

impl Row {
    /// This row's treatment for `family`.
    pub fn treatment(&self, family: Family) -> Treatment {
        self.by_family[family.column()]
    }
}

use Treatment::{Container as C, Honoured as H, NoEffect, Refused};

const fn all(path: &'static str, t: Treatment) -> Row {
    Row {
        path,
        by_family: [t, t, t, t],
    }
}

const fn each(
    path: &'static str,
    onnx: Treatment,
    stage: Treatment,
    generation: Treatment,
    ensemble: Treatment,
) -> Row {
    Row {
        path,
        by_family: [onnx, stage, generation, ensemble],
    }
}

/// Honoured by the backends that execute, without effect on an ensemble (which runs none of
/// its own: its steps' models do).
const fn executing(path: &'static str, ensemble_why: &'static str) -> Row {
    each(path, H, H, H, NoEffect(ensemble_why))
}

const TENSORRT: &str = "a TensorRT backend setting; Triton's ONNX Runtime and Python backends \
                        ignore it too";
const STAGE_BATCH_IO: &str = "a stage receives each request's own tensors (a list per batch), so \
                              there is no concatenated tensor for batch inputs and outputs to \
                              describe; Triton's Python backend ignores them too";
const ENSEMBLE_BATCHES: &str = "an ensemble forms no batches of its own (its steps' models do), \
                                as on Triton";
const NO_INSTANCES: &str = "an ensemble runs no instances of its own (its steps' models do), as \
                            on Triton";
const GEN_BATCHES: &str = "the generation backend batches sequences in flight by itself \
                           (max_batch_size rows); it takes no other scheduler";
const GEN_INSTANCES: &str = "the generation backend sizes its own instances (2 x max_batch_size \
                             + 64, each waiting on one sequence) and runs its decoder on the \
                             CPU; set max_batch_size instead";
const STAGE_CPU: &str = "Wasm stages run on the CPU; execution accelerators apply to ONNX \
                         models (a stage's called models may use them)";
const GEN_CPU: &str = "the generation backend runs its decoder on the CPU with ONNX Runtime's \
                       defaults";
const GRAPH_LEVEL_ELSEWHERE: &str = "graph optimisation levels are read by the ONNX Runtime and \
                                     TensorFlow backends only, as on Triton";
const PRIORITY: &str = "sets CUDA stream priorities in Triton's TensorRT and TensorFlow \
                        backends; its ONNX Runtime backend ignores it too";
const PINNED: &str = "GPU instances here always stage inputs and outputs in pinned host memory; \
                      CPU instances copy nothing";
const GATHER: &str = "a GPU gather-kernel threshold; inputs here are gathered on the host";
const SECONDARY: &str = "NVDLA cores for TensorRT; Triton's other backends ignore them too";
const PROFILE: &str = "TensorRT optimisation profiles; Triton's other backends ignore them too";
const HOST_POLICY: &str = "host policies (--host-policy: NUMA binding) are not supported here";
const CC_FILES: &str = "per-GPU-architecture model files are not supported here; name the file \
                        with default_model_filename";
const RUNTIME: &str = "selects a backend's shared library or Python runtime on Triton; this \
                       server's backends are built in";
const NAMESPACE: &str = "reserved by Triton for internal use";
const OPS_ELSEWHERE: &str = "custom operator libraries are read by the ONNX Runtime and \
                             TensorFlow backends only, as on Triton";
const SHAPE_TENSORS: &str = "shape tensors are a TensorRT feature, not supported here";
const NON_LINEAR: &str = "non-linear I/O formats are a TensorRT feature, not supported here";
const STATE_BUFFERS: &str = "a GPU-state buffer option of Triton's TensorRT and ONNX Runtime \
                             backends; sequence state is kept on the host here";
const STAGE_RESHAPE: &str = "a stage receives tensors in the shape the client sent; reshape is \
                             applied to ONNX models only";
const GEN_SEQUENCE: &str = "the generation backend keeps each sequence's state itself";
const WARMUP_ENSEMBLE: &str = "an ensemble warms up through its steps' models, as on Triton";

/// The table: every field of `ModelConfig`, in the schema's order.
pub const FIELDS: &[Row] = &[
    all("name", H),
    all("platform", H),
    all("backend", H),
    all("runtime", Refused(RUNTIME)),
    all("version_policy", H),
    all("version_policy.latest", H),
    all("version_policy.latest.num_versions", H),
    all("version_policy.all", H),
    all("version_policy.specific", H),
    all("version_policy.specific.versions", H),
    all("max_batch_size", H),
    all("input", H),
    all("input.name", H),
    all("input.data_type", H),
    all("input.format", H),
    all("input.dims", H),
    each(
        "input.reshape",
        H,
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
    ),
    each(
        "input.reshape.shape",
        H,
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
    ),
    all("input.is_shape_tensor", Refused(SHAPE_TENSORS)),
    each(
        "input.allow_ragged_batch",
        H,
        H,
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    all("input.optional", H),
    all("input.is_non_linear_format_io", Refused(NON_LINEAR)),
    all("output", H),
    all("output.name", H),
    all("output.data_type", H),
    all("output.dims", H),
    each(
        "output.reshape",
        H,
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
    ),
    each(
        "output.reshape.shape",
        H,
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
        Refused(STAGE_RESHAPE),
    ),
    all("output.label_filename", H),
    all("output.is_shape_tensor", Refused(SHAPE_TENSORS)),
    all("output.is_non_linear_format_io", Refused(NON_LINEAR)),
    each(
        "batch_input",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_input.kind",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_input.target_name",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_input.data_type",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_input.source_input",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_output",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_output.target_name",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_output.kind",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    each(
        "batch_output.source_input",
        H,
        NoEffect(STAGE_BATCH_IO),
        Refused(GEN_BATCHES),
        NoEffect(ENSEMBLE_BATCHES),
    ),
    all("optimization", C),
    all("optimization.graph", C),
    each(
        "optimization.graph.level",
        H,
        NoEffect(GRAPH_LEVEL_ELSEWHERE),
        Refused(GEN_CPU),
        NoEffect(GRAPH_LEVEL_ELSEWHERE),
    ),
    all("optimization.priority", NoEffect(PRIORITY)),
    all("optimization.cuda", C),
    all("optimization.cuda.graphs", NoEffect(TENSORRT)),
    all("optimization.cuda.busy_wait_events", NoEffect(TENSORRT)),
    all("optimization.cuda.graph_spec", NoEffect(TENSORRT)),
    all(
        "optimization.cuda.graph_spec.batch_size",
        NoEffect(TENSORRT),
    ),
    all("optimization.cuda.graph_spec.input", NoEffect(TENSORRT)),
    all("optimization.cuda.graph_spec.input.dim", NoEffect(TENSORRT)),
    all(
        "optimization.cuda.graph_spec.graph_lower_bound",
        NoEffect(TENSORRT),
    ),
    all(
        "optimization.cuda.graph_spec.graph_lower_bound.batch_size",
        NoEffect(TENSORRT),
    ),
    all(
        "optimization.cuda.graph_spec.graph_lower_bound.input",
        NoEffect(TENSORRT),
    ),
    all(
        "optimization.cuda.graph_spec.graph_lower_bound.input.dim",
        NoEffect(TENSORRT),
    ),
    all("optimization.cuda.output_copy_stream", NoEffect(TENSORRT)),
    all("optimization.execution_accelerators", C),
    each(
        "optimization.execution_accelerators.gpu_execution_accelerator",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "optimization.execution_accelerators.gpu_execution_accelerator.name",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "optimization.execution_accelerators.gpu_execution_accelerator.parameters",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "optimization.execution_accelerators.cpu_execution_accelerator",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "optimization.execution_accelerators.cpu_execution_accelerator.name",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "optimization.execution_accelerators.cpu_execution_accelerator.parameters",
        H,
        Refused(STAGE_CPU),
        Refused(GEN_CPU),
        NoEffect(NO_INSTANCES),
    ),
    all("optimization.input_pinned_memory", C),
    all("optimization.input_pinned_memory.enable", NoEffect(PINNED)),
    all("optimization.output_pinned_memory", C),
    all("optimization.output_pinned_memory.enable", NoEffect(PINNED)),
    all(
        "optimization.gather_kernel_buffer_threshold",
        NoEffect(GATHER),
    ),
    all("optimization.eager_batching", NoEffect(TENSORRT)),
    each("dynamic_batching", H, H, Refused(GEN_BATCHES), H),
    each(
        "dynamic_batching.preferred_batch_size",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.max_queue_delay_microseconds",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.preserve_ordering",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_levels",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_priority_level",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_queue_policy",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_queue_policy.timeout_action",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_queue_policy.default_timeout_microseconds",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_queue_policy.allow_timeout_override",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.default_queue_policy.max_queue_size",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_queue_policy",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_queue_policy.timeout_action",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_queue_policy.default_timeout_microseconds",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_queue_policy.allow_timeout_override",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each(
        "dynamic_batching.priority_queue_policy.max_queue_size",
        H,
        H,
        Refused(GEN_BATCHES),
        H,
    ),
    each("sequence_batching", H, H, Refused(GEN_SEQUENCE), H),
    each("sequence_batching.direct", H, H, Refused(GEN_SEQUENCE), H),
    each(
        "sequence_batching.direct.max_queue_delay_microseconds",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.direct.minimum_slot_utilization",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each("sequence_batching.oldest", H, H, Refused(GEN_SEQUENCE), H),
    each(
        "sequence_batching.oldest.max_candidate_sequences",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.oldest.preferred_batch_size",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.oldest.max_queue_delay_microseconds",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.oldest.preserve_ordering",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.max_sequence_idle_microseconds",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.name",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control.kind",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control.int32_false_true",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control.fp32_false_true",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control.bool_false_true",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.control_input.control.data_type",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each("sequence_batching.state", H, H, Refused(GEN_SEQUENCE), H),
    each(
        "sequence_batching.state.input_name",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.output_name",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.data_type",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.dims",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state.data_type",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state.dims",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state.zero_data",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state.data_file",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.initial_state.name",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    each(
        "sequence_batching.state.use_same_buffer_for_input_output",
        NoEffect(STATE_BUFFERS),
        NoEffect(STATE_BUFFERS),
        Refused(GEN_SEQUENCE),
        NoEffect(STATE_BUFFERS),
    ),
    each(
        "sequence_batching.state.use_growable_memory",
        NoEffect(STATE_BUFFERS),
        NoEffect(STATE_BUFFERS),
        Refused(GEN_SEQUENCE),
        NoEffect(STATE_BUFFERS),
    ),
    each(
        "sequence_batching.iterative_sequence",
        H,
        H,
        Refused(GEN_SEQUENCE),
        H,
    ),
    all("ensemble_scheduling", H),
    all("ensemble_scheduling.step", H),
    all("ensemble_scheduling.step.model_name", H),
    all("ensemble_scheduling.step.model_version", H),
    all("ensemble_scheduling.step.input_map", H),
    all("ensemble_scheduling.step.output_map", H),
    all(
        "ensemble_scheduling.step.model_namespace",
        Refused(NAMESPACE),
    ),
    all("ensemble_scheduling.max_inflight_requests", H),
    each(
        "instance_group",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.name",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.kind",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.count",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    all("instance_group.rate_limiter", C),
    each(
        "instance_group.rate_limiter.resources",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.rate_limiter.resources.name",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.rate_limiter.resources.global",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.rate_limiter.resources.count",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.rate_limiter.priority",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    each(
        "instance_group.gpus",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    all("instance_group.secondary_devices", NoEffect(SECONDARY)),
    all("instance_group.secondary_devices.kind", NoEffect(SECONDARY)),
    all(
        "instance_group.secondary_devices.device_id",
        NoEffect(SECONDARY),
    ),
    all("instance_group.profile", NoEffect(PROFILE)),
    each(
        "instance_group.passive",
        H,
        H,
        Refused(GEN_INSTANCES),
        NoEffect(NO_INSTANCES),
    ),
    all("instance_group.host_policy", Refused(HOST_POLICY)),
    executing("default_model_filename", NO_INSTANCES),
    all("cc_model_filenames", Refused(CC_FILES)),
    all("metric_tags", H),
    all("parameters", H),
    all("parameters.string_value", H),
    executing("model_warmup", WARMUP_ENSEMBLE),
    executing("model_warmup.name", WARMUP_ENSEMBLE),
    executing("model_warmup.batch_size", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs.data_type", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs.dims", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs.zero_data", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs.random_data", WARMUP_ENSEMBLE),
    executing("model_warmup.inputs.input_data_file", WARMUP_ENSEMBLE),
    executing("model_warmup.count", WARMUP_ENSEMBLE),
    each(
        "model_operations",
        C,
        NoEffect(OPS_ELSEWHERE),
        NoEffect(OPS_ELSEWHERE),
        NoEffect(OPS_ELSEWHERE),
    ),
    each(
        "model_operations.op_library_filename",
        H,
        NoEffect(OPS_ELSEWHERE),
        NoEffect(OPS_ELSEWHERE),
        NoEffect(OPS_ELSEWHERE),
    ),
    all("model_transaction_policy", H),
    all("model_transaction_policy.decoupled", H),
    all("model_repository_agents", H),
    all("model_repository_agents.agents", H),
    all("model_repository_agents.agents.name", H),
    all("model_repository_agents.agents.parameters", H),
    all("response_cache", C),
    all("response_cache.enable", H),
    all("model_metrics", C),
    all("model_metrics.metric_control", H),
    all("model_metrics.metric_control.metric_identifier", H),
    all("model_metrics.metric_control.metric_identifier.family", H),
    all("model_metrics.metric_control.histogram_options", H),
    all("model_metrics.metric_control.histogram_options.buckets", H),
];

/// The row of `path`, if the table has one.
pub fn row(path: &str) -> Option<&'static Row> {
    FIELDS.iter().find(|r| r.path == path)
}

/// One field set in a configuration that has no effect here, for the load's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoEffectField {
    /// The field's dotted path.
    pub path: &'static str,
    /// Why it has no effect.
    pub why: &'static str,
    /// Where it was written (`file:line`), or the file alone when the line is unknown.
    pub at: String,
}

/// Checks every field set in `config` against the table for `family`: the first refused one
/// is an error naming the field, file and line (found in `text`, the file's contents, when
/// given); fields without effect are returned for the caller to log once each.
pub fn check(
    config: &ModelConfig,
    family: Family,
    text: Option<&str>,
    file: &str,
) -> Result<Vec<NoEffectField>, ConfigError> {
    let mut dynamic = DynamicMessage::new(model_config_descriptor().clone());
    dynamic
        .transcode_from(config)
        .map_err(|e| ConfigError::Invalid {
            file: file.to_owned(),
            message: e.to_string(),
        })?;
    let mut set = Vec::new();
    set_fields(&dynamic, "", &mut set);
    let mut quiet = Vec::new();
    for path in set {
        let Some(row) = row(&path) else {
            // The schema test keeps every field in the table; a field without a row would be
            // a build defect, refused rather than ignored.
            return Err(ConfigError::Invalid {
                file: file.to_owned(),
                message: format!("field '{path}' is not supported by this server"),
            });
        };
        let at = || match text.and_then(|t| line_of(t, row.path)) {
            Some(line) => format!("{file}:{line}"),
            None => file.to_owned(),
        };
        match row.treatment(family) {
            Treatment::Honoured | Treatment::Container => {}
            Treatment::Refused(why) => {
                return Err(ConfigError::Invalid {
                    file: at(),
                    message: format!(
                        "field '{}' is not supported for {} models: {why}",
                        row.path,
                        family.label()
                    ),
                })
            }
            Treatment::NoEffect(why) => {
                if !quiet.iter().any(|q: &NoEffectField| q.path == row.path) {
                    quiet.push(NoEffectField {
                        path: row.path,
                        why,
                        at: at(),
                    });
                }
            }
        }
    }
    Ok(quiet)
}

/// The dotted paths of the fields set in `message` (and in the messages it holds), parents
/// before their fields.
fn set_fields(message: &DynamicMessage, prefix: &str, out: &mut Vec<String>) {
    for (field, value) in message.fields() {
        let path = format!("{prefix}{}", field.name());
        out.push(path.clone());
        let nested = format!("{path}.");
        let mut visit = |v: &Value| {
            if let Value::Message(m) = v {
                set_fields(m, &nested, out);
            }
        };
        match value {
            Value::List(items) => items.iter().for_each(&mut visit),
            Value::Map(entries) => entries.values().for_each(&mut visit),
            other => visit(other),
        }
    }
}

/// The line of `text` where the field at `path` is written: each segment is looked for after
/// the previous one, as a name followed by `:`, `{` or `[` (comments and strings skipped).
fn line_of(text: &str, path: &str) -> Option<usize> {
    let tokens = names(text);
    let mut from = 0;
    let mut line = None;
    for segment in path.split('.') {
        let (index, found_line) = tokens[from..]
            .iter()
            .enumerate()
            .find(|(_, (name, _))| name == segment)
            .map(|(i, (_, l))| (from + i, *l))?;
        from = index + 1;
        line = Some(found_line);
    }
    line
}

/// The field names written in a text-format file, with their lines.
fn names(text: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for (number, raw) in text.lines().enumerate() {
        let mut code = String::new();
        let mut in_string = None;
        for c in raw.chars() {
            match in_string {
                Some(q) if c == q => in_string = None,
                Some(_) => {}
                None if c == '"' || c == '\'' => in_string = Some(c),
                None if c == '#' => break,
                None => code.push(c),
            }
        }
        let bytes: Vec<char> = code.chars().collect();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i].is_ascii_alphabetic() || bytes[i] == '_' {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == '_') {
                    i += 1;
                }
                let word: String = bytes[start..i].iter().collect();
                let next = bytes[i..].iter().find(|c| !c.is_whitespace());
                if matches!(next, Some(':' | '{' | '[')) {
                    out.push((word, number + 1));
                }
            } else {
                i += 1;
            }
        }
    }
    out
}

/// The configuration reference of `docs/configuration.md`, one line per field: `path | onnxruntime | wasm |
/// generation | ensemble`, each `honoured`, `refused` or `no effect` (containers skipped).
pub fn reference_lines() -> Vec<String> {
    FIELDS
        .iter()
        .filter(|r| {
            Family::ALL
                .iter()
                .any(|f| r.treatment(*f) != Treatment::Container)
        })
        .map(|r| {
            let cells: Vec<&str> = Family::ALL
                .iter()
                .map(|f| match r.treatment(*f) {
                    Treatment::Honoured => "honoured",
                    Treatment::Container => "(its fields)",
                    Treatment::Refused(_) => "refused",
                    Treatment::NoEffect(_) => "no effect",
                })
                .collect();
            format!("| `{}` | {} |", r.path, cells.join(" | "))
        })
        .collect()
}

/// `docs/configuration.md`'s block, between its markers, as [`reference_lines`] makes it.
pub fn reference_block() -> String {
    let mut out = String::from(
        "| field | onnxruntime | wasm | generation | ensemble |\n|---|---|---|---|---|\n",
    );
    for line in reference_lines() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repository::config::parse_text;
    use prost_reflect::{Kind, MessageDescriptor};
    use std::path::Path;

    fn schema_paths(message: &MessageDescriptor, prefix: &str, out: &mut Vec<String>) {
        for field in message.fields() {
            let path = format!("{prefix}{}", field.name());
            out.push(path.clone());
            let value_kind = if field.is_map() {
                match field.kind() {
                    Kind::Message(entry) => entry.map_entry_value_field().kind(),
                    other => other,
                }
            } else {
                field.kind()
            };
            if let Kind::Message(inner) = value_kind {
                schema_paths(&inner, &format!("{path}."), out);
            }
        }
    }

    #[test]
    fn every_field_of_the_schema_has_exactly_one_row() {
        let mut paths = Vec::new();
        schema_paths(model_config_descriptor(), "", &mut paths);
        let missing: Vec<&String> = paths.iter().filter(|p| row(p).is_none()).collect();
        assert!(missing.is_empty(), "fields without a row: {missing:?}");
        let stale: Vec<&str> = FIELDS
            .iter()
            .map(|r| r.path)
            .filter(|p| !paths.iter().any(|s| s == p))
            .collect();
        assert!(stale.is_empty(), "rows for no field: {stale:?}");
        for (i, r) in FIELDS.iter().enumerate() {
            assert!(
                !FIELDS[..i].iter().any(|o| o.path == r.path),
                "two rows for {}",
                r.path
            );
        }
        assert_eq!(FIELDS.len(), paths.len());
    }

    #[test]
    fn the_manuals_reference_is_the_table() {
        let readme = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md"),
        )
        .unwrap();
        let begin =
            "<!-- config-fields:begin (generated from host/src/repository/config_fields.rs) -->\n";
        let end = "<!-- config-fields:end -->";
        let start = readme.find(begin).map(|i| i + begin.len());
        let stop = readme.find(end);
        let written = match (start, stop) {
            (Some(a), Some(b)) if a <= b => &readme[a..b],
            _ => "",
        };
        let want = reference_block();
        if written != want {
            std::fs::write(std::env::temp_dir().join("config-fields.md"), &want).unwrap();
        }
        assert!(
            written == want,
            "docs/configuration.md's field table differs from the code's; the table the code makes is in \
             {}",
            std::env::temp_dir().join("config-fields.md").display()
        );
    }

    #[test]
    fn a_refused_field_is_named_with_its_file_and_line() {
        let text = "name: \"m\"\nmax_batch_size: 8\ninput [\n  {\n    name: \"x\"\n    \
                    data_type: TYPE_FP32\n    dims: [ -1 ]\n    is_shape_tensor: true\n  }\n]\n";
        let config = parse_text(text, Path::new("m/config.pbtxt")).unwrap();
        let e = check(&config, Family::Onnx, Some(text), "m/config.pbtxt")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("m/config.pbtxt:8: field 'input.is_shape_tensor' is not supported"),
            "{e}"
        );
    }

    #[test]
    fn fields_without_effect_are_reported_once_with_their_line() {
        let text = "name: \"m\"\noptimization {\n  cuda { graphs: true }\n  priority: \
                    PRIORITY_MAX\n}\ninstance_group [ { count: 1 profile: [\"0\"] }, { count: 1 \
                    profile: [\"1\"] } ]\n";
        let config = parse_text(text, Path::new("c")).unwrap();
        let quiet = check(&config, Family::Onnx, Some(text), "c").unwrap();
        let mut paths: Vec<(&str, &str)> = quiet.iter().map(|q| (q.path, q.at.as_str())).collect();
        paths.sort();
        assert_eq!(
            paths,
            vec![
                ("instance_group.profile", "c:6"),
                ("optimization.cuda.graphs", "c:3"),
                ("optimization.priority", "c:4"),
            ]
        );
    }

    #[test]
    fn the_same_field_reads_differently_per_backend() {
        let text = "name: \"m\"\ndynamic_batching { }\n";
        let config = parse_text(text, Path::new("c")).unwrap();
        assert!(check(&config, Family::Onnx, Some(text), "c").is_ok());
        let e = check(&config, Family::Generation, Some(text), "c")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("c:2: field 'dynamic_batching' is not supported for generation"),
            "{e}"
        );
    }
}
