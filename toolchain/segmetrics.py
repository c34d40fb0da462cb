"""Mean IoU for segmentation: the confusion matrix, and a model scored over a split at each mask's own resolution
(beside detmetrics.py, which scores a detector)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from vfm_toolchain.core.console import track
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.data.segmentation import IGNORE_INDEX, SegmentationDataset
from vfm_toolchain.devices import loader_kwargs

__all__ = ["confusion_matrix", "mean_iou", "segmentation_miou"]


def _stack_images_list_masks(batch):
    """Masks keep their own sizes, so they stay a list."""
    return torch.stack([x for x, _ in batch]), [m for _, m in batch]


@torch.no_grad()
def segmentation_miou(predict: Callable[[torch.Tensor], torch.Tensor], items, pp: Preprocess, num_classes: int,
                      batch_size: int = 16, what: str = "") -> float:
    """Mean IoU of ``predict(images) -> logits (B, C, h, w)`` over a split, at each mask's own resolution: the
    logits are upsampled (bilinear) to the mask, as a user scores a model on their own frames."""
    if not items:
        return float("nan")
    ds = SegmentationDataset(items, pp, train=False)
    cm = torch.zeros(num_classes, num_classes, dtype=torch.long)
    batches = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=_stack_images_list_masks,
                                          **loader_kwargs())
    for x, masks in track(batches, -(-len(ds) // batch_size), f"scoring {what}{len(ds)} images (mIoU)", unit="batch"):
        logits = predict(x).float().cpu()
        for lg, mask in zip(logits, masks):
            if lg.shape[-2:] != mask.shape:
                lg = F.interpolate(lg[None], size=tuple(mask.shape), mode="bilinear", align_corners=False)[0]
            cm += confusion_matrix(lg.argmax(0), mask, num_classes)
    return mean_iou(cm)


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C, C) counts of (target, predicted) over the pixels whose target is not IGNORE_INDEX."""
    valid = target != IGNORE_INDEX
    idx = target[valid] * num_classes + pred[valid]
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def mean_iou(cm: torch.Tensor) -> float:
    """Mean over classes of TP / (TP + FP + FN); classes absent from both target and prediction are left out."""
    tp = cm.diag().double()
    union = cm.sum(0).double() + cm.sum(1).double() - tp
    present = union > 0
    return float((tp[present] / union[present]).mean()) if present.any() else float("nan")
