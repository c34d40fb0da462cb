"""Detection accuracy: COCO mAP@[.5:.95], mAP50 and per-class AP, at each image's own resolution.

The numbers are COCO's own (torchmetrics' ``MeanAveragePrecision`` on the ``faster_coco_eval`` backend, a
maintained C++ reimplementation of pycocotools' COCOeval that gives the same results): 101-point interpolated
precision, IoU thresholds 0.50:0.05:0.95, at most ``max_detections`` (100) detections per image, area "all".
A model predicts at its input size (the image resized, not letterboxed, to (h, w)); its boxes are mapped back
through each image's own scale factors and scored against the image's own boxes, as a user scores a detector on
their own frames, so the score does not depend on the input size the boxes were squashed to.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence

import torch

from vfm_toolchain.data.images import Preprocess

__all__ = ["to_original", "coco_map", "detection_map"]


def to_original(boxes: torch.Tensor, scale, orig_size) -> torch.Tensor:
    """Boxes (N, 4) xyxy in input pixels -> the image's own pixels: x / sx, y / sy, clipped to the image
    (``scale`` = (sx, sy) and ``orig_size`` = (h, w), as :class:`vfm_toolchain.data.detection.DetectionDataset` gives
    them)."""
    sx, sy = scale
    h, w = orig_size
    out = boxes.float() / torch.tensor([sx, sy, sx, sy], dtype=torch.float32)
    return torch.stack([out[:, 0].clamp(0, w), out[:, 1].clamp(0, h), out[:, 2].clamp(0, w), out[:, 3].clamp(0, h)],
                       dim=1) if len(out) else out.reshape(0, 4)


def coco_map(predictions: Sequence[Dict[str, torch.Tensor]], targets: Sequence[Dict[str, torch.Tensor]],
             classes: Sequence[str], max_detections: int = 100) -> Dict[str, object]:
    """COCO mAP of per-image predictions (``boxes`` xyxy, ``scores``, ``labels``) against per-image targets
    (``boxes``, ``labels``), in one coordinate frame.

    Returns ``{"map": mAP@[.5:.95], "map50": mAP@.5, "map75": mAP@.75, "per_class_ap": {name: AP@[.5:.95]}}``;
    an AP is None for a class with no box in the targets (COCO leaves it out of the mean), and the means are
    NaN when no class has one.  Each image keeps its ``max_detections`` highest-scoring predictions.
    """
    from torchmetrics.detection import MeanAveragePrecision

    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", class_metrics=True,
                                  max_detection_thresholds=[1, 10, max_detections], backend="faster_coco_eval")
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} images; give one per image, empty "
                         f"where nothing was found")
    preds, gts = [], []
    for p, t in zip(predictions, targets):
        keep = p["scores"].float().argsort(descending=True)[:max_detections]
        preds.append({"boxes": p["boxes"].float()[keep].reshape(-1, 4), "scores": p["scores"].float()[keep],
                      "labels": p["labels"].long()[keep]})
        gts.append({"boxes": t["boxes"].float().reshape(-1, 4), "labels": t["labels"].long()})
    present = set(int(c) for t in gts for c in t["labels"])
    if not present:
        return {"map": math.nan, "map50": math.nan, "map75": math.nan,
                "per_class_ap": {name: None for name in classes}}
    metric.update(preds, gts)
    r = metric.compute()
    by_class = dict(zip([int(c) for c in r["classes"].reshape(-1)], [float(v) for v in r["map_per_class"].reshape(-1)]))
    # COCO's -1 marks a class with no ground truth (only false positives): undefined, not zero
    per_class = {name: (by_class.get(i, 0.0) if i in present else None) for i, name in enumerate(classes)}
    return {"map": float(r["map"]), "map50": float(r["map_50"]), "map75": float(r["map_75"]),
            "per_class_ap": per_class}


@torch.no_grad()
def detection_map(predict: Callable[[torch.Tensor], List[Dict[str, torch.Tensor]]], records: Sequence[Dict],
                  pp: Preprocess, classes: Sequence[str], batch_size: int = 16, max_detections: int = 100,
                  what: str = "") -> Dict[str, object]:
    """COCO mAP of ``predict(images (B, 3, H, W)) -> [{"boxes", "scores", "labels"}, ...]`` (boxes xyxy in input
    pixels) over a split's records, at each image's own resolution: the predicted boxes are mapped back through
    the resize (:func:`to_original`) and scored against the record's own boxes.  ``classes``: the class names
    (their number is the model's class count).  Returns what :func:`coco_map` does."""
    from vfm_toolchain.core.console import track
    from vfm_toolchain.data.detection import DetectionDataset, detection_collate
    from vfm_toolchain.devices import loader_kwargs

    if not records:
        return {"map": math.nan, "map50": math.nan, "map75": math.nan,
                "per_class_ap": {name: None for name in classes}}
    ds = DetectionDataset(records, pp, train=False)
    batches = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=detection_collate, **loader_kwargs())
    preds, gts = [], []
    for x, targets in track(batches, -(-len(ds) // batch_size), f"scoring {what}{len(ds)} images (mAP)", unit="batch"):
        for p, t in zip(predict(x), targets):
            rec = records[t["index"]]
            preds.append({"boxes": to_original(p["boxes"].detach().cpu(), t["scale"], t["orig_size"]),
                          "scores": p["scores"].detach().cpu(), "labels": p["labels"].detach().cpu()})
            gts.append({"boxes": torch.tensor(rec["boxes"], dtype=torch.float32).reshape(-1, 4),
                        "labels": torch.tensor(rec["labels"], dtype=torch.int64)})
    return coco_map(preds, gts, classes, max_detections)
