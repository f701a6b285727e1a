import numpy as np
import triton_python_backend_utils as pb_utils


def checks(request):
    """(what, call, exception expected) for arguments of the wrong type or value."""
    x = pb_utils.Tensor("X", np.zeros(1, np.float32))
    build = pb_utils.InferenceRequest
    return [
        ("model_name None", lambda: build(model_name=None, inputs=[x]), TypeError),
        ("model_name a number", lambda: build(model_name=3, inputs=[x]), TypeError),
        ("outputs a string", lambda: build(model_name="m", inputs=[x],
                                           requested_output_names="Y"), TypeError),
        ("inputs not tensors", lambda: build(model_name="m", inputs=[1]), TypeError),
        ("flags a string", lambda: build(model_name="m", inputs=[x], flags="0"), TypeError),
        ("timeout a float", lambda: build(model_name="m", inputs=[x], timeout=1.5), TypeError),
        ("request parameter a float", lambda: build(model_name="m", inputs=[x],
                                                    parameters={"p": 1.5}),
         pb_utils.TritonModelException),
        ("request parameters a list", lambda: build(model_name="m", inputs=[x],
                                                    parameters=[1]),
         pb_utils.TritonModelException),
        ("response parameter nested", lambda: pb_utils.InferenceResponse(
            output_tensors=[x], parameters={"p": {"q": 1}}), pb_utils.TritonModelException),
        ("tensor of None", lambda: pb_utils.Tensor("X", None), TypeError),
        ("release flags a string", lambda: request.set_release_flags("0"), TypeError),
        ("log level a string", lambda: pb_utils.Logger.log("x", "INFO"), TypeError),
    ]


class TritonPythonModel:
    """Calls pb_utils with arguments of the wrong type; answers the checks that did not raise
    what Triton's bindings raise (none: all held)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            wrong = []
            for what, call, expected in checks(request):
                try:
                    call()
                    wrong.append(what + ": accepted")
                except expected:
                    pass
                except Exception as e:
                    wrong.append("%s: %s" % (what, type(e).__name__))
            text = np.array(["; ".join(wrong).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("WRONG", text)]))
        return responses
