"""An image -> its text lines with the rapidocr-onnxruntime package (PP-OCRv4 detector and
recogniser in onnxruntime inside this model, the package's own pre- and post-processing),
without the angle classifier, as examples/rust/ocr reads them."""
import numpy as np
import triton_python_backend_utils as pb_utils
from rapidocr_onnxruntime import RapidOCR


class TritonPythonModel:
    def initialize(self, args):
        self.engine = RapidOCR()

    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)[0]
            lines = self.engine(image, use_cls=False)[0] or []
            texts = np.array([line[1].encode() for line in lines], dtype=np.object_)
            boxes = np.array([line[0] for line in lines], dtype=np.int32).reshape(-1, 4, 2)
            scores = np.array([line[2] for line in lines], dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("TEXTS", texts), pb_utils.Tensor("BOXES", boxes),
                pb_utils.Tensor("SCORES", scores)]))
        return responses
