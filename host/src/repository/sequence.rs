//! `sequence_batching` read into what the server acts on: the control tensors it injects into
//! each request of a sequence, the implicit state it carries from one request to the next, and
//! how long a sequence may sit idle. Checked when the configuration is read, so that a wrong
//! setting fails the load with a message naming the field.

use std::time::Duration;

use crate::{
    proto::inference::{
        model_config::SchedulingChoice,
        model_sequence_batching::{control::Kind, initial_state::StateData, StrategyChoice},
        ModelConfig, ModelSequenceBatching,
    },
    tensor::{element_count, DataType},
};

/// Triton's default when `max_sequence_idle_microseconds` is 0 or absent: one second.
const DEFAULT_IDLE: Duration = Duration::from_secs(1);

/// What a control input tells the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlKind {
    /// True on the first request of a sequence.
    Start,
    /// True on the last request of a sequence.
    End,
    /// True when the request carries data; false on the filler row of a slot that has
    /// nothing to run in a batch of the direct strategy.
    Ready,
    /// The sequence's correlation ID.
    CorrelationId,
}

/// A control input: a tensor the server adds to every request of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Control {
    /// Input name the model reads it under.
    pub name: String,
    /// Its meaning.
    pub kind: ControlKind,
    /// Element type.
    pub datatype: DataType,
    /// For flags: the element bytes meaning false and true.
    pub false_true: Option<[Vec<u8>; 2]>,
}

/// Where a state starts at the first request of a sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum InitialState {
    /// All zeros (empty strings for BYTES).
    Zeros,
    /// The contents of `<model dir>/initial_state/<file>`, row-major.
    File(String),
}

/// One implicit state: the model reads it as input `input` and writes the next value as output
/// `output`; the server keeps it per sequence in between.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// Input name of the state.
    pub input: String,
    /// Output name of the state.
    pub output: String,
    /// Element type.
    pub datatype: DataType,
    /// Dimensions without the batch dimension, as declared.
    pub dims: Vec<i64>,
    /// Shape of the initial value (without the batch dimension): `dims`, or `initial_state.dims`
    /// where `dims` has variable dimensions.
    pub initial_dims: Vec<i64>,
    /// The first value.
    pub initial: InitialState,
}

/// How sequences share a model's instances (`sequence_batching.direct` / `.oldest`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Strategy {
    /// Triton's default: each instance has `max_batch_size` slots (one without batching); a
    /// sequence holds one from START to END, and one that finds none free waits for one.
    Direct {
        /// A batch waits (up to `max_queue_delay`) until this share of an instance's slots
        /// has a request ready; 0: it runs at once.
        minimum_slot_utilization: f32,
    },
    /// Requests of up to `max_candidate_sequences` live sequences batch through the dynamic
    /// batcher, one request per sequence in a batch.
    Oldest,
}

/// A model's `sequence_batching`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceSpec {
    /// A sequence without a request for this long is released.
    pub max_idle: Duration,
    /// Control inputs, in declaration order.
    pub controls: Vec<Control>,
    /// Implicit states, in declaration order.
    pub states: Vec<State>,
    /// How sequences share the model's instances.
    pub strategy: Strategy,
    /// How long a request may wait for requests of other sequences to batch with.
    pub max_queue_delay: Duration,
    /// Preferred batch sizes (`oldest` strategy only).
    pub preferred_batch_sizes: Vec<i32>,
    /// Sequences live at once (`oldest.max_candidate_sequences`; 0: no limit): a new
    /// sequence's START waits, in arrival order, until one ends or is released.
    pub max_candidates: usize,
}

impl SequenceSpec {
    /// The names of every tensor the server adds to a request (controls, then state inputs).
    pub fn injected_inputs(&self) -> impl Iterator<Item = &str> {
        self.controls
            .iter()
            .map(|c| c.name.as_str())
            .chain(self.states.iter().map(|s| s.input.as_str()))
    }

    /// The state whose output is `name`.
    pub fn state_output(&self, name: &str) -> Option<&State> {
        self.states.iter().find(|s| s.output == name)
    }
}

/// The `sequence_batching` of `config`, checked; `Ok(None)` for models without one. The error
/// names the field at fault.
pub fn sequence_spec(config: &ModelConfig) -> Result<Option<SequenceSpec>, String> {
    let Some(SchedulingChoice::SequenceBatching(sb)) = &config.scheduling_choice else {
        return Ok(None);
    };
    if sb.iterative_sequence {
        // Iterative sequences (Triton's request rescheduling): each request is its own
        // sequence, run again in a later batch whenever the model releases it for that; the
        // model keeps what it needs, so there are no control inputs or state to manage.
        if !sb.control_input.is_empty() || !sb.state.is_empty() {
            return Err(
                "field 'sequence_batching.iterative_sequence': iterative sequences run each \
                 request as its own sequence; control inputs and state are not supported with \
                 it (remove 'control_input' and 'state', or the setting)"
                    .to_owned(),
            );
        }
        return Ok(None);
    }
    let declared = |name: &str| {
        config.input.iter().any(|i| i.name == name) || config.output.iter().any(|o| o.name == name)
    };
    let mut controls = Vec::new();
    for (i, input) in sb.control_input.iter().enumerate() {
        let field = format!("sequence_batching.control_input[{i}]");
        if input.name.is_empty() {
            return Err(format!("field '{field}.name': must not be empty"));
        }
        if declared(&input.name) {
            return Err(format!(
                "field '{field}': '{}' is also declared in input/output; the server supplies \
                 control inputs, so leave them out of 'input'",
                input.name
            ));
        }
        let [control] = input.control.as_slice() else {
            return Err(format!(
                "field '{field}.control': control input '{}' needs exactly one control, got {}",
                input.name,
                input.control.len()
            ));
        };
        controls.push(read_control(&field, &input.name, control)?);
    }
    let mut states = Vec::new();
    for (i, state) in sb.state.iter().enumerate() {
        let field = format!("sequence_batching.state[{i}]");
        states.push(read_state(&field, state, config)?);
    }
    let mut names: Vec<&str> = controls
        .iter()
        .map(|c| c.name.as_str())
        .chain(states.iter().map(|s| s.input.as_str()))
        .collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!(
            "field 'sequence_batching': input '{}' is named by more than one control input or \
             state",
            w[0]
        ));
    }
    let (strategy, max_queue_delay, preferred_batch_sizes, max_candidates) =
        match &sb.strategy_choice {
            Some(StrategyChoice::Direct(d)) => {
                let util = d.minimum_slot_utilization;
                if !(0.0..=1.0).contains(&util) {
                    return Err(format!(
                        "field 'sequence_batching.direct.minimum_slot_utilization': {util} is not \
                     between 0 and 1"
                    ));
                }
                (
                    Strategy::Direct {
                        minimum_slot_utilization: util,
                    },
                    d.max_queue_delay_microseconds,
                    Vec::new(),
                    0,
                )
            }
            Some(StrategyChoice::Oldest(o)) => {
                if let Some(size) = o
                    .preferred_batch_size
                    .iter()
                    .find(|&&s| s <= 0 || (config.max_batch_size > 0 && s > config.max_batch_size))
                {
                    return Err(format!(
                        "field 'sequence_batching.oldest.preferred_batch_size': {size} is not \
                     between 1 and max_batch_size ({})",
                        config.max_batch_size
                    ));
                }
                (
                    Strategy::Oldest,
                    o.max_queue_delay_microseconds,
                    o.preferred_batch_size.clone(),
                    o.max_candidate_sequences.max(0) as usize,
                )
            }
            None => (
                Strategy::Direct {
                    minimum_slot_utilization: 0.0,
                },
                0,
                Vec::new(),
                0,
            ),
        };
    Ok(Some(SequenceSpec {
        max_idle: idle_limit(sb),
        controls,
        states,
        strategy,
        max_queue_delay: Duration::from_micros(max_queue_delay),
        preferred_batch_sizes,
        max_candidates,
    }))
}

/// The data type and dims of the implicit state that `config` writes as output `name`: a
/// backend returns it beside the declared outputs.
pub fn state_output<'a>(config: &'a ModelConfig, name: &str) -> Option<(i32, &'a [i64])> {
    let Some(SchedulingChoice::SequenceBatching(sb)) = &config.scheduling_choice else {
        return None;
    };
    sb.state
        .iter()
        .find(|s| s.output_name == name)
        .map(|s| (s.data_type, s.dims.as_slice()))
}

fn idle_limit(sb: &ModelSequenceBatching) -> Duration {
    match sb.max_sequence_idle_microseconds {
        0 => DEFAULT_IDLE,
        us => Duration::from_micros(us),
    }
}

fn read_control(
    field: &str,
    name: &str,
    control: &crate::proto::inference::model_sequence_batching::Control,
) -> Result<Control, String> {
    let kind = match Kind::try_from(control.kind) {
        Ok(Kind::ControlSequenceStart) => ControlKind::Start,
        Ok(Kind::ControlSequenceEnd) => ControlKind::End,
        Ok(Kind::ControlSequenceReady) => ControlKind::Ready,
        Ok(Kind::ControlSequenceCorrid) => ControlKind::CorrelationId,
        Err(_) => return Err(format!("field '{field}.control.kind': unknown kind")),
    };
    if kind == ControlKind::CorrelationId {
        let datatype = DataType::from_config_value(control.data_type);
        return match datatype {
            Some(
                d @ (DataType::Uint64
                | DataType::Int64
                | DataType::Uint32
                | DataType::Int32
                | DataType::Bytes),
            ) => Ok(Control {
                name: name.to_owned(),
                kind,
                datatype: d,
                false_true: None,
            }),
            _ => Err(format!(
                "field '{field}.control.data_type': CONTROL_SEQUENCE_CORRID '{name}' needs \
                 TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING"
            )),
        };
    }
    let int32 = &control.int32_false_true;
    let fp32 = &control.fp32_false_true;
    let boolean = &control.bool_false_true;
    let given = [!int32.is_empty(), !fp32.is_empty(), !boolean.is_empty()];
    let (datatype, values): (DataType, Vec<Vec<u8>>) = match given {
        [true, false, false] => (
            DataType::Int32,
            int32.iter().map(|v| v.to_le_bytes().to_vec()).collect(),
        ),
        [false, true, false] => (
            DataType::Fp32,
            fp32.iter().map(|v| v.to_le_bytes().to_vec()).collect(),
        ),
        [false, false, true] => (
            DataType::Bool,
            boolean.iter().map(|v| vec![u8::from(*v)]).collect(),
        ),
        _ => {
            return Err(format!(
                "field '{field}.control': control input '{name}' needs exactly one of \
                 int32_false_true, fp32_false_true or bool_false_true"
            ))
        }
    };
    let Ok([off, on]) = <[Vec<u8>; 2]>::try_from(values) else {
        return Err(format!(
            "field '{field}.control': the *_false_true of control input '{name}' needs two \
             values, false then true"
        ));
    };
    Ok(Control {
        name: name.to_owned(),
        kind,
        datatype,
        false_true: Some([off, on]),
    })
}

fn read_state(
    field: &str,
    state: &crate::proto::inference::model_sequence_batching::State,
    config: &ModelConfig,
) -> Result<State, String> {
    for (what, name) in [
        ("input_name", &state.input_name),
        ("output_name", &state.output_name),
    ] {
        if name.is_empty() {
            return Err(format!("field '{field}.{what}': must not be empty"));
        }
    }
    if config.input.iter().any(|i| i.name == state.input_name) {
        return Err(format!(
            "field '{field}.input_name': '{}' is also declared in 'input'; the server supplies \
             state inputs, so leave it out",
            state.input_name
        ));
    }
    // An output state may be listed in 'output' too: clients may then ask for it (to debug).
    if let Some(output) = config.output.iter().find(|o| o.name == state.output_name) {
        if output.data_type != state.data_type || output.dims != state.dims {
            return Err(format!(
                "field '{field}.output_name': '{}' is also declared in 'output', with another \
                 data_type or dims",
                state.output_name
            ));
        }
    }
    let datatype = DataType::from_config_value(state.data_type).ok_or_else(|| {
        format!(
            "field '{field}.data_type': state '{}' needs a valid type",
            state.input_name
        )
    })?;
    if state.dims.is_empty() || state.dims.iter().any(|&d| d < -1 || d == 0) {
        return Err(format!(
            "field '{field}.dims': state '{}' needs dimensions that are positive or -1, got {:?}",
            state.input_name, state.dims
        ));
    }
    let (initial, initial_dims) = match state.initial_state.as_slice() {
        [] => (InitialState::Zeros, state.dims.clone()),
        [init] => {
            let data = match &init.state_data {
                Some(StateData::ZeroData(true)) => InitialState::Zeros,
                Some(StateData::DataFile(file)) if !file.is_empty() => {
                    if file.contains("..") || file.starts_with('/') {
                        return Err(format!(
                            "field '{field}.initial_state.data_file': '{file}' must be a file \
                             name inside the model's initial_state/ directory"
                        ));
                    }
                    InitialState::File(file.clone())
                }
                _ => {
                    return Err(format!(
                        "field '{field}.initial_state': set zero_data: true or data_file for \
                         state '{}'",
                        state.input_name
                    ))
                }
            };
            if init.data_type != 0 && init.data_type != state.data_type {
                return Err(format!(
                    "field '{field}.initial_state.data_type': differs from the state's \
                     data_type"
                ));
            }
            let dims = if init.dims.is_empty() {
                state.dims.clone()
            } else {
                init.dims.clone()
            };
            (data, dims)
        }
        more => {
            return Err(format!(
                "field '{field}.initial_state': state '{}' has {} initial states; give one",
                state.input_name,
                more.len()
            ))
        }
    };
    if element_count(&initial_dims).is_none() {
        return Err(format!(
            "field '{field}': state '{}' has variable dims {:?}; give initial_state with fixed \
             dims",
            state.input_name, state.dims
        ));
    }
    Ok(State {
        input: state.input_name.clone(),
        output: state.output_name.clone(),
        datatype,
        dims: state.dims.clone(),
        initial_dims,
        initial,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::repository::config::parse_text;
    use std::path::Path;

    fn spec(text: &str) -> Result<Option<SequenceSpec>, String> {
        sequence_spec(&parse_text(text, Path::new("config.pbtxt")).unwrap())
    }

    const MODEL: &str = r#"
        max_batch_size: 4
        input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
    "#;

    #[test]
    fn reads_controls_states_and_strategy() {
        let text = format!(
            "{MODEL} sequence_batching {{
              max_sequence_idle_microseconds: 5000
              oldest {{ max_queue_delay_microseconds: 100 preferred_batch_size: [ 2 ] }}
              control_input [
                {{ name: \"START\" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
                {{ name: \"READY\" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
                {{ name: \"CORRID\" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
              ]
              state [ {{ input_name: \"ACC_IN\" output_name: \"ACC_OUT\" data_type: TYPE_INT32 dims: [ 1 ]
                         initial_state {{ zero_data: true name: \"zeros\" }} }} ]
            }}"
        );
        let s = spec(&text).unwrap().unwrap();
        assert_eq!(s.max_idle, Duration::from_micros(5000));
        assert_eq!(s.max_queue_delay, Duration::from_micros(100));
        assert_eq!(s.preferred_batch_sizes, [2]);
        assert_eq!(s.controls[0].kind, ControlKind::Start);
        assert_eq!(s.controls[0].datatype, DataType::Int32);
        assert_eq!(
            s.controls[0].false_true,
            Some([0i32.to_le_bytes().to_vec(), 1i32.to_le_bytes().to_vec()])
        );
        assert_eq!(s.controls[1].false_true, Some([vec![0], vec![1]]));
        assert_eq!(s.controls[2].datatype, DataType::Uint64);
        assert_eq!(s.states[0].initial, InitialState::Zeros);
        assert_eq!(
            s.injected_inputs().collect::<Vec<_>>(),
            ["START", "READY", "CORRID", "ACC_IN"]
        );
        assert!(spec(MODEL).unwrap().is_none());
        let default_idle = spec(&format!("{MODEL} sequence_batching {{ }}"))
            .unwrap()
            .unwrap();
        assert_eq!(default_idle.max_idle, Duration::from_secs(1));
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (
                r#"control_input [ { name: "INPUT" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]"#,
                "'sequence_batching.control_input[0]': 'INPUT' is also declared",
            ),
            (
                r#"control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 1 ] } ] } ]"#,
                "needs two values",
            ),
            (
                r#"control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_END } ] } ]"#,
                "needs exactly one of int32_false_true",
            ),
            (
                r#"control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]"#,
                "'sequence_batching.control_input[0].control.data_type'",
            ),
            (
                r#"state [ { input_name: "S" output_name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]"#,
                "'sequence_batching.state[0].output_name': 'OUTPUT' is also declared in 'output', with another data_type",
            ),
            (
                r#"state [ { input_name: "INPUT" output_name: "T" data_type: TYPE_INT32 dims: [ 1 ] } ]"#,
                "'sequence_batching.state[0].input_name': 'INPUT' is also declared in 'input'",
            ),
            (
                r#"state [ { input_name: "S" output_name: "T" data_type: TYPE_FP32 dims: [ -1 ] } ]"#,
                "give initial_state with fixed dims",
            ),
            (
                r#"state [ { input_name: "S" output_name: "T" dims: [ 2 ] } ]"#,
                "'sequence_batching.state[0].data_type'",
            ),
            (
                r#"oldest { preferred_batch_size: [ 8 ] }"#,
                "'sequence_batching.oldest.preferred_batch_size': 8 is not between 1 and max_batch_size (4)",
            ),
        ];
        for (body, want) in cases {
            let e = spec(&format!("{MODEL} sequence_batching {{ {body} }}")).unwrap_err();
            assert!(e.contains(want), "{body}: {e}");
        }
    }
}
