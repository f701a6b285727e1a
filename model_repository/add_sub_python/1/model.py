"""OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, written as a Triton Python-backend
model: `initialize` reads the output types from the configuration Triton passes in `args`,
`execute` answers every request of the batch, `finalize` runs at unload."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtypes = {
            name: pb_utils.triton_string_to_numpy(
                pb_utils.get_output_config_by_name(config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")
        }

    def execute(self, requests):
        responses = []
        for request in requests:
            left = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            right = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            total = pb_utils.Tensor("OUTPUT0", (left + right).astype(self.dtypes["OUTPUT0"]))
            difference = pb_utils.Tensor("OUTPUT1", (left - right).astype(self.dtypes["OUTPUT1"]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[total, difference]))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub_python: unloaded")
