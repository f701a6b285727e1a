//! Whether anyone still waits for a request's answer. Every [`crate::inference::InferRequest`]
//! carries a [`Cancellation`]; the server cancels it when the caller stops waiting (the future
//! of `Server::infer` dropped: an HTTP client that closed its connection, an HTTP/2
//! `RST_STREAM`, a gRPC cancel, a stream whose reader stalled, a stage call whose caller was
//! itself cancelled), and the work checks it wherever it runs: a queued request is skipped, a
//! generating sequence leaves the batch, a Wasm stage is interrupted at its next epoch tick
//! and its calls into other models return `Cancelled`.
//!
//! Work done on behalf of other work gets a child: an ensemble's steps are cancelled with the
//! ensemble, the calls a stage makes with the batch that made them (when every request of the
//! batch is cancelled: the others still wait for the answer).

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

/// How often an async wait for a cancellation looks again (see [`Cancellation::cancelled`]).
const POLL: Duration = Duration::from_millis(10);

/// A request's cancellation: cheap to clone (clones share it) and to check.
#[derive(Clone)]
pub struct Cancellation(Arc<Inner>);

struct Inner {
    cancelled: AtomicBool,
    /// Cancelled too once every one of these is (none: only by [`Cancellation::cancel`]).
    parents: Vec<Cancellation>,
    /// The request this work is for at the root: children of one parent share it, so that
    /// the work of one client request can be told apart from another's (the generation
    /// engine shares its rows among them).
    root: u64,
}

fn next_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Default for Cancellation {
    fn default() -> Self {
        Self::new()
    }
}

impl Cancellation {
    /// A cancellation of its own, not cancelled.
    pub fn new() -> Self {
        Self(Arc::new(Inner {
            cancelled: AtomicBool::new(false),
            parents: Vec::new(),
            root: next_id(),
        }))
    }

    /// Cancelled when it is cancelled itself or when `self` is: for work done for `self`'s.
    pub fn child(&self) -> Self {
        Self(Arc::new(Inner {
            cancelled: AtomicBool::new(false),
            parents: vec![self.clone()],
            root: self.0.root,
        }))
    }

    /// Cancelled when it is cancelled itself or when every one of `parents` is (work shared
    /// by several requests, such as a stage's call for a whole batch); with no parents, a
    /// cancellation of its own.
    pub fn child_of_all(parents: impl IntoIterator<Item = Cancellation>) -> Self {
        let parents: Vec<Cancellation> = parents.into_iter().collect();
        match parents.as_slice() {
            [one] => one.child(),
            _ => Self(Arc::new(Inner {
                cancelled: AtomicBool::new(false),
                parents,
                root: next_id(),
            })),
        }
    }

    /// Cancels it (and its children).
    pub fn cancel(&self) {
        self.0.cancelled.store(true, Ordering::Release);
    }

    /// Whether it was cancelled, itself or through its parents.
    pub fn is_cancelled(&self) -> bool {
        self.0.cancelled.load(Ordering::Acquire)
            || (!self.0.parents.is_empty() && self.0.parents.iter().all(Self::is_cancelled))
    }

    /// The root request it belongs to (see `Inner::root`).
    pub fn root(&self) -> u64 {
        self.0.root
    }

    /// Resolves once it is cancelled (looked at every 10 ms: for waits that last, not for hot
    /// paths).
    pub async fn cancelled(&self) {
        while !self.is_cancelled() {
            tokio::time::sleep(POLL).await;
        }
    }

    /// A guard that cancels it when dropped before [`CancelOnDrop::disarm`]: held by the
    /// future that waits for the answer, so that dropping that future cancels the work.
    pub fn cancel_on_drop(&self) -> CancelOnDrop {
        CancelOnDrop(Some(self.clone()))
    }
}

impl std::fmt::Debug for Cancellation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_cancelled() {
            "Cancellation(cancelled)"
        } else {
            "Cancellation"
        })
    }
}

/// Requests compare equal whatever their cancellations.
impl PartialEq for Cancellation {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// See [`Cancellation::cancel_on_drop`].
#[must_use = "the guard cancels when dropped"]
pub struct CancelOnDrop(Option<Cancellation>);

impl CancelOnDrop {
    /// The wait ended with an answer: dropping the guard no longer cancels.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_follow_their_parents() {
        let parent = Cancellation::new();
        let child = parent.child();
        let grandchild = child.child();
        assert!(!grandchild.is_cancelled());
        assert_eq!(grandchild.root(), parent.root());
        child.cancel();
        assert!(grandchild.is_cancelled() && !parent.is_cancelled());
        let other = Cancellation::new().child();
        parent.cancel();
        assert!(!other.is_cancelled());
    }

    #[test]
    fn work_for_several_requests_is_cancelled_when_all_are() {
        let (a, b) = (Cancellation::new(), Cancellation::new());
        let shared = Cancellation::child_of_all([a.clone(), b.clone()]);
        a.cancel();
        assert!(!shared.is_cancelled());
        b.cancel();
        assert!(shared.is_cancelled());
        let alone = Cancellation::child_of_all([]);
        assert!(!alone.is_cancelled());
    }

    #[test]
    fn a_guard_cancels_unless_disarmed() {
        let c = Cancellation::new();
        c.cancel_on_drop().disarm();
        assert!(!c.is_cancelled());
        drop(c.cancel_on_drop());
        assert!(c.is_cancelled());
    }
}
