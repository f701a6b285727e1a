//! The sequence batcher: for a model with `sequence_batching`, the requests of one sequence
//! (one correlation ID, from the request with `sequence_start` to the one with
//! `sequence_end`) run one after another, in arrival order, each with the control tensors
//! the model declares (START, END, READY, CORRID) and the implicit state the previous request
//! left behind.
//!
//! Two strategies, as on Triton: `direct` (the default; `slots.rs`) gives each sequence a
//! batch slot of one instance for its whole life, and `oldest` (`candidates.rs`) batches the
//! requests of the live sequences through the model's queue. Either way every request of a
//! sequence runs on the one instance the sequence started on, since a model may keep a
//! sequence's state in its instance (a `model.py` adding to `self`). `injection.rs` builds the
//! tensors both add to a request.

mod candidates;
mod injection;
mod slots;

use std::{path::Path, sync::Arc, time::Instant};

use super::{
    scheduler::Scheduler,
    stats::{FailureReason, ModelStats},
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse, ParamValue},
    repository::sequence::{SequenceSpec, Strategy},
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

/// How many released IDs are remembered, to say why a later request is refused.
const REMEMBERED_RELEASES: usize = 10_000;

/// The sequence batcher of one model version, in front of its scheduler.
pub struct SequenceBatcher {
    model: String,
    batching: bool,
    stats: Arc<ModelStats>,
    strategy: Batcher,
}

enum Batcher {
    Candidates(Box<candidates::Candidates>),
    Slots(Arc<slots::Slots>),
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
        let injector = injection::Injector::new(model, spec, batching, model_dir)?;
        let strategy = match injector.spec.strategy {
            Strategy::Direct {
                minimum_slot_utilization,
            } => {
                // The slots hold requests back for Triton's test hook, not the queue.
                scheduler.skip_delay_hook();
                Batcher::Slots(Arc::new(slots::Slots::new(
                    injector,
                    scheduler,
                    max_batch_size.max(1) as usize,
                    minimum_slot_utilization,
                )))
            }
            Strategy::Oldest => {
                Batcher::Candidates(Box::new(candidates::Candidates::new(injector, scheduler)))
            }
        };
        Ok(Self {
            model: model.to_owned(),
            batching,
            stats,
            strategy,
        })
    }

    /// The scheduler behind it.
    pub fn scheduler(&self) -> &Scheduler {
        match &self.strategy {
            Batcher::Candidates(c) => c.scheduler(),
            Batcher::Slots(s) => s.scheduler(),
        }
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
        if self.batching && rows != 1 {
            return Err(refuse(Error::invalid(format!(
                "inference request to model '{}' must specify batch-size 1 due to requirements \
                 of sequence batcher (sequence {} sent {rows} rows)",
                self.model, flags.id
            ))));
        }
        let result = match &self.strategy {
            Batcher::Candidates(c) => c.run(request, outputs, rows, received, flags).await,
            Batcher::Slots(s) => s.run(request, outputs, received, flags).await,
        };
        result.map_err(|(e, refused)| if refused { refuse(e) } else { e })
    }
}

impl Drop for SequenceBatcher {
    fn drop(&mut self) {
        if let Batcher::Slots(s) = &self.strategy {
            s.close();
        }
    }
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
