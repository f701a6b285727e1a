"""Exits the interpreter when asked (as a model that calls os._exit or dies in a native
library would); a replacement's initialize waits while the test holds it ("hold" in the
model's folder, until "go" appears)."""
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        folder = args["model_repository"]
        if os.path.exists(os.path.join(folder, "hold")):
            waited = 0.0
            # Within initialize's deadline (execution_timeout_ms, 30 s for Python models).
            while not os.path.exists(os.path.join(folder, "go")) and waited < 25:
                time.sleep(0.05)
                waited += 0.05

    def execute(self, requests):
        responses = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().flat[0]
            if mode == b"exit":
                os._exit(3)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OK", np.array([1], np.int32))]))
        return responses
