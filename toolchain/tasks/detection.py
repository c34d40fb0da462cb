"""Detection: boxes of classes per image, COCO JSON or YOLO txt splits (toolchain/detdata.py), COCO mAP50."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.tasks.base import Task, register_task


@register_task
class Detection(Task):
    name = "detection"
    reads = "images with COCO JSON or YOLO txt boxes"
    owns = frozenset({"data.format"})
    metric = "map50"
    budget_unit = "images per class"

    def class_count(self, recipe: Any) -> int:
        """Object classes only: a detector has no background class."""
        from vfm_toolchain.detdata import read_detection_classes

        d = recipe.data
        return d.synthetic.classes if d.source == "synthetic" else len(read_detection_classes(d.train, d.format,
                                                                                               d.roots))

    def budget_images(self, delta: int, num_classes: int) -> int:
        return delta

    def check_data(self, recipe: Any) -> None:
        """Every split's annotation files parse (COCO JSON or YOLO txt), with no unknown category ids, repeated
        image ids or lines that do not parse, every path they name inside the data roots, and every split lists
        train's classes; train has a box to learn from, and without data.val an image to validate with.  Images
        are not decoded here: a missing, unreadable or mis-sized image and a box outside its image are skipped and
        counted by data.prepare, as a serious tool would, not refused."""
        from vfm_toolchain.detdata import check_same_detection_classes, parse_detection_split

        d = recipe.data
        train = parse_detection_split(d.train, "train", d.format, d.roots)
        for role, split in (("val", d.val), ("test", d.test)):
            if split:
                check_same_detection_classes(train.classes, parse_detection_split(split, role, d.format,
                                                                                  d.roots).classes, role)
        if not any(entry.boxes for entry in train.entries):
            raise ToolchainError(f"train folder '{d.train}' ({train.format}) has {len(train.entries)} image"
                                 f"{'s' * (len(train.entries) != 1)} but no box: a detector learns from boxes; add "
                                 f"annotations, or check that the labels belong to these images")
        if d.val is None and len(train.entries) < 2:
            raise ToolchainError(f"train folder '{d.train}' has 1 labeled image; without data.val at least 2 are "
                                 f"needed (one to train on, one to validate with): add images or give data.val")

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        """COCO mAP50 over the split's records at each image's own resolution; the class names (``classes``, or
        ``num_classes`` numbered) only label the per-class APs."""
        from vfm_toolchain.training import detection_scores

        if classes is None and num_classes is None:
            raise ValueError("detection scores need the classes (their names, or num_classes)")
        names = list(classes) if classes is not None else [str(i) for i in range(num_classes)]
        return float(detection_scores(model, items, preprocess, names)["map50"])
