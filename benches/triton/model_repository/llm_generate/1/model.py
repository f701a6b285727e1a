"""Text generation as a Triton python-backend user writes it: for each request, tokenize,
prefill, then decode one token at a time (batch 1; scripts/decoder_loop.py, copied beside this
file, runs either cache layout), sending each token's text as it comes. Each request runs on its own thread (Triton's decoupled examples do
this) so that requests overlap; they share one onnxruntime session. Greedy, no end token:
exactly max_tokens tokens, as the benchmark asks of both servers."""
import os
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(__file__))
import decoder_loop  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.dirname(__file__)
        self.tokenizer = Tokenizer.from_file(os.path.join(here, "tokenizer.json"))
        self.decoder = decoder_loop.DecoderLoop(os.path.join(here, "model.onnx"))
        self.threads = []

    def generate(self, request):
        sender = request.get_response_sender()
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            count = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            ids = self.tokenizer.encode(text.decode("utf-8")).ids
            generated = []

            def send(tokens):
                before = self.tokenizer.decode(generated[-8:])
                generated.append(tokens[0])
                piece = self.tokenizer.decode(generated[-9:])[len(before):]
                out = pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))

            self.decoder.greedy([ids], count, on_step=send)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001 - the error goes to the client
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def execute(self, requests):
        self.threads = [t for t in self.threads if t.is_alive()]
        for request in requests:
            t = threading.Thread(target=self.generate, args=(request,), daemon=True)
            t.start()
            self.threads.append(t)
        return None

    def finalize(self):
        for t in self.threads:
            t.join()
