"""Simulated labeling for the study's selection axis: the pool's withheld labels (``study.oracle``) play the person
who labels the chosen images, and the grown labeled set becomes a data folder the next build reads.

Only the simulation reads an oracle; no stage does.  A task says which oracle it reads (``Task.oracle``,
toolchain/tasks/): classification a csv with ``file,label`` rows (:class:`LabelCsv`: ``file`` a path ending of
the pool image, its name or ``pool/task/000001.png``; a label that is not one of the task's classes, a
distractor image, labels nothing, as a person would throw the image away, and is counted); segmentation a
folder of ``<image stem>.png`` masks (:class:`MaskFolder`).
"""
from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import place_file
from vfm_toolchain.core.roots import DataRoots

__all__ = ["Oracle", "LabelCsv", "MaskFolder"]


class Oracle:
    """Withheld labels of pool images, by path, and the folders a grown label set is written as."""

    def reveal(self, path: str) -> Tuple[Optional[Any], str]:
        """(label, "") for the image's task label as a data index holds it, or (None, why) when there is none."""
        raise NotImplementedError

    def write_labeled(self, folder: Path, classes: Sequence[str], train: Sequence, val: Sequence) -> Dict[str, str]:
        """``train`` and ``val`` items of a data index as the folders data.prepare reads, links to the files under
        unique names (two source folders may hold one file name); returns {"train": ..., "val": ...}."""
        if folder.exists():
            shutil.rmtree(folder)  # an interrupted earlier attempt: written again from the items
        out = {}
        for split, items in (("train", train), ("val", val)):
            root = folder / split
            seen: set = set()
            for k, (src, label) in enumerate(items):
                name = Path(src).name
                if name in seen:
                    name = f"{k}_{name}"
                seen.add(name)
                self._place(root, name, src, label, classes)
            self._finish(root, classes)
            out[split] = str(root)
        return out

    def _place(self, root: Path, name: str, src: str, label: Any, classes: Sequence[str]) -> None:
        raise NotImplementedError

    def _finish(self, root: Path, classes: Sequence[str]) -> None:
        raise NotImplementedError


class LabelCsv(Oracle):
    """Class labels from a csv of ``file,label`` (or ``path,label``) rows; the grown set is an ImageFolder."""

    def __init__(self, source: str, classes: Sequence[str]):
        self.source, self.classes = Path(source), list(classes)
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
        """(class index, "") or (None, why)."""
        norm = path.replace("\\", "/")
        for f, label in self.by_name.get(norm.rsplit("/", 1)[-1], []):
            if norm == f or norm.endswith("/" + f):
                if label not in self.classes:
                    return None, f"labeled '{label}', not one of the task's classes"
                return self.classes.index(label), ""
        return None, "not in the oracle"

    def _place(self, root: Path, name: str, src: str, label: Any, classes: Sequence[str]) -> None:
        place_file(src, root / classes[label] / name)

    def _finish(self, root: Path, classes: Sequence[str]) -> None:
        for c in classes:  # every class a folder, as the ImageFolder reader expects
            (root / c).mkdir(parents=True, exist_ok=True)


class MaskFolder(Oracle):
    """Masks in a folder of ``<image stem>.png``; the grown set is images/ + masks/ + classes.txt."""

    def __init__(self, source: str, data_roots: Sequence[str] = ()):
        self.source = Path(source)
        if not self.source.is_dir():
            raise ToolchainError(f"study.oracle '{source}' must be a folder of <image stem>.png masks for "
                                 f"segmentation")
        # a revealed mask becomes a training label: one linked from outside the oracle is refused like any
        DataRoots(self.source, data_roots).check_links(self.source, sorted(self.source.glob("*.png")))

    def reveal(self, path: str) -> Tuple[Optional[Any], str]:
        """(the mask's path, "") or (None, why)."""
        mask = self.source / f"{Path(path).stem}.png"
        return (str(mask), "") if mask.is_file() else (None, "no mask in the oracle")

    def _place(self, root: Path, name: str, src: str, label: Any, classes: Sequence[str]) -> None:
        place_file(src, root / "images" / name)
        place_file(label, root / "masks" / f"{Path(name).stem}.png")

    def _finish(self, root: Path, classes: Sequence[str]) -> None:
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "classes.txt").write_text("\n".join(classes) + "\n")
