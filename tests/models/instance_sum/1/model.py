import random

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Adds each request's INPUT to its sequence's sum, kept in this instance only."""

    def initialize(self, args):
        self.sums = {}
        self.token = random.getrandbits(62)

    def execute(self, requests):
        responses = []
        for request in requests:
            start = int(pb_utils.get_input_tensor_by_name(request, "START").as_numpy().flat[0])
            corrid = int(pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy().flat[0])
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy().flat[0])
            if start:
                self.sums[corrid] = 0
            self.sums[corrid] = self.sums.get(corrid, 0) + value
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[self.sums[corrid]]], dtype=np.int32)),
                pb_utils.Tensor("INSTANCE", np.array([[self.token]], dtype=np.int64)),
            ]))
        return responses
