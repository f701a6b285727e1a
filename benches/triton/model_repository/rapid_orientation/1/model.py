"""Runs model.onnx (beside this file) with onnxruntime, one session per instance."""
import os

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(os.path.dirname(__file__), "model.onnx")
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            (scores,) = self.session.run(["fetch_name_0"], {"x": x})
            out = pb_utils.Tensor("fetch_name_0", scores)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
