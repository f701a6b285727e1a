import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Fails each request with the TritonError code its CODE input names (none: no code)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy().flat[0].decode()
            code = getattr(pb_utils.TritonError, name, None)
            error = (pb_utils.TritonError("failed with " + name, code) if code is not None
                     else pb_utils.TritonError("failed without a code"))
            responses.append(pb_utils.InferenceResponse(error=error))
        return responses
