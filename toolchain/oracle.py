"""Simulated labeling for the study's selection axis: the pool's withheld labels (``study.oracle``) play the person
who labels the chosen images, and the grown labeled set becomes a data folder the next build reads.

Only the simulation reads an oracle; no stage does.  Classification: a csv with ``file,label`` rows (``file`` a
path ending of the pool image: its name, or ``pool/task/000001.png``); a label that is not one of the task's
classes (a distractor image) labels nothing, as a person would throw the image away, and is counted.
Segmentation: a folder of ``<image stem>.png`` masks.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.roots import DataRoots
from vfm_toolchain.store import place_file

__all__ = ["Oracle", "write_labeled_folders"]


class Oracle:
    """Withheld labels of pool images, by path."""

    def __init__(self, source: Optional[str], task: str, classes: Sequence[str], data_roots: Sequence[str] = ()):
        if source is None:
            raise ToolchainError("study.selection grows the labels by revealing the chosen pool images' withheld "
                                 "labels: set study.oracle (a csv of file,label for classification, a folder of "
                                 "masks for segmentation)")
        if task == "detection":
            raise ToolchainError("study.selection simulates labeling with a csv of class labels (classification) "
                                 "or a folder of masks (segmentation); detection has no box oracle: remove "
                                 "study.selection for this recipe")
        self.source, self.task, self.classes = Path(source), task, list(classes)
        if task == "segmentation":
            if not self.source.is_dir():
                raise ToolchainError(f"study.oracle '{source}' must be a folder of <image stem>.png masks for "
                                     f"segmentation")
            # a revealed mask becomes a training label: one linked from outside the oracle is refused like any
            DataRoots(self.source, data_roots).check_links(self.source, sorted(self.source.glob("*.png")))
            return
        if not self.source.is_file():
            raise ToolchainError(f"study.oracle '{source}' must be a csv of file,label rows for classification")
        with open(self.source, newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not {"file", "label"} <= set(reader.fieldnames) and \
                    not {"path", "label"} <= set(reader.fieldnames):
                raise ToolchainError(f"study.oracle '{source}' needs a header with file (or path) and label; it has "
                                     f"{reader.fieldnames}")
            self.by_name: Dict[str, List[Tuple[str, str]]] = {}
            for row in reader:
                f = (row.get("file") or row.get("path") or "").replace("\\", "/")
                self.by_name.setdefault(f.rsplit("/", 1)[-1], []).append((f, row["label"]))

    def reveal(self, path: str) -> Tuple[Optional[Any], str]:
        """(label, "") for a task label: a class index (classification) or the mask's path (segmentation);
        (None, why) when the oracle has none for the image or it is not one of the task's classes."""
        if self.task == "segmentation":
            mask = self.source / f"{Path(path).stem}.png"
            return (str(mask), "") if mask.is_file() else (None, "no mask in the oracle")
        norm = path.replace("\\", "/")
        for f, label in self.by_name.get(norm.rsplit("/", 1)[-1], []):
            if norm == f or norm.endswith("/" + f):
                if label not in self.classes:
                    return None, f"labeled '{label}', not one of the task's classes"
                return self.classes.index(label), ""
        return None, "not in the oracle"


def write_labeled_folders(folder: Path, task: str, classes: Sequence[str], train: Sequence, val: Sequence) -> Dict[str, str]:
    """``train`` and ``val`` items of a data index (classification (path, class), segmentation (image, mask)) as
    the folders data.prepare reads, links to the files under unique names; returns {"train": ..., "val": ...}."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder)  # an interrupted earlier attempt: written again from the items
    out = {}
    for split, items in (("train", train), ("val", val)):
        root = folder / split
        seen: set = set()
        for k, (src, label) in enumerate(items):
            name = Path(src).name
            if name in seen:  # two source folders, one file name
                name = f"{k}_{name}"
            seen.add(name)
            if task == "segmentation":
                place_file(src, root / "images" / name)
                place_file(label, root / "masks" / f"{Path(name).stem}.png")
            else:
                place_file(src, root / classes[label] / name)
        if task == "segmentation":
            (root / "images").mkdir(parents=True, exist_ok=True)
            (root / "classes.txt").write_text("\n".join(classes) + "\n")
        else:
            for c in classes:  # every class a folder, as the ImageFolder reader expects
                (root / c).mkdir(parents=True, exist_ok=True)
        out[split] = str(root)
    return out
