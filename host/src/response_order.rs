//! The order in which the responses of different requests leave one stream: the order they
//! were produced in. On a gRPC `ModelStreamInfer` stream several requests run at once and each
//! has its own path from the model to the stream; without an order, two responses produced one
//! after the other (a decoupled model answering request 1 with an error, then request 0) could
//! reach the client the other way round, depending on which path ran first. As on Triton, whose
//! stream writes responses in the order its response callbacks run, each response takes a
//! [`Stamp`] where it is produced, and leaves the stream only once every response stamped
//! before it has left (or was dropped: a stamp that goes away gives its turn up).

use std::{
    collections::BTreeSet,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
};

/// The production order of one stream's responses.
#[derive(Debug, Default)]
pub struct ResponseOrder {
    /// The next stamp handed out.
    next_stamp: AtomicU64,
    turns: Mutex<Turns>,
    /// Told whenever the turn moves on.
    moved: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Turns {
    /// Every stamp below this one has left or was dropped.
    next: u64,
    /// Stamps done out of turn (dropped while waiting), above `next`.
    done: BTreeSet<u64>,
}

impl ResponseOrder {
    /// A new order, for one stream.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// A stamp for a response produced now: it leaves after every response stamped before.
    pub fn stamp(self: &Arc<Self>) -> Stamp {
        Stamp {
            order: self.clone(),
            n: self.next_stamp.fetch_add(1, Ordering::AcqRel),
        }
    }

    fn finish(&self, n: u64) {
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        turns.done.insert(n);
        let before = turns.next;
        loop {
            let next = turns.next;
            if !turns.done.remove(&next) {
                break;
            }
            turns.next = next + 1;
        }
        if turns.next != before {
            drop(turns);
            self.moved.notify_waiters();
        }
    }

    fn is_turn_of(&self, n: u64) -> bool {
        self.turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .next
            >= n
    }
}

/// A response's place in its stream's order; dropping it ends its turn (it left, or it never
/// will).
#[derive(Debug)]
pub struct Stamp {
    order: Arc<ResponseOrder>,
    n: u64,
}

impl Stamp {
    /// Waits until every response stamped before this one has left.
    pub async fn turn(&self) {
        loop {
            let moved = self.order.moved.notified();
            tokio::pin!(moved);
            // Registered before the check, so that a move in between is not missed.
            moved.as_mut().enable();
            if self.order.is_turn_of(self.n) {
                return;
            }
            moved.await;
        }
    }
}

impl Drop for Stamp {
    fn drop(&mut self) {
        self.order.finish(self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stamps_take_turns_in_the_order_they_were_taken() {
        let order = ResponseOrder::new();
        let (first, second, third) = (order.stamp(), order.stamp(), order.stamp());
        let left = Arc::new(Mutex::new(Vec::new()));
        let wait = |stamp: Stamp, name: &'static str| {
            let left = left.clone();
            tokio::spawn(async move {
                stamp.turn().await;
                left.lock().unwrap().push(name);
                drop(stamp);
            })
        };
        // Started last-first: each still leaves in its stamp's order.
        let c = wait(third, "third");
        let b = wait(second, "second");
        tokio::task::yield_now().await;
        assert!(left.lock().unwrap().is_empty(), "nothing before the first");
        let a = wait(first, "first");
        for task in [a, b, c] {
            task.await.unwrap();
        }
        assert_eq!(*left.lock().unwrap(), ["first", "second", "third"]);
    }

    #[tokio::test]
    async fn a_dropped_stamp_gives_its_turn_up() {
        let order = ResponseOrder::new();
        let (gone, waiting) = (order.stamp(), order.stamp());
        drop(gone);
        tokio::time::timeout(std::time::Duration::from_secs(60), waiting.turn())
            .await
            .expect("the turn passed the dropped stamp");
    }
}
