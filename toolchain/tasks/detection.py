"""Detection: boxes of classes per image, COCO JSON or YOLO txt splits (data/detection.py), COCO mAP50."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.sizes import image_hw, nearest_sizes, size_spelling
from vfm_toolchain.tasks.base import Splits, Task, per_split_lines, register_task

# the coarsest stride of a detector's feature maps: each input side is a multiple of it (blocks/detection.py)
DETECTION_STRIDE = 32


@register_task
class Detection(Task):
    name = "detection"
    reads = "images with COCO JSON or YOLO txt boxes"
    # object-crop queries, the head's norm, what a detector distills from, the NMS its artifacts ship with
    owns = frozenset({"data.format", "curate.object_share", "curate.crop_context", "student.head_norm",
                      "distill.detection_targets", "distill.pseudo_threshold", "export.detection"})
    generator = ("vfm_toolchain.data.synthetic_detection", "generate_detection_task", "DETECTION_GENERATOR_VERSION")
    metric = "map50"
    metric_label = "mAP50"
    budget_unit = "images per class"

    def describe(self, metrics: Dict[str, Any], splits: Sequence[str] = ("val", "test")) -> str:
        return ", ".join(f"{s} mAP50 {metrics[f'{s}_map50']:.4f} (mAP {metrics[f'{s}_map']:.4f})" for s in splits)

    def summary(self, metrics: Dict[str, Any], split: str = "test") -> str:
        return (f"{split} mAP50 {self.score_text(metrics.get(f'{split}_map50'))}, mAP@[.5:.95] "
                f"{self.score_text(metrics.get(f'{split}_map'))}")

    def score_text(self, value: Optional[float]) -> str:
        """An AP as detection papers write it (points, 0-100), or n/a."""
        return "n/a" if value is None or value != value else f"{100 * value:.1f}"

    def validate(self, recipe: Any) -> None:
        """A detector reads maps at strides 8, 16 and 32 whose locations must tile the input exactly (the
        teacher's and the student's coincide, blocks/detection.py): every side a multiple of 32.  The rules
        that depend on the model (64 for MobileViT-V2 students, a ViT's patch, a teacher's own size when
        teacher.image_size is not set) are checked by the teacher and student areas before the first stage."""
        for field, size in (("student.image_size", recipe.student.image_size),
                            ("teacher.image_size", recipe.teacher.image_size)):
            if size is None:
                continue
            hw = image_hw(size)
            if any(side % DETECTION_STRIDE for side in hw):
                raise ValueError(f"{field} {size_spelling(hw)} must be a multiple of {DETECTION_STRIDE} on each side "
                                 f"for detection (the detector's strides 8, 16 and 32 must tile the input "
                                 f"exactly); nearest valid: {field} {nearest_sizes(hw, DETECTION_STRIDE)}")

    starter = {  # recipes/aquarium.yaml
        "max_side": 320,  # the longest input side init proposes
        "one_size": True,  # the teacher at the student's size: the student learns its outputs per grid location
        "recipe": "aquarium.yaml", "labeled": 81, "transfer": 438,
        "teacher": {"adapter": {"name": "full"}, "lp_ft": False, "epochs": 120, "lr": 1.0e-3, "head_lr": 5.0e-3,
                    "batch_size": 8},
        "student": {"name": "fastvit_t8"},
        "distill": {"detection_targets": "both", "labeled_images": True, "views": 4, "epochs": 100, "lr": 2.0e-3,
                    "batch_size": 8, "warmup_epochs": 1},
        "finetune": {"epochs": 60, "lr": 1.0e-3, "batch_size": 8},
        "baseline": {"epochs": 150, "lr": 2.0e-3, "batch_size": 8},
        "export": {"max_accuracy_drop": 0.01},
    }

    def recognize(self, folder: Any, asked: bool = False) -> Optional[str]:
        root = Path(folder)
        if (root / "annotations.json").is_file() and (root / "images").is_dir():
            return "COCO JSON"
        if (root / "labels").is_dir() and (root / "images").is_dir():
            return "YOLO txt"
        return None

    def label_counts(self, samples: Sequence[Any], num_classes: int) -> List[int]:
        from vfm_toolchain.data.detection import images_per_class

        return images_per_class(samples, num_classes)

    def write_split(self, samples: Sequence[Any], classes: Sequence[str], folder: Any) -> None:
        """COCO whatever the source layout (a YOLO split is written as COCO: the reader takes either)."""
        from vfm_toolchain.core.files import place_file
        from vfm_toolchain.data.detection import write_coco

        images = Path(folder) / "images"
        linked = []
        for r in samples:
            dst = images / Path(r["path"]).name
            place_file(r["path"], dst)
            linked.append({**r, "path": str(dst)})
        write_coco(Path(folder) / "annotations.json", linked, classes, images)

    def read_splits(self, ctx: Any, train_dir: str, val_dir: Optional[str], test_dir: str) -> Splits:
        """COCO or YOLO splits read into records (data/detection.py); a label budget picks whole images so
        each class appears in at least ``labeled_per_class`` of them.  Without a val folder, as in
        classification, the images outside the budget are the validation set, or without a budget a fraction of
        train is held out."""
        from vfm_toolchain.data.detection import (EDGE_TOLERANCE, boxes_per_class, check_same_detection_classes,
                                                  images_per_class, scan_detection_split, select_labeled)

        d, seed = ctx.recipe.data, ctx.recipe.seed
        fmt = "coco" if d.source == "synthetic" else d.format
        train = scan_detection_split(train_dir, "train", fmt, d.roots)
        test = scan_detection_split(test_dir, "test", fmt, d.roots)
        val = scan_detection_split(val_dir, "val", fmt, d.roots) if val_dir else None
        for role, other in (("val", val), ("test", test)):
            if other is not None:
                check_same_detection_classes(train.classes, other.classes, role)
        classes = train.classes
        notes: List[str] = []
        labeled, rest = train.records, []
        if d.labeled_per_class:
            labeled, rest = select_labeled(train.records, len(classes), d.labeled_per_class, seed)
            have = images_per_class(train.records, len(classes))
            short = [f"'{c}' {n}" for c, n in zip(classes, have) if n < d.labeled_per_class]
            if short:
                notes.append(f"data.labeled_per_class is {d.labeled_per_class} but train has fewer images containing "
                             f"{', '.join(short)}; each such class keeps every image it is in")
        if val is None and rest:
            val_records = rest  # labels outside the budget are never trained on; they are the validation set
            ctx.log.info("no val folder: the %d labeled images outside the budget are the validation set", len(rest))
        elif val is None:
            if len(labeled) < 2:
                raise ToolchainError(f"train folder '{train_dir}' has {len(labeled)} usable labeled image; without "
                                     f"data.val at least 2 are needed (one to train on, one to validate with): "
                                     f"add images or give data.val")
            order = list(labeled)
            random.Random(seed).shuffle(order)
            k = min(max(1, int(round(len(order) * d.val_fraction))), len(order) - 1)
            val_records, labeled = sorted(order[:k], key=_path), sorted(order[k:], key=_path)
            ctx.log.info("no val folder: held out %d of the labeled images for validation", k)
        else:
            val_records = val.records
        kept_boxes = boxes_per_class(labeled, len(classes))
        absent = [c for c, n in zip(classes, kept_boxes) if n == 0]
        if absent:
            notes.append(f"no box of class{'es' * (len(absent) > 1)} {', '.join(repr(c) for c in absent)} in the "
                         f"labeled train images: the detector cannot learn {'them' if len(absent) > 1 else 'it'} "
                         f"(a category with no annotations, such as a dataset-wide parent category, can be removed)")
        ctx.log.info("labeled train: %d images; boxes per class kept: %s", len(labeled),
                     dict(zip(classes, kept_boxes)))
        splits = {"train": labeled, "val": val_records, "test": test.records}
        scanned = {"train": train, "val": val, "test": test}
        dropped = {role: s.dropped_boxes if s else {} for role, s in scanned.items()}
        clipped = {role: s.clipped if s else 0 for role, s in scanned.items()}
        notes += per_split_lines(dropped, "box", "es", "dropped", "{}")
        for role, n in clipped.items():
            if n:
                ctx.log.info("%s: %d box%s reached more than %g px past the image and were clipped to it", role, n,
                             "es" * (n != 1), EDGE_TOLERANCE)
        index = {"classes": classes, "format": train.format, **splits,
                 "corrupt": {"train": train.skipped, "val": val.skipped if val else {}, "test": test.skipped},
                 "dropped_boxes": dropped, "clipped_boxes": clipped}
        extra = {"format": train.format,
                 "boxes": {role: sum(len(r["boxes"]) for r in recs) for role, recs in splits.items()},
                 "boxes_per_class": {role: dict(zip(classes, boxes_per_class(recs, len(classes))))
                                     for role, recs in splits.items()},
                 "images_per_class": {role: dict(zip(classes, images_per_class(recs, len(classes))))
                                      for role, recs in splits.items()},
                 "dropped_boxes": {role: len(v) for role, v in dropped.items()}, "clipped_boxes": clipped}
        return Splits(index, extra, notes)

    def data_key(self, data: Any) -> Dict[str, Any]:
        """YOLO's class names may live above the split folders, outside the fingerprint."""
        from vfm_toolchain.data.detection import detect_format, read_yolo_names

        if detect_format(data.train, "train", data.format) != "yolo":
            return {}
        return {"yolo_names": {role: read_yolo_names(split, data.roots) for role, split in
                               (("train", data.train), ("val", data.val), ("test", data.test)) if split}}

    def named_files(self, data: Any) -> List[str]:
        """The images COCO files name (YOLO splits name none: their images are the folder's)."""
        from vfm_toolchain.data.detection import detect_format, parse_detection_split

        return [str(e.path) for role, split in (("train", data.train), ("val", data.val), ("test", data.test))
                if split and detect_format(split, role, data.format) == "coco"
                for e in parse_detection_split(split, role, "coco", data.roots).entries]

    def predict(self, model: Any, x: Any, preprocess: Any, sizes: Sequence[Any], score_thresh: float) -> Any:
        """Per image ``{"boxes" (K, 4) xyxy in the image's own pixels, "scores", "labels"}``: the model's own
        decoding and NMS at ``score_thresh``."""
        from vfm_toolchain.detmetrics import to_original

        dets = model.decode(model.forward_levels(x), score_thresh=score_thresh)
        H, W = preprocess.hw  # input size; s = the image's own (h, w), as DetectionDataset scales
        return [{"boxes": to_original(d["boxes"].cpu(), (W / s[1], H / s[0]), s), "scores": d["scores"].float().cpu(),
                 "labels": d["labels"].cpu()} for d, s in zip(dets, sizes)]

    pseudo_folder = "coco"
    label_studio_control = ("RectangleLabels", "Label")
    cvat_kind = "rectangle"

    def pseudo_predictions(self, outs: Any, sizes: Sequence[Any], threshold: float,
                           classes: Sequence[str]) -> List[Dict[str, Any]]:
        """Boxes scoring at least the threshold are the labels; an image is doubtful (for review) when a box
        scores between half the threshold and the threshold (an object the teacher is unsure of)."""
        found = []
        for d in outs[:len(sizes)]:
            scores = d["scores"].numpy()
            sure = scores >= threshold
            doubtful = bool(((scores >= threshold / 2) & ~sure).any())
            found.append({"boxes": d["boxes"].numpy(), "scores": scores, "labels": d["labels"].numpy(),
                          "confidence": float(scores[sure].min()) if sure.any() else (0.0 if doubtful else 1.0),
                          "doubtful": doubtful, "summary": f"{int(sure.sum())} boxes: " + " ".join(
                              classes[c] for c in d["labels"][sure].tolist())})
        return found

    def pseudo_annotations(self, prediction: Dict[str, Any], w: int, h: int, classes: Sequence[str],
                           threshold: float) -> Tuple[List[Dict[str, Any]], List[str]]:
        """Every box scoring at least half the threshold, with its score."""
        from xml.sax.saxutils import quoteattr

        result, cvat = [], []
        for box, s, c in zip(prediction["boxes"], prediction["scores"], prediction["labels"]):
            (x1, y1, x2, y2), s, c = (float(v) for v in box), float(s), int(c)
            if s < threshold / 2:
                continue
            c = classes[c]
            result.append({"type": "rectanglelabels", "score": s,
                           "value": {"x": 100 * x1 / w, "y": 100 * y1 / h, "width": 100 * (x2 - x1) / w,
                                     "height": 100 * (y2 - y1) / h, "rotation": 0, "rectanglelabels": [c]}})
            cvat.append(f'    <box label={quoteattr(c)} source="auto" occluded="0" xtl="{x1:.2f}" '
                        f'ytl="{y1:.2f}" xbr="{x2:.2f}" ybr="{y2:.2f}" z_order="0"></box>')
        return result, cvat

    def keep_pseudo_label(self, writer: Any, path: str, name: str, prediction: Dict[str, Any], w: int,
                          h: int) -> None:
        from vfm_toolchain.core.files import place_file

        keep = prediction["scores"] >= writer.threshold
        image = writer.out / self.pseudo_folder / "images" / name
        place_file(path, image, writer.copy)
        writer.kept.append({"path": str(image), "width": w, "height": h, "boxes": prediction["boxes"][keep].tolist(),
                            "labels": prediction["labels"][keep].tolist(),
                            "scores": prediction["scores"][keep].tolist()})

    def finish_pseudo_labels(self, writer: Any) -> None:
        """The kept boxes as a COCO file, each with its ``score``."""
        from vfm_toolchain.data.detection import write_coco

        folder = writer.out / self.pseudo_folder
        (folder / "images").mkdir(parents=True, exist_ok=True)
        write_coco(folder / "annotations.json", writer.kept, writer.classes, folder / "images",
                   info={"description": f"pseudo-labels of {writer.teacher}, boxes scoring >= {writer.threshold}"})

    def score_artifact(self, run: Any, items: Sequence[Any], preprocess: Any, num_classes: int,
                       batch_size: int) -> float:
        """COCO mAP50 of ``run(images) -> [K, 7]`` detection rows (:func:`artifact_scores`)."""
        return artifact_scores(run, items, preprocess, num_classes, batch_size, "the artifact on ")["map50"]

    def unlabeled_samples(self, paths: Sequence[str]) -> List[Any]:
        """Records of their own size with no box, which DetectionDataset resizes as a detector sees them (no
        crop); the sizes come from the headers alone."""
        from PIL import Image

        records = []
        for p in paths:
            with Image.open(p) as im:
                records.append({"path": p, "width": im.size[0], "height": im.size[1], "boxes": [], "labels": []})
        return records

    def fit(self, model: Any, groups: Any, index: Dict[str, Any], preprocess: Any, cfg: Any, state: Any, log: Any,
            seed: int, name: str, extra_loss: Any = None, criterion: Any = None) -> List[Dict[str, float]]:
        """The detector's own loss (focal, GIoU, quality) on the records, with val mAP50 (and mAP)."""
        from vfm_toolchain.training import fit_detector

        return fit_detector(model, groups, index["train"], preprocess, cfg, state, log, seed, name,
                            val_records=index["val"], classes=index["classes"], extra_loss=extra_loss)

    def scores(self, model: Any, index: Dict[str, Any], preprocess: Any,
               splits: Sequence[str] = ("val", "test")) -> Dict[str, Any]:
        """``<split>_map50`` first (the main metric), then ``<split>_map`` (mAP@[.5:.95]) and
        ``<split>_per_class_ap`` (toolchain/training.py detection_metrics)."""
        from vfm_toolchain.training import detection_metrics

        return detection_metrics(model, index, preprocess, index["classes"], splits)

    def test_slice(self, records: Sequence[Any], pp: Any, num_classes: int, path: Any) -> None:
        """A detection slice: the images resized to the input size as the build's DetectionDataset resizes them (uint8)
        and their boxes moved with them (xyxy input pixels), flat: ``boxes`` [M, 4], ``box_labels`` [M],
        ``box_image`` [M] (which image each belongs to).  An image that no longer reads as scanned is black with no
        boxes, as in the build."""
        import numpy as np
        import torch
        from PIL import Image
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as TF

        from vfm_toolchain.data.images import load_image
        from torchmetrics.detection import MeanAveragePrecision

        from vfm_toolchain.data.detection import detection_transform

        resize = detection_transform(pp, train=False)
        images, boxes, labels, owner = [], [], [], []
        for k, rec in enumerate(records):
            w, h = rec["width"], rec["height"]
            im = load_image(rec["path"])
            b = torch.tensor(rec["boxes"], dtype=torch.float32).reshape(-1, 4)
            y = torch.tensor(rec["labels"], dtype=torch.int64)
            if im is None or im.size != (w, h):
                im, b, y = Image.new("RGB", (w, h)), b[:0], y[:0]
            img, target = resize(tv_tensors.Image(TF.pil_to_tensor(im)),
                                 {"boxes": tv_tensors.BoundingBoxes(b, format="XYXY", canvas_size=(h, w)), "labels": y})
            images.append(img.permute(1, 2, 0).numpy())
            boxes.append(target["boxes"].as_subclass(torch.Tensor).numpy().reshape(-1, 4))
            labels.append(target["labels"].numpy())
            owner.append(np.full(len(labels[-1]), k, dtype=np.int64))
        # the build evaluator's own sampling points, so the device's mAP50 is the build's to the bit
        recall = np.asarray(MeanAveragePrecision(backend="faster_coco_eval").rec_thresholds, dtype=np.float64)
        np.savez_compressed(path, images=np.stack(images).astype(np.uint8),
                            boxes=np.concatenate(boxes).astype(np.float32), box_labels=np.concatenate(labels),
                            box_image=np.concatenate(owner), mean=np.asarray(pp.mean, np.float32),
                            std=np.asarray(pp.std, np.float32), num_classes=np.asarray(num_classes),
                            recall_thresholds=recall)

    artifact_capability = "detection"
    artifact_words = "final boxes from the graph's NMS or the runtime layer's"

    def artifact_settings(self, recipe: Any) -> Optional[Dict[str, Any]]:
        """The NMS every detection artifact ships with (export.detection): part of what is exported and timed."""
        return recipe.export.detection.model_dump()

    def describe_data(self, r: Dict[str, Any], section: Any) -> None:
        dropped = r.get("dropped_boxes", {})
        section.summary.append(f"boxes ({r.get('format')}): {r.get('boxes')}; boxes per class in the labeled "
                               f"train images: {r.get('boxes_per_class', {}).get('train')}")
        section.record["data"].update(boxes=r.get("boxes"), boxes_per_class=r.get("boxes_per_class"),
                                      dropped_boxes=dropped, clipped_boxes=r.get("clipped_boxes"))
        if any(dropped.values()):
            section.warnings.append(f"boxes dropped (outside their image or with no area): {dropped}")

    def class_count(self, recipe: Any) -> int:
        """Object classes only: a detector has no background class."""
        from vfm_toolchain.data.detection import read_detection_classes

        d = recipe.data
        return d.synthetic.classes if d.source == "synthetic" else len(read_detection_classes(d.train, d.format,
                                                                                               d.roots))

    def check_data(self, recipe: Any) -> None:
        """Every split's annotation files parse (COCO JSON or YOLO txt), with no unknown category ids, repeated
        image ids or lines that do not parse, every path they name inside the data roots, and every split lists
        train's classes; train has a box to learn from, and without data.val an image to validate with.  Images
        are not decoded here: a missing, unreadable or mis-sized image and a box outside its image are skipped and
        counted by data.prepare, as a serious tool would, not refused."""
        from vfm_toolchain.data.detection import check_same_detection_classes, parse_detection_split

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


def _path(record: Dict[str, Any]) -> str:
    return record["path"]


def artifact_scores(run, records, pp, num_classes: int, batch_size: int = 32, what: str = "") -> Dict[str, float]:
    """COCO mAP50 and mAP@[.5:.95] of ``run(images) -> [K, 7]`` detection rows (batch_index, x1, y1, x2, y2, score,
    class; what a detection artifact returns) over a split's records, the way the build scores detectors
    (toolchain/detmetrics.py: each image at its own resolution)."""
    import numpy as np
    import torch

    from vfm_toolchain.detmetrics import detection_map

    def predict(xb: torch.Tensor):
        rows = torch.from_numpy(np.asarray(run(np.ascontiguousarray(xb.numpy())), dtype=np.float32)).reshape(-1, 7)
        return [{"boxes": d[:, 1:5], "scores": d[:, 5], "labels": d[:, 6].long()}
                for d in (rows[rows[:, 0] == k] for k in range(len(xb)))]

    got = detection_map(predict, records, pp, [str(c) for c in range(num_classes)], batch_size, what=what)
    return {"map50": got["map50"], "map": got["map"]}
