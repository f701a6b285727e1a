"""Streaming voice activity detection with silero-vad, as examples/rust/vad does: per stream,
the last 64 samples and the recurrent state carry over; a batch of chunks from different
streams runs as one onnxruntime call."""
import os

import numpy as np
import onnxruntime
import triton_python_backend_utils as pb_utils

CONTEXT = 64


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(
            os.path.join(here, "silero_vad.onnx"), options, providers=["CPUExecutionProvider"])
        self.streams = {}  # correlation ID -> (state [2, 128], context [64])

    def execute(self, requests):
        windows, states, ids = [], [], []
        for request in requests:
            audio = pb_utils.get_input_tensor_by_name(request, "AUDIO").as_numpy().reshape(-1)
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy().item()
            stream = request.correlation_id()
            if start or stream not in self.streams:
                self.streams[stream] = (np.zeros((2, 128), np.float32), np.zeros(CONTEXT, np.float32))
            state, context = self.streams[stream]
            windows.append(np.concatenate([context, audio]))
            states.append(state)
            ids.append(stream)
        x = np.stack(windows).astype(np.float32)
        out, next_state = self.session.run(
            None, {"input": x, "state": np.stack(states, axis=1), "sr": np.array(16000, np.int64)})
        responses = []
        for b, request in enumerate(requests):
            if pb_utils.get_input_tensor_by_name(request, "END").as_numpy().item():
                self.streams.pop(ids[b], None)
            else:
                self.streams[ids[b]] = (next_state[:, b], x[b, -CONTEXT:])
            result = pb_utils.Tensor("SPEECH_PROBABILITY", out[b:b + 1].astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[result]))
        return responses
