import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Default mode: releases each request to run again once, and answers it (X + 1 and the
    number of times this instance saw it) the second time."""

    def initialize(self, args):
        self.seen = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.request_id()
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] == 1:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            del self.seen[key]
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", x + 1), pb_utils.Tensor("RUNS", np.array([2], np.int32))]))
        return responses
