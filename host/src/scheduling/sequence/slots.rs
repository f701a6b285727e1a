//! The `direct` strategy (Triton's default): each instance has `max_batch_size` slots (one
//! for a model without batching). A sequence takes a free slot at its START — the lowest slot
//! number over all instances, so that sequences spread over instances first — and keeps it
//! until its END; a sequence that finds none free waits in the backlog, in arrival order, and
//! takes the next slot a sequence gives up. Every request of a sequence queues in its slot.
//!
//! Each instance runs one batch at a time: the next request of each of its slots, one row per
//! slot up to the highest slot with a request ready, so a sequence always has the same row.
//! A slot with nothing ready below that gets a filler row whose READY control is false (a
//! copy of another row's inputs, the initial states, correlation ID 0); as on Triton it
//! counts in its execution's batch size but not as an inference. With `minimum_slot_utilization`, a batch waits until that share
//! of the slots has a request or its oldest request has waited `max_queue_delay_microseconds`.
//!
//! A slot whose sequence has no request queued or running for
//! `max_sequence_idle_microseconds` is given up (the backlog's first sequence takes it), and
//! a later request of that sequence must start it again. A sequence whose next request's
//! caller has gone (a closed connection, a cancelled call) is cancelled as on Triton: its
//! slot is given up and its other queued requests are answered CANCELLED. Triton's test hooks
//! `TRITONSERVER_DELAY_SCHEDULER` (hold every batch until that many requests are queued in
//! the slots) and `TRITONSERVER_BACKLOG_DELAY_SCHEDULER` (…and that many in the backlog) are
//! honoured, as Triton's QA tests line requests up with them.

use std::{
    collections::{HashMap, VecDeque},
    sync::{Arc, Mutex, MutexGuard, Once, PoisonError},
    time::{Duration, Instant},
};

use tokio::sync::{oneshot, Notify};

use super::{
    injection::{Controls, Injector, FILLER_ID},
    SequenceFlags, SequenceKey, REMEMBERED_RELEASES,
};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    scheduling::scheduler::{BatchMember, Scheduler},
    tensor::Tensor,
};

/// A request waiting in its sequence's slot (or in the backlog).
struct Pending {
    request: InferRequest,
    /// The outputs to compute: the client's, then the state outputs.
    outputs: Vec<String>,
    /// How many of `outputs` the client asked for.
    requested: usize,
    received: Instant,
    queued: Instant,
    flags: SequenceFlags,
    reply: oneshot::Sender<Result<InferResponse>>,
}

/// One batch slot of an instance.
struct Slot {
    /// The sequence holding it; `None` when free.
    holder: Option<SequenceKey>,
    queue: VecDeque<Pending>,
    /// The state its sequence's last request left (`None`: the initial state).
    states: Option<Vec<Tensor>>,
    /// A request of it is running now.
    running: bool,
    /// When its sequence last sent or finished a request.
    last_used: Instant,
}

impl Slot {
    fn free() -> Self {
        Self {
            holder: None,
            queue: VecDeque::new(),
            states: None,
            running: false,
            last_used: Instant::now(),
        }
    }
}

/// Where a live sequence's next request goes.
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Slot { instance: usize, slot: usize },
    Backlog(u64),
}

/// A sequence waiting for a slot, with its requests so far.
struct Backlogged {
    id: u64,
    queue: VecDeque<Pending>,
}

/// Everything the slots share, under one lock.
struct Board {
    /// `[instance][slot]`.
    slots: Vec<Vec<Slot>>,
    /// Live sequences: where their next request goes. A sequence whose END has arrived is
    /// no longer here (a new START of its ID starts a new sequence).
    places: HashMap<SequenceKey, Place>,
    backlog: VecDeque<Backlogged>,
    next_backlog: u64,
    /// Sequences given up for being idle, to say why their next request is refused.
    released: HashMap<SequenceKey, Instant>,
    /// `TRITONSERVER_DELAY_SCHEDULER` / `TRITONSERVER_BACKLOG_DELAY_SCHEDULER` (0: off).
    hold_slots: usize,
    hold_backlog: usize,
    closed: bool,
}

/// What an instance does next.
enum Next {
    Run(Vec<Row>),
    Wait(Duration),
}

/// One row of a batch.
enum Row {
    Request {
        slot: usize,
        pending: Box<Pending>,
        /// The state it starts from (`None`: the initial state).
        states: Option<Vec<Tensor>>,
    },
    Filler,
}

impl Row {
    fn describe(&self) -> String {
        match self {
            Row::Request { slot, pending, .. } => format!(
                "{slot}:{}{}{}",
                pending.flags.id,
                if pending.flags.start { "+" } else { "" },
                if pending.flags.end { "." } else { "" }
            ),
            Row::Filler => "-".to_owned(),
        }
    }
}

/// The direct strategy of one model version.
pub(super) struct Slots {
    injector: Injector,
    scheduler: Scheduler,
    per_instance: usize,
    minimum_slot_utilization: f32,
    board: Mutex<Board>,
    /// One per instance: something changed that its next batch may depend on.
    wake: Vec<Notify>,
    started: Once,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while the board is locked.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn env_count(name: &str) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

impl Slots {
    pub fn new(
        injector: Injector,
        scheduler: Scheduler,
        per_instance: usize,
        minimum_slot_utilization: f32,
    ) -> Self {
        let instances = scheduler.instance_count().max(1);
        let slots = (0..instances)
            .map(|_| (0..per_instance).map(|_| Slot::free()).collect())
            .collect();
        Self {
            injector,
            scheduler,
            per_instance,
            minimum_slot_utilization,
            board: Mutex::new(Board {
                slots,
                places: HashMap::new(),
                backlog: VecDeque::new(),
                next_backlog: 0,
                released: HashMap::new(),
                hold_slots: env_count("TRITONSERVER_DELAY_SCHEDULER"),
                hold_backlog: env_count("TRITONSERVER_BACKLOG_DELAY_SCHEDULER"),
                closed: false,
            }),
            wake: (0..instances).map(|_| Notify::new()).collect(),
            started: Once::new(),
        }
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Stops the instances' loops; what is still queued is answered UNAVAILABLE.
    pub fn close(&self) {
        lock(&self.board).closed = true;
        for wake in &self.wake {
            wake.notify_one();
        }
    }

    /// Queues one request of a sequence in its slot (or the backlog) and waits for its
    /// answer. An error says whether it came before the queue.
    pub async fn run(
        self: &Arc<Self>,
        request: InferRequest,
        outputs: Vec<String>,
        received: Instant,
        flags: SequenceFlags,
    ) -> std::result::Result<InferResponse, (Error, bool)> {
        self.start_loops();
        let (outputs, requested) = self.injector.with_state_outputs(outputs);
        let (reply, answer) = oneshot::channel();
        let pending = Pending {
            request,
            outputs,
            requested,
            received,
            queued: Instant::now(),
            flags,
            reply,
        };
        let woken = self.enqueue(pending).map_err(|e| (e, true))?;
        if let Some(instance) = woken {
            self.wake[instance].notify_one();
        }
        answer
            .await
            .unwrap_or_else(|_| {
                Err(Error::unavailable(format!(
                    "model '{}' is unloading: the sequence's request was not run",
                    self.injector.model
                )))
            })
            .map_err(|e| (e, false))
    }

    /// One loop per instance, started with the first request (on the async runtime).
    fn start_loops(self: &Arc<Self>) {
        self.started.call_once(|| {
            for instance in 0..self.wake.len() {
                let slots = self.clone();
                tokio::spawn(async move { slots.instance_loop(instance).await });
            }
        });
    }

    /// Puts a request where its sequence's requests go; returns the instance to wake.
    fn enqueue(&self, pending: Pending) -> Result<Option<usize>> {
        let mut board = lock(&self.board);
        if board.closed {
            return Err(Error::unavailable(format!(
                "model '{}' is unloading",
                self.injector.model
            )));
        }
        let key = pending.flags.key();
        let end = pending.flags.end;
        let now = Instant::now();
        let place = match board.places.get(&key).copied() {
            Some(place) => place,
            None if !pending.flags.start => {
                let hint = if board.released.contains_key(&key) {
                    self.injector.released_hint()
                } else {
                    String::new()
                };
                return Err(self.injector.not_started(&pending.flags.id, &hint));
            }
            None => {
                board.released.remove(&key);
                match board.free_slot() {
                    Some((instance, slot)) => {
                        let s = &mut board.slots[instance][slot];
                        s.holder = Some(key.clone());
                        s.states = None;
                        Place::Slot { instance, slot }
                    }
                    None => {
                        let id = board.next_backlog;
                        board.next_backlog += 1;
                        board.backlog.push_back(Backlogged {
                            id,
                            queue: VecDeque::new(),
                        });
                        Place::Backlog(id)
                    }
                }
            }
        };
        // A START of a live sequence continues in its place: the earlier one ends early.
        if end {
            board.places.remove(&key);
        } else {
            board.places.insert(key, place);
        }
        // The sequence's next request may come now: it queues behind this one.
        pending.request.sequence_queued.fire();
        match place {
            Place::Slot { instance, slot } => {
                let s = &mut board.slots[instance][slot];
                s.queue.push_back(pending);
                s.last_used = now;
                Ok(Some(instance))
            }
            Place::Backlog(id) => {
                if let Some(b) = board.backlog.iter_mut().find(|b| b.id == id) {
                    b.queue.push_back(pending);
                }
                // The backlog hook may be what a loop waits for.
                Ok(board.hold_backlog.gt(&0).then_some(0))
            }
        }
    }

    async fn instance_loop(self: Arc<Self>, instance: usize) {
        loop {
            let next = {
                let mut board = lock(&self.board);
                if board.closed {
                    board.fail_all(instance, &self.injector.model);
                    return;
                }
                let now = Instant::now();
                self.release_idle(&mut board, instance, now);
                if board.holds() {
                    Next::Wait(Duration::from_millis(10))
                } else {
                    self.next_batch(&mut board, instance, now)
                }
            };
            match next {
                Next::Run(rows) => self.run_batch(instance, rows).await,
                Next::Wait(wait) => {
                    let _ = tokio::time::timeout(wait, self.wake[instance].notified()).await;
                }
            }
        }
    }

    /// Gives up the slots of `instance` whose sequences have been idle too long.
    fn release_idle(&self, board: &mut Board, instance: usize, now: Instant) {
        let max_idle = self.injector.spec.max_idle;
        for slot in 0..self.per_instance {
            let s = &board.slots[instance][slot];
            let idle = s.holder.is_some()
                && s.queue.is_empty()
                && !s.running
                && now.saturating_duration_since(s.last_used) > max_idle;
            if !idle {
                continue;
            }
            if let Some(key) = board.slots[instance][slot].holder.clone() {
                let here = Place::Slot { instance, slot };
                if board.places.get(&key) == Some(&here) {
                    board.places.remove(&key);
                    board.remember_release(key, now, max_idle);
                }
            }
            board.release(instance, slot, now);
        }
    }

    /// The next batch of `instance`, or how long to wait before looking again.
    fn next_batch(&self, board: &mut Board, instance: usize, now: Instant) -> Next {
        // Idle sequences are looked for at least this often.
        let tick = (self.injector.spec.max_idle / 2)
            .clamp(Duration::from_millis(10), Duration::from_millis(500));
        // A sequence whose next request's caller has gone is cancelled, as on Triton: its
        // slot goes to the backlog and its other queued requests are answered CANCELLED.
        for slot in 0..self.per_instance {
            let s = &board.slots[instance][slot];
            if s.queue.front().is_some_and(|p| p.reply.is_closed()) {
                self.cancel(board, instance, slot, now);
            }
        }
        let slots = &board.slots[instance];
        let Some(highest) = slots.iter().rposition(|s| !s.queue.is_empty()) else {
            return Next::Wait(tick);
        };
        let delay = self.injector.spec.max_queue_delay;
        if self.minimum_slot_utilization > 0.0 && !delay.is_zero() {
            let ready = slots.iter().filter(|s| !s.queue.is_empty()).count();
            let oldest = slots
                .iter()
                .filter_map(|s| s.queue.front().map(|p| p.queued))
                .min()
                .unwrap_or(now);
            let waited = now.saturating_duration_since(oldest);
            let share = ready as f32 / self.per_instance as f32;
            if waited <= delay && share < self.minimum_slot_utilization {
                return Next::Wait((delay - waited).min(tick));
            }
        }
        let mut rows = Vec::with_capacity(highest + 1);
        for slot in 0..=highest {
            let s = &mut board.slots[instance][slot];
            let Some(pending) = s.queue.pop_front() else {
                rows.push(Row::Filler);
                continue;
            };
            if pending.flags.start {
                s.states = None;
            }
            let states = s.states.clone();
            s.last_used = now;
            let end = pending.flags.end;
            rows.push(Row::Request {
                slot,
                pending: Box::new(pending),
                states,
            });
            if end {
                // Its slot goes to the backlog's first sequence now; this row's answer
                // carries no state back.
                board.release(instance, slot, now);
            } else {
                board.slots[instance][slot].running = true;
            }
        }
        // What each row is, as `slot:id` (`+` START, `.` END) or `-` for a filler.
        tracing::debug!(
            model = %self.injector.model,
            instance,
            rows = %rows.iter().map(Row::describe).collect::<Vec<_>>().join(" "),
            "sequence batch"
        );
        Next::Run(rows)
    }

    /// Cancels the sequence in a slot: its queued requests are answered CANCELLED and the slot
    /// is given up.
    fn cancel(&self, board: &mut Board, instance: usize, slot: usize, now: Instant) {
        let here = Place::Slot { instance, slot };
        let s = &mut board.slots[instance][slot];
        let queued: Vec<Pending> = s.queue.drain(..).collect();
        if let Some(key) = s.holder.clone() {
            if board.places.get(&key) == Some(&here) {
                board.places.remove(&key);
            }
        }
        for pending in queued {
            let _ = pending.reply.send(Err(Error::new(
                crate::error::Code::Cancelled,
                format!(
                    "sequence {} of model '{}' was cancelled: the caller of one of its \
                     requests went away",
                    pending.flags.id, self.injector.model
                ),
            )));
        }
        board.release(instance, slot, now);
    }

    /// Runs one batch on `instance`, keeps each sequence's next state and answers its rows.
    async fn run_batch(&self, instance: usize, rows: Vec<Row>) {
        if !rows.iter().any(|row| matches!(row, Row::Request { .. })) {
            return;
        }
        // Filler rows copy a request's inputs: taken only when the batch has one.
        let template = if rows.iter().any(|row| matches!(row, Row::Filler)) {
            rows.iter().find_map(|row| match row {
                Row::Request { pending, .. } => Some((
                    pending.request.model_name.clone(),
                    pending.request.model_version,
                    pending.request.inputs.clone(),
                    pending.outputs.clone(),
                    pending.received,
                )),
                Row::Filler => None,
            })
        } else {
            None
        };
        let mut members = Vec::with_capacity(rows.len());
        let mut answers: Vec<Option<(usize, Box<Pending>)>> = Vec::with_capacity(rows.len());
        for row in rows {
            match row {
                Row::Request {
                    slot,
                    mut pending,
                    states,
                } => {
                    let controls = Controls::of(&pending.flags);
                    let injected =
                        self.injector
                            .inject(&mut pending.request, &controls, states.as_deref());
                    if let Err(e) = injected {
                        let _ = pending.reply.send(Err(e));
                        self.finish(instance, slot, None, pending.flags.end);
                        continue;
                    }
                    members.push(BatchMember {
                        request: std::mem::take(&mut pending.request),
                        outputs: pending.outputs.clone(),
                        received: pending.received,
                        counted: true,
                    });
                    answers.push(Some((slot, pending)));
                }
                Row::Filler => {
                    let Some((model_name, model_version, inputs, outputs, received)) = &template
                    else {
                        continue;
                    };
                    let mut request = InferRequest {
                        model_name: model_name.clone(),
                        model_version: *model_version,
                        inputs: inputs.clone(),
                        ..Default::default()
                    };
                    let controls = Controls {
                        id: &FILLER_ID,
                        start: false,
                        end: false,
                        ready: false,
                    };
                    // The correlation ID input's type takes 0, whatever it is.
                    if self.injector.inject(&mut request, &controls, None).is_err() {
                        continue;
                    }
                    members.push(BatchMember {
                        request,
                        outputs: outputs.clone(),
                        received: *received,
                        counted: false,
                    });
                    answers.push(None);
                }
            }
        }
        let results = self.scheduler.infer_batch_on(instance, members).await;
        for (answer, result) in answers.into_iter().zip(results) {
            let Some((slot, pending)) = answer else {
                continue;
            };
            let end = pending.flags.end;
            let result = result.and_then(|mut response| {
                let next = self
                    .injector
                    .take_states(&mut response, pending.requested)?;
                Ok((response, next))
            });
            let (result, next) = match result {
                Ok((response, next)) => (Ok(response), Some(next)),
                Err(e) => (Err(e), None),
            };
            self.finish(instance, slot, next, end);
            let _ = pending.reply.send(result);
        }
    }

    /// Keeps a finished request's next state in its slot (unless its sequence ended).
    fn finish(&self, instance: usize, slot: usize, next: Option<Vec<Tensor>>, end: bool) {
        if end {
            return;
        }
        let mut board = lock(&self.board);
        let s = &mut board.slots[instance][slot];
        if let Some(next) = next {
            s.states = Some(next);
        }
        s.running = false;
        s.last_used = Instant::now();
    }
}

impl Board {
    /// The free slot with the lowest number, on the lowest-numbered instance among those.
    fn free_slot(&self) -> Option<(usize, usize)> {
        let per_instance = self.slots.first().map_or(0, Vec::len);
        (0..per_instance).find_map(|slot| {
            (0..self.slots.len())
                .find(|&instance| self.slots[instance][slot].holder.is_none())
                .map(|instance| (instance, slot))
        })
    }

    /// Frees a slot, or hands it to the backlog's first sequence with its requests.
    fn release(&mut self, instance: usize, slot: usize, now: Instant) {
        let s = &mut self.slots[instance][slot];
        s.holder = None;
        s.states = None;
        s.running = false;
        while let Some(next) = self.backlog.pop_front() {
            let Some(key) = next.queue.front().map(|p| p.flags.key()) else {
                continue;
            };
            if self.places.get(&key) == Some(&Place::Backlog(next.id)) {
                self.places
                    .insert(key.clone(), Place::Slot { instance, slot });
            }
            let s = &mut self.slots[instance][slot];
            s.holder = Some(key);
            s.queue.extend(next.queue);
            s.last_used = now;
            return;
        }
    }

    fn remember_release(&mut self, key: SequenceKey, now: Instant, max_idle: Duration) {
        self.released
            .retain(|_, at| now.saturating_duration_since(*at) <= max_idle * 10);
        if self.released.len() >= REMEMBERED_RELEASES {
            self.released.clear();
        }
        self.released.insert(key, now);
    }

    /// Whether Triton's test hooks still hold batches back. Once enough is queued they are
    /// off for good, for every instance (the first batches take requests out again).
    fn holds(&mut self) -> bool {
        if self.hold_slots == 0 && self.hold_backlog == 0 {
            return false;
        }
        let in_slots: usize = self.slots.iter().flatten().map(|s| s.queue.len()).sum();
        let in_backlog: usize = self.backlog.iter().map(|b| b.queue.len()).sum();
        if in_slots < self.hold_slots || in_backlog < self.hold_backlog {
            return true;
        }
        self.hold_slots = 0;
        self.hold_backlog = 0;
        false
    }

    /// Answers everything queued for `instance` (and, for instance 0, the backlog) with
    /// UNAVAILABLE: the model is unloading.
    fn fail_all(&mut self, instance: usize, model: &str) {
        let err = || Error::unavailable(format!("model '{model}' is unloading"));
        let mut queued: Vec<Pending> = self.slots[instance]
            .iter_mut()
            .flat_map(|s| s.queue.drain(..))
            .collect();
        if instance == 0 {
            queued.extend(self.backlog.drain(..).flat_map(|b| b.queue));
        }
        for pending in queued {
            let _ = pending.reply.send(Err(err()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduling::sequence::SequenceId;

    fn board(instances: usize, per_instance: usize) -> Board {
        Board {
            slots: (0..instances)
                .map(|_| (0..per_instance).map(|_| Slot::free()).collect())
                .collect(),
            places: HashMap::new(),
            backlog: VecDeque::new(),
            next_backlog: 0,
            released: HashMap::new(),
            hold_slots: 0,
            hold_backlog: 0,
            closed: false,
        }
    }

    fn pending(id: u64, start: bool, end: bool) -> Pending {
        Pending {
            request: InferRequest::default(),
            outputs: Vec::new(),
            requested: 0,
            received: Instant::now(),
            queued: Instant::now(),
            flags: SequenceFlags {
                id: SequenceId::Number(id),
                start,
                end,
                owner: None,
            },
            reply: oneshot::channel().0,
        }
    }

    #[test]
    fn new_sequences_spread_over_instances_first() {
        // Triton's order: slot 0 of every instance, then slot 1 (L0_sequence_batcher's
        // test_half_batch puts two sequences on two instances of two slots each).
        let mut b = board(2, 2);
        let mut taken = Vec::new();
        while let Some((i, s)) = b.free_slot() {
            b.slots[i][s].holder = Some((None, SequenceId::Number(taken.len() as u64)));
            taken.push((i, s));
        }
        assert_eq!(taken, [(0, 0), (1, 0), (0, 1), (1, 1)]);
    }

    #[test]
    fn a_released_slot_goes_to_the_first_backlogged_sequence_with_its_requests() {
        let mut b = board(1, 1);
        let first = (None, SequenceId::Number(1));
        b.slots[0][0].holder = Some(first.clone());
        b.places.insert(
            first,
            Place::Slot {
                instance: 0,
                slot: 0,
            },
        );
        let waiting = (None, SequenceId::Number(2));
        b.backlog.push_back(Backlogged {
            id: 7,
            queue: [pending(2, true, false), pending(2, false, false)].into(),
        });
        b.places.insert(waiting.clone(), Place::Backlog(7));
        b.backlog.push_back(Backlogged {
            id: 8,
            queue: [pending(3, true, true)].into(),
        });
        b.release(0, 0, Instant::now());
        assert_eq!(b.slots[0][0].holder, Some(waiting.clone()));
        assert_eq!(b.slots[0][0].queue.len(), 2);
        // Its later requests go to the slot now.
        assert!(
            b.places[&waiting]
                == Place::Slot {
                    instance: 0,
                    slot: 0
                }
        );
        assert_eq!(b.backlog.len(), 1);
        // The next release takes the next one; then the slot is free.
        b.slots[0][0].queue.clear();
        b.release(0, 0, Instant::now());
        assert_eq!(b.slots[0][0].holder, Some((None, SequenceId::Number(3))));
        b.slots[0][0].queue.clear();
        b.release(0, 0, Instant::now());
        assert_eq!(b.slots[0][0].holder, None);
        assert_eq!(b.free_slot(), Some((0, 0)));
    }

    #[test]
    fn the_test_hooks_hold_until_enough_is_queued_then_stay_off() {
        let mut b = board(1, 2);
        b.hold_slots = 2;
        b.slots[0][0].queue.push_back(pending(1, true, false));
        assert!(b.holds());
        b.slots[0][1].queue.push_back(pending(2, true, false));
        assert!(!b.holds());
        b.slots[0][1].queue.clear();
        assert!(
            !b.holds(),
            "once released, the hook is off for every instance"
        );
    }
}
