"""Classification: one class per image, ImageFolder splits (``<split>/<class>/<image>``), top-1 accuracy."""
from __future__ import annotations

import random
from pathlib import Path
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.tasks.base import Splits, Task, artifact_outputs, register_task, save_slice, slice_images


@register_task
class Classification(Task):
    name = "classification"
    reads = "ImageFolder splits"
    supports = frozenset({"label_smoothing", "label_mixing", "random_erasing", "gramian_heads", "linear_probe",
                          "zero_shot_head"})
    generator = ("vfm_toolchain.data.synthetic", "generate_task", "GENERATOR_VERSION")
    metric = "top1"
    metric_label = "top-1"
    budget_unit = "labels per class"

    starter = {  # recipes/cifar10_fewshot.yaml
        "max_side": 224,  # the longest input side init proposes
        "recipe": "cifar10_fewshot.yaml", "labeled": 250, "transfer": 10000,
        "teacher": {"adapter": {"name": "linear"}, "epochs": 30, "lr": 1.0e-3, "head_lr": 1.0e-2, "batch_size": 50,
                    "weight_decay": 0.01},
        "student": {"name": "fastvit_t8"},
        "distill": {"temperature": 4.0, "views": 8, "epochs": 16, "lr": 3.0e-3, "batch_size": 64, "warmup_epochs": 1},
        "finetune": {"epochs": 15, "lr": 2.0e-4, "batch_size": 50},
        "baseline": {"epochs": 400, "lr": 2.0e-3, "batch_size": 16, "augment": "strong", "label_smoothing": 0.1},
    }

    def recognize(self, folder: Any, asked: bool = False) -> Optional[str]:
        """Class folders holding images, and nothing of another layout (images/, annotation files)."""
        from vfm_toolchain.data.images import _is_image, class_folders

        root = Path(folder)
        if (root / "images").is_dir() or any((root / f).is_file() for f in ("annotations.json", "tags.csv")):
            return None
        filled = [c for c in class_folders(root) if any(_is_image(p) for p in (root / c).iterdir())]
        return "ImageFolder: a folder per class" if len(filled) >= 2 or (asked and filled) else None

    def label_counts(self, samples: Sequence[Any], num_classes: int) -> List[int]:
        counts = [0] * num_classes
        for _, label in samples:
            counts[label] += 1
        return counts

    def write_split(self, samples: Sequence[Any], classes: Sequence[str], folder: Any) -> None:
        from vfm_toolchain.core.files import place_file

        for c in classes:  # every class folder, so the split's classes match train's even where one is empty
            (Path(folder) / c).mkdir(parents=True, exist_ok=True)
        for path, label in samples:
            place_file(path, Path(folder) / classes[label] / Path(path).name)

    def read_splits(self, ctx: Any, train_dir: str, val_dir: Optional[str], test_dir: str) -> Splits:
        """ImageFolder splits with the same class folders; a label budget takes that many images of each class
        (seeded), and without a val folder the labels outside the budget, or a fraction of train, validate."""
        from vfm_toolchain.data.images import check_same_classes, scan_image_folder

        d, seed = ctx.recipe.data, ctx.recipe.seed
        train = scan_image_folder(train_dir, "train", data_roots=d.roots)
        test = scan_image_folder(test_dir, "test", data_roots=d.roots)
        val = scan_image_folder(val_dir, "val", data_roots=d.roots) if val_dir else None
        for role, other in (("val", val), ("test", test)):
            if other is not None:
                check_same_classes(train.classes, other.classes, role)
        train_samples = train.samples
        rest = []
        if d.labeled_per_class:
            train_samples = _subset_per_class(train.samples, d.labeled_per_class, seed)
            chosen = set(map(tuple, train_samples))
            rest = [s for s in train.samples if tuple(s) not in chosen]
        if val is None and rest:
            # labels left out of the budget are never trained on; they are the validation set
            val_samples = rest
            ctx.log.info("no val folder: the %d labels outside the budget are the validation set", len(rest))
        elif val is None:
            train_samples, val_samples = _split(train_samples, d.val_fraction, seed)
            ctx.log.info("no val folder: held out %d of the labels for validation", len(val_samples))
        else:
            val_samples = val.samples
        return Splits({"classes": train.classes, "train": train_samples, "val": val_samples, "test": test.samples,
                       "corrupt": {"train": train.corrupt, "val": val.corrupt if val else {}, "test": test.corrupt}})

    def train_dataset(self, items: Sequence[Any], preprocess: Any, augment: str) -> Any:
        from vfm_toolchain.data.images import ImageListDataset, train_transform

        return ImageListDataset(items, train_transform(preprocess, augment))

    pseudo_folder = "imagefolder"
    label_studio_control = ("Choices", "Choice")
    cvat_kind = "tag"

    def pseudo_predictions(self, outs: Any, sizes: Sequence[Any], threshold: float,
                           classes: Sequence[str]) -> List[Dict[str, Any]]:
        """The top class and its probability."""
        found = []
        for p in outs[:len(sizes)]:
            c = int(p.argmax())
            found.append({"label": c, "confidence": float(p[c]), "summary": classes[c]})
        return found

    def pseudo_annotations(self, prediction: Dict[str, Any], w: int, h: int, classes: Sequence[str],
                           threshold: float) -> Tuple[List[Dict[str, Any]], List[str]]:
        from xml.sax.saxutils import quoteattr

        c = classes[prediction["label"]]
        return ([{"type": "choices", "value": {"choices": [c]}, "score": float(prediction["confidence"])}],
                [f'    <tag label={quoteattr(c)} source="auto"></tag>'])

    def keep_pseudo_label(self, writer: Any, path: str, name: str, prediction: Dict[str, Any], w: int,
                          h: int) -> None:
        from vfm_toolchain.core.files import place_file

        place_file(path, writer.out / self.pseudo_folder / writer.classes[prediction["label"]] / name, writer.copy)

    def score_artifact(self, run: Any, items: Sequence[Any], preprocess: Any, num_classes: int,
                       batch_size: int) -> float:
        """Top-1 of ``run(images) -> logits``."""
        import numpy as np

        out = artifact_outputs(run, [p for p, _ in items], preprocess, batch_size)
        return int((out.argmax(1) == np.asarray([y for _, y in items])).sum()) / max(1, len(items))

    def test_slice(self, items: Sequence[Any], preprocess: Any, num_classes: int, path: Any) -> None:
        """Images resized as eval_transform resizes the PIL image, and their class ids."""
        save_slice(path, slice_images([p for p, _ in items], preprocess), [int(y) for _, y in items], preprocess,
                   num_classes)

    def classifier_labels(self, classes: Sequence[str]) -> Optional[List[str]]:
        return list(classes)

    def class_count(self, recipe: Any) -> int:
        from vfm_toolchain.data.images import class_folders

        d = recipe.data
        return d.synthetic.classes if d.source == "synthetic" else len(class_folders(d.train))

    def budget_images(self, delta: int, num_classes: int) -> int:
        """Images a label budget ``delta`` larger brings: the budget counts labels per class."""
        return delta * num_classes

    def oracle(self, source: str, classes: Sequence[str], data_roots: Sequence[str] = ()) -> Any:
        from vfm_toolchain.oracle import LabelCsv

        return LabelCsv(source, classes)

    def check_data(self, recipe: Any) -> None:
        """Class folders (at least two, the same in every split, their symlinks inside the data roots) and the
        label budget, from folder listings."""
        from vfm_toolchain.data.images import check_same_classes, class_folders, scan_image_folder

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


def _subset_per_class(samples: List[Tuple[str, int]], n: int, seed: int) -> List[Tuple[str, int]]:
    by_class: Dict[int, List[Tuple[str, int]]] = defaultdict(list)
    for s in samples:
        by_class[s[1]].append(s)
    rng = random.Random(seed)
    out = []
    for label in sorted(by_class):
        items = sorted(by_class[label])
        rng.shuffle(items)
        out.extend(sorted(items[:n]))
    return out


def _split(samples, fraction: float, seed: int):
    by_class: Dict[int, list] = defaultdict(list)
    for s in samples:
        by_class[s[1]].append(s)
    rng = random.Random(seed)
    train, val = [], []
    for label in sorted(by_class):
        items = sorted(by_class[label])
        rng.shuffle(items)
        k = max(1, int(round(len(items) * fraction))) if len(items) > 1 else 0
        val.extend(items[:k])
        train.extend(items[k:])
    return sorted(train), sorted(val)
