import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Counts the requests this interpreter has seen: state lives as long as the instance."""

    def initialize(self, args):
        self.seen = 0

    def execute(self, requests):
        out = []
        for _ in requests:
            self.seen += 1
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("SEEN", np.array([self.seen], dtype=np.int64))]))
        return out
