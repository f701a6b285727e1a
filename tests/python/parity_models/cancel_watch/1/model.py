import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Waits up to SECONDS for its request to be cancelled, logging what it sees."""

    def execute(self, requests):
        responses = []
        for request in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(request, "SECONDS").as_numpy().flat[0])
            pb_utils.Logger.log_info("[cancel_watch] waiting")
            deadline = time.time() + seconds
            while time.time() < deadline and not request.is_cancelled():
                time.sleep(0.05)
            if request.is_cancelled():
                pb_utils.Logger.log_info("[cancel_watch] saw the cancellation")
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("cancelled", pb_utils.TritonError.CANCELLED)))
            else:
                pb_utils.Logger.log_info("[cancel_watch] never cancelled")
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("never cancelled")))
        return responses
