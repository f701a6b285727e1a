import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            call = pb_utils.InferenceRequest(
                model_name="repeat",
                requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", values.astype(np.int32)),
                        pb_utils.Tensor("DELAY", np.zeros(values.shape, np.uint32))],
                trace=request.trace(),
                preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0))
            call.set_flags(0)
            stream = call.exec(decoupled=True)
            first = None
            for response in stream:
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                out = pb_utils.get_output_tensor_by_name(response, "OUT")
                if out is not None:
                    first = out.as_numpy()
                    # The first response is enough: the call is cancelled (responses the
                    # called model still sends would be read by iterating on).
                    stream.cancel()
                    break
            report = {
                "context": request.trace().get_context(),
                "flags": call.flags(),
                "parameters": json.loads(request.parameters()),
                "requested": sorted(request.requested_output_names()),
                "codes": [pb_utils.TritonError.UNKNOWN, pb_utils.TritonError.CANCELLED],
                "error": pb_utils.TritonError("no", pb_utils.TritonError.NOT_FOUND).code(),
            }
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("FIRST", np.array(first, np.int32).reshape(1)),
                pb_utils.Tensor("REPORT", np.array([json.dumps(report).encode()], np.object_)),
            ]))
        return responses
