"""The guest half of Wasmtron's Python backend: loads a Triton `model.py`, runs its
`initialize`, `execute` and `finalize`, and talks to the host through `_host.call`.

Run once per interpreter after `triton_python_backend_utils` is registered; the host then
drives it with one-line turns (`_wasmtron.load(...)`, then `_wasmtron.serve()`, whose loop
takes each batch from the host).
"""

import asyncio
import concurrent.futures
import concurrent.futures.thread
import contextvars
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import selectors
import sys
import threading
import time
import traceback

import _host
import triton_python_backend_utils as pb


# --- NumPy 1's names ---------------------------------------------------------------------------
# The sandbox's NumPy is 2.x, which removed names that models written for NumPy 1 use (Triton's
# own QA model nan_inf_output uses np.NINF). Each comes back as the NumPy 2 spelling of the same
# thing, before any model is imported, so such a model runs unchanged; a model written for
# NumPy 2 never used them. Only names NumPy no longer has are set.

def _numpy1_names(np):
    names = {
        # constants
        "NINF": -np.inf, "PINF": np.inf, "NZERO": -0.0, "PZERO": 0.0, "Inf": np.inf,
        "Infinity": np.inf, "infty": np.inf, "NaN": np.nan,
        # scalar types
        "float_": np.float64, "complex_": np.complex128, "cfloat": np.complex128,
        "singlecomplex": np.complex64, "longfloat": np.longdouble,
        "longcomplex": np.clongdouble, "clongfloat": np.clongdouble, "string_": np.bytes_,
        "unicode_": np.str_, "bool8": np.bool_, "int0": np.intp, "uint0": np.uintp,
        "object0": np.object_, "bytes0": np.bytes_, "str0": np.str_, "void0": np.void,
        # functions
        "round_": np.round, "alltrue": np.all, "sometrue": np.any, "product": np.prod,
        "cumproduct": np.cumprod, "issubclass_": issubclass, "mat": np.asmatrix,
        "row_stack": np.vstack, "trapz": getattr(np, "trapezoid", None),
        "in1d": lambda ar1, ar2, assume_unique=False, invert=False, **kw: np.isin(
            np.ravel(ar1), ar2, assume_unique=assume_unique, invert=invert, **kw),
        "asfarray": lambda a, dtype=np.float64: np.asarray(
            a, dtype=dtype if np.issubdtype(np.dtype(dtype), np.inexact) else np.float64),
    }
    for name, value in names.items():
        if value is not None and name not in np.__dict__:
            setattr(np, name, value)


_numpy1_names(pb._np)


class _LogStream:
    """`print` and `sys.stderr` of a model go to the server's log, a line at a time."""

    def __init__(self, level):
        self._level = level
        self._buffer = ""

    def write(self, text):
        self._buffer += text
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            if line:
                pb._log(self._level, line)
        return len(text)

    def flush(self):
        if self._buffer:
            pb._log(self._level, self._buffer)
            self._buffer = ""

    def isatty(self):
        return False


sys.stdout = _LogStream(0)
sys.stderr = _LogStream(2)


# --- modules the sandbox's interpreter does not have, refused with the way around ----------

_FRAMEWORKS = {
    "torch": "PyTorch", "torchvision": "PyTorch", "tensorflow": "TensorFlow",
    "onnxruntime": "ONNX Runtime", "tokenizers": "tokenizers", "transformers": "transformers",
    "cv2": "OpenCV", "cupy": "CuPy", "tensorrt": "TensorRT", "jax": "JAX",
}


class _RefuseFrameworks:
    """Last on `sys.meta_path`: reached only for a module no other finder has."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        what = _FRAMEWORKS.get(top)
        if what is None:
            return None
        raise ModuleNotFoundError(
            "No module named %r: Wasmtron runs model.py in a WebAssembly sandbox whose "
            "interpreter has the standard library, numpy, scipy, pandas, Pillow and "
            "scikit-learn, not %s. Serve the network as an ONNX model and call it from "
            "model.py with pb_utils.InferenceRequest(...).exec() (BLS), or write the step as "
            "a Rust stage; --python-runtime names another interpreter build." % (top, what),
            name=name)


sys.meta_path.append(_RefuseFrameworks())


# --- asyncio without sockets: `async def execute` and `async_exec` under `asyncio.gather` --

class _IdleSelector(selectors.BaseSelector):
    """A selector with no files: waiting is sleeping (the host answers calls when asked)."""

    def register(self, fileobj, events, data=None):
        raise OSError("the Python backend's event loop has no sockets or pipes")

    def unregister(self, fileobj):
        raise KeyError(fileobj)

    def select(self, timeout=None):
        if _wasmtron.background:
            # The host waits for what the loop waits for: a batch, an awaited call's answer,
            # the next timer.
            ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
            _wasmtron.events(_host.call(b"E" + str(ms).encode()))
            return []
        if timeout:
            time.sleep(min(timeout, 1.0))
        return []

    def close(self):
        pass

    def get_map(self):
        return {}


class _Loop(asyncio.SelectorEventLoop):
    def __init__(self):
        super().__init__(_IdleSelector())

    def _make_self_pipe(self):
        pass

    def _close_self_pipe(self):
        pass

    def _write_to_self(self):
        pass

    async def shutdown_default_executor(self, timeout=None):
        # The default one shuts its executor down from a thread of its own.
        self._executor_shutdown_called = True
        if self._default_executor is not None:
            self._default_executor.shutdown(wait=True)


# `asyncio.run(...)` and `asyncio.new_event_loop()` in a model get this loop too (the default
# one needs a socket pair to wake itself, which the sandbox does not have).
asyncio.events.new_event_loop = _Loop
asyncio.new_event_loop = _Loop

_loop = None


def _run(awaitable):
    global _loop
    if _loop is None:
        _loop = _Loop()
        asyncio.set_event_loop(_loop)
    return _loop.run_until_complete(awaitable)


# --- threads, run cooperatively: the sandbox has one thread ---------------------------------
# A thread a model starts (Triton's decoupled examples send responses from one) runs when
# it is joined, or else when `execute` returns, before the batch ends.

_deferred = []


def _thread_start(self):
    if getattr(self, "_wasmtron_state", None) is not None:
        raise RuntimeError("threads can only be started once")
    self._wasmtron_state = "pending"
    _deferred.append(self)


def _thread_run(thread):
    if getattr(thread, "_wasmtron_state", None) != "pending":
        return
    thread._wasmtron_state = "running"
    try:
        thread.run()
    except BaseException:
        pb._log(2, "exception in thread %s:\n%s" % (thread.name, traceback.format_exc()))
    finally:
        thread._wasmtron_state = "done"


def _thread_join(self, timeout=None):
    state = getattr(self, "_wasmtron_state", None)
    if state is None:
        raise RuntimeError("cannot join thread before it is started")
    if state == "pending":
        _deferred.remove(self)
        _thread_run(self)


def _thread_is_alive(self):
    return getattr(self, "_wasmtron_state", None) in ("pending", "running")


def _condition_wait(self, timeout=None):
    """`Condition.wait` with one thread (under `Event.wait`, `Queue.get`/`put`, `Semaphore`):
    the threads the model started and that have not run yet run now, as they are the only ones
    that could notify; if none did, a wait with a timeout sleeps it out and one without fails
    with the reason instead of waiting forever."""
    if not self._is_owned():
        raise RuntimeError("cannot wait on un-acquired lock")
    waiter = threading._allocate_lock()
    waiter.acquire()
    self._waiters.append(waiter)
    saved = self._release_save()
    notified = False
    try:
        while _deferred and not notified:
            _thread_run(_deferred.pop(0))
            notified = waiter.acquire(False)
        if not notified:
            if timeout is None:
                raise RuntimeError(
                    "waiting without a timeout for another thread to notify, but every thread "
                    "this model started has run: Wasmtron runs model.py with one thread, "
                    "threads running when joined or when execute returns")
            if timeout > 0:
                time.sleep(timeout)
        return notified
    finally:
        self._acquire_restore(saved)
        if not notified:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass


class _Lock:
    """`threading.Lock` with one thread: a lock already held can only be released by the code
    that holds it, which waits; so a blocking acquire fails with the reason (the interpreter's
    own lock would trap), one with a timeout sleeps it out and answers False, and a
    non-blocking one answers False at once, as they would if no other thread released it."""

    def __init__(self):
        self._lock = threading._allocate_lock()

    def acquire(self, blocking=True, timeout=-1):
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        if timeout is None or timeout < 0:
            raise RuntimeError(
                "acquiring a lock that is already held, without a timeout, would wait forever: "
                "Wasmtron runs model.py with one thread, so nothing else can release it")
        if timeout > 0:
            time.sleep(timeout)
        return self._lock.acquire(False)

    def release(self):
        self._lock.release()

    def locked(self):
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()

    def __repr__(self):
        return "<%s %s object>" % ("locked" if self.locked() else "unlocked",
                                   type(self).__name__)


threading.Thread.start = _thread_start
threading.Thread.join = _thread_join
threading.Thread.is_alive = _thread_is_alive
threading.Condition.wait = _condition_wait
threading.Lock = _Lock


class _InlineExecutor(concurrent.futures.Executor):
    """`concurrent.futures.ThreadPoolExecutor` in the sandbox: each piece of work runs when
    it is submitted, so `submit(...).result()`, `map` and asyncio's `run_in_executor` /
    `to_thread` give their answers (a pool's threads could never run beside the waiting one)."""

    def __init__(self, max_workers=None, thread_name_prefix="", initializer=None, initargs=()):
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        self._initializer = initializer
        self._initargs = initargs
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs):
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if self._initializer is not None:
            initializer, self._initializer = self._initializer, None
            initializer(*self._initargs)
        future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            future.set_exception(e)
        else:
            future.set_result(result)
        return future

    def shutdown(self, wait=True, *, cancel_futures=False):
        self._shutdown = True


concurrent.futures.ThreadPoolExecutor = _InlineExecutor
concurrent.futures.thread.ThreadPoolExecutor = _InlineExecutor


def _drain():
    """Runs what the model left to run: threads it started, then asyncio tasks it created
    (an `async def execute` that answers from a background task)."""
    while True:
        if _deferred:
            _thread_run(_deferred.pop(0))
            continue
        if _loop is not None:
            pending = [t for t in asyncio.all_tasks(_loop) if not t.done()]
            if pending:
                _loop.run_until_complete(asyncio.wait(pending))
                continue
        return


def _open_descriptors():
    """The file descriptors open past stdin, stdout and stderr (the folders the host opened
    among them), counted up to the first gap of 16."""
    count, gap, fd = 0, 0, 3
    while gap < 16:
        try:
            os.fstat(fd)
            count, gap = count + 1, 0
        except OSError:
            gap += 1
        fd += 1
    return count


def _failure(e):
    """An exception as Triton's Python backend reports it: type, message and where."""
    text = "%s: %s" % (type(e).__name__, e) if not isinstance(e, pb.TritonModelException) else str(e)
    frames = traceback.extract_tb(e.__traceback__)
    where = [f for f in frames if not f.filename.startswith("<")]
    if where:
        text += "\n\nAt:\n" + "\n".join(
            "  %s(%d): %s" % (f.filename, f.lineno, f.name) for f in reversed(where[-5:]))
    return text


# --- background mode: a decoupled `async def execute`, batches overlapping ------------------
# Each batch's coroutine runs as a task whose context names its batch; what it asks of the
# host reaches that batch's door (the host is told the batch first when it changes).

_batch_var = contextvars.ContextVar("wasmtron_batch", default=None)


class _HostCalls:
    """`_host` as pb_utils sees it in background mode."""

    def call(self, frame):
        return _wasmtron.call_for(_batch_var.get(), frame)


class _BatchState:
    def __init__(self):
        self.senders = {}


_RESCHEDULE = pb.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE


def _rescheduled(request):
    return request._release_flags == _RESCHEDULE


class _Backend:
    def __init__(self):
        self.args = {}
        self.model_config = {}
        self.decoupled = False
        self.senders = {}
        self.returned = None  # what the current batch's execute returned, once it has
        self.model = None
        # Background mode (a decoupled `async def execute`): batches overlap as tasks.
        self.background = False
        self._selected = None
        self._states = {}
        self._closing = False
        self._wakeup = None
        self._call_waiters = []
        self._tasks = {}  # batch -> its task
        # The model's own packages (EXECUTION_ENV_PATH), set by the host when it has some.
        self.packages = None
        # The model's class, once `prepare` imported model.py.
        self.cls = None

    def call_for(self, batch, frame):
        """A host call for `batch` (`None`: outside the background mode)."""
        if batch is not None and batch != self._selected:
            _host.call(b"B" + str(batch).encode())
            self._selected = batch
        return _host.call(frame)

    def _fail(self, e):
        _host.call(b"F" + _failure(e).encode("utf-8", "replace"))

    def _use_packages(self):
        """The model's own packages on sys.path, after the sandbox's: a package the sandbox
        has (numpy, Pillow, ...) is the sandbox's; one only the environment has must be
        Python, and one holding a native extension module is refused here, at load."""
        folder, self.packages = self.packages, None
        if folder is None or folder in sys.path:
            return
        native = (".so", ".pyd", ".dylib")
        for entry in sorted(os.listdir(folder)):
            top = entry.split(".")[0].split("-")[0]
            if not top.isidentifier() or entry.endswith((".dist-info", ".egg-info", ".pth")):
                continue
            if importlib.util.find_spec(top) is not None:
                continue  # the sandbox's own (or the standard library's), which wins
            path = os.path.join(folder, entry)
            found = [path] if os.path.isfile(path) else sorted(
                os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
            for file in found:
                if file.endswith(native) or ".so." in os.path.basename(file):
                    relative = os.path.relpath(file, folder)
                    module = relative.split(".")[0].replace(os.sep, ".")
                    raise pb.TritonModelException(
                        "EXECUTION_ENV_PATH: package '%s' holds the native extension module "
                        "'%s' (%s), which cannot run in the sandbox: only pure-Python "
                        "packages are importable here (the sandbox has its own numpy, scipy, "
                        "pandas, Pillow and scikit-learn)" % (top, module, relative))
        sys.path.append(folder)

    def _model_class(self, model_file, version_dir):
        self._use_packages()
        # As Triton's stub does: the version folder and the model folder on the path, and
        # the file imported as `<version>.<stem>` so that both `import helper` and
        # `from . import helper` find modules beside model.py.
        model_dir = os.path.dirname(version_dir)
        for folder in (model_dir, version_dir):
            if folder not in sys.path:
                sys.path.insert(0, folder)
        version = os.path.basename(version_dir)
        stem = os.path.splitext(os.path.basename(model_file))[0]
        package = importlib.util.module_from_spec(
            importlib.machinery.ModuleSpec(version, None, is_package=True))
        package.__path__ = [version_dir]
        sys.modules[version] = package
        name = "%s.%s" % (version, stem)
        spec = importlib.util.spec_from_file_location(name, model_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.modules["model"] = module
        spec.loader.exec_module(module)
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise pb.TritonModelException("%s defines no class TritonPythonModel" % model_file)
        return cls

    def auto_complete(self, config_json, model_file, version_dir):
        """Runs the model's static `auto_complete_config`, if it has one, on the
        configuration; sends back what it returns."""
        try:
            cls = self._model_class(model_file, version_dir)
            config = pb.ModelConfig(config_json)
            complete = getattr(cls, "auto_complete_config", None)
            if complete is not None:
                returned = complete(config)
                config = returned if returned is not None else config
                if not isinstance(config, pb.ModelConfig):
                    raise pb.TritonModelException(
                        "auto_complete_config must return the config it was given")
            _host.call(b"K" + json.dumps(config.as_dict()).encode())
        except BaseException as e:
            self._fail(e)

    def prepare(self, model_file, version_dir):
        """Imports model.py, and what it imports, before any instance's `initialize`: the
        state every instance of the model starts from (the host keeps a snapshot of it).
        Says how many files are open beyond the folders the host opened: a snapshot of an
        interpreter holding one would not hold the file."""
        try:
            self.cls = self._model_class(model_file, version_dir)
            _host.call(b"K" + json.dumps({"descriptors": _open_descriptors()}).encode())
        except BaseException as e:
            self._fail(e)

    def reseed(self):
        """After a start from the snapshot: the random generators the import seeded get
        seeds of this instance's own, as in a process of its own."""
        for name in ("random", "numpy.random"):
            module = sys.modules.get(name)
            if module is not None:
                module.seed()

    def load(self, args_json, model_file, version_dir):
        try:
            self.args = json.loads(args_json)
            self.model_config = json.loads(self.args["model_config"])
            self.decoupled = pb.using_decoupled_model_transaction_policy(self.model_config)
            cls = self.cls or self._model_class(model_file, version_dir)
            self.model = cls()
            init = getattr(self.model, "initialize", None)
            if init is not None:
                result = init(self.args)
                if inspect.isawaitable(result):
                    _run(result)
            _drain()
            said = {}
            # Readiness checks run the model's own `is_ready()` only when it defines one.
            if callable(getattr(self.model, "is_ready", None)):
                said["is_ready"] = True
            # As Triton's stub: a decoupled model's coroutine runs in the background, and the
            # instance takes the next batch while it awaits.
            if self.decoupled and inspect.iscoroutinefunction(
                    getattr(self.model, "execute", None)):
                said["background"] = True
                self.background = True
                pb._host = _HostCalls()
            if said:
                _host.call(b"K" + json.dumps(said).encode())
        except BaseException as e:
            self._fail(e)

    async def _readiness(self):
        """`is_ready()` (plain or `async def`) for a readiness check: only `True` is ready;
        another value or an exception is logged and not ready, as on Triton."""
        name = self.args.get("model_name")
        try:
            result = self.model.is_ready()
            if inspect.isawaitable(result):
                result = await result
        except BaseException as e:
            pb._log(2, "is_ready() of model '%s' raised: %s" % (name, _failure(e)))
            return False
        if isinstance(result, bool):
            return result
        pb._log(2, "is_ready() of model '%s' returned %s, not a bool: the model is "
                   "reported not ready" % (name, type(result).__name__))
        return False

    def check_ready(self):
        """A readiness check between batches."""
        ready = _run(self._readiness())
        _drain()
        _host.call(pb._Writer().finish({"ready": ready}, b"R"))

    def serve(self):
        """Runs batches as the host hands them over, until it hands over none."""
        while True:
            frame = _host.call(b"N")
            if not frame:
                break
            self.execute(frame)
        self.finalize()

    def sender(self, index, batch=None):
        """The response sender of request `index` of the batch (one per request)."""
        if batch is not None:
            state = self._states.get(batch)
            if state is None:
                raise pb.TritonModelException(
                    "Unable to get response sender: the request's batch has ended")
            sender = state.senders.get(index)
            if sender is None:
                sender = state.senders[index] = pb.InferenceResponseSender(index, batch)
            return sender
        sender = self.senders.get(index)
        if sender is None:
            sender = self.senders[index] = pb.InferenceResponseSender(index)
            if self.returned is not None and self.returned[index] is not None:
                sender._count(self.returned[index], pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return sender

    def _returned(self, result, requests):
        """What `execute` returned, checked as Triton checks it: None, or (default mode
        only) a list of one InferenceResponse or None per request (None for a request
        released for rescheduling)."""
        n = len(requests)
        if result is None:
            return [None] * n
        # Triton names the instance (`<model>_0_0`) in these messages.
        name = self.args.get("model_instance_name") or self.args.get("model_name")
        if self.decoupled:
            raise pb.TritonModelException(
                "Python model '%s' is using the decoupled mode and the execute function "
                "must return None." % name)
        if not isinstance(result, (list, tuple)):
            raise pb.TritonModelException(
                "Expected a list in the execute return, found type '%s'."
                % type(result).__name__)
        if len(result) != n:
            raise pb.TritonModelException(
                "Number of InferenceResponse objects do not match the number of "
                "InferenceRequest objects. InferenceRequest(s) size is:%d, and "
                "InferenceResponse(s) size is:%d" % (n, len(result)))
        response_type = pb.InferenceResponse
        for r, request in zip(result, requests):
            if r is None or (type(r) is response_type
                             and request._release_flags != _RESCHEDULE):
                continue  # the usual case, decided in one test
            if _rescheduled(request):
                raise pb.TritonModelException(
                    "Expected a None object in the execute function return list for "
                    "reschduled request, found type '%s'." % type(r))
            if not isinstance(r, pb.InferenceResponse):
                raise pb.TritonModelException(
                    "Expected an 'InferenceResponse' object in the execute function return "
                    "list, found type '%s'." % type(r).__name__)
        # A returned response is sent at once, final: the request's sender closes with it
        # (one the model takes later, from a thread, starts closed: see `sender`).
        self.returned = result
        for i, sender in self.senders.items():
            if result[i] is not None:
                sender._count(result[i], pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return list(result)

    def _answer(self, w, i, returned, error, finished):
        """Request `i`'s entry in the responses frame; `finished`: its sender had sent the
        final flag when execute ended."""
        sender = self.senders.get(i)
        if self.decoupled:
            if error is not None and not finished:
                return {"error": error}
            return None
        if sender is not None and sender._response is not None:
            return w.response(sender._response)
        if error is not None:
            return {"error": error}
        if returned[i] is not None:
            return w.response(returned[i])
        return {"error": {
            "message": "Python model '%s' answered request %d with no response: execute "
                       "returned None for it and its response sender sent none"
                       % (self.args.get("model_name"), i),
            "code": "INTERNAL"}}

    def execute(self, frame):
        header, blob = pb._read_frame(frame)
        if header.get("probe"):
            return self.check_ready()
        requests = []
        name = self.args.get("model_name")
        tensor, received = pb._tensor_from, pb.InferenceRequest._received
        for i, r in enumerate(header["requests"]):
            # Parameters as the client sent them (numbers with a fraction too).
            requests.append(received(
                name, [tensor(t, blob) for t in r["inputs"]], r["outputs"],
                r.get("correlation_id", 0), r.get("id", ""), r.get("flags", 0),
                r.get("parameters") or {}, i))
        self.senders = {}
        self.returned = None
        n = len(requests)
        returned = [None] * n
        error = None
        try:
            result = self.model.execute(requests)
            # Most models return a list: no coroutine to look for then.
            if type(result) is not list and inspect.isawaitable(result):
                result = _run(result)
            returned = self._returned(result, requests)
        except BaseException as e:
            # Triton's wording, which clients match on.
            message = "Failed to process the request(s) for model '%s', message: %s" % (
                self.args.get("model_name"), _failure(e))
            # Logged too, as Triton does: a decoupled model's requests may have been answered
            # already, and then the log is the only place the error shows.
            pb._log(2, message)
            error = {"message": message, "code": "INTERNAL"}
        # Threads and tasks the model left running send their responses before the batch
        # ends; a sender closes with an error once execute failed.
        finished = {i for i, sender in self.senders.items() if sender._closed}
        if error is not None:
            for i in range(n):
                self.sender(i)._closed = True
        _drain()
        try:
            w = pb._Writer()
            if error is None and not self.senders and not self.decoupled:
                # The usual batch: each answer is what execute returned for its request
                # (`_answer`'s outcome for this case, without its per-request calls).
                responses = [{"reschedule": True} if r._release_flags == _RESCHEDULE
                             else w.response(returned[i]) if returned[i] is not None
                             else self._answer(w, i, returned, error, False)
                             for i, r in enumerate(requests)]
            else:
                responses = [{"reschedule": True} if error is None and _rescheduled(requests[i])
                             else self._answer(w, i, returned, error, i in finished)
                             for i in range(n)]
        except BaseException as e:
            w = pb._Writer()
            failed = {"error": {"message": _failure(e), "code": "INTERNAL"}}
            responses = [failed] * n
        _host.call(w.finish({"responses": responses}, b"R"))

    # --- background mode ---------------------------------------------------------------

    def serve_background(self):
        """Takes batches as the host hands them over and runs each as a task, until the
        host says the loop ends; then `finalize()`."""
        _run(self._serve_background())
        self._selected = None
        self.finalize()

    async def _serve_background(self):
        loop = asyncio.get_running_loop()
        tasks = self._tasks
        while not self._closing:
            while True:
                frame = _host.call(b"N")
                if not frame:
                    break
                batch = int.from_bytes(bytes(frame[:8]), "little")
                task = self._start_batch(loop, batch, frame)
                tasks[batch] = task
                task.add_done_callback(lambda _, batch=batch: tasks.pop(batch, None))
            if self._closing:
                break
            self._wakeup = loop.create_future()
            await self._wakeup
        # The instance closes: batches still running are cancelled.
        running = list(tasks.values())
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    def events(self, data):
        """What the host's wait ended with: batches to take, the loop to end, answers of
        awaited calls."""
        said = json.loads(bytes(data)) if data else {}
        if said.get("closing"):
            self._closing = True
        if (said.get("batches") or said.get("closing")) and self._wakeup is not None \
                and not self._wakeup.done():
            self._wakeup.set_result(None)
        for batch in said.get("cancel") or ():
            task = self._tasks.get(batch)
            if task is not None:
                task.cancel()
        if said.get("calls"):
            waiters, self._call_waiters = self._call_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    def call_event(self):
        """A future done when the host next says an awaited call has its answer."""
        waiter = asyncio.get_running_loop().create_future()
        self._call_waiters.append(waiter)
        return waiter

    def _start_batch(self, loop, batch, frame):
        header, blob = pb._read_frame(bytes(frame[8:]))
        context = contextvars.copy_context()
        context.run(_batch_var.set, batch)
        if header.get("probe"):
            return loop.create_task(self._probe(batch), context=context)
        name = self.args.get("model_name")
        tensor, received = pb._tensor_from, pb.InferenceRequest._received
        requests = []
        for i, r in enumerate(header["requests"]):
            request = received(
                name, [tensor(t, blob) for t in r["inputs"]], r["outputs"],
                r.get("correlation_id", 0), r.get("id", ""), r.get("flags", 0),
                r.get("parameters") or {}, i)
            request._batch = batch
            requests.append(request)
        self._states[batch] = _BatchState()
        return loop.create_task(self._run_batch(batch, requests), context=context)

    async def _run_batch(self, batch, requests):
        name = self.args.get("model_name")
        state = self._states[batch]
        error = None
        try:
            result = self.model.execute(requests)
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                raise pb.TritonModelException(
                    "Python model '%s' is using the decoupled mode and the execute function "
                    "must return None." % (self.args.get("model_instance_name") or name))
        except asyncio.CancelledError:
            error = "model '%s' is being unloaded: the request was cancelled" % name
        except BaseException as e:
            error = "Failed to process the request(s) for model '%s', message: %s" % (
                name, _failure(e))
            pb._log(2, error)
        finished = {i for i, sender in state.senders.items() if sender._closed}
        if error is not None:
            for i in range(len(requests)):
                self.sender(i, batch)._closed = True
        try:
            # Threads the model started, then tasks this batch created, end before it does.
            while _deferred:
                _thread_run(_deferred.pop(0))
            current = asyncio.current_task()
            mine = [t for t in asyncio.all_tasks() if t is not current and not t.done()
                    and t.get_context().get(_batch_var) == batch]
            if mine:
                await asyncio.wait(mine)
        except BaseException as e:
            pb._log(2, "model '%s': %s" % (name, _failure(e)))
        responses = [None if error is None or i in finished
                     else {"error": {"message": error, "code": "INTERNAL"}}
                     for i in range(len(requests))]
        del self._states[batch]
        self.call_for(batch, pb._Writer().finish({"responses": responses}, b"R"))

    async def _probe(self, batch):
        """A readiness check in background mode, as a task beside the batches."""
        ready = await self._readiness()
        self.call_for(batch, pb._Writer().finish({"ready": ready}, b"R"))

    def finalize(self):
        try:
            fin = getattr(self.model, "finalize", None)
            if fin is not None:
                result = fin()
                if inspect.isawaitable(result):
                    _run(result)
            _drain()
        except BaseException as e:
            self._fail(e)


_wasmtron = _Backend()
pb._backend = _wasmtron
