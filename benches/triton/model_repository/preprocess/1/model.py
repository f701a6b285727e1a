"""PNG/JPEG bytes -> normalised FP32 [3, 224, 224], as examples/rust/preprocess does."""
import io

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image

SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            pixels = []
            for data in images.reshape(-1):
                image = Image.open(io.BytesIO(data)).convert("RGB")
                image = image.resize((SIZE, SIZE), Image.BILINEAR)
                chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
                pixels.append((chw - MEAN) / STD)
            out = pb_utils.Tensor("PIXELS", np.stack(pixels).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
