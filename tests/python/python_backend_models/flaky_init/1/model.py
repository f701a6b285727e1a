import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        x = pb_utils.Tensor("X", np.array([1], dtype=np.int32))
        # The server loads models side by side: the counter may not be there yet.
        for _ in range(80):
            response = pb_utils.InferenceRequest(
                model_name="counter_for_flaky", inputs=[x], requested_output_names=["SEEN"]).exec()
            if not response.has_error():
                break
            time.sleep(0.1)
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        seen = int(pb_utils.get_output_tensor_by_name(response, "SEEN").as_numpy()[0])
        if seen > 1:
            raise RuntimeError("cannot start again (start %d)" % seen)

    def execute(self, requests):
        out = []
        for request in requests:
            what = pb_utils.get_input_tensor_by_name(request, "WHAT").as_numpy()[0]
            if what == b"spin":
                while True:
                    pass
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ANSWER", np.array([b"fine"], dtype=np.object_))]))
        return out
