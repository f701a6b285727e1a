"""The peer of benches/stage_twins.rs: the user code of Triton's python-backend twins
(benches/triton/model_repository/preprocess and topk: Pillow + NumPy), timed in-process on the
same inputs, without Triton around it: what a Triton user's own code costs per request, the
floor of the python backend before its IPC. Medians of repeated runs, in microseconds.

Run after the Rust bench (it writes benches/results/photo_640x480.jpg):
    cargo bench -p wasmtron --bench stage_twins && .venv/bin/python benches/twin_peers.py
"""
import io
import os
import statistics
import time

import numpy as np
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)
LABELS = ["0", "90", "180", "270"]


def preprocess(data: bytes) -> np.ndarray:
    """The twin's execute body for one request of one image."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    image = image.resize((SIZE, SIZE), Image.BILINEAR)
    chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return np.stack([(chw - MEAN) / STD]).astype(np.float32)


def topk(scores: np.ndarray, k: int = 2):
    """The topk twin's execute body for one request."""
    k = min(k, scores.shape[1])
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    labels = [[f"{row[i]:.6f}:{i}:{LABELS[i] if i < len(LABELS) else ''}".encode() for i in idx]
              for row, idx in zip(scores, order)]
    return np.array(labels, dtype=np.object_), order.astype(np.int64)


def median_us(fn, arg, seconds=3.0):
    for _ in range(20):
        fn(arg)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main():
    photo = os.path.join(ROOT, "benches", "results", "photo_640x480.jpg")
    if not os.path.exists(photo):
        raise SystemExit("run `cargo bench -p wasmtron --bench stage_twins` first (it writes the photo)")
    images = {"png_128x96": open(os.path.join(ROOT, "tests", "fixtures", "lines_down.png"), "rb").read(),
              "jpeg_640x480": open(photo, "rb").read()}
    print("| twin (Triton python backend's code, in-process) | input | median µs |")
    print("|---|---|---|")
    for label, data in images.items():
        print(f"| preprocess (Pillow + NumPy) | {label} | {median_us(preprocess, data):.0f} |")
    for rows, classes in [(1, 4), (8, 1000)]:
        scores = (np.arange(rows * classes) * 7919 % 1000 / 1000.0).astype(np.float32).reshape(rows, classes)
        print(f"| topk (NumPy) | {rows}x{classes} | {median_us(topk, scores):.1f} |")


if __name__ == "__main__":
    main()
