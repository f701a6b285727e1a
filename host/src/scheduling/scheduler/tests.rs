use super::*;
use crate::tenancy::{hash_key, Tenancy};
use std::collections::HashMap;

/// What the probe instances saw: executions running and the most at once, per tenant.
#[derive(Default)]
struct Seen {
    running: HashMap<String, usize>,
    most: HashMap<String, usize>,
    released: bool,
}

type Board = Arc<(Mutex<Seen>, Condvar)>;

/// An instance that counts executions per tenant and holds tenant "a"'s until released.
struct Probe(Board);

impl ModelInstance for Probe {
    fn execute_batch(
        &mut self,
        requests: &[&InferRequest],
        outputs: &[String],
    ) -> (Vec<Result<Vec<Tensor>>>, ExecTimings) {
        batch::execute_merged(requests, outputs, |r, o| self.run(r, o))
    }
}

impl Probe {
    fn run(&mut self, request: &InferRequest, _: &[String]) -> Result<(Vec<Tensor>, ExecTimings)> {
        let tenant = request.callers.first().and_then(Caller::tenant);
        let tenant = tenant.unwrap_or_default().to_owned();
        let (seen, released) = &*self.0;
        let mut s = lock(seen);
        let now = *s.running.entry(tenant.clone()).or_default() + 1;
        s.running.insert(tenant.clone(), now);
        let most = s.most.entry(tenant.clone()).or_default();
        *most = (*most).max(now);
        released.notify_all();
        while tenant == "a" && !s.released {
            s = released.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        if tenant == "b" {
            // Long enough for executions on other instances to overlap this one.
            drop(s);
            std::thread::sleep(Duration::from_millis(20));
            s = lock(seen);
        }
        *s.running.entry(tenant).or_default() -= 1;
        Ok((Vec::new(), ExecTimings::default()))
    }
}

fn tenants() -> (Caller, Caller) {
    let text = format!(
        "[[tenant]]\nname = \"a\"\napi_keys = [\"{}\"]\ninfer = [\"*\"]\n\
         [[tenant]]\nname = \"b\"\napi_keys = [\"{}\"]\ninfer = [\"*\"]\n",
        hash_key("a-key"),
        hash_key("b-key")
    );
    let t = Tenancy::parse(&text, "w.toml").unwrap();
    let caller = |key: &str| t.authenticate(Some(&format!("Bearer {key}"))).unwrap();
    (caller("a-key"), caller("b-key"))
}

/// A model of three probe instances under `share`.
fn model(share: ExecutionShare) -> (Arc<Scheduler>, Board) {
    let board: Board = Default::default();
    (model_on(&board, Arc::new(share), Vec::new()), board)
}

/// A model of three probe instances on `board`, with `claims` from a rate limiter.
fn model_on(board: &Board, share: Arc<ExecutionShare>, claims: Vec<Arc<Claim>>) -> Arc<Scheduler> {
    let instances: Vec<Box<dyn ModelInstance>> = (0..3)
        .map(|_| Box::new(Probe(board.clone())) as Box<dyn ModelInstance>)
        .collect();
    let scheduler = Scheduler::start(
        "m",
        1,
        instances,
        BatchPolicy::one_at_a_time(),
        100,
        Default::default(),
        ExecutionLimits { share, claims },
    )
    .unwrap();
    Arc::new(scheduler)
}

fn call(
    scheduler: &Arc<Scheduler>,
    caller: &Caller,
) -> tokio::task::JoinHandle<Result<InferResponse>> {
    let (scheduler, caller) = (scheduler.clone(), caller.clone());
    tokio::spawn(async move {
        let request = InferRequest {
            model_name: "m".into(),
            callers: vec![caller],
            ..Default::default()
        };
        scheduler
            .infer(request, Vec::new(), 1, Instant::now())
            .await
    })
}

/// Waits (up to a minute) until `tenant` has had `n` executions running at once.
fn wait_for_most(board: &Board, tenant: &str, n: usize) -> usize {
    let (seen, changed) = &**board;
    let mut s = lock(seen);
    let until = Instant::now() + Duration::from_secs(60);
    while s.most.get(tenant).copied().unwrap_or(0) < n && Instant::now() < until {
        s = changed
            .wait_timeout(s, Duration::from_millis(50))
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    s.most.get(tenant).copied().unwrap_or(0)
}

fn release(board: &Board) {
    lock(&board.0).released = true;
    board.1.notify_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_leaves_an_instance_to_an_active_one() {
    let (a, b) = tenants();
    let (m, board) = model(ExecutionShare::with_window(2, Duration::from_secs(3600)));
    call(&m, &b).await.unwrap().unwrap();
    let flood: Vec<_> = (0..6).map(|_| call(&m, &a)).collect();
    let held = board.clone();
    assert_eq!(
        tokio::task::spawn_blocking(move || wait_for_most(&held, "a", 1))
            .await
            .unwrap(),
        1
    );
    // a's execution is held: b can only be answered if a left it an instance.
    let answered = tokio::time::timeout(Duration::from_secs(60), call(&m, &b)).await;
    assert!(
        matches!(answered, Ok(Ok(Ok(_)))),
        "b waited behind a's flood"
    );
    release(&board);
    for r in flood {
        r.await.unwrap().unwrap();
    }
    assert_eq!(
        lock(&board.0).most["a"],
        1,
        "a ran beyond its part of 2 slots"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_alone_uses_every_instance() {
    let (a, _) = tenants();
    let (m, board) = model(ExecutionShare::with_window(2, Duration::from_secs(3600)));
    let flood: Vec<_> = (0..6).map(|_| call(&m, &a)).collect();
    let held = board.clone();
    let most = tokio::task::spawn_blocking(move || wait_for_most(&held, "a", 3))
        .await
        .unwrap();
    release(&board);
    for r in flood {
        r.await.unwrap().unwrap();
    }
    assert_eq!(most, 3, "alone, a is not held to a part");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_sharing_one_resource_never_run_at_once() {
    use crate::scheduling::rate_limiter::RateLimiter;
    let (_, b) = tenants();
    let limiter = Arc::new(RateLimiter::new(&["R:1".into()]).unwrap());
    let config = crate::repository::config::parse_text(
        "name: \"m\"\ninstance_group [ { count: 3, kind: KIND_CPU, rate_limiter { \
         resources [ { name: \"R\", count: 1 } ] } } ]\n",
        std::path::Path::new("m"),
    )
    .unwrap();
    let board: Board = Default::default();
    let share = Arc::new(ExecutionShare::new(0));
    let models: Vec<_> = (0..2)
        .map(|_| {
            let claims = limiter.claims(&config, 3).unwrap();
            model_on(&board, share.clone(), claims)
        })
        .collect();
    let calls: Vec<_> = (0..12).map(|i| call(&models[i % 2], &b)).collect();
    for c in calls {
        c.await.unwrap().unwrap();
    }
    // Six instances with work, one resource: one execution at a time.
    assert_eq!(lock(&board.0).most["b"], 1);
}

#[test]
fn answers_leave_in_arrival_order() {
    let mut r = Reorder::default();
    assert!(r.release(1, "b").is_empty(), "waits for request 0");
    assert!(r.release(2, "c").is_empty());
    assert_eq!(r.release(0, "a"), ["a", "b", "c"]);
    assert_eq!(r.release(3, "d"), ["d"]);
}
