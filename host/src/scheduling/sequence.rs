//! The sequence batcher: for a model with `sequence_batching`, the requests of one sequence
//! (one correlation ID, from the request with `sequence_start` to the one with
//! `sequence_end`) run one after another, in arrival order, each with the control tensors
//! the model declares (START, END, READY, CORRID) and the implicit state the previous request
//! left behind. Requests of different sequences share the model's queue and batch together.
//!
//! Each sequence is pinned to one instance, as on Triton: the one with the fewest live
//! sequences when it starts. A model may keep a sequence's state in its instance (a
//! `model.py` adding to `self`), so all of a sequence's requests must reach the same one.
//! Implicit state (`state` in the configuration) lives here between requests. A sequence
//! holds no batch slot, so no sequence waits for a free one. A sequence that sees no
//! request for `max_sequence_idle_microseconds` is released (checked whenever requests
//! arrive), and a later request for it must start it again.

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Instant,
};

use bytes::Bytes;

use super::{
    scheduler::Scheduler,
    stats::{FailureReason, ModelStats},
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, ParamValue},
    repository::sequence::{Control, ControlKind, InitialState, SequenceSpec, State},
    tensor::{element_count, push_bytes_element, shape_string, DataType, Tensor},
};

/// A correlation ID: Triton takes an unsigned integer or a string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SequenceId {
    /// A non-zero integer.
    Number(u64),
    /// A non-empty string.
    Text(String),
}

impl std::fmt::Display for SequenceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SequenceId::Number(n) => write!(f, "{n}"),
            SequenceId::Text(s) => write!(f, "\"{s}\""),
        }
    }
}

/// The sequence parameters of a request: its correlation ID and START / END flags.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceFlags {
    /// Which sequence.
    pub id: SequenceId,
    /// First request of the sequence.
    pub start: bool,
    /// Last request of the sequence.
    pub end: bool,
    /// The tenant whose sequence it is (`None` without tenants): two tenants' sequences never
    /// meet, even under the same ID, so no tenant can continue, reset or end another's.
    pub owner: Option<String>,
}

/// What the sequence table is keyed by: the owner and the correlation ID.
type SequenceKey = (Option<String>, SequenceId);

impl SequenceFlags {
    fn key(&self) -> SequenceKey {
        (self.owner.clone(), self.id.clone())
    }
}

/// Reads `sequence_id`, `sequence_start` and `sequence_end`; an error names the model and the
/// parameter that is missing or malformed.
pub fn sequence_flags(model: &str, request: &InferRequest) -> Result<SequenceFlags> {
    let missing = || {
        Error::invalid(format!(
            "inference request to model '{model}' must specify a non-zero or non-empty \
             correlation ID (parameter 'sequence_id'): the model keeps state per sequence"
        ))
    };
    let id = match request.parameters.get("sequence_id") {
        None => return Err(missing()),
        Some(ParamValue::Uint(0) | ParamValue::Int(0)) => return Err(missing()),
        Some(ParamValue::Uint(n)) => SequenceId::Number(*n),
        Some(ParamValue::Int(n)) => SequenceId::Number(u64::try_from(*n).map_err(|_| {
            Error::invalid(format!(
                "inference request to model '{model}': sequence_id {n} is negative"
            ))
        })?),
        Some(ParamValue::String(s)) if s.is_empty() => return Err(missing()),
        Some(ParamValue::String(s)) => SequenceId::Text(s.clone()),
        Some(other) => {
            return Err(Error::invalid(format!(
                "inference request to model '{model}': sequence_id must be an unsigned integer \
                 or a string, got {other:?}"
            )))
        }
    };
    let flag = |key: &str| match request.parameters.get(key) {
        None => Ok(false),
        Some(ParamValue::Bool(b)) => Ok(*b),
        Some(other) => Err(Error::invalid(format!(
            "inference request to model '{model}': parameter '{key}' must be a boolean, got \
             {other:?}"
        ))),
    };
    Ok(SequenceFlags {
        owner: request
            .callers
            .first()
            .and_then(crate::tenancy::Caller::tenant)
            .map(str::to_owned),
        id,
        start: flag("sequence_start")?,
        end: flag("sequence_end")?,
    })
}

/// What a sequence carries from one request to the next.
struct Carried {
    /// The states the last request left, in the order of the spec's states; `None` until a
    /// request of this sequence succeeded.
    states: Option<Vec<Tensor>>,
    /// The END request ran: only a new START revives the ID.
    ended: bool,
}

/// One live sequence.
struct Sequence {
    /// Requests holding or waiting for `carried`; a sequence with any is never idle.
    busy: AtomicUsize,
    /// When its last request finished (or its first arrived).
    last_used: Mutex<Instant>,
    /// Taken by one request at a time, in arrival order (tokio's mutex is fair).
    carried: tokio::sync::Mutex<Carried>,
    /// Its place among `max_candidate_sequences`, given back when the sequence is dropped.
    _candidate: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The instance that runs its requests.
    instance: Pinned,
}

/// A sequence's instance, counted among that instance's live sequences until dropped.
struct Pinned {
    index: usize,
    live: Arc<[AtomicUsize]>,
}

impl Pinned {
    /// The instance with the fewest live sequences (the first of those on a tie).
    fn least_loaded(live: &Arc<[AtomicUsize]>) -> Self {
        let index = (0..live.len())
            .min_by_key(|&i| live[i].load(Ordering::Acquire))
            .unwrap_or(0);
        if let Some(count) = live.get(index) {
            count.fetch_add(1, Ordering::AcqRel);
        }
        Self {
            index,
            live: live.clone(),
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if let Some(count) = self.live.get(self.index) {
            count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Sequence {
    fn idle_since(&self) -> Option<Instant> {
        (self.busy.load(Ordering::Acquire) == 0).then(|| *lock(&self.last_used))
    }
}

/// Counts a request as holding its sequence until dropped (also when the caller goes away).
struct Busy(Arc<Sequence>);

impl Drop for Busy {
    fn drop(&mut self) {
        *lock(&self.0.last_used) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while these locks are held.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How many released IDs are remembered, to say why a later request is refused.
const REMEMBERED_RELEASES: usize = 10_000;

struct Table {
    sequences: HashMap<SequenceKey, Arc<Sequence>>,
    /// Sequences released for being idle (their state dropped), until the next sweep after.
    released: HashMap<SequenceKey, Instant>,
    last_sweep: Instant,
}

impl Table {
    /// Releases the sequences idle for longer than `max_idle` and forgets older releases.
    fn sweep(&mut self, now: Instant, max_idle: std::time::Duration) {
        let idle = |s: &Sequence| {
            s.idle_since()
                .is_some_and(|t| now.saturating_duration_since(t) > max_idle)
        };
        let expired: Vec<SequenceKey> = self
            .sequences
            .iter()
            .filter(|(_, s)| idle(s))
            .map(|(id, _)| id.clone())
            .collect();
        self.released
            .retain(|_, at| now.saturating_duration_since(*at) <= max_idle * 10);
        if self.released.len() + expired.len() > REMEMBERED_RELEASES {
            self.released.clear();
        }
        for id in expired {
            self.sequences.remove(&id);
            self.released.insert(id, now);
        }
        self.last_sweep = now;
    }
}

/// The sequence batcher of one model version, in front of its scheduler.
pub struct SequenceBatcher {
    model: String,
    spec: SequenceSpec,
    batching: bool,
    /// The first value of each state, shaped for one request.
    initial: Vec<Tensor>,
    scheduler: Scheduler,
    stats: Arc<ModelStats>,
    table: Mutex<Table>,
    /// `max_candidate_sequences`: places for live sequences, taken in arrival order.
    candidates: Option<Arc<tokio::sync::Semaphore>>,
    /// Live sequences per instance.
    live: Arc<[AtomicUsize]>,
}

impl SequenceBatcher {
    /// Puts the sequence batcher described by `spec` in front of `scheduler`. Initial states
    /// from files are read from `model_dir/initial_state/`.
    pub fn new(
        model: &str,
        max_batch_size: i32,
        spec: SequenceSpec,
        model_dir: &Path,
        scheduler: Scheduler,
        stats: Arc<ModelStats>,
    ) -> Result<Self> {
        let batching = max_batch_size > 0;
        let initial = spec
            .states
            .iter()
            .map(|state| initial_state(model, state, batching, model_dir))
            .collect::<Result<Vec<_>>>()?;
        let candidates = (spec.max_candidates > 0)
            .then(|| Arc::new(tokio::sync::Semaphore::new(spec.max_candidates)));
        let live = (0..scheduler.instance_count())
            .map(|_| AtomicUsize::new(0))
            .collect();
        Ok(Self {
            model: model.to_owned(),
            candidates,
            live,
            spec,
            batching,
            initial,
            scheduler,
            stats,
            table: Mutex::new(Table {
                sequences: HashMap::new(),
                released: HashMap::new(),
                last_sweep: Instant::now(),
            }),
        })
    }

    /// The scheduler behind it.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Runs one request of a sequence: waits for the sequence's earlier requests, adds the
    /// control and state tensors, queues it, keeps the new state and answers with the
    /// requested outputs only. The arguments are those of [`Scheduler::infer`].
    pub async fn infer(
        &self,
        request: InferRequest,
        outputs: Vec<String>,
        rows: u64,
        received: Instant,
    ) -> Result<InferResponse> {
        let refuse = |e: Error| {
            // Refused before the queue (no ID, no START): counted like other bad requests.
            self.stats
                .record_failure(FailureReason::Other, received.elapsed());
            e
        };
        let flags = sequence_flags(&self.model, &request).map_err(refuse)?;
        self.run(request, outputs, rows, received, flags)
            .await
            .map_err(|(e, refused)| if refused { refuse(e) } else { e })
    }

    /// [`Self::infer`] after reading the flags; an error says whether it came before the queue.
    async fn run(
        &self,
        mut request: InferRequest,
        mut outputs: Vec<String>,
        rows: u64,
        received: Instant,
        flags: SequenceFlags,
    ) -> std::result::Result<InferResponse, (Error, bool)> {
        let refused = |e: Error| (e, true);
        if self.batching && rows != 1 {
            return Err(refused(Error::invalid(format!(
                "inference request to model '{}' must specify batch-size 1 due to requirements \
                 of sequence batcher (sequence {} sent {rows} rows)",
                self.model, flags.id
            ))));
        }
        let candidate = match &self.candidates {
            Some(places) if flags.start && !self.is_live(&flags) => self.place(places).await,
            _ => None,
        };
        let sequence = self.enter(&flags, candidate).map_err(refused)?;
        let busy = Busy(sequence);
        let mut carried = busy.0.carried.lock().await;
        if flags.start {
            carried.states = None;
            carried.ended = false;
        } else if carried.ended {
            return Err(refused(self.not_started(&flags.id, "")));
        }
        self.add_controls(&mut request, &flags).map_err(refused)?;
        let states = carried.states.as_ref().unwrap_or(&self.initial);
        request.inputs.extend(states.iter().cloned());
        // The state outputs the client did not ask for (it may, where `output` lists them)
        // are asked for here and taken out of the response.
        let requested = outputs.len();
        for state in &self.spec.states {
            if !outputs.contains(&state.output) {
                outputs.push(state.output.clone());
            }
        }
        let pinned = Some(busy.0.instance.index);
        let result = self
            .scheduler
            .infer_on(request, outputs, rows, received, pinned)
            .await;
        let result = result.and_then(|mut response| {
            let mut next = Vec::with_capacity(self.spec.states.len());
            for state in &self.spec.states {
                let found = response.outputs.iter().position(|t| t.name == state.output);
                let Some(index) = found else {
                    return Err(Error::internal(format!(
                        "model '{}' did not return its state output '{}'",
                        self.model, state.output
                    )));
                };
                let tensor = if index >= requested {
                    response.outputs.remove(index)
                } else {
                    response.outputs[index].clone()
                };
                next.push(Tensor {
                    name: state.input.clone(),
                    ..tensor
                });
            }
            carried.states = Some(next);
            Ok(response)
        });
        if flags.end {
            carried.ended = true;
            let mut table = lock(&self.table);
            if table
                .sequences
                .get(&flags.key())
                .is_some_and(|s| Arc::ptr_eq(s, &busy.0))
            {
                table.sequences.remove(&flags.key());
            }
        }
        result.map_err(|e| (e, false))
    }

    fn is_live(&self, flags: &SequenceFlags) -> bool {
        lock(&self.table).sequences.contains_key(&flags.key())
    }

    /// Waits for a place among `max_candidate_sequences` for a new sequence, in arrival order
    /// (tokio's semaphore is fair), as Triton's oldest strategy keeps later sequences in its
    /// backlog. Idle sequences hold their place until released, so they are released while
    /// this waits.
    async fn place(
        &self,
        places: &Arc<tokio::sync::Semaphore>,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let tick = (self.spec.max_idle / 2).clamp(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_secs(1),
        );
        let turn = places.clone().acquire_owned();
        tokio::pin!(turn);
        loop {
            tokio::select! {
                // The semaphore is never closed.
                permit = &mut turn => return permit.ok(),
                () = tokio::time::sleep(tick) => {
                    lock(&self.table).sweep(Instant::now(), self.spec.max_idle);
                }
            }
        }
    }

    /// Finds (or with START, creates, holding `candidate`) the sequence of a request and
    /// counts the request as holding it; releases idle sequences on the way.
    fn enter(
        &self,
        flags: &SequenceFlags,
        candidate: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Result<Arc<Sequence>> {
        let now = Instant::now();
        let max_idle = self.spec.max_idle;
        let mut table = lock(&self.table);
        let due = now.saturating_duration_since(table.last_sweep) > max_idle;
        let this_one_idle = table.sequences.get(&flags.key()).is_some_and(|s| {
            s.idle_since()
                .is_some_and(|t| now.saturating_duration_since(t) > max_idle)
        });
        if due || this_one_idle {
            table.sweep(now, max_idle);
        }
        let existing = table.sequences.get(&flags.key()).cloned();
        let sequence = match existing {
            Some(s) => s,
            None if !flags.start => {
                let hint = if table.released.contains_key(&flags.key()) {
                    format!(
                        " (it was released after {} ms without a request: \
                         max_sequence_idle_microseconds)",
                        max_idle.as_millis()
                    )
                } else {
                    String::new()
                };
                return Err(self.not_started(&flags.id, &hint));
            }
            None => {
                table.released.remove(&flags.key());
                let s = Arc::new(Sequence {
                    busy: AtomicUsize::new(0),
                    last_used: Mutex::new(now),
                    carried: tokio::sync::Mutex::new(Carried {
                        states: None,
                        ended: false,
                    }),
                    _candidate: candidate,
                    instance: Pinned::least_loaded(&self.live),
                });
                table.sequences.insert(flags.key(), s.clone());
                s
            }
        };
        sequence.busy.fetch_add(1, Ordering::AcqRel);
        Ok(sequence)
    }

    fn not_started(&self, id: &SequenceId, hint: &str) -> Error {
        Error::invalid(format!(
            "inference request for sequence {id} to model '{}' must specify the START flag \
             on the first request of the sequence (parameter 'sequence_start'){hint}",
            self.model
        ))
    }

    fn add_controls(&self, request: &mut InferRequest, flags: &SequenceFlags) -> Result<()> {
        let shape = if self.batching { vec![1, 1] } else { vec![1] };
        for control in &self.spec.controls {
            let data = match control.kind {
                ControlKind::Start => flag(control, flags.start),
                ControlKind::End => flag(control, flags.end),
                ControlKind::Ready => flag(control, true),
                ControlKind::CorrelationId => self.correlation_id(control, &flags.id)?,
            };
            request.inputs.push(Tensor {
                name: control.name.clone(),
                datatype: control.datatype,
                shape: shape.clone(),
                data,
            });
        }
        Ok(())
    }

    fn correlation_id(&self, control: &Control, id: &SequenceId) -> Result<Bytes> {
        let number = match id {
            SequenceId::Number(n) => *n,
            SequenceId::Text(s) if control.datatype == DataType::Bytes => {
                let mut out = Vec::new();
                push_bytes_element(&mut out, s.as_bytes());
                return Ok(out.into());
            }
            SequenceId::Text(_) => {
                return Err(Error::invalid(format!(
                    "inference request for sequence {id} to model '{}': the model's \
                     correlation ID input '{}' is {}, so sequence_id must be an integer",
                    self.model,
                    control.name,
                    control.datatype.config_name()
                )))
            }
        };
        let too_big = || {
            Error::invalid(format!(
                "inference request for sequence {id} to model '{}': the ID does not fit the \
                 model's correlation ID input '{}' ({})",
                self.model,
                control.name,
                control.datatype.config_name()
            ))
        };
        let bytes = match control.datatype {
            DataType::Uint64 => number.to_le_bytes().to_vec(),
            DataType::Int64 => i64::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            DataType::Uint32 => u32::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            DataType::Int32 => i32::try_from(number)
                .map_err(|_| too_big())?
                .to_le_bytes()
                .to_vec(),
            _ => {
                let mut out = Vec::new();
                push_bytes_element(&mut out, number.to_string().as_bytes());
                out
            }
        };
        Ok(bytes.into())
    }
}

fn flag(control: &Control, on: bool) -> Bytes {
    match &control.false_true {
        Some([off, true_value]) => Bytes::copy_from_slice(if on { true_value } else { off }),
        None => Bytes::new(),
    }
}

/// The first value of `state` for one request: `[1, dims]` for batching models.
fn initial_state(model: &str, state: &State, batching: bool, model_dir: &Path) -> Result<Tensor> {
    let mut shape = state.initial_dims.clone();
    if batching {
        shape.insert(0, 1);
    }
    let count = element_count(&shape).unwrap_or(0);
    let data: Bytes = match (&state.initial, state.datatype.element_size()) {
        (InitialState::Zeros, Some(size)) => vec![0u8; count * size].into(),
        // BYTES zeros: empty strings, each a zero length prefix.
        (InitialState::Zeros, None) => vec![0u8; count * 4].into(),
        (InitialState::File(file), _) => {
            let path = model_dir.join("initial_state").join(file);
            std::fs::read(&path)
                .map_err(|e| {
                    Error::invalid(format!(
                        "model '{model}': cannot read the initial state of '{}' from '{}': {e}",
                        state.input,
                        path.display()
                    ))
                })?
                .into()
        }
    };
    let tensor = Tensor {
        name: state.input.clone(),
        datatype: state.datatype,
        shape,
        data,
    };
    tensor.validate_size().map_err(|e| {
        Error::invalid(format!(
            "model '{model}': the initial state of '{}' does not fit {} {}: {}",
            state.input,
            state.datatype.config_name(),
            shape_string(&state.initial_dims),
            e.message
        ))
    })?;
    Ok(tensor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(params: &[(&str, ParamValue)]) -> InferRequest {
        InferRequest {
            parameters: params
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn flags_need_a_correlation_id() {
        let e = sequence_flags("m", &request(&[])).unwrap_err();
        assert!(e
            .message
            .contains("must specify a non-zero or non-empty correlation ID"));
        let e = sequence_flags("m", &request(&[("sequence_id", ParamValue::Uint(0))]));
        assert!(e.is_err());
        let e = sequence_flags("m", &request(&[("sequence_id", ParamValue::Int(-3))]));
        assert!(e.unwrap_err().message.contains("negative"));
        let f = sequence_flags(
            "m",
            &request(&[
                ("sequence_id", ParamValue::Int(7)),
                ("sequence_start", ParamValue::Bool(true)),
            ]),
        )
        .unwrap();
        assert_eq!(
            f,
            SequenceFlags {
                id: SequenceId::Number(7),
                start: true,
                end: false,
                owner: None,
            }
        );
        let f = sequence_flags(
            "m",
            &request(&[("sequence_id", ParamValue::String("abc".into()))]),
        )
        .unwrap();
        assert_eq!(f.id, SequenceId::Text("abc".into()));
        let e = sequence_flags(
            "m",
            &request(&[
                ("sequence_id", ParamValue::Uint(1)),
                ("sequence_end", ParamValue::String("yes".into())),
            ]),
        );
        assert!(e
            .unwrap_err()
            .message
            .contains("'sequence_end' must be a boolean"));
    }
}
