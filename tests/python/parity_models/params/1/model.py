import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers with the parameters its PARAMS input holds (a JSON object), and tells what
    parameters its request carried; in decoupled mode through its response sender."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "PARAMS").as_numpy().flat[0]
            seen = np.array([request.parameters().encode()], dtype=np.object_)
            try:
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("SEEN", seen)],
                    parameters=json.loads(text))
            except Exception as e:  # a parameter value pb_utils refuses
                response = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("%s: %s" % (type(e).__name__, e)))
            if self.decoupled:
                request.get_response_sender().send(
                    response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(response)
        return None if self.decoupled else responses
