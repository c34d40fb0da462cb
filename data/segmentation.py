"""Segmentation data: folders of images with label maps, and joint transforms.

Layout of each split: ``<split>/images/<name>.<ext>`` and ``<split>/masks/<name>.png``, a single-channel
PNG of class ids (``IGNORE_INDEX`` = 255 marks pixels that count for nothing), and ``classes.txt`` in the
train folder (one class name per line, in id order; the first is usually ``background``).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.roots import DataRoots
from vfm_toolchain.data.images import Preprocess, _interp, _is_image, crop_ratios, load_image, read_image

__all__ = ["IGNORE_INDEX", "mask_polygons", "scan_segmentation_folder", "list_segmentation_pairs", "check_label_budget",
           "read_classes", "SegmentationDataset",
           "seg_train_transform", "seg_eval_transform"]

IGNORE_INDEX = 255


def read_classes(root: str | Path, data_roots: Sequence[str] = ()) -> List[str]:
    """The class names of a segmentation train folder's classes.txt, in id order."""
    f = Path(root) / "classes.txt"
    DataRoots(root, data_roots).check_links(root, [f])
    if not f.is_file():
        raise ToolchainError(f"segmentation train folder '{root}' needs classes.txt (one class name per line, "
                             f"in label-id order)")
    lines = [line.strip() for line in f.read_text().splitlines()]
    classes = [name for name in lines if name]
    if len(classes) < 2:
        raise ToolchainError(f"{f} lists {len(classes)} classes; a segmentation task needs at least 2")
    # a name twice gives one class two ids: which one a mask means is a guess, and the per-class scores and the
    # exported label list would show two classes of one name
    seen: Dict[str, List[int]] = defaultdict(list)
    for number, name in enumerate(lines, start=1):
        if name:
            seen[name].append(number)
    twice = {name: numbers for name, numbers in seen.items() if len(numbers) > 1}
    if twice:
        shown = "; ".join(f"'{name}' {_times(len(n))} (lines {', '.join(map(str, n[:-1]))} and {n[-1]})"
                          for name, n in list(twice.items())[:5])
        raise ToolchainError(f"'{f}' names {shown}. Each line is the class of one mask id (line order is id "
                             f"order), so list every class once: rename the class or remove the repeated line, "
                             f"and check the masks' ids still match")
    return classes


def _times(n: int) -> str:
    return "twice" if n == 2 else f"{n} times"


def list_segmentation_pairs(root: str | Path, role: str,
                            data_roots: Sequence[str] = ()) -> Tuple[List[Tuple[Path, Path]], List[Tuple[Path, Path]]]:
    """From a split's listing, nothing decoded: its (image, mask) pairs, and the (image, expected mask) of the
    images without a mask file.

    Raises:
        ToolchainError: the folder has no images/ or masks/, or holds a symlink that leads outside it and
            ``data_roots`` (core/roots.py).
    """
    root = Path(root)
    images, masks = root / "images", root / "masks"
    if not images.is_dir() or not masks.is_dir():
        raise ToolchainError(f"{role} folder '{root}' needs images/ and masks/ (masks/<name>.png per image)")
    allowed = DataRoots(root, data_roots)
    allowed.check_links(root, [images, masks])
    found = sorted(p for p in images.rglob("*") if _is_image(p))
    allowed.check_links(images, found)
    allowed.check_links(masks, sorted(masks.rglob("*.png")))
    pairs, unlabeled = [], []
    for img in found:
        mask = masks / img.relative_to(images).with_suffix(".png")
        (pairs if mask.is_file() else unlabeled).append((img, mask))
    return pairs, unlabeled


def scan_segmentation_folder(root: str | Path, role: str, num_classes: int,
                             data_roots: Sequence[str] = ()) -> Tuple[List[Tuple[str, str]], Dict[str, str]]:
    """(image, mask) pairs of a split and the images skipped, each with why (corrupt, no mask, or a mask that
    does not fit).

    Raises:
        ToolchainError: the folder layout is wrong or nothing usable is left.
    """
    listed, unlabeled = list_segmentation_pairs(root, role, data_roots)
    bad = {str(img): f"no mask (expected '{mask}')" for img, mask in unlabeled}
    pairs = []
    for img, mask in listed:
        why = _pair_problem(img, mask, num_classes)
        if why:
            bad[str(img)] = why
        else:
            pairs.append((str(img), str(mask)))
    if not pairs:
        raise ToolchainError(f"{role} folder '{root}' has no usable image/mask pairs ({len(bad)} skipped: masks must "
                             f"be single-channel PNGs of the image's size with ids below {num_classes} or 255)")
    return pairs, dict(sorted(bad.items()))


def _pair_problem(img: Path, mask: Path, num_classes: int) -> str:
    """Why an image/mask pair cannot be used, or ""."""
    im, why = read_image(img)
    if im is None:
        return why
    try:
        with Image.open(mask) as m:
            if m.size != im.size:  # said from the header: a mask of another size is not decoded
                return (f"its mask '{mask}' is {m.width}x{m.height} but the image is {im.width}x{im.height}; "
                        f"they must be the same size")
            arr = np.asarray(m)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        return f"its mask '{mask}' cannot be read: {exc}"
    if arr.ndim != 2:
        return f"its mask '{mask}' has shape {arr.shape}; a mask is a single-channel PNG of class ids"
    top = int(arr[arr != IGNORE_INDEX].max(initial=0))
    if top >= num_classes:
        return (f"its mask '{mask}' has class id {top} but classes.txt lists {num_classes} classes (ids 0 to "
                f"{num_classes - 1}, and {IGNORE_INDEX} for pixels to ignore)")
    return ""


def check_label_budget(root: str | Path, pairs: int, budget: Optional[int], has_val: bool, unlabeled: int = 0) -> None:
    """The train folder's usable pairs must cover the label budget (``data.labeled_per_class``, which for
    segmentation counts labeled images, not images per class) and, without a val folder, leave at least one
    pair for validation (the labels outside the budget, or ``data.val_fraction`` of them, are the validation set,
    as in classification).

    Raises:
        ToolchainError: too few pairs, naming the counts and the largest budget allowed.
    """
    most = pairs if has_val else pairs - 1
    without = f" ({unlabeled} image{'s' * (unlabeled != 1)} without a mask)" if unlabeled else ""
    if most < 1:
        raise ToolchainError(
            f"the segmentation train folder '{root}' has {pairs} labeled image/mask pair{'s' * (pairs != 1)}"
            f"{without}: training needs at least 1, and without data.val 1 more for validation; add labeled "
            f"images{'' if has_val else ' or give data.val'}")
    if not budget:
        return
    if budget > pairs:
        raise ToolchainError(
            f"data.labeled_per_class is {budget} but the segmentation train folder '{root}' has {pairs} labeled "
            f"image/mask pairs{without}; for segmentation the budget counts labeled images, not images per class. "
            f"Lower it to at most {most}{'' if has_val else ' (without data.val one is left for validation)'} "
            f"or add labeled images")
    if budget > most:
        raise ToolchainError(
            f"data.labeled_per_class is {budget}, every labeled image/mask pair of '{root}', which leaves no "
            f"validation images: give data.val, or lower data.labeled_per_class to at most {most}")


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
        from vfm_toolchain.data.augment import photometric_augment

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


def mask_polygons(mask: np.ndarray, label: int, most: int = 200, min_area: float = 16.0) -> List[np.ndarray]:
    """The outlines of the regions of ``label`` in a class-id mask, as (K, 2) arrays of x, y in pixels (pixel
    corners, so a region of one pixel at (0, 0) is the square 0..1), at most ``most`` points each; regions under
    ``min_area`` pixels are left out."""
    import contourpy

    region = np.pad((mask == label).astype(np.float64), 1)
    lines = contourpy.contour_generator(z=region, line_type=contourpy.LineType.Separate).lines(0.5)
    out = []
    for line in lines:
        xy = np.asarray(line, dtype=np.float64) - 1 + 0.5  # undo the pad; contour at pixel centres -> corners
        x, y = xy[:, 0], xy[:, 1]
        area = 0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))
        if area < min_area or len(xy) < 3:
            continue
        if len(xy) > most:
            xy = xy[np.linspace(0, len(xy) - 1, most).astype(int)]
        out.append(xy)
    return out
