import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

import helper


def attempt(fn):
    try:
        return "ok: %s" % (fn(),)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return "refused: %s" % type(e).__name__


class TritonPythonModel:
    def initialize(self, args):
        self.args = args

    def answer(self, what):
        if what == "args":
            return json.dumps(self.args)
        if what == "helper":
            return helper.GREETING
        if what == "own_file":
            path = os.path.join(self.args["model_repository"], self.args["model_version"],
                                "labels.txt")
            with open(path) as f:
                return f.read().strip()
        if what == "etc_passwd":
            return attempt(lambda: open("/etc/passwd").read())
        if what == "write":
            path = os.path.join(self.args["model_repository"], "new.txt")
            return attempt(lambda: open(path, "w").write("x"))
        if what == "socket":
            import socket
            return attempt(lambda: socket.create_connection(("127.0.0.1", 80), timeout=1))
        if what == "environ":
            return json.dumps(dict(os.environ))
        if what == "spin":
            while True:
                pass
        if what == "dlpack":
            t = pb_utils.Tensor("x", np.arange(3, dtype=np.float32))
            back = pb_utils.Tensor.from_dlpack("y", t.to_dlpack())
            again = pb_utils.Tensor.from_dlpack("z", t)
            return "%s %s %s" % (back.name(), back.as_numpy().tolist(), again.as_numpy().tolist())
        if what == "hog":
            hoard = [np.ones(2**27, dtype=np.uint8) for _ in range(16)]  # 2 GiB in all
            return str(len(hoard))
        if what == "nap":
            import time
            start = time.monotonic()
            time.sleep(0.2)
            return "%.3f" % (time.monotonic() - start)
        if what == "sleep":
            import time
            time.sleep(3600)
        if what == "select":
            import select
            select.select([], [], [], 3600)
        if what == "pool":
            # A thread pool, as models use one for parallel BLS calls.
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(max_workers=4) as pool:
                squares = list(pool.map(lambda i: i * i, range(5)))
                total = pool.submit(sum, squares).result(timeout=5)
            return "%s %d" % (squares, total)
        if what == "to_thread":
            import asyncio
            return str(asyncio.run(asyncio.to_thread(lambda: 6 * 7)))
        if what == "producer":
            import queue
            import threading
            q = queue.Queue(maxsize=8)
            producer = threading.Thread(target=lambda: [q.put(i) for i in range(3)])
            producer.start()
            return str([q.get(timeout=5) for _ in range(3)])
        if what == "event_timeout":
            import threading
            return str(threading.Event().wait(0.05))
        if what in ("lock_timed", "lock_twice"):
            import threading
            lock = threading.Lock()
            lock.acquire()
            answers = [lock.acquire(False), lock.acquire(timeout=0.05), lock.locked()]
            with threading.Lock() as other:
                answers.append(other)
            lock.release()
            answers.append(lock.acquire(timeout=0.05))
            if what == "lock_twice":
                lock.acquire()
            return str(answers)
        if what == "wait_forever":
            import threading
            threading.Event().wait()
            return "woken"
        if what == "torch":
            try:
                import torch  # noqa: F401
            except ImportError as e:
                return str(e)
            return "imported"
        raise pb_utils.TritonModelException("unknown question %r" % what)

    def execute(self, requests):
        out = []
        for request in requests:
            what = pb_utils.get_input_tensor_by_name(request, "WHAT").as_numpy()[0].decode()
            answer = np.array([self.answer(what).encode()], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("ANSWER", answer)]))
        return out
