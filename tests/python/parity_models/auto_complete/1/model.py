import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """No config.pbtxt beside it: `auto_complete_config` declares its inputs, outputs,
    batching and dynamic batcher. Y = A * B."""

    @staticmethod
    def auto_complete_config(config):
        for name in ("A", "B"):
            config.add_input({"name": name, "data_type": "TYPE_FP32", "dims": [3]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [3]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        out = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", a * b)]))
        return out
