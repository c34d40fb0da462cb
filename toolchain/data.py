"""Images in, tensors out: robust decoding, ImageFolder scanning, datasets and transforms.

Users' folders hold whatever their cameras and scrapers produced.  Every image goes through
:func:`load_image`, which converts grayscale, palette, RGBA, 16-bit and CMYK images to 8-bit RGB, and
returns ``None`` for a corrupt or truncated file so the caller can skip and count it instead of dying
an hour into a build.
"""
from __future__ import annotations

import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageFile

from toolchain.errors import ToolchainError
from toolchain.sizes import ImageSize, canonical_size, crop_ratios, image_hw, size_text
from toolchain.pools import IMAGE_EXTENSIONS, expand_sources, item_exists, list_pool_source, read_item

__all__ = ["IMAGE_EXTENSIONS", "load_image", "scan_image_folder", "scan_pool", "ImageListDataset",
           "Preprocess", "train_transform", "eval_transform", "FolderScan", "ImageSize",
           "image_hw", "size_text", "crop_ratios", "canonical_size"]


# Truncated files must fail loudly in load_image (and be counted), not decode half an image silently.
ImageFile.LOAD_TRUNCATED_IMAGES = False


def load_image(path: str | Path) -> Optional[Image.Image]:
    """Decode ``path`` (a file, or a ``shard.tar::member`` pool item) into an 8-bit RGB PIL image, or
    ``None`` when it is corrupt, truncated or missing from its shard."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(read_item(str(path))) as im:
                im.load()
                return _to_rgb(im)
    except (OSError, ValueError, SyntaxError, KeyError, Image.DecompressionBombError):
        return None


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit / 32-bit single channel: scale the actual range to 0..255 rather than clipping.
        arr = np.asarray(im, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(arr)
        im = Image.fromarray(arr.astype(np.uint8), mode="L")
    if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))  # composite on white, the common viewer default
        im = Image.alpha_composite(bg, im)
    return im.convert("RGB")


def _is_image(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")


@dataclass
class FolderScan:
    """An ImageFolder: class names in sorted order, (path, label) samples, and the files that failed."""

    root: str
    classes: List[str]
    samples: List[Tuple[str, int]]
    corrupt: List[str] = field(default_factory=list)


def class_folders(root: str | Path) -> List[str]:
    """The class names of an ImageFolder: its visible subfolders, sorted (label i is the i-th)."""
    return sorted(d.name for d in Path(root).iterdir() if d.is_dir() and not d.name.startswith("."))


def check_same_classes(train: Sequence[str], other: Sequence[str], role: str) -> None:
    """Every split must have train's class folders, or labels would mean different classes."""
    if list(other) != list(train):
        raise ToolchainError(
            f"{role} classes differ from train classes: only in train {sorted(set(train) - set(other))}, only in "
            f"{role} {sorted(set(other) - set(train))}. Every split needs the same class folders.")


def scan_image_folder(root: str | Path, role: str, verify: bool = True) -> FolderScan:
    """Scan an ImageFolder (``root/<class>/*.jpg``); decode each image once to find corrupt files.

    Raises:
        ToolchainError: the folder is missing, has no class folders, or a class folder has no images.
    """
    root = Path(root)
    if not root.is_dir():
        raise ToolchainError(f"{role} folder '{root}' does not exist (expected an ImageFolder: {role}/<class>/<image>)")
    classes = class_folders(root)
    if not classes:
        raise ToolchainError(f"{role} folder '{root}' has no class folders (expected {role}/<class>/<image>)")
    samples, corrupt = [], []
    for label, cls in enumerate(classes):
        files = sorted(p for p in (root / cls).rglob("*") if _is_image(p))
        if not files:
            raise ToolchainError(
                f"{role} class folder '{root / cls}' has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                f"add images or remove the folder"
            )
        n_ok = 0
        for p in files:
            if verify and load_image(p) is None:
                corrupt.append(str(p))
                continue
            samples.append((str(p), label))
            n_ok += 1
        if n_ok == 0:
            raise ToolchainError(f"{role} class folder '{root / cls}' has only corrupt images ({len(files)} files)")
    return FolderScan(str(root), classes, samples, corrupt)


def scan_pool(roots: Sequence[str | Path], verify: bool = True) -> Tuple[List[str], List[str]]:
    """All images of the pool sources (folders, file lists, tar shards); returns (good items, corrupt items).

    A listed file that is missing or undecodable is corrupt: skipped and counted, never fatal."""
    good, corrupt = [], []
    for root in roots:
        items = list_pool_source(str(root))
        if not items:
            raise ToolchainError(f"pool source '{root}' has no images ({', '.join(IMAGE_EXTENSIONS)})")
        for p in items:
            (good if not verify or load_image(p) is not None else corrupt).append(p)
    if not good:
        raise ToolchainError(f"the unlabeled pool ({', '.join(map(str, roots))}) has no readable images")
    return good, corrupt


# ---------------------------------------------------------------------------------------------------
# preprocessing travels with the model (open_clip style) and is applied the same way everywhere


@dataclass
class Preprocess:
    size: ImageSize  # one side, or (height, width)
    mean: Tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: Tuple[float, float, float] = (0.229, 0.224, 0.225)
    interpolation: str = "bilinear"

    def __post_init__(self):
        self.size = canonical_size(self.size)

    @property
    def hw(self) -> Tuple[int, int]:
        return image_hw(self.size)

    def to_dict(self) -> Dict:
        size = list(self.size) if isinstance(self.size, tuple) else self.size
        return {"size": size, "mean": list(self.mean), "std": list(self.std), "interpolation": self.interpolation}

    @classmethod
    def from_dict(cls, d: Dict) -> "Preprocess":
        return cls(d["size"], tuple(d["mean"]), tuple(d["std"]), d.get("interpolation", "bilinear"))


def _interp(name: str):
    from torchvision.transforms import InterpolationMode

    return {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
            "nearest": InterpolationMode.NEAREST}.get(name, InterpolationMode.BILINEAR)


def eval_transform(pp: Preprocess) -> Callable:
    from torchvision.transforms import v2 as T

    return T.Compose([T.Resize(pp.hw, interpolation=_interp(pp.interpolation), antialias=True),
                      T.ToImage(), T.ToDtype(torch.float32, scale=True), T.Normalize(pp.mean, pp.std)])


def train_transform(pp: Preprocess, augment: str = "light") -> Callable:
    """Augmentation for training on labels.  light: random resized crop (60-100%), flip, mild colour jitter;
    strong (timm's few-label recipe): crop 25-100%, flip, RandAugment 2 ops at magnitude 9, random erasing;
    strong_shift: strong with :func:`label_geometry`'s shift in place of the resized crop."""
    from torchvision.transforms import v2 as T

    strong = augment != "light"
    colour = T.RandAugment(num_ops=2, magnitude=9) if strong else T.ColorJitter(0.2, 0.2, 0.2)
    tail = [T.RandomErasing(p=0.25, value=0)] if strong else []
    return T.Compose([label_geometry(pp, augment), T.RandomHorizontalFlip(), colour, T.ToImage(),
                      T.ToDtype(torch.float32, scale=True), T.Normalize(pp.mean, pp.std), *tail])


def label_geometry(pp: Preprocess, augment: str) -> Callable:
    """The crop of :func:`train_transform`: a random resized crop (light 60-100% of the area, strong 25-100%),
    or for strong_shift the CIFAR recipe's shift (resize, reflect-pad by 1/8 of each side, crop back at a random
    offset), which keeps the scale: for small images whose object fills the frame, a 25% crop of a 32 px photo
    can leave none of the object in it."""
    from torchvision.transforms import v2 as T

    if augment not in ("light", "strong", "strong_shift"):
        raise ToolchainError(f"unknown augmentation '{augment}'; use light, strong or strong_shift")
    if augment == "strong_shift":
        pad = [max(1, side // 8) for side in pp.hw[::-1]]  # torchvision's order: (left/right, top/bottom)
        return T.Compose([T.Resize(pp.hw, interpolation=_interp(pp.interpolation), antialias=True),
                          T.RandomCrop(pp.hw, padding=pad, padding_mode="reflect")])
    return T.RandomResizedCrop(pp.hw, scale=(0.25 if augment == "strong" else 0.6, 1.0), ratio=crop_ratios(pp.hw),
                               interpolation=_interp(pp.interpolation), antialias=True)


class ImageListDataset(torch.utils.data.Dataset):
    """(path, label) pairs through a transform.  Decoded images are kept in memory when they fit the budget.

    A file that became unreadable after the scan yields a black image and is counted in ``self.failed``
    instead of killing a worker.
    """

    def __init__(self, items: Sequence[Tuple[str, int]], transform: Callable, cache_mb: int = 512):
        self.items = list(items)
        self.transform = transform
        self.cache: Dict[int, Image.Image] = {}
        self.cache_budget = cache_mb * (1 << 20)
        self.cache_bytes = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self.items)

    def image(self, i: int) -> Image.Image:
        im = self.cache.get(i)
        if im is None:
            path = self.items[i][0]
            if not item_exists(path):
                raise ToolchainError(f"image '{path}' is listed in the data index but no longer exists; "
                                     f"restore it or delete the data.prepare folder in the store to rescan")
            im = load_image(path)
            if im is None:
                self.failed += 1
                im = Image.new("RGB", (32, 32))
            nbytes = im.width * im.height * 3
            if self.cache_bytes + nbytes <= self.cache_budget:
                self.cache[i] = im
                self.cache_bytes += nbytes
        return im

    def __getitem__(self, i: int):
        return self.transform(self.image(i)), self.items[i][1]


def seeded(seed: int):
    """Seed python, numpy and torch together (one call at the top of every stage)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
