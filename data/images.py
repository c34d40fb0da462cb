"""Images in, tensors out: robust decoding, ImageFolder scanning, datasets and transforms.

Users' folders hold whatever their cameras and scrapers produced.  Every image goes through
:func:`read_image`, which converts grayscale, palette, RGBA, 16-bit and CMYK images to 8-bit RGB, and
answers a corrupt, truncated, missing or oversized file with the reason it cannot be used, so the caller can
skip and count it (and say why) instead of dying an hour into a build.
"""
from __future__ import annotations

import random
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.roots import DataRoots
from vfm_toolchain.core.sizes import ImageSize, canonical_size, crop_ratios, image_hw, size_text
from vfm_toolchain.data.pools import IMAGE_EXTENSIONS, item_exists, list_pool_source, read_item

__all__ = ["IMAGE_EXTENSIONS", "load_image", "read_image", "set_max_image_pixels", "DEFAULT_MAX_IMAGE_PIXELS",
           "scan_image_folder", "scan_pool", "scan_pool_with_reasons", "ImageListDataset",
           "Preprocess", "train_transform", "eval_transform", "FolderScan", "ImageSize",
           "image_hw", "size_text", "crop_ratios", "canonical_size"]


# Truncated files must fail loudly in load_image (and be counted), not decode half an image silently.
ImageFile.LOAD_TRUNCATED_IMAGES = False


# Pillow refuses an image of more than twice Image.MAX_IMAGE_PIXELS (a decompression bomb: a small file that
# decodes to gigabytes) and only warns below that; the refusal is the limit, 178956970 pixels by default.
_PILLOW_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS
DEFAULT_MAX_IMAGE_PIXELS = 2 * _PILLOW_MAX_IMAGE_PIXELS
_LIMIT = {"pixels": DEFAULT_MAX_IMAGE_PIXELS}
_PILLOW_GUARD = threading.Lock()


def set_max_image_pixels(limit: Optional[int]) -> None:
    """The pixel limit of this process (``data.max_image_pixels``; None: Pillow's).  Process-wide on purpose:
    every stage that decodes the images data.prepare accepted, and the loader workers it forks, must accept
    them too.  Pillow's own guard is raised with a higher limit (never lowered), since it applies to every image
    the process opens, segmentation masks included; a lower limit is :func:`read_image`'s check alone."""
    _LIMIT["pixels"] = limit or DEFAULT_MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max(_PILLOW_MAX_IMAGE_PIXELS, -(-_LIMIT["pixels"] // 2))


def read_image(path: str | Path) -> Tuple[Optional[Image.Image], str]:
    """Decode ``path`` (a file, or a ``shard.tar::member`` pool item) into ``(8-bit RGB PIL image, "")``, or
    ``(None, why it cannot be used)`` when it is missing, corrupt, truncated or larger than the pixel limit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(read_item(str(path))) as im:
                too_large = _too_large(im.size)  # from the header, before a byte is decoded
                if too_large:
                    return None, too_large
                im.load()
                return _to_rgb(im), ""
    except FileNotFoundError:
        return None, "the file does not exist"
    except KeyError:
        return None, "the member is not in its tar shard"
    except UnidentifiedImageError:
        return None, "not an image Pillow can read (an unknown format, or a damaged header)"
    except Image.DecompressionBombError as exc:  # Pillow's guard fired in open, before the size reached us
        size = _header_size(path)
        return None, (_too_large(size) if size else "") or (
            f"a decompression-bomb guard refused it ({exc}); if the image is meant to be this large, raise "
            f"data.max_image_pixels, or downscale it")
    except (OSError, ValueError, SyntaxError) as exc:
        return None, f"cannot be decoded (damaged or truncated): {exc}"


def _too_large(size: Tuple[int, int]) -> str:
    w, h = size
    limit = _LIMIT["pixels"]
    if w * h <= limit:
        return ""
    return (f"larger than the {limit}-pixel limit ({w}x{h} = {w * h} pixels): a decompression-bomb guard; if the "
            f"image is meant to be this large, set data.max_image_pixels to at least {w * h}, or downscale it")


def _header_size(path: str | Path) -> Optional[Tuple[int, int]]:
    """The (width, height) in an image's header, read with Pillow's guard lifted for that one open (nothing is
    decoded), so that a refusal can name the size and the limit that would admit it.  The guard is a module
    global of Pillow: the lock keeps this process's own lifts from overlapping."""
    with _PILLOW_GUARD:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            with Image.open(read_item(str(path))) as im:
                return im.size
        except (OSError, ValueError, SyntaxError, KeyError, Image.DecompressionBombError):
            return None  # only a better message was at stake
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def load_image(path: str | Path) -> Optional[Image.Image]:
    """:func:`read_image` without the reason: the image, or ``None`` when it cannot be used."""
    return read_image(path)[0]


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
    """An ImageFolder: class names in sorted order, (path, label) samples, and the files that failed, each with
    the reason (path -> why)."""

    root: str
    classes: List[str]
    samples: List[Tuple[str, int]]
    corrupt: Dict[str, str] = field(default_factory=dict)


def class_folders(root: str | Path) -> List[str]:
    """The class names of an ImageFolder: its visible subfolders, sorted (label i is the i-th)."""
    return sorted(d.name for d in Path(root).iterdir() if d.is_dir() and not d.name.startswith("."))


def check_same_classes(train: Sequence[str], other: Sequence[str], role: str) -> None:
    """Every split must have train's class folders, or labels would mean different classes."""
    if list(other) != list(train):
        raise ToolchainError(
            f"{role} classes differ from train classes: only in train {sorted(set(train) - set(other))}, only in "
            f"{role} {sorted(set(other) - set(train))}. Every split needs the same class folders.")


def scan_image_folder(root: str | Path, role: str, verify: bool = True, data_roots: Sequence[str] = ()) -> FolderScan:
    """Scan an ImageFolder (``root/<class>/*.jpg``); decode each image once to find corrupt files.

    Raises:
        ToolchainError: the folder is missing, has no class folders, a class folder has no images, or an image
            is a symlink that leads outside the folder and ``data_roots`` (core/roots.py).
    """
    root = Path(root)
    if not root.is_dir():
        raise ToolchainError(f"{role} folder '{root}' does not exist (expected an ImageFolder: {role}/<class>/<image>)")
    classes = class_folders(root)
    if not classes:
        raise ToolchainError(f"{role} folder '{root}' has no class folders (expected {role}/<class>/<image>)")
    samples, corrupt = [], {}
    allowed = DataRoots(root, data_roots)
    allowed.check_links(root, [root / c for c in classes])
    for label, cls in enumerate(classes):
        files = sorted(p for p in (root / cls).rglob("*") if _is_image(p))
        allowed.check_links(root, files)
        if not files:
            raise ToolchainError(
                f"{role} class folder '{root / cls}' has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                f"add images or remove the folder"
            )
        n_ok = 0
        for p in files:
            why = read_image(p)[1] if verify else ""
            if why:
                corrupt[str(p)] = why
                continue
            samples.append((str(p), label))
            n_ok += 1
        if n_ok == 0:
            raise ToolchainError(f"{role} class folder '{root / cls}' has only corrupt images ({len(files)} files; "
                                 f"{_first_reason(corrupt)}); replace them or remove the folder")
    return FolderScan(str(root), classes, samples, corrupt)


def scan_pool(roots: Sequence[str | Path], verify: bool = True,
              data_roots: Sequence[str] = ()) -> Tuple[List[str], List[str]]:
    """All images of the pool sources (folders, file lists, tar shards); returns (good items, corrupt items)."""
    good, corrupt = scan_pool_with_reasons(roots, verify, data_roots)
    return good, list(corrupt)


def scan_pool_with_reasons(roots: Sequence[str | Path], verify: bool = True,
                           data_roots: Sequence[str] = ()) -> Tuple[List[str], Dict[str, str]]:
    """(good items, corrupt item -> why) of the pool sources (``data_roots``: :func:`list_pool_source`).

    A listed file that is missing, undecodable or too large is corrupt: skipped and counted, never fatal."""
    good, corrupt = [], {}
    for root in roots:
        items = list_pool_source(str(root), data_roots)
        if not items:
            raise ToolchainError(f"pool source '{root}' has no images ({', '.join(IMAGE_EXTENSIONS)})")
        for p in items:
            why = read_image(p)[1] if verify else ""
            if why:
                corrupt[p] = why
            else:
                good.append(p)
    if not good:
        raise ToolchainError(f"the unlabeled pool ({', '.join(map(str, roots))}) has no readable images "
                             f"({len(corrupt)} skipped; {_first_reason(corrupt)})")
    return good, corrupt


def _first_reason(corrupt: Dict[str, str]) -> str:
    path, why = next(reversed(corrupt.items()))
    return f"e.g. '{path}': {why}"


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
    strong (timm's few-label recipe): crop 25-100%, flip, RandAugment 2 ops at magnitude 9, random erasing."""
    from torchvision.transforms import v2 as T

    strong = augment != "light"
    colour = T.RandAugment(num_ops=2, magnitude=9) if strong else T.ColorJitter(0.2, 0.2, 0.2)
    tail = [T.RandomErasing(p=0.25, value=0)] if strong else []
    return T.Compose([label_geometry(pp, augment), T.RandomHorizontalFlip(), colour, T.ToImage(),
                      T.ToDtype(torch.float32, scale=True), T.Normalize(pp.mean, pp.std), *tail])


def label_geometry(pp: Preprocess, augment: str) -> Callable:
    """The crop of :func:`train_transform`: a random resized crop (light 60-100% of the area, strong 25-100%)."""
    from torchvision.transforms import v2 as T

    if augment not in ("light", "strong"):
        raise ToolchainError(f"unknown augmentation '{augment}'; use light or strong")
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
                raise ToolchainError(f"image '{path}' is listed in the data index but no longer exists (the data "
                                     f"folder changed, or the store entry holding it was removed by hand, during "
                                     f"the build); rerun the same command: a changed folder gets a new data.prepare "
                                     f"key, a removed entry is rebuilt")
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
