"""Final detections from a detector's decoded candidates, in NumPy: the post-processing an artifact leaves to the app
where its format cannot hold an NMS (ExecuTorch, LiteRT; Core ML's own pipeline does it on the device).

The toolchain's detection artifacts all answer with the same rows, ``(batch_index, x1, y1, x2, y2, score, class)``,
``[K, 7]`` float32, boxes in input pixels, sorted by image then score.  A format that holds NMS (ONNX, OpenVINO,
TensorRT) returns them from its graph; the others return **candidates**, ``[B, N, 4 + C]`` float32: for each of the
N locations of the strides 8 / 16 / 32 (row-major, finest level first) its decoded box ``x1, y1, x2, y2`` in input
pixels and its C class scores ``sqrt(sigmoid(class) * sigmoid(quality))`` in [0, 1].  :func:`select_detections`
turns candidates into the rows with exactly the semantics of the graphs' NMS (ONNX ``NonMaxSuppression``): per image
and class, the candidates scoring above ``score_thresh``, greedy suppression of any box overlapping a better one by
IoU above ``iou``, at most ``max_det`` per class; then the best ``max_det`` of the image over all classes.

An app developer ports these forty lines (Kotlin, Swift, C++); the artifact's metadata names the thresholds it
was checked with (``nms``).  The toolchain itself uses this file for parity, latency and the device bundle, so the
NMS a number was measured with is the NMS an app is told to write.  Like every file in this folder it imports
nothing but the standard library and NumPy (device bundles carry it verbatim).
"""
from __future__ import annotations

import heapq
import time

import numpy as np

__all__ = ["select_detections", "with_nms", "nms_seconds"]


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one xyxy box with each of ``others``: torchvision's ``box_iou`` (a zero-area pair gives NaN, which
    suppresses nothing)."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    w = np.clip(np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0]), 0, None)
    h = np.clip(np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1]), 0, None)
    inter = w * h
    with np.errstate(divide="ignore", invalid="ignore"):
        return inter / (area + areas - inter)


def select_detections(candidates: np.ndarray, score_thresh: float = 0.05, iou: float = 0.6,
                      max_det: int = 100) -> np.ndarray:
    """``[B, N, 4 + C]`` candidates -> ``[K, 7]`` rows (module docstring), float32."""
    candidates = np.asarray(candidates, dtype=np.float32)
    if candidates.ndim != 3 or candidates.shape[-1] < 5:
        raise ValueError(f"candidates must be [B, N, 4 + C] (boxes then class scores), got shape {candidates.shape}")
    rows = []
    for b, image in enumerate(candidates):
        rows += [(b, *image[i, :4], s, c) for s, c, i in _image_detections(image, score_thresh, iou, max_det)]
    return np.asarray(rows, dtype=np.float32).reshape(-1, 7)


def _image_detections(image: np.ndarray, score_thresh: float, iou: float, max_det: int) -> list:
    """(score, class, location) of one image's detections, best first.

    Greedy NMS per class, then the best ``max_det`` over all classes, computed in one pass in score order over
    all classes at once: a class's greedy decisions depend only on its own better boxes, so taking the best
    surviving box of any class next, and stopping at ``max_det``, keeps exactly what per-class NMS followed by the
    top ``max_det`` keeps, with at most ``max_det`` suppression steps instead of up to ``max_det`` per class (a
    real photo has thousands of candidates above 0.05).  Equal scores go to the lower class, then the earlier
    location."""
    boxes, scores = image[:, :4], image[:, 4:]
    remaining, heads = {}, []  # per class: its surviving locations, best first; a heap of each class's best
    for c in range(scores.shape[1]):
        idx = np.nonzero(scores[:, c] > score_thresh)[0]
        if idx.size:
            remaining[c] = idx[np.argsort(-scores[idx, c], kind="stable")]
            heads.append((-scores[remaining[c][0], c], c))
    heapq.heapify(heads)
    found = []
    while heads and len(found) < max_det:
        neg_score, c = heapq.heappop(heads)
        best, rest = remaining[c][0], remaining[c][1:]
        found.append((-neg_score, c, best))
        rest = rest[~(_iou(boxes[best], boxes[rest]) > iou)]
        remaining[c] = rest
        if rest.size:
            heapq.heappush(heads, (-scores[rest[0], c], c))
    return found


def with_nms(run, nms: dict):
    """``run(batch) -> candidates`` finished by :func:`select_detections` with an artifact's ``nms`` settings
    (``score_thresh``, ``iou``, ``max_det``), so that it returns the rows every detection artifact returns; the time
    the last call spent in NMS is ``nms_seconds(run)``, every call's in ``run.nms_log``."""
    def finished(x: np.ndarray) -> np.ndarray:
        candidates = run(x)
        t0 = time.perf_counter()
        out = select_detections(candidates, float(nms["score_thresh"]), float(nms["iou"]), int(nms["max_det"]))
        finished.nms_seconds = time.perf_counter() - t0
        if len(finished.nms_log) < 100_000:
            finished.nms_log.append(finished.nms_seconds)
        return out

    finished.nms_seconds = 0.0
    finished.nms_log = []  # every call's NMS time, for a timing that wants them beside its latencies
    return finished


def nms_seconds(run) -> float | None:
    """What the runner's last call spent in NMS outside its graph; None for a runner without one."""
    return getattr(run, "nms_seconds", None)
