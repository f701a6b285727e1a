import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes X, failing every second request this instance sees."""

    def initialize(self, args):
        self.seen = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.seen += 1
            if self.seen % 2 == 0:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError("request %d fails on purpose" % self.seen)))
                continue
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
