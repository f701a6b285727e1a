import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Calls `params` with its own request's parameters and PARAMS, and answers with the
    parameters of the response it got back and what `params` saw."""

    def execute(self, requests):
        responses = []
        for request in requests:
            params = pb_utils.get_input_tensor_by_name(request, "PARAMS")
            call = pb_utils.InferenceRequest(
                model_name="params", inputs=[params], requested_output_names=["SEEN"],
                parameters=json.loads(request.parameters()))
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
                continue
            seen = pb_utils.get_output_tensor_by_name(answer, "SEEN")
            got = np.array([answer.parameters().encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("SEEN", seen.as_numpy()),
                                pb_utils.Tensor("GOT", got)]))
        return responses
