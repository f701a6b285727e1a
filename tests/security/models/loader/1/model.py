"""Loads the model the request describes with `pb_utils.load_model` and answers "loaded" or
the error the server gave."""
import numpy as np
import triton_python_backend_utils as pb_utils


def text(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0]


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = text(request, "NAME").decode()
            config = text(request, "CONFIG").decode()
            key = text(request, "FILE_KEY").decode()
            try:
                pb_utils.load_model(model_name=name, config=config,
                                    files={key: bytes(text(request, "FILE"))})
                answer = "loaded"
            except Exception as e:  # the server's refusal, as the model sees it
                answer = "refused: %s" % e
            out = pb_utils.Tensor("ANSWER", np.array([answer.encode()], dtype=np.object_))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
