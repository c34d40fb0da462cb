"""Segmentation: a class id per pixel, ``<split>/images`` + ``<split>/masks`` and ``train/classes.txt``, mean IoU."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.core.sizes import image_hw
from vfm_toolchain.tasks.base import Splits, Task, register_task, save_slice


@register_task
class Segmentation(Task):
    name = "segmentation"
    reads = "images with masks"
    supports = frozenset({"label_smoothing"})  # its per-pixel cross-entropy
    generator = ("vfm_toolchain.data.synthetic", "generate_segmentation_task", "GENERATOR_VERSION")
    metric = "miou"
    metric_label = "mIoU"
    budget_unit = "labeled images"

    def validate(self, recipe: Any) -> None:
        """The student's mask is predicted at output stride 8: every side of its input a multiple of 8."""
        hw = image_hw(recipe.student.image_size)
        if any(side % 8 for side in hw):
            fix = [8 * round(side / 8) or 8 for side in hw]
            raise ValueError(f"student.image_size {recipe.student.image_size} must be a multiple of 8 for segmentation "
                             f"(output stride 8) on each side, e.g. {fix[0] if fix[0] == fix[1] else fix}")

    starter = {  # recipes/stanford_background.yaml
        "max_side": 256,  # the longest input side init proposes
        "recipe": "stanford_background.yaml", "labeled": 40, "transfer": 492,
        "teacher": {"output_stride": 16, "adapter": {"name": "full"}, "lp_ft": True, "probe_epochs": 20, "epochs": 40,
                    "lr": 1.0e-3, "head_lr": 1.0e-2, "batch_size": 8},
        "student": {"name": "timm:resnet10t"},
        "distill": {"views": 8, "epochs": 30, "lr": 2.0e-3, "batch_size": 16, "warmup_epochs": 1},
        "finetune": {"epochs": 40, "lr": 5.0e-4, "batch_size": 8},
        "baseline": {"epochs": 80, "lr": 2.0e-3},
    }

    def recognize(self, folder: Any, asked: bool = False) -> Optional[str]:
        root = Path(folder)
        return "images + masks" if (root / "images").is_dir() and (root / "masks").is_dir() else None

    def label_counts(self, samples: Sequence[Any], num_classes: int) -> List[int]:
        """Images whose mask holds the class."""
        import numpy as np
        from PIL import Image

        counts = [0] * num_classes
        for _, mask in samples:
            with Image.open(mask) as m:
                for c in np.unique(np.asarray(m)):
                    if c < num_classes:
                        counts[int(c)] += 1
        return counts

    def write_split(self, samples: Sequence[Any], classes: Sequence[str], folder: Any) -> None:
        from vfm_toolchain.core.files import atomic_write_bytes, place_file

        folder = Path(folder)
        for img, mask in samples:
            place_file(img, folder / "images" / Path(img).name)
            place_file(mask, folder / "masks" / Path(mask).name)
        atomic_write_bytes(folder / "classes.txt", ("\n".join(classes) + "\n").encode())

    def read_splits(self, ctx: Any, train_dir: str, val_dir: Optional[str], test_dir: str) -> Splits:
        """Image/mask pairs; a label budget counts images.  Without a val folder, as in classification, the labels
        outside the budget are the validation set, or without a budget a fraction of train is held out."""
        from vfm_toolchain.data.segmentation import check_label_budget, read_classes, scan_segmentation_folder

        d, seed = ctx.recipe.data, ctx.recipe.seed
        classes = read_classes(train_dir, d.roots)
        train, bad_train = scan_segmentation_folder(train_dir, "train", len(classes), d.roots)
        test, bad_test = scan_segmentation_folder(test_dir, "test", len(classes), d.roots)
        val, bad_val = scan_segmentation_folder(val_dir, "val", len(classes), d.roots) if val_dir else (None, {})
        # the recipe checks counted the pairs from the listing; decoding may have skipped some since
        check_label_budget(train_dir, len(train), d.labeled_per_class, val is not None)
        order = list(train)
        random.Random(seed).shuffle(order)
        if d.labeled_per_class:
            order, rest = order[:d.labeled_per_class], order[d.labeled_per_class:]
            if val is None:
                val = rest
                ctx.log.info("no val folder: the %d labeled images outside the budget are the validation set",
                             len(rest))
        elif val is None:
            k = max(1, int(round(len(order) * d.val_fraction)))
            val, order = order[:k], order[k:]
            ctx.log.info("no val folder: held out %d of the labeled images for validation", len(val))
        return Splits({"classes": classes, "train": sorted(order), "val": sorted(val), "test": test,
                       "corrupt": {"train": bad_train, "val": bad_val, "test": bad_test}})

    def train_dataset(self, items: Sequence[Any], preprocess: Any, augment: str) -> Any:
        """Image and mask through one geometry (data/segmentation.py)."""
        from vfm_toolchain.data.segmentation import SegmentationDataset

        return SegmentationDataset(items, preprocess, train=True, augment=augment)

    pseudo_folder = "segmentation"
    label_studio_control = ("PolygonLabels", "Label")
    cvat_kind = "polygon"

    def pseudo_predictions(self, outs: Any, sizes: Sequence[Any], threshold: float,
                           classes: Sequence[str]) -> List[Dict[str, Any]]:
        """The mask at the image's own size, each pixel's confidence, and their mean."""
        import numpy as np
        import torch

        found = []
        for k, size in enumerate(sizes):
            p = torch.nn.functional.interpolate(outs[k:k + 1], size=tuple(size), mode="bilinear",
                                                align_corners=False)[0]
            conf, mask = p.max(0)
            found.append({"mask": mask.numpy().astype(np.int64), "pixel_confidence": conf.numpy(),
                          "confidence": float(conf.mean()),
                          "summary": " ".join(classes[c] for c in mask.unique().tolist())})
        return found

    def pseudo_annotations(self, prediction: Dict[str, Any], w: int, h: int, classes: Sequence[str],
                           threshold: float) -> Tuple[List[Dict[str, Any]], List[str]]:
        """Each class's regions as polygons (holes are not kept)."""
        from xml.sax.saxutils import quoteattr

        import numpy as np

        from vfm_toolchain.data.segmentation import mask_polygons

        result, cvat = [], []
        mask = prediction["mask"]
        for c in np.unique(mask):
            for poly in mask_polygons(mask, int(c)):
                result.append({"type": "polygonlabels", "value": {"points": (100 * poly / [w, h]).round(3).tolist(),
                                                                  "polygonlabels": [classes[c]]}})
                cvat.append(f'    <polygon label={quoteattr(classes[c])} source="auto" occluded="0" '
                            f'points="{";".join(f"{x:.2f},{y:.2f}" for x, y in poly)}" z_order="0"></polygon>')
        return result, cvat

    def keep_pseudo_label(self, writer: Any, path: str, name: str, prediction: Dict[str, Any], w: int,
                          h: int) -> None:
        """The image and its mask, the pixels under the threshold 255 (IGNORE_INDEX: training skips them, a
        reviewer sees the holes)."""
        import io

        import numpy as np
        from PIL import Image

        from vfm_toolchain.core.files import atomic_write_bytes, place_file

        folder = writer.out / self.pseudo_folder
        place_file(path, folder / "images" / name, writer.copy)
        masked = np.where(prediction["pixel_confidence"] >= writer.threshold, prediction["mask"], 255).astype(np.uint8)
        (folder / "masks").mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(masked, mode="L").save(buf, format="PNG")
        atomic_write_bytes(folder / "masks" / f"{Path(name).stem}.png", buf.getvalue())

    def finish_pseudo_labels(self, writer: Any) -> None:
        from vfm_toolchain.core.files import atomic_write_bytes

        (writer.out / self.pseudo_folder).mkdir(exist_ok=True)
        atomic_write_bytes(writer.out / self.pseudo_folder / "classes.txt", ("\n".join(writer.classes) + "\n").encode())

    def score_artifact(self, run: Any, items: Sequence[Any], preprocess: Any, num_classes: int,
                       batch_size: int) -> float:
        """Mean IoU of ``run(images) -> per-pixel logits`` at each mask's own resolution."""
        import numpy as np
        import torch

        from vfm_toolchain.segmetrics import segmentation_miou

        return segmentation_miou(lambda xb: torch.from_numpy(np.asarray(run(xb.numpy()))), items, preprocess,
                                 num_classes, batch_size, "the artifact on ")

    def test_slice(self, items: Sequence[Any], preprocess: Any, num_classes: int, path: Any) -> None:
        """Images resized as SegmentationDataset resizes the uint8 tensor, and their masks (nearest)."""
        import numpy as np
        from PIL import Image
        from torchvision.transforms.v2 import functional as TF

        from vfm_toolchain.data.images import load_image
        from vfm_toolchain.data.segmentation import seg_eval_transform

        h, w = preprocess.hw
        resize = seg_eval_transform(preprocess)
        images, masks = [], []
        for p, mask in items:
            im = load_image(p) or Image.new("RGB", (w, h))
            images.append(resize(TF.pil_to_tensor(im)).permute(1, 2, 0).numpy())
            with Image.open(mask) as m:
                masks.append(np.asarray(m.resize((w, h), Image.NEAREST), dtype=np.uint8))
        save_slice(path, images, masks, preprocess, num_classes)

    def class_count(self, recipe: Any) -> int:
        from vfm_toolchain.data.segmentation import read_classes

        d = recipe.data
        if d.source == "synthetic":  # the shapes plus background (data/synthetic.py)
            return d.synthetic.classes + 1
        return len(read_classes(d.train, d.roots))

    def oracle(self, source: str, classes: Sequence[str], data_roots: Sequence[str] = ()) -> Any:
        from vfm_toolchain.oracle import MaskFolder

        return MaskFolder(source, data_roots)

    def check_data(self, recipe: Any) -> None:
        """classes.txt, the image/mask pairs of every split (their symlinks inside the data roots) and the label
        budget, from the listing."""
        from vfm_toolchain.data.segmentation import check_label_budget, list_segmentation_pairs, read_classes

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
