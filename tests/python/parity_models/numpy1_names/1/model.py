"""A model written for NumPy 1: it spells things the way NumPy 2 removed (np.NINF, np.NaN,
np.float_, np.product, np.in1d, np.bool8), as models moved from an older Triton do."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            special = np.array([np.NaN, np.PINF, np.NINF, np.Inf], dtype=np.float_)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SPECIAL", special.astype(np.float32)),
                pb_utils.Tensor("PRODUCT", np.array([np.product(x)], np.float32)),
                pb_utils.Tensor("FOUND", np.in1d([1.0, 7.0], x).astype(np.bool8)),
            ]))
        return responses
