"""The parity gate: an artifact is accepted only if it reproduces the folded PyTorch model on real inputs.

Dense outputs (logits, masks) are compared element by element (:func:`check_parity`).  A detector's artifact
returns final detections, whose number is decided by a threshold, an NMS and a cap, so its rows are matched
instead (:func:`match_detections`, :func:`check_detection_parity`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["ParityError", "check_parity", "DETECTION_MIN_IOU", "NMS_IOU_ATOL", "match_detections",
           "check_detection_parity"]


class ParityError(ToolchainError):
    """An exported artifact disagrees with PyTorch beyond its tolerance; the build fails."""


def check_parity(name: str, reference: np.ndarray, candidate: np.ndarray, atol: float) -> float:
    if reference.shape != candidate.shape:
        raise ParityError(f"{name}: output shape {candidate.shape} differs from PyTorch {reference.shape}")
    if not np.all(np.isfinite(candidate)):
        raise ParityError(f"{name}: output has NaN/Inf where PyTorch has finite values")
    diff = float(np.max(np.abs(reference.astype(np.float64) - candidate.astype(np.float64))))
    if diff > atol:
        raise ParityError(f"{name}: max |PyTorch - artifact| = {diff:.3g} exceeds the tolerance {atol:.3g}; "
                          f"the artifact is rejected (raise export.parity_atol only if this drift is acceptable)")
    return diff


# --------------------------------------------------------------------------------------------------------------
# Detections: rows (batch_index, x1, y1, x2, y2, score, class) in input pixels (blocks/detection.py)

# The same box: an artifact detection of the same image and class overlapping the PyTorch one by at least this
# IoU.  An fp32 runtime moves a corner by ~1e-5 px (IoU ~ 1 - 1e-6); 0.99 still refuses a shift of half a percent
# of a box's side, which no correct fp32 export produces.  IoU, not pixels: it does not depend on the input size.
DETECTION_MIN_IOU = 0.99
# Two fp32 runtimes compute one IoU ~1e-6 apart; a box whose overlap with a better one lies this close to the NMS
# threshold is suppressed by one and kept by the other, correctly both times
NMS_IOU_ATOL = 1e-4


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) IoU of xyxy boxes, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    area = lambda t: np.clip(t[:, 2] - t[:, 0], 0, None) * np.clip(t[:, 3] - t[:, 1], 0, None)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=-1)
    union = area(a)[:, None] + area(b)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _rows(d: np.ndarray, what: str) -> np.ndarray:
    d = np.asarray(d)
    if d.ndim != 2 or d.shape[1] != 7:
        raise ParityError(f"{what}: detections must be a [K, 7] array of (batch_index, x1, y1, x2, y2, score, class) "
                          f"rows, got shape {d.shape}")
    return d.astype(np.float64)


def match_detections(reference: np.ndarray, candidate: np.ndarray, score_atol: float, score_thresh: float,
                     nms_iou: float, max_det: int, min_iou: float = DETECTION_MIN_IOU) -> Dict[str, Any]:
    """Match the artifact's detections (``candidate``) to PyTorch's (``reference``) on the same images.

    Per image and class, pairs are taken greedily by IoU (highest first), each detection in one pair at most; a
    pair with IoU >= ``min_iou`` is the same box, and its scores must agree within ``score_atol``.  A detection
    left without a partner counts against the artifact unless a difference within ``score_atol`` explains it:

    - its score is within ``score_atol`` of ``score_thresh`` (the other side may score it just under);
    - its image holds ``max_det`` detections on either side and its score is within ``score_atol`` of the last
      one kept there (the cap may cut between two near-equal scores);
    - an unpartnered detection of the other side, same image and class, overlaps it by more than ``nms_iou``
      with a score within ``score_atol``: NMS kept one of two near-equal boxes on each side;
    - its overlap with a detection of the other side, same image and class, scoring at least as well, is within
      ``NMS_IOU_ATOL`` of ``nms_iou``: NMS suppressed it on one side and not on the other, at the threshold.

    Returns counts, ``min_iou`` / ``max_score_diff`` / ``max_box_diff_px`` over the pairs, ``excused`` (the
    detections explained so), and ``problems``: one line for each detection or pair that fails."""
    ref, cand = _rows(reference, "PyTorch"), _rows(candidate, "artifact")
    pairs: List[tuple] = []  # (ref row, cand row, iou)
    lone_ref: List[int] = []
    lone_cand: List[int] = []
    keys = {(r[0], r[6]) for r in ref} | {(c[0], c[6]) for c in cand}
    for b, c in sorted(keys):
        ri = np.flatnonzero((ref[:, 0] == b) & (ref[:, 6] == c))
        ci = np.flatnonzero((cand[:, 0] == b) & (cand[:, 6] == c))
        iou = _iou(ref[ri, 1:5], cand[ci, 1:5]) if len(ri) and len(ci) else np.zeros((len(ri), len(ci)))
        free_r, free_c = set(range(len(ri))), set(range(len(ci)))
        for flat in np.argsort(-iou, axis=None, kind="stable"):
            i, j = divmod(int(flat), len(ci))
            if iou[i, j] < min_iou:
                break
            if i in free_r and j in free_c:
                pairs.append((ri[i], ci[j], float(iou[i, j])))
                free_r.discard(i)
                free_c.discard(j)
        lone_ref += [int(ri[i]) for i in sorted(free_r)]
        lone_cand += [int(ci[j]) for j in sorted(free_c)]

    def last_kept(d: np.ndarray, b: float) -> Optional[float]:
        s = d[d[:, 0] == b, 5]
        return float(s.min()) if len(s) >= max_det else None

    def explained(row: np.ndarray, others: np.ndarray, other_lone: Sequence[int]) -> bool:
        s, b = row[5], row[0]
        if abs(s - score_thresh) <= score_atol:
            return True
        for d in (ref, cand):
            cut = last_kept(d, b)
            if cut is not None and s <= cut + score_atol:
                return True
        same = [others[k] for k in other_lone if others[k, 0] == b and others[k, 6] == row[6]]
        if any(abs(o[5] - s) <= score_atol and _iou(row[None, 1:5], o[None, 1:5])[0, 0] > nms_iou for o in same):
            return True
        better = others[(others[:, 0] == b) & (others[:, 6] == row[6]) & (others[:, 5] >= s - score_atol)]
        return bool(len(better)) and bool((np.abs(_iou(row[None, 1:5], better[:, 1:5])[0] - nms_iou)
                                           <= NMS_IOU_ATOL).any())

    problems: List[str] = []
    excused = 0

    def show(row: np.ndarray) -> str:
        return (f"image {int(row[0])} class {int(row[6])} score {row[5]:.4f} box "
                f"[{', '.join(f'{v:.1f}' for v in row[1:5])}]")

    for k in lone_ref:
        if explained(ref[k], cand, lone_cand):
            excused += 1
        else:
            same = cand[(cand[:, 0] == ref[k, 0]) & (cand[:, 6] == ref[k, 6])]
            best = float(_iou(ref[k][None, 1:5], same[:, 1:5]).max()) if len(same) else 0.0
            problems.append(f"PyTorch's {show(ref[k])} has no artifact detection of its image and class with IoU >= "
                            f"{min_iou} (best IoU {best:.3f})")
    for k in lone_cand:
        if explained(cand[k], ref, lone_ref):
            excused += 1
        else:
            problems.append(f"the artifact's {show(cand[k])} is not among PyTorch's detections")
    score_diff = [abs(ref[i, 5] - cand[j, 5]) for i, j, _ in pairs]
    for (i, j, _), d in zip(pairs, score_diff):
        if d > score_atol:
            problems.append(f"PyTorch's {show(ref[i])} scores {cand[j, 5]:.4f} in the artifact (|diff| {d:.3g} > "
                            f"{score_atol:.3g})")
    return {"reference_detections": len(ref), "artifact_detections": len(cand), "matched": len(pairs),
            "excused": excused, "min_iou": min((p[2] for p in pairs), default=None),
            "max_score_diff": float(max(score_diff, default=0.0)),
            "max_box_diff_px": float(max((np.abs(ref[i, 1:5] - cand[j, 1:5]).max() for i, j, _ in pairs),
                                         default=0.0)),
            "problems": problems}


def check_detection_parity(name: str, reference: np.ndarray, candidate: np.ndarray, score_atol: float,
                           score_thresh: float, nms_iou: float, max_det: int,
                           min_iou: float = DETECTION_MIN_IOU) -> Dict[str, Any]:
    """:func:`match_detections`, raising :class:`ParityError` with the first differences when any detection or
    pair fails; returns the summary without ``problems`` when none does."""
    if not np.all(np.isfinite(np.asarray(candidate, dtype=np.float64))):
        raise ParityError(f"{name}: the detections have NaN/Inf where PyTorch's are finite")
    got = match_detections(reference, candidate, score_atol, score_thresh, nms_iou, max_det, min_iou)
    problems = got.pop("problems")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ParityError(
            f"{name}: the artifact's final detections differ from PyTorch's on the parity images "
            f"({got['reference_detections']} from PyTorch, {got['artifact_detections']} from the artifact, "
            f"{got['matched']} matched as the same box, IoU >= {min_iou}): {len(problems)} "
            f"difference{'s' * (len(problems) != 1)}: {shown}. The artifact is rejected (scores must agree within "
            f"{score_atol:.3g}: raise export.parity_atol only if this drift is acceptable)")
    return got
