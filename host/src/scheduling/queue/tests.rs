use super::*;

/// A request of `rows` rows whose inputs have shape class `shape`.
#[derive(Debug, PartialEq)]
struct J(usize, u8);

impl Batchable for J {
    fn rows(&self) -> usize {
        self.0
    }
    fn fits_with(&self, other: &Self) -> bool {
        self.1 == other.1
    }
}

fn policy(max: usize, preferred: &[usize], delay_us: u64) -> BatchPolicy {
    BatchPolicy {
        max_batch_size: max,
        preferred: preferred.to_vec(),
        max_queue_delay: Duration::from_micros(delay_us),
        batching: true,
        ..BatchPolicy::one_at_a_time()
    }
}

fn queue(jobs: &[J], now: Instant) -> RequestQueue<J> {
    let mut q = RequestQueue::new(&[QueuePolicy::default()], 100);
    for j in jobs {
        q.push(0, J(j.0, j.1), None, now).unwrap();
    }
    q
}

#[test]
fn batches_whatever_is_queued_without_a_delay() {
    let now = Instant::now();
    let q = queue(&[J(1, 0), J(2, 0), J(1, 0)], now);
    assert_eq!(q.decide(&policy(8, &[], 0), now), Decision::Run(3));
    assert_eq!(
        q.decide(&BatchPolicy::one_at_a_time(), now),
        Decision::Run(1)
    );
}

#[test]
fn stops_at_the_first_request_that_does_not_fit() {
    let now = Instant::now();
    let q = queue(&[J(1, 0), J(1, 0), J(1, 7), J(1, 0)], now);
    assert_eq!(q.decide(&policy(8, &[], 1_000_000), now), Decision::Run(2));
    let q = queue(&[J(3, 0), J(3, 0), J(3, 0)], now);
    assert_eq!(q.decide(&policy(8, &[], 1_000_000), now), Decision::Run(2));
}

#[test]
fn waits_for_the_delay_then_runs_what_it_has() {
    let now = Instant::now();
    let q = queue(&[J(1, 0), J(1, 0)], now);
    let p = policy(8, &[], 500);
    assert_eq!(
        q.decide(&p, now),
        Decision::WaitUntil(now + Duration::from_micros(500))
    );
    assert_eq!(
        q.decide(&p, now + Duration::from_micros(500)),
        Decision::Run(2)
    );
}

#[test]
fn runs_a_preferred_size_at_once() {
    let now = Instant::now();
    let p = policy(8, &[2, 4], 1_000_000);
    assert_eq!(
        queue(&[J(1, 0)], now).decide(&p, now),
        Decision::WaitUntil(now + Duration::from_secs(1))
    );
    assert_eq!(
        queue(&[J(1, 0), J(1, 0), J(1, 0)], now).decide(&p, now),
        Decision::Run(2)
    );
    assert_eq!(
        queue(&[J(1, 0), J(1, 0), J(2, 0)], now).decide(&p, now),
        Decision::Run(3)
    );
    let full = policy(8, &[4], 1_000_000);
    assert_eq!(
        queue(&[J(2, 0), J(2, 0), J(1, 0)], now).decide(&full, now),
        Decision::Run(2),
        "the largest prefix that adds up to a preferred size"
    );
}

#[test]
fn a_batch_past_the_largest_preferred_size_runs_at_once() {
    // L0_batcher: Triton issues these without waiting out max_queue_delay.
    let now = Instant::now();
    let p = policy(8, &[4], 10_000_000);
    assert_eq!(queue(&[J(5, 0)], now).decide(&p, now), Decision::Run(1));
    assert_eq!(
        queue(&[J(3, 0), J(3, 0)], now).decide(&p, now),
        Decision::Run(1),
        "the prefix before the batch would pass the largest preferred size"
    );
    assert_eq!(
        queue(&[J(2, 0), J(3, 0)], now).decide(&p, now),
        Decision::Run(1)
    );
    assert_eq!(
        queue(&[J(2, 0), J(1, 0)], now).decide(&p, now),
        Decision::WaitUntil(now + Duration::from_secs(10)),
        "below every preferred size it waits"
    );
    let no_delay = policy(8, &[2, 4], 0);
    assert_eq!(
        queue(&[J(1, 0), J(1, 0), J(1, 0)], now).decide(&no_delay, now),
        Decision::Run(2),
        "without a delay the preferred prefix still goes first"
    );
    let after = now + Duration::from_secs(10);
    assert_eq!(
        queue(&[J(1, 0), J(1, 0), J(1, 0)], now).decide(&p, after),
        Decision::Run(3),
        "once the delay is over everything gathered runs"
    );
}

#[test]
fn higher_priorities_go_first_and_levels_have_their_own_limits() {
    let now = Instant::now();
    let limited = QueuePolicy {
        max_queue_size: 1,
        ..QueuePolicy::default()
    };
    let mut q = RequestQueue::new(&[QueuePolicy::default(), limited], 10);
    q.push(1, J(1, 1), None, now).unwrap();
    assert_eq!(
        q.push(1, J(1, 2), None, now).unwrap_err().1,
        Refusal::LevelFull {
            priority: 2,
            max: 1
        }
    );
    q.push(0, J(1, 3), None, now).unwrap();
    let order: Vec<u8> = q.take(2).into_iter().map(|e| e.job.1).collect();
    assert_eq!(order, [3, 1]);
    assert!(q.is_empty());
}

#[test]
fn timeouts_reject_or_delay_per_policy() {
    let now = Instant::now();
    let reject = QueuePolicy {
        default_timeout: Some(Duration::from_millis(10)),
        ..QueuePolicy::default()
    };
    let delay = QueuePolicy {
        on_timeout: OnTimeout::Delay,
        ..reject.clone()
    };
    let mut q = RequestQueue::new(&[reject, delay], 10);
    q.push(0, J(1, 1), None, now).unwrap();
    q.push(0, J(1, 2), Some(Duration::from_secs(1)), now)
        .unwrap(); // cannot lengthen the default
    q.push(1, J(1, 3), None, now).unwrap();
    q.push(0, J(1, 4), None, now + Duration::from_millis(9))
        .unwrap();
    q.push(1, J(1, 5), None, now + Duration::from_millis(5))
        .unwrap();
    let later = now + Duration::from_millis(11);
    let rejected: Vec<u8> = q.expire(later).into_iter().map(|j| j.1).collect();
    assert_eq!(rejected, [1, 2]);
    let order: Vec<u8> = q.iter().map(|e| e.job.1).collect();
    assert_eq!(order, [4, 5, 3], "the delayed request goes behind");
    assert_eq!(q.len(), 3);
}

#[test]
fn a_full_queue_refuses() {
    let now = Instant::now();
    let mut q = RequestQueue::new(&[QueuePolicy::default()], 2);
    q.push(0, J(1, 0), None, now).unwrap();
    q.push(0, J(1, 0), None, now).unwrap();
    assert_eq!(
        q.push(0, J(1, 0), None, now).unwrap_err().1,
        Refusal::Full { capacity: 2 }
    );
}

/// A request of one row from `tenant` (weight, queue quota), numbered `id`.
#[derive(Debug)]
struct T(&'static str, f64, Option<usize>, u8);

impl Batchable for T {
    fn rows(&self) -> usize {
        1
    }
    fn fits_with(&self, _: &Self) -> bool {
        true
    }
    fn share(&self) -> Option<Share<'_>> {
        Some(Share {
            tenant: self.0,
            weight: self.1,
            max_queued: self.2,
        })
    }
}

fn order(q: &RequestQueue<T>) -> Vec<String> {
    q.iter()
        .map(|e| format!("{}{}", e.job.0, e.job.3))
        .collect()
}

#[test]
fn a_flooding_tenant_only_pushes_back_its_own_requests() {
    let now = Instant::now();
    let mut q = RequestQueue::new(&[QueuePolicy::default()], 100);
    for i in 0..5 {
        q.push(0, T("a", 1.0, None, i), None, now).unwrap();
    }
    q.push(0, T("b", 1.0, None, 0), None, now).unwrap();
    assert_eq!(order(&q), ["a0", "b0", "a1", "a2", "a3", "a4"]);
    // Later, once a0, b0 and a1 ran, b's next request goes first again.
    q.take(2);
    q.take(1);
    q.push(0, T("b", 1.0, None, 1), None, now).unwrap();
    assert_eq!(order(&q), ["b1", "a2", "a3", "a4"]);
}

#[test]
fn weights_share_turns_and_queue_quotas_refuse() {
    let now = Instant::now();
    let mut q = RequestQueue::new(&[QueuePolicy::default()], 100);
    for i in 0..4 {
        q.push(0, T("a", 2.0, None, i), None, now).unwrap();
    }
    for i in 0..4 {
        q.push(0, T("b", 1.0, Some(4), i), None, now).unwrap();
    }
    assert_eq!(order(&q), ["a0", "b0", "a1", "a2", "b1", "a3", "b2", "b3"]);
    assert_eq!(
        q.push(0, T("b", 1.0, Some(4), 9), None, now).unwrap_err().1,
        Refusal::TenantFull { max: 4 }
    );
    q.push(0, T("a", 2.0, Some(5), 9), None, now).unwrap();
}

#[test]
fn requests_held_back_keep_their_places_while_others_pass() {
    let now = Instant::now();
    let mut q = RequestQueue::new(&[QueuePolicy::default()], 100);
    for i in 0..3 {
        q.push(0, T("a", 1.0, None, i), None, now).unwrap();
    }
    q.push(0, T("b", 1.0, None, 0), None, now).unwrap();
    q.push(0, T("c", 1.0, None, 0), None, now).unwrap();
    let not_a = |j: &T| j.0 != "a";
    let p = policy(8, &[], 0);
    assert_eq!(q.decide_among(&p, now, not_a), Decision::Run(2));
    let taken: Vec<_> = q
        .take_among(2, not_a)
        .into_iter()
        .map(|e| e.job.0)
        .collect();
    assert_eq!(taken, ["b", "c"]);
    assert_eq!(order(&q), ["a0", "a1", "a2"]);
    assert_eq!(q.decide_among(&p, now, not_a), Decision::Idle);
    assert_eq!(q.len(), 3);
    assert_eq!(q.decide(&p, now), Decision::Run(3));
}

#[test]
fn priority_zero_or_out_of_range_uses_the_default_level() {
    let p = BatchPolicy {
        levels: vec![QueuePolicy::default(); 3],
        default_level: 1,
        ..BatchPolicy::one_at_a_time()
    };
    assert_eq!(
        (p.level_of(0), p.level_of(1), p.level_of(3), p.level_of(4)),
        (1, 0, 2, 1)
    );
}
