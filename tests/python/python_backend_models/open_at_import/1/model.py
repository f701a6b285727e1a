"""Reads, per request, a file its import opened and kept open."""
import os

import numpy as np
import triton_python_backend_utils as pb_utils

WORDS = open(os.path.join(os.path.dirname(__file__), "words.txt"))


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for _ in requests:
            WORDS.seek(0)
            text = WORDS.read().strip()
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("TEXT", np.array([text.encode()], dtype=np.object_))]))
        return out
