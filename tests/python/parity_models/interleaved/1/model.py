"""Answers the requests of a batch interleaved, last request first, `ROUNDS` responses each;
every response carries its place in the order the model produced them (`ORDER`) and its
request's index in the batch (`REQUEST`). The first response produced is an error, for the
batch's last request, as Triton's decoupled_execute_error model answers its first request."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        senders = [r.get_response_sender() for r in requests]
        rounds = int(pb_utils.get_input_tensor_by_name(requests[0], "ROUNDS").as_numpy().flat[0])
        produced = 0
        for _ in range(rounds):
            for index in reversed(range(len(requests))):
                if produced == 0:
                    error = pb_utils.TritonError("order 0: an error, produced first")
                    senders[index].send(pb_utils.InferenceResponse(error=error))
                else:
                    senders[index].send(pb_utils.InferenceResponse([
                        pb_utils.Tensor("ORDER", np.array([produced], np.int32)),
                        pb_utils.Tensor("REQUEST", np.array([index], np.int32))]))
                produced += 1
        for sender in reversed(senders):
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
