"""Image sizes: one side (square, the default) or [height, width] (apps run 4:3 and 16:9 cameras).

Kept apart from data/images.py so the recipe can validate sizes without importing torch.
"""
from __future__ import annotations

from typing import Tuple, Union

__all__ = ["ImageSize", "image_hw", "canonical_size", "size_text", "crop_ratios", "size_spelling", "nearest_sizes"]

ImageSize = Union[int, Tuple[int, int]]  # a side (square) or (height, width), the order torch uses


def image_hw(size: ImageSize) -> Tuple[int, int]:
    """(height, width) of an image size given as one side or as [height, width]."""
    if isinstance(size, (tuple, list)):
        h, w = size
        return int(h), int(w)
    return int(size), int(size)


def canonical_size(size: ImageSize) -> ImageSize:
    """One spelling per size: a square is its side (so specs and store keys of square builds never change),
    anything else the tuple (height, width)."""
    h, w = image_hw(size)
    return h if h == w else (h, w)


def size_text(size: ImageSize) -> str:
    """'256 px' for a square, '192x256 px (h x w)' otherwise: reports and logs say which side is which."""
    h, w = image_hw(size)
    return f"{h} px" if h == w else f"{h}x{w} px (h x w)"


def crop_ratios(size: ImageSize) -> Tuple[float, float]:
    """RandomResizedCrop's width/height range around the output's own aspect (torchvision's 3/4 .. 4/3 of it),
    so a 4:3 model is trained on 4:3 crops and not on squares stretched to 4:3."""
    h, w = image_hw(size)
    return (w / h * 3 / 4, w / h * 4 / 3)


def size_spelling(hw: Tuple[int, int]) -> str:
    """A size as a recipe writes it: 224, or [192, 256] (height, width)."""
    return str(hw[0]) if hw[0] == hw[1] else f"[{hw[0]}, {hw[1]}]"


def nearest_sizes(hw: Tuple[int, int], multiple: int) -> str:
    """The sizes on either side of ``hw`` with every side a multiple of ``multiple``, as a recipe writes them
    ('96 or 128', '[64, 96] or [64, 128]'), the smaller first; a side is never below ``multiple``."""
    low = tuple(max(multiple, side // multiple * multiple) for side in hw)
    high = tuple(-(-side // multiple) * multiple for side in hw)
    return " or ".join(size_spelling(s) for s in dict.fromkeys((low, high)))
