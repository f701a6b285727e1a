"""Runs model.onnx (beside this file, all-MiniLM-L6-v2 int8) with onnxruntime."""
import os

import onnxruntime as ort
import triton_python_backend_utils as pb_utils

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(os.path.dirname(__file__), "model.onnx")
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in INPUTS}
            (hidden,) = self.session.run(["last_hidden_state"], feeds)
            out = pb_utils.Tensor("last_hidden_state", hidden)
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
