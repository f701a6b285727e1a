import numpy as np
import triton_python_backend_utils as pb_utils


def scalar(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().flat[0])


class TritonPythonModel:
    """Adds each request's INPUT to its sequence's sum and says how its batch looked."""

    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        fillers = sum(1 for r in requests if not scalar(r, "READY"))
        responses = []
        for request in requests:
            corrid = scalar(request, "CORRID")
            if scalar(request, "READY"):
                if scalar(request, "START"):
                    self.sums[corrid] = 0
                self.sums[corrid] = self.sums.get(corrid, 0) + scalar(request, "INPUT")
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[self.sums.get(corrid, 0)]], dtype=np.int32)),
                pb_utils.Tensor("ROWS", np.array([[len(requests)]], dtype=np.int32)),
                pb_utils.Tensor("FILLERS", np.array([[fillers]], dtype=np.int32)),
            ]))
        return responses
