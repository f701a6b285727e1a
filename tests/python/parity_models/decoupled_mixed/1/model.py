import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(i):
    return pb_utils.InferenceResponse([pb_utils.Tensor("I", np.array([i], np.int32))])


class TritonPythonModel:
    """Decoupled, doing what MODE says with N:
    "errors": N responses, every second one an error; "raise": raises;
    "after_final": a response, the final flag, then tries to send once more (and logs why it
    could not); "until_cancelled": a response every 20 ms until the request is cancelled (at
    most N), then the final flag."""

    def execute(self, requests):
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().flat[0].decode()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().flat[0])
            sender = request.get_response_sender()
            if mode == "raise":
                raise pb_utils.TritonModelException("decoupled_mixed raised on purpose")
            if mode == "errors":
                for i in range(n):
                    sender.send(answer(i) if i % 2 == 0 else pb_utils.InferenceResponse(
                        error=pb_utils.TritonError("response %d is an error" % i)))
                sender.send(flags=FINAL)
            elif mode == "after_final":
                sender.send(answer(0), flags=FINAL)
                try:
                    sender.send(answer(1))
                    pb_utils.Logger.log_error("decoupled_mixed: sent after the final flag")
                except Exception as e:
                    pb_utils.Logger.log_info("decoupled_mixed: refused after final: %s" % e)
            elif mode == "until_cancelled":
                sent = 0
                while sent < n and not request.is_cancelled():
                    sender.send(answer(sent))
                    sent += 1
                    time.sleep(0.02)
                pb_utils.Logger.log_info("decoupled_mixed: stopped after %d, cancelled: %s"
                                         % (sent, request.is_cancelled()))
                sender.send(flags=FINAL)
        return None
