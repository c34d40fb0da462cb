"""Segmentation: a class id per pixel, ``<split>/images`` + ``<split>/masks`` and ``train/classes.txt``, mean IoU."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from vfm_toolchain.tasks.base import Task, register_task


@register_task
class Segmentation(Task):
    name = "segmentation"
    reads = "images with masks"
    metric = "miou"
    budget_unit = "labeled images"

    def class_count(self, recipe: Any) -> int:
        from vfm_toolchain.segdata import read_classes

        d = recipe.data
        if d.source == "synthetic":  # the shapes plus background (toolchain/synthetic.py)
            return d.synthetic.classes + 1
        return len(read_classes(d.train, d.roots))

    def budget_images(self, delta: int, num_classes: int) -> int:
        """A segmentation label budget counts labeled images."""
        return delta

    def check_data(self, recipe: Any) -> None:
        """classes.txt, the image/mask pairs of every split (their symlinks inside the data roots) and the label
        budget, from the listing."""
        from vfm_toolchain.segdata import check_label_budget, list_segmentation_pairs, read_classes

        d = recipe.data
        read_classes(d.train, d.roots)
        pairs, unlabeled = list_segmentation_pairs(d.train, "train", d.roots)
        check_label_budget(d.train, len(pairs), d.labeled_per_class, d.val is not None, len(unlabeled))
        for role, split in (("val", d.val), ("test", d.test)):
            if split:
                list_segmentation_pairs(split, role, d.roots)  # the images/ + masks/ layout, and its symlinks

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        from vfm_toolchain.training import miou

        return miou(model, items, preprocess, num_classes if num_classes is not None else len(classes or ()))
