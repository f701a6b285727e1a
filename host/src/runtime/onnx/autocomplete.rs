//! The configuration against the model file: inputs, outputs and `max_batch_size` filled in
//! from the model's signature (auto-complete), and cross-checked with messages that say which
//! side to change.

use crate::runtime::backend::LoadContext;
use crate::{
    error::{Error, Result},
    proto::inference::{model_config::SchedulingChoice, ModelConfig, ModelInput, ModelOutput},
    repository::sequence::sequence_spec,
    tensor::{shape_string, DataType},
};

use super::*;

/// Auto-completes `config` from the model signature and checks that the two agree.
pub(super) fn reconcile(
    config: &mut ModelConfig,
    inputs: &[Signature],
    outputs: &[Signature],
    settings: &OnnxSettings,
    load: &LoadContext,
) -> Result<()> {
    let name = config.name.clone();
    let invalid = |msg: String| Error::invalid(format!("model '{name}': {msg}"));
    let all_inputs = inputs;
    for sig in inputs.iter().chain(outputs) {
        if sig.datatype.is_none() {
            return Err(invalid(format!(
                "tensor '{}' of the ONNX model is not a tensor of a supported type",
                sig.name
            )));
        }
    }
    // Control and state tensors of a sequence model are the server's, not the client's.
    let sequence = sequence_spec(config).map_err(&invalid)?;
    // So are batch inputs (ragged batching): the server makes them for each batch.
    let injected: Vec<String> = sequence
        .iter()
        .flat_map(|s| s.injected_inputs().map(str::to_owned))
        .chain(
            config
                .batch_input
                .iter()
                .flat_map(|b| b.target_name.clone()),
        )
        .collect();
    let state_outputs: Vec<String> = sequence
        .iter()
        .flat_map(|s| s.states.iter().map(|st| st.output.clone()))
        .collect();
    // Initializers that are inputs too are the model's own unless a configuration names them.
    let inputs: Vec<&Signature> = inputs
        .iter()
        .filter(|s| !injected.contains(&s.name) && !s.initializer)
        .collect();
    let model_outputs = outputs;
    let outputs: Vec<&Signature> = outputs
        .iter()
        .filter(|s| !state_outputs.contains(&s.name))
        .collect();
    // Every tensor of the model has a variable first dimension: it can batch.
    let can_batch = inputs
        .iter()
        .chain(&outputs)
        .all(|s| s.shape.first() == Some(&-1));
    let io_given = !config.input.is_empty() || !config.output.is_empty();
    if !load.disable_auto_complete && can_batch {
        if !io_given && config.max_batch_size == 0 && settings.default_max_batch_size > 0 {
            config.max_batch_size = settings.default_max_batch_size;
        }
        // As Triton's ONNX Runtime backend does: a model that batches gets the dynamic batcher
        // unless the configuration names a scheduler (whether or not it gave its tensors), so
        // that concurrent requests run as batches.
        if config.max_batch_size > 1 && config.scheduling_choice.is_none() {
            config.scheduling_choice = Some(SchedulingChoice::DynamicBatching(Default::default()));
        }
    }
    if !load.disable_auto_complete && !io_given {
        let skip = usize::from(config.max_batch_size > 0);
        config.input = inputs
            .iter()
            .map(|s| ModelInput {
                name: s.name.clone(),
                data_type: s.datatype.map_or(0, DataType::config_value),
                dims: s.shape.get(skip..).unwrap_or_default().to_vec(),
                ..Default::default()
            })
            .collect();
        config.output = outputs
            .iter()
            .map(|s| ModelOutput {
                name: s.name.clone(),
                data_type: s.datatype.map_or(0, DataType::config_value),
                dims: s.shape.get(skip..).unwrap_or_default().to_vec(),
                ..Default::default()
            })
            .collect();
    }
    if config.input.is_empty() || config.output.is_empty() {
        return Err(invalid(
            "config.pbtxt declares no inputs or no outputs and auto-complete is disabled"
                .to_owned(),
        ));
    }
    let batch = config.max_batch_size;
    for input in &config.input {
        if input.allow_ragged_batch {
            check_ragged_input(input, all_inputs).map_err(&invalid)?;
            continue;
        }
        // With `reshape`, the model sees the reshaped form.
        let shape = input.reshape.as_ref().map_or(&input.dims, |r| &r.shape);
        check_against_model(
            "input",
            &input.name,
            input.data_type,
            shape,
            batch,
            all_inputs,
        )
        .map_err(&invalid)?;
    }
    for b in &config.batch_input {
        for target in &b.target_name {
            check_batch_input(target, b.data_type, all_inputs).map_err(&invalid)?;
        }
    }
    for sig in &inputs {
        if !config.input.iter().any(|i| i.name == sig.name) {
            return Err(invalid(format!(
                "the ONNX model has input '{}' {} {} that config.pbtxt does not declare",
                sig.name,
                sig.datatype.map_or("?", |d| d.config_name()),
                shape_string(&sig.shape)
            )));
        }
    }
    let scattered: Vec<&str> = config
        .batch_output
        .iter()
        .flat_map(|b| b.target_name.iter().map(String::as_str))
        .collect();
    for output in &config.output {
        let shape = output.reshape.as_ref().map_or(&output.dims, |r| &r.shape);
        if scattered.contains(&output.name.as_str()) {
            // A batch output's shape is the batch's, not the configuration's (as on Triton,
            // only its name and type are checked).
            check_batch_output(output, model_outputs).map_err(&invalid)?;
            continue;
        }
        check_against_model(
            "output",
            &output.name,
            output.data_type,
            shape,
            batch,
            model_outputs,
        )
        .map_err(&invalid)?;
    }
    for control in sequence.iter().flat_map(|s| &s.controls) {
        let data_type = control.datatype.config_value();
        check_against_model("input", &control.name, data_type, &[1], batch, all_inputs)
            .map_err(|e| invalid(format!("control {e}")))?;
    }
    for state in sequence.iter().flat_map(|s| &s.states) {
        let data_type = state.datatype.config_value();
        check_against_model(
            "input",
            &state.input,
            data_type,
            &state.dims,
            batch,
            all_inputs,
        )
        .map_err(|e| invalid(format!("state {e}")))?;
        check_against_model(
            "output",
            &state.output,
            data_type,
            &state.dims,
            batch,
            model_outputs,
        )
        .map_err(|e| invalid(format!("state {e}")))?;
    }
    Ok(())
}

pub(super) fn check_against_model(
    kind: &str,
    name: &str,
    data_type: i32,
    dims: &[i64],
    max_batch_size: i32,
    model: &[Signature],
) -> std::result::Result<(), String> {
    let sig = check_named(kind, name, data_type, model, None)?;
    let batch = usize::from(max_batch_size > 0);
    // A scalar model tensor is declared with dims of 1s (or none) when the model does not
    // batch, as Triton's ONNX Runtime backend accepts it (and words the refusal).
    if sig.shape.is_empty() && batch == 0 {
        if dims.iter().all(|&d| d == 1) {
            return Ok(());
        }
        return Err(format!(
            "scalar tensor '{name}', should only provide 1 in the model configuration when \
             the model doesn't support batching. Model configuration provided: {}.",
            shape_string(dims)
        ));
    }
    if dims.len() + batch != sig.shape.len() {
        let extra = if batch == 1 {
            format!(
                " (max_batch_size {max_batch_size} adds a leading batch dimension to dims, making {} dimensions)",
                dims.len() + 1
            )
        } else {
            String::new()
        };
        return Err(format!(
            "{kind} '{name}': the ONNX model's shape {} has {} dimensions, but config.pbtxt gives dims {}{extra}",
            shape_string(&sig.shape),
            sig.shape.len(),
            shape_string(dims)
        ));
    }
    if batch == 1 && sig.shape[0] != -1 {
        return Err(format!(
            "{kind} '{name}': max_batch_size is {max_batch_size}, but the ONNX model fixes the first dimension to {}; \
             set max_batch_size: 0 and give the full shape in dims",
            sig.shape[0]
        ));
    }
    for (i, (&want, &have)) in dims.iter().zip(&sig.shape[batch..]).enumerate() {
        if want != -1 && have != -1 && want != have {
            return Err(format!(
                "{kind} '{name}': dims {} differ from the ONNX model's shape {} at dimension {i}",
                shape_string(dims),
                shape_string(&sig.shape)
            ));
        }
    }
    Ok(())
}

/// A ragged input reaches the model as the 1-D concatenation of every request's elements, so
/// the model must take shape `[-1]` (Triton's ONNX Runtime backend requires the same).
fn check_ragged_input(input: &ModelInput, model: &[Signature]) -> std::result::Result<(), String> {
    let name = &input.name;
    let sig = check_named(
        "input",
        name,
        input.data_type,
        model,
        Some("allow_ragged_batch: true"),
    )?;
    match sig.shape.as_slice() {
        [-1] => Ok(()),
        other => Err(format!(
            "input '{name}' has allow_ragged_batch: true, so the ONNX model must take it with \
             shape [-1] (every request's elements, concatenated); the model has {}",
            shape_string(other)
        )),
    }
}

/// A batch input's target must be an input of the model, of the batch input's type.
fn check_batch_input(
    target: &str,
    data_type: i32,
    model: &[Signature],
) -> std::result::Result<(), String> {
    check_named(
        "input",
        target,
        data_type,
        model,
        Some("a batch_input target"),
    )
    .map(drop)
}

/// A batch output's target must be an output of the model, of its configured type.
fn check_batch_output(
    output: &ModelOutput,
    model: &[Signature],
) -> std::result::Result<(), String> {
    check_named(
        "output",
        &output.name,
        output.data_type,
        model,
        Some("a batch_output target"),
    )
    .map(drop)
}

/// The model's tensor `name`, checked to be of `data_type`; `what` says why config.pbtxt names
/// it, when that is not as one of its declared inputs or outputs.
fn check_named<'m>(
    kind: &str,
    name: &str,
    data_type: i32,
    model: &'m [Signature],
    what: Option<&str>,
) -> std::result::Result<&'m Signature, String> {
    let Some(sig) = model.iter().find(|s| s.name == name) else {
        let names: Vec<&str> = model.iter().map(|s| s.name.as_str()).collect();
        let named = match what {
            Some(what) => format!("({what})"),
            None => "in config.pbtxt".to_owned(),
        };
        return Err(format!(
            "{kind} '{name}' {named} is not an {kind} of the ONNX model (its {kind}s are: {})",
            names.join(", ")
        ));
    };
    let declared = DataType::from_config_value(data_type);
    if declared != sig.datatype {
        let why = what.map(|w| format!(" ({w})")).unwrap_or_default();
        return Err(format!(
            "{kind} '{name}'{why}: config.pbtxt says data_type {} but the ONNX model has {}",
            declared.map_or("TYPE_INVALID", |d| d.config_name()),
            sig.datatype
                .map_or("an unsupported type", |d| d.config_name())
        ));
    }
    Ok(sig)
}
