"""The host tensor operations (`wasmtron:stage/ops`) called from a Python stage, against
Pillow and NumPy computed here, and against hostile arguments; and the Python stage SDK's
`@batch`, errors and model calls. The stage: tests/guests/python/ops_probe."""
import io
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from conftest import ROOT, Server, copy_models, model_variant

DTYPES = {"FP32": np.float32, "UINT8": np.uint8, "INT64": np.int64, "INT32": np.int32,
          "FP64": np.float64, "INT8": np.int8, "UINT16": np.uint16, "FP16": np.float16, "BOOL": np.bool_}


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("ops")
    for name in ("ops_probe", "sdk_probe"):
        shutil.copytree(os.path.join(ROOT, "tests", "models", name), repo / name)
    copy_models(str(repo), ["identity_fp32", "preprocess", "preprocess_py", "topk", "topk_js"])
    # The probe's 2 s deadline is for the deadline test; moving 16 MiB a request on a debug
    # build whose machine is busy with other tests needs more.
    model_variant(str(repo), "ops_probe_roomy", os.path.join(ROOT, "tests", "models", "ops_probe"),
                  [('"2000"', '"120000"')])
    s = Server(str(repo))
    yield s
    s.stop()


def client(server):
    return httpclient.InferenceServerClient(server.http, network_timeout=120)


def run_ops(server, operands, steps, hold=False, model="ops_probe"):
    """Runs `steps` on `operands` (np arrays become host arrays, bytes stay raw) in the probe
    stage; returns the results as NumPy arrays."""
    specs, raws = [], []
    for x in operands:
        if isinstance(x, np.ndarray):
            dtype = next(k for k, v in DTYPES.items() if np.dtype(v) == x.dtype)
            specs.append({"dtype": dtype, "shape": list(x.shape)})
            raws.append(np.ascontiguousarray(x).tobytes())
        else:
            specs.append(None)
            raws.append(bytes(x))
    data = httpclient.InferInput("DATA", [len(raws)], "BYTES")
    data.set_data_from_numpy(np.array(raws, dtype=np.object_))
    params = {"inputs": json.dumps(specs), "steps": json.dumps(steps)}
    if hold:
        params["hold"] = 1
    result = client(server).infer(model, [data], parameters=params)
    meta = json.loads(result.as_numpy("META")[0])
    return [np.frombuffer(raw, dtype=DTYPES[m["dtype"]]).reshape(m["shape"])
            for raw, m in zip(result.as_numpy("OUT"), meta)]


def failure(server, operands, steps, **kw):
    with pytest.raises(InferenceServerException) as e:
        run_ops(server, operands, steps, **kw)
    return e.value


def png(array, mode=None):
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def photo(h=97, w=131, seed=0):
    """A smooth image with detail: what resizing meets in photographs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(x / 7.0 + c) * np.cos(y / 5.0) for c in range(3)], -1)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def test_decoding_png_equals_pillow_in_every_color(ops_server):
    image = photo()
    (rgb,) = run_ops(ops_server, [png(image)], [["decode_image", {}]])
    assert rgb.shape == (97, 131, 3) and np.array_equal(rgb, image)
    (bgr,) = run_ops(ops_server, [png(image)], [["decode_image", {"color": "bgr"}]])
    assert np.array_equal(bgr, image[..., ::-1])
    (gray,) = run_ops(ops_server, [png(image)], [["decode_image", {"color": "gray"}]])
    expected = np.asarray(Image.fromarray(image).convert("L"))
    assert gray.shape == (97, 131, 1) and np.array_equal(gray[..., 0], expected)
    (gray,) = run_ops(ops_server, [image], [["convert_color", {"source": "rgb", "target": "gray"}]])
    assert np.array_equal(gray[..., 0], expected)


def test_decoding_jpeg_is_within_a_level_of_pillow_on_average(ops_server):
    image = photo(120, 160)
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=90)
    (ours,) = run_ops(ops_server, [buf.getvalue()], [["decode_image", {}]])
    theirs = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB")).astype(np.int16)
    diff = np.abs(ours.astype(np.int16) - theirs)
    # Different IDCT and chroma upsampling than libjpeg-turbo: close, not equal (docs/stages.md).
    assert diff.mean() < 1.0 and diff.max() <= 16, (diff.mean(), diff.max())


@pytest.mark.parametrize("size", [(224, 224), (50, 70), (300, 40), (97, 131), (1, 1)])
@pytest.mark.parametrize("filt", ["bilinear", "nearest"])
def test_resizing_uint8_equals_pillow(ops_server, size, filt):
    image = photo()
    h, w = size
    (ours,) = run_ops(ops_server, [image], [["resize", {"height": h, "width": w, "filter": filt}]])
    resample = Image.BILINEAR if filt == "bilinear" else Image.NEAREST
    theirs = np.asarray(Image.fromarray(image).resize((w, h), resample))
    assert ours.shape == (h, w, 3)
    assert np.array_equal(ours, theirs), np.abs(ours.astype(int) - theirs).max()


def test_resizing_fp32_matches_pillow_mode_f(ops_server):
    plane = photo()[..., :1].astype(np.float32) / 3.0
    (ours,) = run_ops(ops_server, [plane], [["resize", {"height": 60, "width": 200}]])
    theirs = np.asarray(Image.fromarray(plane[..., 0]).resize((200, 60), Image.BILINEAR))
    np.testing.assert_allclose(ours[..., 0], theirs, rtol=0, atol=1e-4)


def test_aspect_preserving_resizes_and_crops_follow_torchvision_and_yolo(ops_server):
    image = photo(97, 131)
    (short,) = run_ops(ops_server, [image], [["resize_shorter_side", {"size": 64}]])
    assert short.shape == (64, int(64 * 131 / 97), 3)  # torchvision truncates the long side
    theirs = np.asarray(Image.fromarray(image).resize((short.shape[1], 64), Image.BILINEAR))
    assert np.array_equal(short, theirs)
    (center,) = run_ops(ops_server, [image], [["center_crop", {"height": 50, "width": 50}]])
    top, left = int(round((97 - 50) / 2.0)), int(round((131 - 50) / 2.0))
    assert np.array_equal(center, image[top:top + 50, left:left + 50])
    (region,) = run_ops(ops_server, [image], [["crop", {"top": 3, "left": 5, "height": 10, "width": 20}]])
    assert np.array_equal(region, image[3:13, 5:25])
    (boxed,) = run_ops(ops_server, [image], [["letterbox", {"height": 128, "width": 128, "pad": 114}]])
    r = min(128 / 97, 128 / 131)
    nh, nw = round(97 * r), round(131 * r)
    expected = np.full((128, 128, 3), 114, np.uint8)
    top, left = (128 - nh) // 2, (128 - nw) // 2
    expected[top:top + nh, left:left + nw] = np.asarray(Image.fromarray(image).resize((nw, nh), Image.BILINEAR))
    assert np.array_equal(boxed, expected)


def test_layout_cast_and_normalisation_equal_numpy(ops_server):
    x = np.random.default_rng(1).normal(0, 100, (4, 5, 3)).astype(np.float32)
    (t,) = run_ops(ops_server, [x], [["transpose", {"axes": [2, 0, 1]}]])
    assert np.array_equal(t, x.transpose(2, 0, 1))
    (s,) = run_ops(ops_server, [x], [["reshape", {"shape": [-1, 3]}]])
    assert np.array_equal(s, x.reshape(-1, 3))
    (c,) = run_ops(ops_server, [x], [["cast", {"dtype": "INT32"}]])
    assert np.array_equal(c, x.astype(np.int32))  # truncation toward zero, as NumPy
    (u,) = run_ops(ops_server, [x], [["cast", {"dtype": "UINT8"}]])
    assert np.array_equal(u, np.clip(np.trunc(x), 0, 255).astype(np.uint8))  # saturates
    (h,) = run_ops(ops_server, [x], [["cast", {"dtype": "FP16"}]])
    assert np.array_equal(h, x.astype(np.float16))
    image = photo(8, 9)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    (n,) = run_ops(ops_server, [image], [["normalize", {"mean": mean, "std": std, "scale": 1 / 255}]])
    expected = (image.astype(np.float32) * np.float32(1 / 255) - np.float32(mean)) / np.float32(std)
    np.testing.assert_allclose(n, expected, rtol=1e-6, atol=1e-6)
    chw = image.transpose(2, 0, 1).copy()
    (n,) = run_ops(ops_server, [chw], [["normalize", {"mean": mean, "std": std, "scale": 1 / 255, "axis": 0}]])
    np.testing.assert_allclose(n, expected.transpose(2, 0, 1), rtol=1e-6, atol=1e-6)


def test_stacking_joins_arrays_along_a_new_axis(ops_server):
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    (s,) = run_ops(ops_server, [a, b], [["stack", {}]])
    assert np.array_equal(s, np.stack([a, b]))
    err = failure(ops_server, [a, np.ones((3, 2), np.float32)], [["stack", {}]])
    assert err.status() == "400" and "array 1 is FP32 [3, 2] but array 0 is FP32 [2, 3]" in err.message()


def test_reductions_equal_numpy(ops_server):
    logits = np.random.default_rng(2).normal(0, 3, (3, 10)).astype(np.float32)
    logits[1, 4] = logits[1, 7] = logits[1].max() + 1  # a tie: the lower index wins
    (p,) = run_ops(ops_server, [logits], [["softmax", {}]])
    e = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    (p0,) = run_ops(ops_server, [logits], [["softmax", {"axis": 0}]])
    e = np.exp(logits - logits.max(0, keepdims=True))
    np.testing.assert_allclose(p0, e / e.sum(0, keepdims=True), rtol=1e-5, atol=1e-7)
    (sg,) = run_ops(ops_server, [logits], [["sigmoid", {}]])
    np.testing.assert_allclose(sg, 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-7)
    (am,) = run_ops(ops_server, [logits], [["argmax", {}]])
    assert np.array_equal(am, logits.argmax(-1))
    values, indices = run_ops(ops_server, [logits], [["top_k", {"k": 4}]])
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :4]
    assert np.array_equal(indices, order)
    assert np.array_equal(values, np.take_along_axis(logits, order, -1))


def reference_nms(boxes, scores, iou, score_threshold):
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] >= score_threshold]
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    kept = []
    for i in order:
        ok = True
        for j in kept:
            w = max(0.0, min(boxes[i, 2], boxes[j, 2]) - max(boxes[i, 0], boxes[j, 0]))
            h = max(0.0, min(boxes[i, 3], boxes[j, 3]) - max(boxes[i, 1], boxes[j, 1]))
            inter = w * h
            if inter / (area[i] + area[j] - inter) > iou:
                ok = False
                break
        if ok:
            kept.append(i)
    return np.array(kept, dtype=np.int64)


def test_nms_equals_a_greedy_reference_in_both_box_formats(ops_server):
    rng = np.random.default_rng(3)
    xy = rng.uniform(0, 100, (60, 2)).astype(np.float32)
    wh = rng.uniform(5, 40, (60, 2)).astype(np.float32)
    corners = np.concatenate([xy, xy + wh], 1)
    scores = rng.uniform(0, 1, 60).astype(np.float32)
    (kept,) = run_ops(ops_server, [corners, scores], [["nms", {"iou_threshold": 0.4, "score_threshold": 0.2}]])
    assert np.array_equal(kept, reference_nms(corners, scores, 0.4, 0.2))
    centers = np.concatenate([xy + wh / 2, wh], 1)
    (kept_c,) = run_ops(ops_server, [centers, scores],
                        [["nms", {"iou_threshold": 0.4, "score_threshold": 0.2, "box_format": "center"}]])
    assert np.array_equal(kept_c, kept)
    (top3,) = run_ops(ops_server, [corners, scores], [["nms", {"iou_threshold": 0.4, "max_outputs": 3}]])
    assert np.array_equal(top3, reference_nms(corners, scores, 0.4, 0.0)[:3])


@pytest.mark.parametrize("operands,steps,message", [
    ([b"not an image"], [["decode_image", {}]], "ops.decode-image: the data is not a PNG or JPEG"),
    ([np.zeros((4, 4, 3), np.uint8)], [["transpose", {"axes": [0, 0, 1]}]], "not a permutation"),
    ([np.zeros((4, 4), np.uint8)], [["resize", {"height": 2, "width": 2}]], "[height, width, channels]"),
    ([np.zeros((4, 4, 3), np.uint8)], [["resize", {"height": 0, "width": 2}]], "is empty"),
    ([np.zeros((4, 4, 3), np.uint8)], [["crop", {"top": 3, "left": 0, "height": 2, "width": 2}]], "outside the 4x4 image"),
    ([np.zeros((2, 3), np.float32)], [["normalize", {"mean": [0.0], "std": [0.0]}]], "std[0] is 0"),
    ([np.zeros((2, 3), np.float32)], [["normalize", {"mean": [0.0, 1.0], "std": [1.0]}]], "mean has 2 values"),
    ([np.zeros((2, 3), np.float32)], [["top_k", {"k": 4}]], "between 1 and 3"),
    ([np.zeros((2, 3), np.float32)], [["softmax", {"axis": 2}]], "axis 2 is out of range"),
    ([np.zeros((3, 4), np.float32), np.zeros(2, np.float32)], [["nms", {}]], "scores must be [3]"),
    ([np.zeros((2, 3), np.float32)], [["reshape", {"shape": [4, -1]}]], "cannot infer"),
    ([np.zeros((4, 4, 3), np.uint8)], [["cast", {"dtype": "BYTES"}]], "cannot cast to BYTES"),
])
def test_bad_arguments_get_a_400_naming_the_operation(ops_server, operands, steps, message):
    err = failure(ops_server, operands, steps)
    assert err.status() == "400" and message in err.message(), err.message()


def test_bad_array_data_is_refused_before_any_operation(ops_server):
    data = httpclient.InferInput("DATA", [1], "BYTES")
    data.set_data_from_numpy(np.array([b"\x00" * 7], dtype=np.object_))
    with pytest.raises(InferenceServerException) as e:
        client(ops_server).infer("ops_probe", [data], parameters={
            "inputs": json.dumps([{"dtype": "FP32", "shape": [2]}]), "steps": "[]"})
    assert e.value.status() == "400" and "needs 8 bytes but the data has 7" in e.value.message()


def huge_png(width, height):
    """A valid PNG header declaring `width` x `height`, with almost no data."""
    import struct
    import zlib
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")


def test_hostile_sizes_are_refused_before_allocating_and_the_stage_keeps_serving(ops_server):
    err = failure(ops_server, [huge_png(60000, 60000)], [["decode_image", {}]])
    assert err.status() == "400" and "more than max-pixels 40000000" in err.message(), err.message()
    err = failure(ops_server, [png(photo())], [["decode_image", {"max_pixels": 1000}]])
    assert "more than max-pixels 1000" in err.message()
    # 6,000 x 6,000 bytes x 3 fits the pixel limit but not the 256 MiB memory limit as fp32.
    err = failure(ops_server, [np.zeros((4, 4, 3), np.float32)], [["resize", {"height": 6000, "width": 6000}]])
    assert err.status() == "503" and "memory_limit_mb" in err.message(), err.message()
    err = failure(ops_server, [np.zeros((4, 4, 3), np.uint8)], [["resize", {"height": 4000000, "width": 4000000}]])
    assert "memory_limit_mb" in err.message() or "too large" in err.message(), err.message()
    # Arrays held by a request count until they are dropped: 80 x 4 MiB exceeds 256 MiB...
    big = np.zeros((512, 512, 4), np.float32)
    steps = [["cast", {"dtype": "FP32"}]] * 80
    err = failure(ops_server, [big], steps, hold=True)
    assert err.status() == "503" and "memory_limit_mb" in err.message(), err.message()
    # ...while dropped ones are freed: the same chain without holding succeeds, many times.
    for _ in range(5):
        (out,) = run_ops(ops_server, [big], steps + [["resize", {"height": 1, "width": 1}]])
        assert out.shape == (1, 1, 4)
    (ok,) = run_ops(ops_server, [photo()], [["resize", {"height": 8, "width": 8}]])
    assert ok.shape == (8, 8, 3)


def test_a_stage_whose_memory_only_grows_is_replaced_before_it_fails(ops_server):
    # componentize-py keeps the bytes of every output a Python stage returns: 16 MiB out per
    # request fills the probe's 256 MiB in about 12 requests. Replaced at 3/4, none fails.
    block = np.zeros((1024, 1024, 4), np.float32)
    for _ in range(30):
        (out,) = run_ops(ops_server, [block], [["cast", {"dtype": "FP32"}]],
                         model="ops_probe_roomy")
        assert out.shape == block.shape


def test_a_stage_looping_over_operations_is_stopped_at_its_deadline(ops_server):
    err = failure(ops_server, [np.ones((64, 64), np.float32)], [["repeat_forever", {}]])
    assert "deadline" in err.message(), err.message()
    (ok,) = run_ops(ops_server, [np.ones(3, np.float32)], [["softmax", {}]])
    np.testing.assert_allclose(ok, [1 / 3] * 3, rtol=1e-6)


def test_the_python_and_javascript_twins_answer_like_the_rust_stages_and_pillow(ops_server):
    image = photo(180, 240)
    raw = png(image)
    c = client(ops_server)
    outs = {}
    for model in ("preprocess", "preprocess_py"):
        t = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
        t.set_data_from_numpy(np.array([[raw]], dtype=np.object_))
        outs[model] = c.infer(model, [t]).as_numpy("PIXELS")
    resized = np.asarray(Image.fromarray(image).resize((224, 224), Image.BILINEAR)).astype(np.float32)
    mean, std = np.float32([0.485, 0.456, 0.406]), np.float32([0.229, 0.224, 0.225])
    expected = ((resized * np.float32(1 / 255) - mean) / std).transpose(2, 0, 1)[None]
    np.testing.assert_allclose(outs["preprocess_py"], expected, rtol=0, atol=1e-6)
    assert np.array_equal(outs["preprocess"], outs["preprocess_py"])
    scores = np.random.default_rng(4).normal(size=(3, 4)).astype(np.float32)
    answers = {}
    for model in ("topk", "topk_js"):
        t = httpclient.InferInput("SCORES", [3, 4], "FP32")
        t.set_data_from_numpy(scores)
        r = c.infer(model, [t])
        answers[model] = (r.as_numpy("LABELS").tolist(), r.as_numpy("INDICES").tolist())
    assert answers["topk"] == answers["topk_js"]
    assert answers["topk_js"][1] == np.argsort(-scores, -1, kind="stable")[:, :2].tolist()
    # A bad image names the image, from either twin.
    t = httpclient.InferInput("IMAGE", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[b"GIF89a"]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as e:
        c.infer("preprocess_py", [t])
    assert e.value.status() == "400" and "IMAGE[0]" in e.value.message()


def sdk_call(server, rows, **params):
    t = httpclient.InferInput("X", list(rows.shape), "FP32")
    t.set_data_from_numpy(rows)
    return client(server).infer("sdk_probe", [t], parameters=params or None)


def test_a_batch_function_sees_joined_rows_and_each_request_gets_its_own(ops_server):
    requests = [np.full((1 + i % 3, 4), i, np.float32) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda x: sdk_call(ops_server, x), requests))
    for x, r in zip(requests, results):
        assert np.array_equal(r.as_numpy("ROW_SUM"), x.sum(1, keepdims=True))
        seen = r.as_numpy("ROWS_SEEN")
        assert seen.shape == (len(x), 1) and (seen >= len(x)).all()


@pytest.mark.parametrize("code,status", [("invalid-argument", "400"), ("not-found", "404"),
                                         ("unavailable", "503"), ("unsupported", "501"), ("internal", "500")])
def test_stage_errors_keep_their_code(ops_server, code, status):
    with pytest.raises(InferenceServerException) as e:
        sdk_call(ops_server, np.ones((1, 2), np.float32), fail=code)
    assert e.value.status() == status and f"asked to fail with {code}" in e.value.message()


def test_a_python_stage_calls_another_model(ops_server):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    r = sdk_call(ops_server, x, call="identity_fp32")
    assert np.array_equal(r.as_numpy("ROW_SUM"), x.sum(1, keepdims=True))
    with pytest.raises(InferenceServerException) as e:
        sdk_call(ops_server, x, call="no_such_model")
    assert "no_such_model" in e.value.message()
