//! The `oldest` strategy: up to `max_candidate_sequences` sequences are live at once (a new
//! one waits, in arrival order, for a place); a sequence's next request waits at the
//! sequence until the previous one answered, then joins the model's queue, where the dynamic
//! batcher batches requests of different sequences.
//!
//! Each sequence is pinned to one instance: the one with the fewest live sequences when it
//! starts. Implicit state lives here between requests. A sequence that sees no request for
//! `max_sequence_idle_microseconds` is released (checked whenever requests arrive), and a
//! later request for it must start it again.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard, PoisonError,
    },
    time::Instant,
};

use super::{
    injection::{Controls, Injector},
    SequenceFlags, SequenceKey, REMEMBERED_RELEASES,
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    scheduling::scheduler::Scheduler,
    tensor::Tensor,
};

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

/// The `oldest` strategy of one model version, in front of its scheduler.
pub(super) struct Candidates {
    injector: Injector,
    scheduler: Scheduler,
    table: Mutex<Table>,
    /// `max_candidate_sequences`: places for live sequences, taken in arrival order.
    candidates: Option<Arc<tokio::sync::Semaphore>>,
    /// Live sequences per instance.
    live: Arc<[AtomicUsize]>,
}

impl Candidates {
    pub fn new(injector: Injector, scheduler: Scheduler) -> Self {
        let candidates = (injector.spec.max_candidates > 0)
            .then(|| Arc::new(tokio::sync::Semaphore::new(injector.spec.max_candidates)));
        let live = (0..scheduler.instance_count())
            .map(|_| AtomicUsize::new(0))
            .collect();
        Self {
            injector,
            candidates,
            live,
            scheduler,
            table: Mutex::new(Table {
                sequences: HashMap::new(),
                released: HashMap::new(),
                last_sweep: Instant::now(),
            }),
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Runs one request of a sequence: waits for the sequence's earlier requests, adds the
    /// control and state tensors, queues it and keeps the new state. An error says whether
    /// it came before the queue.
    pub async fn run(
        &self,
        mut request: InferRequest,
        outputs: Vec<String>,
        rows: u64,
        received: Instant,
        flags: SequenceFlags,
    ) -> std::result::Result<InferResponse, (Error, bool)> {
        let refused = |e: Error| (e, true);
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
            return Err(refused(self.injector.not_started(&flags.id, "")));
        }
        self.injector
            .inject(
                &mut request,
                &Controls::of(&flags),
                carried.states.as_deref(),
            )
            .map_err(refused)?;
        let (outputs, requested) = self.injector.with_state_outputs(outputs);
        let pinned = Some(busy.0.instance.index);
        let result = self
            .scheduler
            .infer_on(request, outputs, rows, received, pinned)
            .await;
        let result = result.and_then(|mut response| {
            carried.states = Some(self.injector.take_states(&mut response, requested)?);
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
        let tick = (self.injector.spec.max_idle / 2).clamp(
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
                    lock(&self.table).sweep(Instant::now(), self.injector.spec.max_idle);
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
        let max_idle = self.injector.spec.max_idle;
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
                    self.injector.released_hint()
                } else {
                    String::new()
                };
                return Err(self.injector.not_started(&flags.id, &hint));
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
}
