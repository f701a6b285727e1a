import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException("this model must be decoupled")
        out_config = pb_utils.get_output_config_by_name(self.model_config, "OUT")
        self.out_dtype = pb_utils.triton_string_to_numpy(out_config["data_type"])
        self.inflight_thread_count = 0
        self.inflight_thread_count_lck = threading.Lock()

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(
                target=self.response_thread,
                args=(request.get_response_sender(),
                      pb_utils.get_input_tensor_by_name(request, "IN").as_numpy(),
                      pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()))
            thread.daemon = True
            with self.inflight_thread_count_lck:
                self.inflight_thread_count += 1
            thread.start()
        return None

    def response_thread(self, response_sender, in_input, delay_input):
        for idx in range(in_input.shape[0]):
            time.sleep(delay_input[idx] / 1000)
            out = pb_utils.Tensor("OUT", np.array([in_input[idx]], dtype=self.out_dtype))
            idx_t = pb_utils.Tensor("IDX", np.array([idx], dtype=np.uint32))
            response_sender.send(pb_utils.InferenceResponse(output_tensors=[out, idx_t]))
        response_sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with self.inflight_thread_count_lck:
            self.inflight_thread_count -= 1

    def finalize(self):
        while self.inflight_thread_count > 0:
            time.sleep(0.1)
