"""The `ocr` stage (Wasm: detection post-processing, crops, CTC decoding; PP-OCRv4 detector
and recogniser as ONNX models called through the server) against the reference: the
`rapidocr-onnxruntime` 1.4.4 package's own pipeline, imported from the wheel `make models`
downloaded, on generated images. Same lines in the same order and the same text, spaces
included; boxes within a pixel (cv2.minAreaRect works in float32 where the stage works in
double, and rapidocr's boxes on scaled-up strips are fractional where ours are whole pixels);
confidences within 0.01. Given the same box, the stage's crop and the recogniser's input are
bit-identical to rapidocr's: the box growth is pyclipper's, the perspective crop and the resizes
are OpenCV's fixed-point arithmetic. (On random pages of short words with narrow gaps about 1 in
100 still differs: a box a pixel off from cv2.minAreaRect's float32 arithmetic can decide a
space.)"""
import io
import os
import sys
import zipfile

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image, ImageDraw, ImageFont

from conftest import ROOT, serving

WHEEL_PREFIX = "rapidocr_onnxruntime-1.4.4-"
BOX_TOLERANCE = 1  # pixel, per corner coordinate (see the docstring)


def page(lines, size, font_size, origin=(20, 20), gap=None, ink=(0, 0, 0), paper=(255, 255, 255)):
    image = Image.new("RGB", size, paper)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_size)
    for i, text in enumerate(lines):
        draw.text((origin[0], origin[1] + i * (gap or font_size * 1.6)), text, fill=ink, font=font)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


IMAGES = {
    "two_lines": page(["Hello World 2026", "Wasmtron reads text"], (480, 160), 28),
    "invoice": page(["INVOICE No. 4711", "Total due: 1,234.56 EUR", "Pay by 31 Dec 2026"],
                    (560, 220), 26, origin=(30, 24)),
    "small_print": page(["The quick brown fox jumps", "over the lazy dog 0123456789"],
                        (420, 120), 18, origin=(12, 16)),
    "grey_on_cream": page(["Side by side with Triton"], (520, 96), 34, ink=(60, 60, 70),
                          paper=(250, 246, 230)),
    "blank": page([], (200, 100), 20),
    # rapidocr's special geometry: more than 8x wider than tall (black bands above and below),
    # and under 30 pixels tall (scaled up first, then banded).
    "one_line_strip": page(["Receipt total 42.00"], (420, 40), 24, origin=(10, 8)),
    "tiny": page(["tiny label 7"], (300, 28), 18, origin=(6, 4)),
    # Narrow gaps between short words and numbers: whether a space is read there turns on a
    # pixel of the box or a grey level of the crop, so these pass only when the detection
    # post-processing, the crop and the resize compute exactly what rapidocr's do.
    "narrow_gaps": page(["Version 42 v2 of 7 a4", "Item 3 x 12 kg", "A 1 b 2 c 3 d 4"],
                        (520, 160), 26),
    "narrow_gaps_strip": page(["ab 12 cd 34 ef 56"], (420, 60), 20),
    "narrow_gaps_units": page(["build 42 v2", "room 7 b", "node 12 x3"], (360, 150), 22),
    "narrow_gaps_mixed": page(["B2 12 tx a4 Item ab"], (379, 84), 28),
    "narrow_gaps_lines": page(["tx kg kg", "Item cd tx cd", "Q a4 12"], (262, 164), 26),
}


@pytest.fixture(scope="module")
def rapidocr(tmp_path_factory):
    wheels = os.path.join(ROOT, ".cache", "wheels")
    found = [f for f in os.listdir(wheels) if f.startswith(WHEEL_PREFIX)]
    assert found, f"no {WHEEL_PREFIX}* wheel in {wheels}: run `make models`"
    dest = tmp_path_factory.mktemp("rapidocr")
    with zipfile.ZipFile(os.path.join(wheels, found[0])) as z:
        z.extractall(dest)
    sys.path.insert(0, str(dest))
    try:
        from rapidocr_onnxruntime import RapidOCR
    finally:
        sys.path.remove(str(dest))
    engine = RapidOCR()
    # The stage reads lines without the optional 0/180-degree classifier.
    return lambda image: engine(image, use_cls=False)[0] or []


@pytest.fixture(scope="module")
def ocr_server(tmp_path_factory):
    yield from serving(tmp_path_factory, "ocr", ["ocr", "ocr_det", "ocr_rec"])


def read(mod, client, image):
    tensor = mod.InferInput("IMAGE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([image], dtype=np.object_))
    result = client.infer("ocr", [tensor])
    texts = [t.decode() for t in result.as_numpy("TEXTS")]
    return texts, result.as_numpy("BOXES"), result.as_numpy("SCORES")


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_lines_match_rapidocr(ocr_server, rapidocr, name):
    expected = rapidocr(IMAGES[name])
    client = httpclient.InferenceServerClient(ocr_server.http)
    texts, boxes, scores = read(httpclient, client, IMAGES[name])
    assert texts == [line[1] for line in expected]
    assert boxes.dtype == np.int32 and boxes.shape == (len(expected), 4, 2)
    for got, line in zip(boxes, expected):
        assert np.abs(got - np.array(line[0])).max() <= BOX_TOLERANCE, (got.tolist(), line[0])
    # A box a pixel off crops a pixel wider, which changes the padded width of its whole
    # recogniser batch: confidences of that batch move by up to a few thousandths.
    assert np.allclose(scores, [line[2] for line in expected], atol=0.01)
    if name != "blank":
        assert texts, "the generated page has text"


def test_grpc_and_a_bad_image(ocr_server, rapidocr):
    client = grpcclient.InferenceServerClient(ocr_server.grpc)
    texts, _, _ = read(grpcclient, client, IMAGES["two_lines"])
    assert texts == [line[1] for line in rapidocr(IMAGES["two_lines"])]
    with pytest.raises(Exception) as error:
        read(grpcclient, client, b"not an image")
    assert "IMAGE is not a PNG or JPEG image" in str(error.value)
