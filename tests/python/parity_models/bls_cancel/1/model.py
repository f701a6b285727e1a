import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Streams from `decoupled_mixed` ("until_cancelled", at most N) and cancels the call
    after CANCEL_AT responses; answers how many responses it got in all."""

    def execute(self, requests):
        responses = []
        for request in requests:
            n = pb_utils.get_input_tensor_by_name(request, "N")
            cancel_at = int(pb_utils.get_input_tensor_by_name(request, "CANCEL_AT").as_numpy().flat[0])
            mode = pb_utils.Tensor("MODE", np.array([b"until_cancelled"], dtype=np.object_))
            call = pb_utils.InferenceRequest(model_name="decoupled_mixed", inputs=[mode, n],
                                             requested_output_names=["I"])
            stream = call.exec(decoupled=True)
            got = 0
            for answer in stream:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                if answer.output_tensors():
                    got += 1
                    if got == cancel_at:
                        stream.cancel()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("GOT", np.array([got], np.int32))]))
        return responses
