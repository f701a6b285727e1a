"""Classifier scores -> top-k "score:index:label" strings, as examples/rust/topk does."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.k = int(params.get("k", {}).get("string_value", "1"))
        labels = params.get("labels", {}).get("string_value", "")
        self.labels = [l.strip() for l in labels.split(",")] if labels else []

    def execute(self, requests):
        responses = []
        for request in requests:
            scores = pb_utils.get_input_tensor_by_name(request, "SCORES").as_numpy()
            k = min(self.k, scores.shape[1])
            # Highest first, ties by lower index (a stable sort of the negated scores).
            order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            labels = [
                [f"{row[i]:.6f}:{i}:{self.labels[i] if i < len(self.labels) else ''}".encode() for i in idx]
                for row, idx in zip(scores, order)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("LABELS", np.array(labels, dtype=np.object_)),
                pb_utils.Tensor("INDICES", order.astype(np.int64)),
            ]))
        return responses
