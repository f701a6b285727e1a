import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: for N, N responses each holding N, sent from a thread after execute
    returns, then the final flag alone (for 0 only the final flag)."""

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().flat[0])
            threading.Thread(target=self.send, args=(request.get_response_sender(), n)).start()
        return None

    def send(self, sender, n):
        for _ in range(n):
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([n], np.int32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
