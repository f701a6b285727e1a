import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x == 13).any():
                raise pb_utils.TritonModelException("13 is unlucky")
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)))
                continue
            # int64 where the config says TYPE_INT32: Triton passes the model's type through.
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("Y", (x * 2).astype(np.int64))]))
        return responses
