import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """`async def execute` awaiting a decoupled BLS call into `async_sleep` per request."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS")
            call = pb_utils.InferenceRequest(
                model_name="async_sleep", inputs=[wait],
                requested_output_names=["DUMMY_OUT", "PEAK"])
            got = []
            for answer in await call.async_exec(decoupled=True):
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                if answer.output_tensors():
                    got.append(pb_utils.get_output_tensor_by_name(answer, "PEAK").as_numpy())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("ANSWERS", np.array([len(got)], np.int32))]))
        return responses
