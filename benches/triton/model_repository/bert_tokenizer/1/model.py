"""Sentences -> BERT token ids with Hugging Face tokenizers and the tokenizer.json beside this
file, padded per request to a multiple of 16, as examples/rust/bert_tokenizer does."""
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

MULTIPLE = 16


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = Tokenizer.from_file(os.path.join(os.path.dirname(__file__), "tokenizer.json"))
        self.tokenizer.no_padding()
        # sentence-transformers' max_seq_length for all-MiniLM-L6-v2, as the Wasm stage uses.
        self.tokenizer.enable_truncation(256)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            encodings = self.tokenizer.encode_batch([t.decode("utf-8") for t in text])
            width = -(-max(len(e.ids) for e in encodings) // MULTIPLE) * MULTIPLE
            outputs = []
            for name, field in [("input_ids", "ids"), ("attention_mask", "attention_mask"),
                                ("token_type_ids", "type_ids")]:
                values = np.zeros((len(encodings), width), dtype=np.int64)
                for row, e in enumerate(encodings):
                    got = getattr(e, field)
                    values[row, :len(got)] = got
                outputs.append(pb_utils.Tensor(name, values))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
