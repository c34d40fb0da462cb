"""Classification: one class per image, ImageFolder splits (``<split>/<class>/<image>``), top-1 accuracy."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.tasks.base import Task, register_task


@register_task
class Classification(Task):
    name = "classification"
    reads = "ImageFolder splits"
    supports = frozenset({"strong_shift", "label_mixing"})
    metric = "top1"
    budget_unit = "labels per class"

    def class_count(self, recipe: Any) -> int:
        from vfm_toolchain.data import class_folders

        d = recipe.data
        return d.synthetic.classes if d.source == "synthetic" else len(class_folders(d.train))

    def budget_images(self, delta: int, num_classes: int) -> int:
        """Images a label budget ``delta`` larger brings: the budget counts labels per class."""
        return delta * num_classes

    def check_data(self, recipe: Any) -> None:
        """Class folders (at least two, the same in every split, their symlinks inside the data roots) and the
        label budget, from folder listings."""
        from vfm_toolchain.data import check_same_classes, class_folders, scan_image_folder

        d = recipe.data
        train = scan_image_folder(d.train, "train", verify=False, data_roots=d.roots)
        for role, folder in (("val", d.val), ("test", d.test)):
            if folder:
                check_same_classes(train.classes, class_folders(folder), role)
                scan_image_folder(folder, role, verify=False, data_roots=d.roots)  # its symlinks, before one is opened
        if len(train.classes) < 2:
            raise ToolchainError(f"train folder '{d.train}' has {len(train.classes)} class folder "
                                 f"({', '.join(train.classes)}); classification needs at least 2 "
                                 f"(train/<class>/<image>)")
        if d.labeled_per_class:
            counts = {c: 0 for c in train.classes}
            for _, label in train.samples:
                counts[train.classes[label]] += 1
            short = {c: n for c, n in counts.items() if n < d.labeled_per_class}
            if short:
                shown = ", ".join(f"'{c}' has {n}" for c, n in sorted(short.items(), key=lambda kv: kv[1])[:5])
                raise ToolchainError(
                    f"data.labeled_per_class is {d.labeled_per_class} but {len(short)} of {len(counts)} train classes "
                    f"have fewer images ({shown}). Lower it to at most {min(counts.values())} or add images")
            if d.val is None and min(counts.values()) == d.labeled_per_class:
                raise ToolchainError(
                    f"data.labeled_per_class is {d.labeled_per_class}, every image of the smallest train class, "
                    f"which leaves no validation images: give data.val, or lower data.labeled_per_class")

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        from vfm_toolchain.training import top1

        return top1(model, items, preprocess)
