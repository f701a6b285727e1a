"""Imports a package the sandbox does not have, from the model's own packed environment."""
import idna
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            names = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()
            ascii_names = [idna.encode(n.decode()) for n in names]
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("ASCII", np.array(ascii_names, dtype=np.object_))]))
        return responses
