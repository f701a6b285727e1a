import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            swapped0 = pb_utils.Tensor("INPUT0", in1.as_numpy())
            swapped1 = pb_utils.Tensor("INPUT1", in0.as_numpy())
            first = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=[in0, in1])
            second = pb_utils.InferenceRequest(
                model_name="add_sub", requested_output_names=["OUTPUT1"],
                inputs=[swapped0, swapped1])
            a, b = await asyncio.gather(first.async_exec(), second.async_exec())
            for r in (a, b):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
            out0 = pb_utils.get_output_tensor_by_name(a, "OUTPUT0").as_numpy()
            out1 = pb_utils.get_output_tensor_by_name(b, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", out0),
                # in1 - in0: the second call's inputs were swapped
                pb_utils.Tensor("OUTPUT1", np.negative(out1)),
            ]))
        return responses
