"""``toolchain pseudo-label RECIPE``: the finetuned teacher's labels on the pool, for a person to correct instead
of drawing from nothing.

The teacher of the recipe's build (from the store, or built now) predicts every pool image; each prediction keeps
its confidence.  An image whose confidence reaches ``threshold`` is **kept**, the rest are listed for **review**:

* classification: the top class and its probability;
* segmentation: the mean over pixels of the top class's probability; in the kept masks the pixels below the
  threshold are 255 (``IGNORE_INDEX``: training skips them, a reviewer sees the holes);
* detection: boxes scoring at least the threshold are the labels; an image is for review when a box scores
  between half the threshold and the threshold (an object the teacher is unsure of).

Written into the output folder:

* ``predictions.csv`` (every image: status, confidence, prediction) and ``review.csv`` (the review ones);
* the kept images in the layout the data readers take, so a reviewed set trains as it is: ``imagefolder/<class>/``
  (classification), ``segmentation/{images,masks}`` + ``classes.txt``, ``coco/{images,annotations.json}`` (COCO
  boxes with a ``score``);
* every image with its predictions for the two labeling tools: ``label_studio/tasks.json`` (pre-annotations:
  ``choices``, ``rectanglelabels`` or ``polygonlabels``, each with its score) and ``label_studio/config.xml``
  (the labeling interface), images at ``/data/local-files/?d=images/<name>`` (Label Studio's local storage with
  the output folder as document root); ``cvat/annotations.xml`` (CVAT for images 1.1: ``tag``, ``box`` or
  ``polygon``) for the images in ``images/``.
* ``images/``: every pool image once, under a unique name (links to the originals; ``--copy`` copies).

Segmentation masks reach the tools as polygons (contourpy's contour of each class's region; holes are not kept).
"""
from __future__ import annotations

import csv
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Sequence
from xml.sax.saxutils import quoteattr

import numpy as np
import torch
from PIL import Image

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.store import atomic_write_bytes, place_file
from vfm_toolchain.tasks import task_of

__all__ = ["pseudo_label", "mask_polygons"]

log = logging.getLogger("toolchain")


def mask_polygons(mask: np.ndarray, label: int, most: int = 200, min_area: float = 16.0) -> List[np.ndarray]:
    """The outlines of the regions of ``label`` in a class-id mask, as (K, 2) arrays of x, y in pixels (pixel
    corners, so a region of one pixel at (0, 0) is the square 0..1), at most ``most`` points each; regions under
    ``min_area`` pixels are left out."""
    import contourpy

    region = np.pad((mask == label).astype(np.float64), 1)
    lines = contourpy.contour_generator(z=region, line_type=contourpy.LineType.Separate).lines(0.5)
    out = []
    for line in lines:
        xy = np.asarray(line, dtype=np.float64) - 1 + 0.5  # undo the pad; contour at pixel centres -> corners
        x, y = xy[:, 0], xy[:, 1]
        area = 0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1)))
        if area < min_area or len(xy) < 3:
            continue
        if len(xy) > most:
            xy = xy[np.linspace(0, len(xy) - 1, most).astype(int)]
        out.append(xy)
    return out


class _Writer:
    """Everything pseudo-label writes, one image at a time, closed by :meth:`finish`."""

    def __init__(self, out: Path, task: str, classes: Sequence[str], threshold: float, copy: bool, teacher: str):
        self.out, self.task, self.classes, self.threshold, self.copy = out, task, list(classes), threshold, copy
        self.teacher = teacher
        for sub in ("images", "imagefolder", "segmentation", "coco", "label_studio", "cvat"):
            if (out / sub).exists():
                shutil.rmtree(out / sub)  # a previous run: the folder holds this one only
        (out / "images").mkdir(parents=True)
        self.rows: List[List[Any]] = []
        self.tasks: List[Dict[str, Any]] = []
        self.cvat: List[str] = []
        self.coco: List[Dict[str, Any]] = []
        self.names: set = set()

    def add(self, k: int, path: str, size, prediction: Dict[str, Any]) -> None:
        h, w = size
        name = Path(path).name
        if name in self.names:  # two pool folders, one file name
            name = f"{k}_{name}"
        self.names.add(name)
        place_file(path, self.out / "images" / name, self.copy)
        kept = prediction["confidence"] >= self.threshold and not prediction.get("doubtful", False)
        status = "kept" if kept else "review"
        self.rows.append([path, name, status, f"{prediction['confidence']:.6f}", prediction["summary"]])
        result, cvat = [], []
        common = {"from_name": "label", "to_name": "image", "original_width": w, "original_height": h,
                  "image_rotation": 0}
        if self.task == "classification":
            c = self.classes[prediction["label"]]
            result.append({**common, "type": "choices", "value": {"choices": [c]},
                           "score": float(prediction["confidence"])})
            cvat.append(f'    <tag label={quoteattr(c)} source="auto"></tag>')
            if kept:
                place_file(path, self.out / "imagefolder" / c / name, self.copy)
        elif self.task == "detection":
            for box, s, c in zip(prediction["boxes"], prediction["scores"], prediction["labels"]):
                (x1, y1, x2, y2), s, c = (float(v) for v in box), float(s), int(c)
                if s < self.threshold / 2:
                    continue
                c = self.classes[c]
                result.append({**common, "type": "rectanglelabels", "score": s,
                               "value": {"x": 100 * x1 / w, "y": 100 * y1 / h, "width": 100 * (x2 - x1) / w,
                                         "height": 100 * (y2 - y1) / h, "rotation": 0, "rectanglelabels": [c]}})
                cvat.append(f'    <box label={quoteattr(c)} source="auto" occluded="0" xtl="{x1:.2f}" '
                            f'ytl="{y1:.2f}" xbr="{x2:.2f}" ybr="{y2:.2f}" z_order="0"></box>')
            if kept:
                keep = prediction["scores"] >= self.threshold
                place_file(path, self.out / "coco" / "images" / name, self.copy)
                self.coco.append({"path": str(self.out / "coco" / "images" / name), "width": w, "height": h,
                                  "boxes": prediction["boxes"][keep].tolist(),
                                  "labels": prediction["labels"][keep].tolist(),
                                  "scores": prediction["scores"][keep].tolist()})
        else:
            mask = prediction["mask"]
            for c in np.unique(mask):
                for poly in mask_polygons(mask, int(c)):
                    result.append({**common, "type": "polygonlabels",
                                   "value": {"points": (100 * poly / [w, h]).round(3).tolist(),
                                             "polygonlabels": [self.classes[c]]}})
                    cvat.append(f'    <polygon label={quoteattr(self.classes[c])} source="auto" occluded="0" '
                                f'points="{";".join(f"{x:.2f},{y:.2f}" for x, y in poly)}" z_order="0"></polygon>')
            if kept:
                stem = Path(name).stem
                place_file(path, self.out / "segmentation" / "images" / name, self.copy)
                masked = np.where(prediction["pixel_confidence"] >= self.threshold, mask, 255).astype(np.uint8)
                (self.out / "segmentation" / "masks").mkdir(parents=True, exist_ok=True)
                buf = io.BytesIO()
                Image.fromarray(masked, mode="L").save(buf, format="PNG")
                atomic_write_bytes(self.out / "segmentation" / "masks" / f"{stem}.png", buf.getvalue())
        self.tasks.append({"data": {"image": f"/data/local-files/?d=images/{name}", "path": path},
                           "predictions": [{"model_version": self.teacher, "score": float(prediction["confidence"]),
                                            "result": result}]})
        self.cvat.append(f'  <image id="{len(self.cvat)}" name={quoteattr(name)} width="{w}" height="{h}">\n'
                         + "".join(line + "\n" for line in cvat) + "  </image>")

    def finish(self) -> Dict[str, Any]:
        out = self.out
        header = ["path", "file", "status", "confidence", "prediction"]
        for file, rows in (("predictions.csv", self.rows), ("review.csv", [r for r in self.rows if r[2] == "review"])):
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(header)
            w.writerows(rows)
            atomic_write_bytes(out / file, buf.getvalue().encode())
        if self.task == "segmentation":
            (out / "segmentation").mkdir(exist_ok=True)
            atomic_write_bytes(out / "segmentation" / "classes.txt", ("\n".join(self.classes) + "\n").encode())
        if self.task == "detection":
            from vfm_toolchain.detdata import write_coco

            (out / "coco" / "images").mkdir(parents=True, exist_ok=True)
            write_coco(out / "coco" / "annotations.json", self.coco, self.classes, out / "coco" / "images",
                       info={"description": f"pseudo-labels of {self.teacher}, boxes scoring >= {self.threshold}"})
        (out / "label_studio").mkdir()
        atomic_write_bytes(out / "label_studio" / "tasks.json", json.dumps(self.tasks, indent=1).encode())
        atomic_write_bytes(out / "label_studio" / "config.xml", _label_studio_config(self.task, self.classes).encode())
        (out / "cvat").mkdir()
        kind = {"classification": "tag", "detection": "rectangle", "segmentation": "polygon"}[self.task]
        labels = "".join(f"        <label><name>{_xml(c)}</name><type>{kind}</type><attributes></attributes></label>\n"
                         for c in self.classes)
        xml = ('<?xml version="1.0" encoding="utf-8"?>\n<annotations>\n  <version>1.1</version>\n  <meta>\n    <task>\n'
               f'      <name>{_xml("pseudo-labels of " + self.teacher)}</name>\n      <size>{len(self.cvat)}</size>\n'
               f'      <mode>annotation</mode>\n      <labels>\n{labels}      </labels>\n    </task>\n  </meta>\n'
               + "\n".join(self.cvat) + "\n</annotations>\n")
        atomic_write_bytes(out / "cvat" / "annotations.xml", xml.encode())
        kept = sum(r[2] == "kept" for r in self.rows)
        return {"images": len(self.rows), "kept": kept, "review": len(self.rows) - kept, "threshold": self.threshold}


def _xml(text: str) -> str:
    return quoteattr(text)[1:-1]


def _label_studio_config(task: str, classes: Sequence[str]) -> str:
    """The labeling interface the tasks' pre-annotations are written for (from_name 'label', to_name 'image')."""
    tag, item = {"classification": ("Choices", "Choice"), "detection": ("RectangleLabels", "Label"),
                 "segmentation": ("PolygonLabels", "Label")}[task]
    items = "".join(f'    <{item} value={quoteattr(c)}/>\n' for c in classes)
    return (f'<View>\n  <Image name="image" value="$image"/>\n  <{tag} name="label" toName="image">\n{items}'
            f'  </{tag}>\n</View>\n')


def _predictions(task: str, outs, sizes, threshold: float, classes: Sequence[str]) -> List[Dict[str, Any]]:
    """One batch of the teacher's output (pool_predict) as per-image predictions with a confidence and a summary
    for the csv files."""
    found = []
    for k, size in enumerate(sizes):
        if task == "classification":
            p = outs[k]
            c = int(p.argmax())
            found.append({"label": c, "confidence": float(p[c]), "summary": classes[c]})
        elif task == "segmentation":
            p = torch.nn.functional.interpolate(outs[k:k + 1], size=tuple(size), mode="bilinear",
                                                align_corners=False)[0]
            conf, mask = p.max(0)
            found.append({"mask": mask.numpy().astype(np.int64), "pixel_confidence": conf.numpy(),
                          "confidence": float(conf.mean()),
                          "summary": " ".join(classes[c] for c in mask.unique().tolist())})
        else:
            d = outs[k]
            scores = d["scores"].numpy()
            sure = scores >= threshold
            doubtful = bool(((scores >= threshold / 2) & ~sure).any())
            found.append({"boxes": d["boxes"].numpy(), "scores": scores, "labels": d["labels"].numpy(),
                          "confidence": float(scores[sure].min()) if sure.any() else (0.0 if doubtful else 1.0),
                          "doubtful": doubtful, "summary": f"{int(sure.sum())} boxes: " + " ".join(
                              classes[c] for c in d["labels"][sure].tolist())})
    return found


def pseudo_label(recipe, out: Path, store_root: Path, threshold: float = 0.5, copy: bool = False,
                 batch_size: int = 32) -> Dict[str, Any]:
    """The teacher of RECIPE's build labels its pool (module docstring); returns a summary."""
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.data import Preprocess
    from vfm_toolchain.pool_predict import predict_pool
    from vfm_toolchain.prepare import load_index
    from vfm_toolchain.runner import build
    from vfm_toolchain.stage import StageOutput

    if not 0 < threshold <= 1:
        raise ToolchainError(f"--threshold {threshold}: a confidence in (0, 1], e.g. 0.5")
    out = Path(out)
    log.info("pseudo-label: the build's finetuned teacher (from the store; built now if it is not there)")
    build(recipe, out / "build", store_root, only=["teacher.finetune"])
    stage = lambda name: StageOutput(name, "", (out / "build" / "stages" / name).resolve(),
                                     json.loads((out / "build" / "stages" / name / "result.json").read_text()))
    index = load_index(stage("data.prepare"))
    pool, task, classes = index["pool"], task_of(index).name, index["classes"]
    if not pool:
        raise ToolchainError("the data index has no pool images: data.pools lists the unlabeled images to label")
    folder = stage("teacher.finetune").path("model")
    spec = json.loads((folder / "spec.json").read_text())
    teacher = (load_model(folder), Preprocess.from_dict(spec["preprocess"]))
    writer = _Writer(out, task, classes, threshold, copy, f"teacher {spec.get('name', recipe.teacher.name)}")
    unreadable = 0
    for pos, sizes, ok, (outs,) in predict_pool([teacher], pool, task, batch_size, score_thresh=threshold / 2,
                                                what="pool images (teacher)"):
        for k, size, good, pred in zip(pos, sizes, ok, _predictions(task, outs, sizes, threshold, classes)):
            if not good:
                unreadable += 1
                continue
            writer.add(k, pool[k], size, pred)
    # the kept folders link to the pool's images: a recipe that trains on them names the pool in data.roots
    roots = [] if copy else list(dict.fromkeys(r if Path(r).is_dir() else str(Path(r).parent)
                                               for r in index["pool_roots"]))
    summary = {**writer.finish(), "unreadable": unreadable, "folder": str(out), "data_roots": roots}
    log.info("pseudo-label: %d pool images, %d kept at confidence >= %g, %d for review (review.csv)%s",
             summary["images"], summary["kept"], threshold, summary["review"],
             f"; {unreadable} unreadable skipped" if unreadable else "")
    if roots:
        log.info("pseudo-label: the folders link to the pool's images; a recipe that trains on them needs "
                 "data.roots: [%s] (toolchain/roots.py), or run with --copy", ", ".join(roots))
    return summary
