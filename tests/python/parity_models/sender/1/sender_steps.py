"""What `sender` does with one request, shared by its plain and its `async def` execute."""
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def number(request, name):
    return int(pb_utils.get_input_tensor_by_name(request, name).as_numpy().flat[0])


def answer(step):
    return pb_utils.InferenceResponse([pb_utils.Tensor("STEP", np.array([[step]], np.int32))])


def plan(request):
    """(responses sent before returning, final flag before, return one, sent after, final
    after), from the request's inputs."""
    return tuple(number(request, n) for n in ("BEFORE", "FINAL_BEFORE", "RETURN", "AFTER",
                                              "FINAL_AFTER"))


def later(sender, count, final):
    for i in range(count):
        sender.send(answer(300 + i))
    if final:
        sender.send(flags=FINAL)


def run(requests, decoupled):
    """Sends what each request's plan asks for; returns what execute returns."""
    returned, any_returned = [], False
    for request in requests:
        before, final_before, on_return, after, final_after = plan(request)
        sender = request.get_response_sender()
        for i in range(before):
            sender.send(answer(100 + i))
        if final_before:
            sender.send(flags=FINAL)
        returned.append(answer(200) if on_return else None)
        any_returned = any_returned or bool(on_return)
        if after or final_after:
            threading.Thread(target=later, args=(sender, after, final_after)).start()
    if decoupled and not any_returned:
        return None
    return returned
