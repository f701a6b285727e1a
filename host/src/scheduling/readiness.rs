//! A model's own readiness check (a Triton `model.py`'s `is_ready()`), run on one of its
//! instances when a client asks whether the model is ready, as Triton's Python backend does:
//! one check at a time per model version, concurrent askers share its answer, and an answer
//! that takes longer than [`CHECK_TIMEOUT`] is "not ready" for the askers who gave up. A check
//! waits for a free instance (it runs between batches) and goes before queued batches.

use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// How long an asker waits for the check's answer, as on Triton.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an answer nobody received (its askers gave up) stays for the next asker: the
/// check it belonged to was already in flight when that asker came, as Triton lets it wait
/// for the check in flight rather than start another.
const LATE_ANSWER_KEPT: Duration = CHECK_TIMEOUT;

/// The readiness checks of one model version, kept under its queue's lock.
#[derive(Default)]
pub(super) struct Checks {
    /// The model has a check of its own (else nothing is ever asked of an instance).
    pub(super) enabled: bool,
    /// Askers waiting for a check no instance has started yet.
    waiting: Vec<oneshot::Sender<bool>>,
    /// Askers joined to the check an instance runs now.
    joined: Option<Vec<oneshot::Sender<bool>>>,
    /// The answer of a check whose askers had all given up, and when it came.
    late: Option<(bool, Instant)>,
}

/// What an asker does: wait for an answer, or take one at once.
pub(super) enum Ask {
    Wait(oneshot::Receiver<bool>),
    Answered(bool),
}

impl Checks {
    /// Joins the check in flight, or asks for one (`true`: an instance must be woken).
    pub(super) fn ask(&mut self) -> (Ask, bool) {
        if let Some((ready, at)) = self.late.take() {
            if at.elapsed() < LATE_ANSWER_KEPT {
                return (Ask::Answered(ready), false);
            }
        }
        let (tx, rx) = oneshot::channel();
        match &mut self.joined {
            Some(joined) => {
                joined.push(tx);
                (Ask::Wait(rx), false)
            }
            None => {
                let wake = self.waiting.is_empty();
                self.waiting.push(tx);
                (Ask::Wait(rx), wake)
            }
        }
    }

    /// For a free instance: whether to run a check now (the askers join it).
    pub(super) fn start(&mut self) -> bool {
        if self.joined.is_some() || self.waiting.is_empty() {
            return false;
        }
        // Askers that already gave up need no check.
        self.waiting.retain(|tx| !tx.is_closed());
        if self.waiting.is_empty() {
            return false;
        }
        self.joined = Some(std::mem::take(&mut self.waiting));
        true
    }

    /// The check's answer, for everyone who joined it; kept for the next asker when nobody
    /// waits for it any more.
    pub(super) fn finish(&mut self, ready: bool) {
        let mut delivered = false;
        for tx in self.joined.take().unwrap_or_default() {
            delivered |= tx.send(ready).is_ok();
        }
        if !delivered {
            self.late = Some((ready, Instant::now()));
        }
    }
}

/// Waits at most [`CHECK_TIMEOUT`] for the answer; a check that did not answer in time (or an
/// instance that stopped) is "not ready".
pub(super) async fn answer(ask: Ask) -> bool {
    match ask {
        Ask::Answered(ready) => ready,
        Ask::Wait(rx) => matches!(tokio::time::timeout(CHECK_TIMEOUT, rx).await, Ok(Ok(true))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn askers_share_one_check_and_a_late_answer_serves_the_next() {
        let mut checks = Checks {
            enabled: true,
            ..Default::default()
        };
        let (first, wake) = checks.ask();
        assert!(wake);
        let (_second, wake) = checks.ask();
        assert!(!wake, "the second asker waits for the same check");
        assert!(checks.start());
        assert!(!checks.start(), "one check at a time");
        let (third, _) = checks.ask();
        // Everyone who asked gave up before the answer came.
        drop(first);
        drop(_second);
        drop(third);
        checks.finish(true);
        match checks.ask() {
            (Ask::Answered(true), false) => {}
            _ => panic!("the answer nobody received goes to the next asker"),
        }
        // Used once: the next asker asks for a check of its own.
        assert!(matches!(checks.ask(), (Ask::Wait(_), true)));
    }
}
