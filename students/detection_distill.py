"""Distilling the finetuned detection teacher into a student detector (issue 38), the detection form of
seed 004's task-oriented transfer (sec. 2, Fig. 1b) and of its task-agnostic feature transfer (Fig. 1d).

Teacher and student are FCOS detectors with the same strides (8 / 16 / 32) and head layout at the same input
size, so location n of one is location n of the other (blocks/detection.py says why FCOS).  What the student
learns from, per (image, seeded view), chosen by ``distill.detection_targets``:

- ``dense`` (:class:`DenseDetection`): at every location the teacher's sigmoid class probabilities are soft
  targets of a quality focal loss (GFL, Li et al. 2020; BCE against the probability, scaled by the squared gap,
  so the many background locations both already agree on add little), normalised by the sum of the teacher's
  per-location top probability (a soft count of its objects); where the teacher is confident (its detection
  score ``sqrt(p_max * quality)`` of at least DENSE_MIN_SCORE, what it would report as a box at all), the
  student's box regresses the teacher's box by GIoU and its quality the teacher's quality by a Bernoulli KL,
  both weighted by that score.  Seed 004's per-pixel KL for segmentation is the same idea on a softmax.
- ``both``: the dense targets, and the teacher's own post-NMS detections above a score threshold (chosen on val
  by the F1 of its boxes against the val boxes at IoU 0.5, :func:`choose_pseudo_threshold`, unless
  ``distill.pseudo_threshold`` fixes it) as labels for the detector's own loss (focal, GIoU, quality): the sum.
  (The pseudo boxes alone taught least: docs/results.md.)

Both kinds are packed in one half-precision row per (image, view) by ``target``, so the cache of
students/distill.py stores them as it stores logits; with ``teacher_outputs: online`` the same ``target`` runs
on every step.

Task-agnostic (:class:`NeckImitation`): the student's FPN maps regress the teacher's FPN maps at every location
(a 1x1 projection where the widths differ; cosine or smooth-L1 per location, each level an equal part).  The
neck is the finetuned teacher's: the pretrained foundation model has no neck (a new FPN is random), and its
last-layer features (what classification distills) say nothing about the strides a detector reads.  The head
is left untrained, for student.finetune.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torchvision.ops import box_iou, generalized_box_iou_loss

from vfm_toolchain.blocks.detection import STRIDES, Detector, level_points, select_detections
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.devices import inference_autocast, loader_kwargs, on_device
from vfm_toolchain.students.losses import bernoulli_kl, quality_focal_loss
from vfm_toolchain.students.objectives import OBJECTIVES, _regression_loss

__all__ = ["DENSE_MIN_SCORE", "PSEUDO_MAX", "PSEUDO_NMS_IOU", "DenseDetection", "NeckImitation",
           "dense_detection_loss", "dense_targets", "flat_neck", "neck_width", "choose_pseudo_threshold", "location_grid"]

DENSE_MIN_SCORE = 0.05  # the teacher's decode threshold: below it the teacher reports no box, so none is taught
PSEUDO_MAX = 100  # pseudo boxes kept per view (the detector's max_det)
PSEUDO_NMS_IOU = 0.6  # the detector's own NMS
THRESHOLDS = tuple(round(0.05 * k, 2) for k in range(1, 20))  # the pseudo-label thresholds tried on val


def location_grid(image_hw: Tuple[int, int], strides: Sequence[int] = STRIDES, device=None
                  ) -> Tuple[torch.Tensor, List[int]]:
    """(N, 2) location centres (x, y) of every level, in :meth:`Detector.flatten`'s order, and each level's
    number of locations."""
    h, w = image_hw
    pts = [level_points(h // s, w // s, s, device) for s in strides]
    return torch.cat(pts), [len(p) for p in pts]


def _xyxy(points: torch.Tensor, ltrb: torch.Tensor) -> torch.Tensor:
    return torch.cat([points - ltrb[..., :2], points + ltrb[..., 2:]], dim=-1)


def dense_detection_loss(flat: Dict[str, torch.Tensor], teacher: torch.Tensor, num_classes: int,
                         min_score: float = DENSE_MIN_SCORE) -> Dict[str, torch.Tensor]:
    """The dense loss (module docstring) of the student's :meth:`Detector.flatten` output against the teacher's
    rows (B, N, C + 5): class probabilities, box distances (l, t, r, b) in pixels, quality probability.
    Returns ``cls``, ``box``, ``quality`` and their sum ``total``."""
    c = num_classes
    s_cls, s_box, s_q = flat["cls"].float(), flat["box"].float(), flat["quality"].float()
    t_cls, t_box, t_q = teacher[..., :c], teacher[..., c:c + 4], teacher[..., c + 4]
    t_max = t_cls.max(dim=-1).values                                              # (B, N)
    cls = quality_focal_loss(s_cls, t_cls).sum() / t_max.sum().clamp(min=1.0)
    score = (t_max * t_q).clamp(min=0).sqrt()                                     # what the teacher's decode ranks
    confident = score >= min_score
    if confident.any():
        w = score[confident]
        pts = flat["points"][None].expand(s_box.shape[0], -1, -1)[confident]
        giou = generalized_box_iou_loss(_xyxy(pts, s_box[confident]), _xyxy(pts, t_box[confident]),
                                        reduction="none")
        box = (giou * w).sum() / w.sum()
        quality = (bernoulli_kl(s_q[confident], t_q[confident]) * w).sum() / w.sum()
    else:  # a view where the teacher sees nothing: only the class loss teaches (zeros keep the graph whole)
        box, quality = s_box.sum() * 0, s_q.sum() * 0
    return {"cls": cls, "box": box, "quality": quality, "total": cls + box + quality}


def dense_targets(raw: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The teacher's :meth:`Detector.forward_dense` rows (B, N, C + 5 logits / pixels) as the dense loss reads
    them: class probabilities, box distances in pixels, quality probability."""
    c = num_classes
    return torch.cat([raw[..., :c].sigmoid(), raw[..., c:c + 4], raw[..., c + 4:].sigmoid()], dim=-1)


@OBJECTIVES.register("detection_dense", teacher="finetuned", task="detection",
                     source="seed 004 sec. 2 (task-oriented), for FCOS detectors: GFL's quality focal loss on the "
                            "teacher's probabilities, GIoU on its boxes")
class DenseDetection(nn.Module):
    """Task-oriented detection distillation; ``targets``: ``dense`` or ``both``; ``pseudo_threshold``: the
    teacher's score a pseudo box needs (both)."""

    def __init__(self, student: Detector, image_hw: Tuple[int, int], targets: str = "dense",
                 pseudo_threshold: Optional[float] = None, **_):
        super().__init__()
        if targets not in ("dense", "both"):
            raise ValueError(f"unknown detection targets '{targets}'; use dense or both")
        if targets != "dense" and pseudo_threshold is None:
            raise ValueError(f"detection targets '{targets}' need a pseudo-box score threshold")
        self.student, self.image_hw = student, tuple(image_hw)
        self.num_classes = student.num_classes
        self.pseudo = targets == "both"
        self.threshold = pseudo_threshold
        points, _ = location_grid(self.image_hw, student.strides)
        self.register_buffer("points", points, persistent=False)  # follows the objective's device, never saved
        self.locations = len(points)

    @property
    def dense_width(self) -> int:
        return self.locations * (self.num_classes + 5)

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        """The teacher's :meth:`Detector.forward_dense` rows (B, N, C + 5 logits / pixels) -> one half-precision
        row per image: the dense targets (probabilities, distances, quality probability), then the pseudo boxes
        (PSEUDO_MAX x (x1, y1, x2, y2, score, class), class -1 where there are fewer)."""
        parts = [dense_targets(raw, self.num_classes).flatten(1)]
        if self.pseudo:
            parts.append(self.pseudo_rows(raw).flatten(1))
        return torch.cat(parts, dim=1).half()

    @torch.no_grad()
    def pseudo_rows(self, raw: torch.Tensor) -> torch.Tensor:
        """(B, PSEUDO_MAX, 6) of the teacher's detections above the threshold: the boxes and scores of
        :meth:`Detector.boxes_and_scores` from the flat rows, then the detector's own NMS."""
        c, (h, w) = self.num_classes, self.image_hw
        pts = self.points.to(raw.device)
        d = raw[..., c:c + 4].float()
        boxes = torch.stack([(pts[:, 0] - d[..., 0]).clamp(0, w), (pts[:, 1] - d[..., 1]).clamp(0, h),
                             (pts[:, 0] + d[..., 2]).clamp(0, w), (pts[:, 1] + d[..., 3]).clamp(0, h)], dim=-1)
        scores = (raw[..., :c].float().sigmoid() * raw[..., c + 4:].float().sigmoid()).sqrt().transpose(1, 2)
        det = select_detections(boxes, scores, self.threshold, PSEUDO_NMS_IOU, PSEUDO_MAX)
        rows = raw.new_zeros(raw.shape[0], PSEUDO_MAX, 6, dtype=torch.float32)
        rows[..., 5] = -1
        for b in range(raw.shape[0]):
            mine = det[det[:, 0] == b][:PSEUDO_MAX]
            rows[b, :len(mine)] = mine[:, 1:7]
        return rows

    def split(self, target: torch.Tensor) -> Tuple[Optional[torch.Tensor], Optional[List[Dict[str, torch.Tensor]]]]:
        """A batch of cached rows -> the dense targets (B, N, C + 5) and the pseudo labels (one dict of ``boxes``
        and ``labels`` per image; None when not taught)."""
        t = target.float()
        dense = t[:, :self.dense_width].reshape(len(t), self.locations, self.num_classes + 5)
        pseudo = None
        if self.pseudo:
            rows = t[:, self.dense_width:].reshape(len(t), PSEUDO_MAX, 6)
            pseudo = [{"boxes": r[r[:, 5] >= 0, :4], "labels": r[r[:, 5] >= 0, 5].round().long(),
                       "scores": r[r[:, 5] >= 0, 4]} for r in rows]
        return dense, pseudo

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        out = self.student.forward_levels(x)
        dense, pseudo = self.split(target)
        loss = dense_detection_loss(self.student.flatten(out), dense, self.num_classes)["total"]
        if pseudo is not None:
            loss = loss + self.student.loss(out, pseudo)["total"]
        return loss


def flat_neck(model: Detector, x: torch.Tensor) -> torch.Tensor:
    """(B, N, D): the FPN maps of every level, one row per location in :meth:`Detector.flatten`'s order."""
    return torch.cat([m.flatten(2).transpose(1, 2) for m in model.neck(model.forward_features(x))], dim=1)


def neck_width(model: Detector) -> int:
    return int(model.neck.lateral[0].out_channels)


@OBJECTIVES.register("detection_neck", teacher="finetuned (its FPN)", task="detection",
                     source="seed 004 sec. 3.1 (feature transfer), on the detector's neck: FitNets-style imitation "
                            "of the teacher's FPN maps")
class NeckImitation(nn.Module):
    """The student's FPN maps through a 1x1 projection (a linear map per location; none when the widths match)
    regress the teacher's, ``loss`` cosine or smooth_l1 per location, each level's mean an equal part."""

    def __init__(self, student: Detector, teacher_dim: int, image_hw: Tuple[int, int], loss: str = "cosine", **_):
        super().__init__()
        self.student, self.loss = student, loss
        width = neck_width(student)
        self.proj = nn.Linear(width, teacher_dim) if width != teacher_dim else nn.Identity()
        _, self.level_sizes = location_grid(tuple(image_hw), student.strides)

    def target(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.half()

    def forward(self, x: torch.Tensor, target: torch.Tensor, index=None) -> torch.Tensor:
        s = self.proj(flat_neck(self.student, x))                          # (B, N, D_teacher)
        t = target.float()
        levels = zip(s.split(self.level_sizes, dim=1), t.split(self.level_sizes, dim=1))
        return sum(_regression_loss(a, b, self.loss, -1) for a, b in levels) / len(self.level_sizes)


# --------------------------------------------------------------------------------------------------------------
# the pseudo-label threshold, chosen on val


def _true_positives(det: Dict[str, torch.Tensor], boxes: torch.Tensor, labels: torch.Tensor,
                    iou: float) -> np.ndarray:
    """Per detection (best first), whether it matches a box of its class not matched by a better detection, at
    IoU >= ``iou``: the greedy matching of COCO, whose first k steps are the matching of the top k detections,
    so one pass serves every threshold."""
    hits = np.zeros(len(det["scores"]), dtype=bool)
    if not len(boxes) or not len(hits):
        return hits
    ious = box_iou(det["boxes"].float(), boxes.float())
    ious[det["labels"][:, None] != labels[None, :]] = -1
    taken = torch.zeros(len(boxes), dtype=torch.bool)
    for k in range(len(hits)):
        row = ious[k].masked_fill(taken, -1)
        best = int(row.argmax())
        if row[best] >= iou:
            hits[k], taken[best] = True, True
    return hits


@torch.no_grad()
def choose_pseudo_threshold(teacher: Detector, records: Sequence[Dict[str, Any]], pp: Preprocess,
                            iou: float = 0.5, batch_size: int = 16, fallback: float = 0.5) -> Dict[str, Any]:
    """The score threshold at which the teacher's boxes on ``records`` (val) best match their labels: the
    highest F1 at IoU ``iou`` over THRESHOLDS (ties: the higher threshold, cleaner labels).  A pseudo label
    is a box the student must find, so a threshold that costs both as few missed objects and as few false
    boxes as possible is what F1 weighs.  ``fallback`` when val has no box to judge by."""
    from vfm_toolchain.data.detection import DetectionDataset, detection_collate

    if not records or not any(r["boxes"] for r in records):
        return {"threshold": fallback, "chosen_on": f"default {fallback} (val has no boxes to choose it on)"}
    ds = DetectionDataset(records, pp, train=False)
    scores, hits, n_boxes = [], [], 0
    teacher.eval()
    with on_device(teacher) as device:
        batches = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=detection_collate,
                                              **loader_kwargs())
        for x, targets in batches:
            with inference_autocast():
                out = teacher.forward_levels(x.to(device, non_blocking=True))
            out = {k: [v.float() for v in vs] for k, vs in out.items()}
            for det, t in zip(teacher.decode(out, THRESHOLDS[0], PSEUDO_NMS_IOU, PSEUDO_MAX), targets):
                det = {k: v.cpu() for k, v in det.items()}
                scores.append(det["scores"].numpy())
                hits.append(_true_positives(det, t["boxes"], t["labels"], iou))
                n_boxes += len(t["labels"])
    scores, hits = np.concatenate(scores), np.concatenate(hits)
    rows = []
    for thr in THRESHOLDS:
        kept = scores >= thr
        tp = int(hits[kept].sum())
        fp, fn = int(kept.sum()) - tp, n_boxes - tp
        rows.append({"threshold": thr, "f1": 2 * tp / max(2 * tp + fp + fn, 1), "precision": tp / max(tp + fp, 1),
                     "recall": tp / max(n_boxes, 1), "boxes": int(kept.sum())})
    best = max(rows, key=lambda r: (round(r["f1"], 6), r["threshold"]))
    if best["f1"] == 0:
        return {"threshold": fallback, "chosen_on": f"default {fallback} (no teacher box matched a val box)",
                "val_images": len(records), "val_boxes": n_boxes}
    return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in best.items()},
            "chosen_on": f"val: best F1 at IoU {iou}", "val_images": len(records), "val_boxes": n_boxes,
            "tried": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]}
