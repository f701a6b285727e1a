"""Text generation as a Triton python-backend user writes it: for each request, tokenize,
prefill, then decode one token at a time with the cache fed back (batch 1), sending each
token's text as it comes. Each request runs on its own thread (Triton's decoupled examples do
this) so that requests overlap; they share one onnxruntime session. Greedy, no end token:
exactly max_tokens tokens, as the benchmark asks of both servers."""
import os
import threading

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.dirname(__file__)
        self.tokenizer = Tokenizer.from_file(os.path.join(here, "tokenizer.json"))
        self.session = ort.InferenceSession(os.path.join(here, "model.onnx"),
                                            providers=["CPUExecutionProvider"])
        self.pasts = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.threads = []

    def generate(self, request):
        sender = request.get_response_sender()
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            count = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            ids = self.tokenizer.encode(text.decode("utf-8")).ids
            feeds = {p.name: np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in self.pasts}
            step, total, generated = list(ids), len(ids), []
            for _ in range(count):
                start = total - len(step)
                feeds.update(input_ids=np.array([step], np.int64),
                             attention_mask=np.ones((1, total), np.int64),
                             position_ids=np.arange(start, total)[None].astype(np.int64))
                results = dict(zip(self.outputs, self.session.run(None, feeds)))
                for p in self.pasts:
                    feeds[p.name] = results[p.name.replace("past_key_values", "present")]
                token = int(np.argmax(results["logits"][0, -1]))
                before = self.tokenizer.decode(generated[-8:])
                generated.append(token)
                piece = self.tokenizer.decode(generated[-9:])[len(before):]
                out = pb_utils.Tensor("text_output", np.array([piece.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                step, total = [token], total + 1
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
