import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A decoupled iterative sequence: for N it answers N, N-1, ..., 1, one per execution,
    releasing the request to be run again until it reaches 1 (Triton's request
    rescheduling). The count left rides on the request's id."""

    def initialize(self, args):
        self.left = {}

    def execute(self, requests):
        for request in requests:
            key = request.request_id()
            if key not in self.left:
                self.left[key] = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().flat[0])
            n = self.left[key]
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse(
                [pb_utils.Tensor("LEFT", np.array([n], dtype=np.int32))]))
            if n > 1:
                self.left[key] = n - 1
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                del self.left[key]
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
