"""Segmentation data: folders of images with label maps, joint transforms, and mean IoU.

Layout of each split: ``<split>/images/<name>.<ext>`` and ``<split>/masks/<name>.png``, a single-channel
PNG of class ids (``IGNORE_INDEX`` = 255 marks pixels that count for nothing), and ``classes.txt`` in the
train folder (one class name per line, in id order; the first is usually ``background``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from toolchain.data import Preprocess, _interp, _is_image, crop_ratios, load_image
from toolchain.errors import ToolchainError

__all__ = ["IGNORE_INDEX", "scan_segmentation_folder", "read_classes", "SegmentationDataset",
           "seg_train_transform", "seg_eval_transform", "confusion_matrix", "mean_iou",
           "segmentation_miou"]

IGNORE_INDEX = 255


def read_classes(root: str | Path) -> List[str]:
    f = Path(root) / "classes.txt"
    if not f.is_file():
        raise ToolchainError(f"segmentation train folder '{root}' needs classes.txt (one class name per line, "
                             f"in label-id order)")
    classes = [line.strip() for line in f.read_text().splitlines() if line.strip()]
    if len(classes) < 2:
        raise ToolchainError(f"{f} lists {len(classes)} classes; a segmentation task needs at least 2")
    return classes


def scan_segmentation_folder(root: str | Path, role: str, num_classes: int) -> Tuple[List[Tuple[str, str]], List[str]]:
    """(image, mask) pairs of a split and the images skipped (corrupt, no mask, or a mask that does not fit).

    Raises:
        ToolchainError: the folder layout is wrong or nothing usable is left.
    """
    root = Path(root)
    images, masks = root / "images", root / "masks"
    if not images.is_dir() or not masks.is_dir():
        raise ToolchainError(f"{role} folder '{root}' needs images/ and masks/ (masks/<name>.png per image)")
    pairs, bad = [], []
    for img in sorted(p for p in images.rglob("*") if _is_image(p)):
        mask = masks / img.relative_to(images).with_suffix(".png")
        im = load_image(img)
        try:
            with Image.open(mask) as m:
                arr = np.asarray(m)
        except (OSError, ValueError):
            arr = None
        ok = im is not None and arr is not None and arr.ndim == 2 and arr.shape == (im.height, im.width) \
            and int(arr[arr != IGNORE_INDEX].max(initial=0)) < num_classes
        (pairs.append((str(img), str(mask))) if ok else bad.append(str(img)))
    if not pairs:
        raise ToolchainError(f"{role} folder '{root}' has no usable image/mask pairs ({len(bad)} skipped: masks must "
                             f"be single-channel PNGs of the image's size with ids below {num_classes} or 255)")
    return pairs, bad


def seg_train_transform(pp: Preprocess) -> Callable:
    """The same random crop and flip on image and mask (nearest for the mask), colour jitter on the image."""
    from torchvision.transforms import v2 as T

    return T.Compose([T.RandomResizedCrop(pp.hw, scale=(0.5, 1.0), ratio=crop_ratios(pp.hw),
                                          interpolation=_interp(pp.interpolation), antialias=True),
                      T.RandomHorizontalFlip(), T.ColorJitter(0.2, 0.2, 0.2)])


def seg_eval_transform(pp: Preprocess) -> Callable:
    from torchvision.transforms import v2 as T

    return T.Resize(pp.hw, interpolation=_interp(pp.interpolation), antialias=True)


class SegmentationDataset(torch.utils.data.Dataset):
    """(image, mask) paths -> (normalised image (3, H, W) at the model's size, mask int64): (H, W) for training,
    the mask's own (H, W) for scoring."""

    def __init__(self, items: Sequence[Tuple[str, str]], pp: Preprocess, train: bool, augment: str = "light"):
        from toolchain.augment import photometric_augment

        self.items, self.pp, self.train = list(items), pp, train
        self.transform = seg_train_transform(pp) if train else seg_eval_transform(pp)
        # strong: colour ops on the image after the shared geometry (they move no pixel, so the mask holds)
        self.photometric = photometric_augment(2, 9) if train and augment == "strong" else None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as TF

        img_path, mask_path = self.items[i]
        im = load_image(img_path) or Image.new("RGB", self.pp.hw[::-1])  # PIL: (w, h)
        with Image.open(mask_path) as m:
            mask = np.asarray(m, dtype=np.uint8)
        img = tv_tensors.Image(TF.pil_to_tensor(im))
        if mask.shape != (im.height, im.width):  # an image replaced after the scan: ignore its pixels
            mask = np.full((im.height, im.width), IGNORE_INDEX, dtype=np.uint8)
        msk = torch.from_numpy(mask.copy())
        if self.train:
            img, msk = self.transform(img, tv_tensors.Mask(msk))
            if self.photometric is not None:
                img = self.photometric(img)
        else:  # scoring: the image at the model's size, the mask at its own resolution (the predictions go to it)
            img = self.transform(img)
        x = TF.normalize(img.float() / 255.0, self.pp.mean, self.pp.std)
        return x.as_subclass(torch.Tensor), msk.as_subclass(torch.Tensor).long()


def _stack_images_list_masks(batch):
    """Masks keep their own sizes, so they stay a list."""
    return torch.stack([x for x, _ in batch]), [m for _, m in batch]


@torch.no_grad()
def segmentation_miou(predict: Callable[[torch.Tensor], torch.Tensor], items, pp: Preprocess, num_classes: int,
                      batch_size: int = 16, what: str = "") -> float:
    """Mean IoU of ``predict(images) -> logits (B, C, h, w)`` over a split, at each mask's own resolution: the
    logits are upsampled (bilinear) to the mask, as a user scores a model on their own frames."""
    import torch.nn.functional as F

    from toolchain.console import track
    from toolchain.devices import loader_kwargs

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
