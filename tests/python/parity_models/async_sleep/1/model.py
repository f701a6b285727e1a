import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled, `async def execute`: sleeps the batch's largest WAIT_SECONDS without holding
    the instance, then answers each request with its rows and the most executions it saw
    running at once. A negative wait raises inside the coroutine."""

    def initialize(self, args):
        self.running = 0
        self.peak = 0

    async def execute(self, requests):
        waits = [pb_utils.get_input_tensor_by_name(r, "WAIT_SECONDS").as_numpy() for r in requests]
        wait = max(float(w.max()) for w in waits)
        if wait < 0:
            raise ValueError("async_sleep: a negative wait")
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(wait)
        finally:
            self.running -= 1
        for request, w in zip(requests, waits):
            out = [pb_utils.Tensor("DUMMY_OUT", np.zeros_like(w)),
                   pb_utils.Tensor("PEAK", np.array([self.peak], np.int32))]
            request.get_response_sender().send(
                pb_utils.InferenceResponse(out),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
