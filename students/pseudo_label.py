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


from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes, place_file
from vfm_toolchain.core.roots import source_folders
from vfm_toolchain.tasks import TASKS, task_of

__all__ = ["pseudo_label"]

log = logging.getLogger("toolchain")


class _Writer:
    """Everything pseudo-label writes, one image at a time, closed by :meth:`finish`; what differs by task (the
    prediction's form, the tools' annotation types, the kept images' layout) the task says (toolchain/tasks/)."""

    def __init__(self, out: Path, task: str, classes: Sequence[str], threshold: float, copy: bool, teacher: str):
        self.out, self.task, self.classes, self.threshold = out, task_of(task), list(classes), threshold
        self.copy, self.teacher = copy, teacher
        for sub in ("images", "label_studio", "cvat", *(TASKS.get(t).pseudo_folder for t in TASKS.list())):
            if (out / sub).exists():
                shutil.rmtree(out / sub)  # a previous run: the folder holds this one only
        (out / "images").mkdir(parents=True)
        self.rows: List[List[Any]] = []
        self.tasks: List[Dict[str, Any]] = []
        self.cvat: List[str] = []
        self.kept: List[Dict[str, Any]] = []  # what a task keeps to write at the end (COCO records)
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
        common = {"from_name": "label", "to_name": "image", "original_width": w, "original_height": h,
                  "image_rotation": 0}
        result, cvat = self.task.pseudo_annotations(prediction, w, h, self.classes, self.threshold)
        if kept:
            self.task.keep_pseudo_label(self, path, name, prediction, w, h)
        self.tasks.append({"data": {"image": f"/data/local-files/?d=images/{name}", "path": path},
                           "predictions": [{"model_version": self.teacher, "score": float(prediction["confidence"]),
                                            "result": [{**common, **r} for r in result]}]})
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
        self.task.finish_pseudo_labels(self)
        (out / "label_studio").mkdir()
        atomic_write_bytes(out / "label_studio" / "tasks.json", json.dumps(self.tasks, indent=1).encode())
        atomic_write_bytes(out / "label_studio" / "config.xml", _label_studio_config(self.task, self.classes).encode())
        (out / "cvat").mkdir()
        kind = self.task.cvat_kind
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


def _label_studio_config(task, classes: Sequence[str]) -> str:
    """The labeling interface the tasks' pre-annotations are written for (from_name 'label', to_name 'image')."""
    tag, item = task.label_studio_control
    items = "".join(f'    <{item} value={quoteattr(c)}/>\n' for c in classes)
    options = "".join(f" {k}={quoteattr(v)}" for k, v in task.label_studio_options.items())
    return (f'<View>\n  <Image name="image" value="$image"/>\n  <{tag} name="label" toName="image"{options}>\n'
            f'{items}  </{tag}>\n</View>\n')


def pseudo_label(recipe, out: Path, store_root: Path, threshold: float = 0.5, copy: bool = False,
                 batch_size: int = 32) -> Dict[str, Any]:
    """The teacher of RECIPE's build labels its pool (module docstring); returns a summary."""
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.data.images import Preprocess
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
        for k, size, good, pred in zip(pos, sizes, ok, writer.task.pseudo_predictions(outs, sizes, threshold, classes)):
            if not good:
                unreadable += 1
                continue
            writer.add(k, pool[k], size, pred)
    # the kept folders link to the pool's images: a recipe that trains on them names the pool in data.roots
    roots = [] if copy else source_folders(index["pool_roots"])
    summary = {**writer.finish(), "unreadable": unreadable, "folder": str(out), "data_roots": roots}
    log.info("pseudo-label: %d pool images, %d kept at confidence >= %g, %d for review (review.csv)%s",
             summary["images"], summary["kept"], threshold, summary["review"],
             f"; {unreadable} unreadable skipped" if unreadable else "")
    if roots:
        log.info("pseudo-label: the folders link to the pool's images; a recipe that trains on them needs "
                 "data.roots: [%s] (core/roots.py), or run with --copy", ", ".join(roots))
    return summary
