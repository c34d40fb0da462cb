"""Augmentation of the student's input on top of a view whose teacher target is cached (distillation).

Only ops that move no pixel: a target computed on the unaugmented view (logits, features, a per-pixel map)
still describes every position of the augmented one.  Imported where it is used: it loads torchvision.
"""
from __future__ import annotations

from typing import Callable, Optional

from torchvision.transforms import v2 as T

__all__ = ["PhotometricRandAugment", "photometric_augment"]


class PhotometricRandAugment(T.RandAugment):
    """RandAugment drawing only from its colour ops (a module-level class, so DataLoader workers can unpickle
    it: the op table holds lambdas and stays on the class)."""

    _AUGMENTATION_SPACE = {k: v for k, v in T.RandAugment._AUGMENTATION_SPACE.items()
                           if k not in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")}


def photometric_augment(ops: int, magnitude: int, erasing: float = 0.0) -> Optional[Callable]:
    """``ops`` colour ops at ``magnitude``, then random erasing with probability ``erasing``: uint8 (3, H, W)
    -> uint8.  None when both are off."""
    steps = ([PhotometricRandAugment(num_ops=ops, magnitude=magnitude)] if ops else []) + \
        ([T.RandomErasing(p=erasing, value=0)] if erasing else [])
    return T.Compose(steps) if steps else None
