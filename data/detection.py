"""Detection data: COCO JSON and YOLO txt splits read into one record format, box-aware transforms, a dataset.

Two layouts of a split folder are read (``data.format``: coco, yolo, or auto, which looks at the folder):

* COCO JSON: ``<split>/images/<file_name>`` and ``<split>/annotations.json`` (``bbox`` = [x, y, width,
  height] in pixels, origin at the top-left corner of the top-left pixel); classes are the categories sorted
  by id, mapped to contiguous indices 0..C-1.
* YOLO txt: ``<split>/images/<name>.<ext>`` and ``<split>/labels/<name>.txt``, one ``class cx cy w h`` line per
  box, normalised to 0..1; class names from ``classes.txt`` (one per line) or a ``data.yaml`` ``names:`` list,
  looked for in the split folder, its ``labels/``, then the folder above it.  An image without a label file is
  a negative (no objects), as in Ultralytics.

Either way every labeled image becomes one record::

    {"path": str, "width": int, "height": int, "boxes": [[x1, y1, x2, y2], ...], "labels": [int, ...]}

boxes in absolute pixels of the image's own resolution (float, xyxy), labels class indices; an image with
no box is a valid negative.  Reading is in two steps: :func:`parse_detection_split` reads only the annotation
files (what preflight checks before the first stage: every structural mistake is an error that says what was
wrong and what is allowed), :func:`scan_detection_split` also decodes every image once (data.prepare): an
unreadable image, a missing one, or one whose declared size is not its real size is skipped and counted with
the reason, as corrupt images are for classification; a box entirely outside its image or with no area is
dropped and counted with the reason, a box reaching past the edge is clipped.
"""
from __future__ import annotations

import json
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.roots import DataRoots, refuse_outside
from vfm_toolchain.core.yamlfile import load_yaml
from vfm_toolchain.data.images import Preprocess, _interp, _is_image, load_image, read_image
from vfm_toolchain.data.pools import IMAGE_EXTENSIONS

__all__ = ["DETECTION_FORMATS", "EDGE_TOLERANCE", "ParsedSplit", "DetectionSplit", "detect_format",
           "parse_detection_split", "scan_detection_split", "read_detection_classes", "read_yolo_names",
           "check_same_detection_classes", "select_labeled", "images_per_class", "boxes_per_class", "write_coco",
           "detection_transform", "DetectionDataset", "detection_collate"]

DETECTION_FORMATS = ("coco", "yolo")

# How far (pixels) a box may reach past the image's edge and count as merely rounded: annotation tools write
# x + w = 640.01 on a 640 px image all the time.  Past this a clipped box is counted (the log says how many),
# and a box with less than this much of itself inside the image is dropped as outside it.
EDGE_TOLERANCE = 1.0

_SHOWN = 5  # examples a message lists before "and N more"


# ---------------------------------------------------------------------------------------------------
# parsing: the annotation files alone, every structural mistake an error


@dataclass
class _Box:
    key: str  # where the box came from, for messages: "<file_name> annotation 12" or "<labels file>:3"
    xyxy: Tuple[float, float, float, float]  # pixels (COCO) or normalised 0..1 (YOLO), as written
    label: int
    crowd: bool = False


@dataclass
class _Entry:
    path: Path
    declared: Optional[Tuple[int, int]]  # (width, height) the annotation file states, when it does
    boxes: List[_Box]


@dataclass
class ParsedSplit:
    """A split's annotation files, nothing decoded: its classes, one entry per image, and the images (or label
    files) skipped because a file is missing, each with why."""

    root: str
    role: str
    format: str
    classes: List[str]
    entries: List[_Entry]
    normalised: bool  # YOLO: boxes are fractions of the image's size, known once it is decoded
    skipped: Dict[str, str] = field(default_factory=dict)


def detect_format(root: str | Path, role: str, fmt: str = "auto") -> str:
    """The layout of a split folder: ``fmt`` checked against the folder, or for ``auto`` the one it has.

    Raises:
        ToolchainError: the folder is missing, has neither layout, or not the one ``fmt`` names.
    """
    root = Path(root)
    if not root.is_dir():
        raise ToolchainError(f"{role} folder '{root}' does not exist (a detection split is <split>/images + "
                             f"<split>/annotations.json (COCO) or <split>/images + <split>/labels (YOLO))")
    has_coco, has_yolo = (root / "annotations.json").is_file(), (root / "labels").is_dir()
    if fmt == "coco" and not has_coco:
        raise ToolchainError(f"{role} folder '{root}' has no annotations.json, which data.format: coco reads "
                             f"(<split>/images + <split>/annotations.json)"
                             + ("; it has labels/: set data.format: yolo or auto" if has_yolo else ""))
    if fmt == "yolo" and not has_yolo:
        raise ToolchainError(f"{role} folder '{root}' has no labels/ folder, which data.format: yolo reads "
                             f"(<split>/images + <split>/labels/<name>.txt)"
                             + ("; it has annotations.json: set data.format: coco or auto" if has_coco else ""))
    if fmt in DETECTION_FORMATS:
        return fmt
    if fmt != "auto":
        raise ToolchainError(f"unknown detection format '{fmt}'; use coco, yolo or auto")
    if has_coco and has_yolo:
        raise ToolchainError(f"{role} folder '{root}' has both annotations.json (COCO) and labels/ (YOLO); say "
                             f"which to read with data.format: coco or data.format: yolo")
    if not (has_coco or has_yolo):
        raise ToolchainError(f"{role} folder '{root}' has neither annotations.json (COCO: <split>/images + "
                             f"<split>/annotations.json) nor labels/ (YOLO: <split>/images + <split>/labels/"
                             f"<name>.txt with classes.txt or data.yaml)")
    return "coco" if has_coco else "yolo"


def parse_detection_split(root: str | Path, role: str, fmt: str = "auto",
                          data_roots: Sequence[str] = ()) -> ParsedSplit:
    """Read a split's annotations without decoding an image (or opening one: a COCO file_name or a symlink that
    leads outside the split's images, or labels, and ``data_roots`` is refused first, core/roots.py).

    Raises:
        ToolchainError: the layout is wrong, the annotation file does not parse, ids repeat, a box names an
            unknown class, a path leads outside, or nothing usable is left; each says what was wrong and what is
            allowed.
    """
    root = Path(root)
    fmt = detect_format(root, role, fmt)
    if not (root / "images").is_dir():
        raise ToolchainError(f"{role} folder '{root}' needs an images/ folder beside its "
                             f"{'annotations.json' if fmt == 'coco' else 'labels/'}")
    parsed = (_parse_coco if fmt == "coco" else _parse_yolo)(root, role, data_roots)
    if not parsed.entries:
        first = next(iter(parsed.skipped.items()), None)
        example = f" ({len(parsed.skipped)} skipped, e.g. '{first[0]}': {first[1]})" if first else ""
        raise ToolchainError(f"{role} folder '{root}' has no usable labeled images{example}")
    return parsed


def _parse_coco(root: Path, role: str, data_roots: Sequence[str] = ()) -> ParsedSplit:
    f, data = _coco_json(root, data_roots)
    DataRoots(root, data_roots).check_links(root, [root / "images"])  # the folder its file_names are joined to
    classes, index_of = _coco_categories(f, data["categories"])
    images = _coco_images(f, data["images"])
    boxes: Dict[Any, List[_Box]] = defaultdict(list)
    unknown_images: Dict[Any, List[Any]] = defaultdict(list)
    unknown_classes: Dict[Any, List[Any]] = defaultdict(list)
    for ann in data["annotations"]:
        if not isinstance(ann, dict):
            raise ToolchainError(f"'{f}': an entry of annotations is {ann!r}; each is an object with id, "
                                 f"image_id, category_id and bbox")
        aid, image_id, cat = ann.get("id"), ann.get("image_id"), ann.get("category_id")
        if image_id not in images:
            unknown_images[image_id].append(aid)
            continue
        if cat not in index_of:
            unknown_classes[cat].append(aid)
            continue
        bbox = ann.get("bbox")
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(_finite(v) for v in bbox)):
            raise ToolchainError(f"'{f}': annotation id {aid} has bbox {bbox!r}; a bbox is [x, y, width, height], "
                                 f"four finite numbers in pixels")
        x, y, w, h = map(float, bbox)
        name = images[image_id][0]
        boxes[image_id].append(_Box(f"{name} annotation {aid}", (x, y, x + w, y + h), index_of[cat],
                                    crowd=bool(ann.get("iscrowd", 0))))
    if unknown_images:
        raise ToolchainError(f"'{f}': annotations name image ids that its images list does not have: "
                             f"{_grouped(unknown_images, 'image id')}. Every annotation's image_id must be the id "
                             f"of an entry of images")
    if unknown_classes:
        known = ", ".join(f"{cid}: {name}" for cid, name in zip(sorted(index_of, key=index_of.get), classes))
        raise ToolchainError(f"'{f}': annotations use category ids that its categories do not define: "
                             f"{_grouped(unknown_classes, 'category id')}. The categories are {{{known}}}; add the "
                             f"missing categories or fix the annotations' category_id")
    allowed = DataRoots(root / "images", data_roots)
    refuse_outside(f, [(f"image id {image_id}", name) for image_id, (name, _) in images.items()
                       if not allowed.admits(root / "images" / name)], allowed)
    entries, skipped = [], {}
    for image_id, (name, declared) in images.items():
        path = root / "images" / name
        if not path.is_file():
            skipped[str(path)] = (f"named in annotations.json (image id {image_id}) but the file does not exist; "
                                  f"its {len(boxes[image_id])} box(es) are skipped with it")
            continue
        entries.append(_Entry(path, declared, boxes[image_id]))
    entries.sort(key=lambda e: str(e.path))
    return ParsedSplit(str(root), role, "coco", classes, entries, normalised=False,
                       skipped=dict(sorted(skipped.items())))


def _coco_json(root: Path, data_roots: Sequence[str]) -> Tuple[Path, Dict[str, Any]]:
    """A split's ``annotations.json`` and its object, checked to hold the lists images, annotations and categories;
    the file itself may not be a symlink leading outside the split and ``data_roots``."""
    f = root / "annotations.json"
    DataRoots(root, data_roots).check_links(root, [f])
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ToolchainError(f"'{f}' is not valid JSON ({exc}); a COCO detection file is one JSON object with "
                             f"the lists images, annotations and categories") from None
    missing = [k for k in ("images", "annotations", "categories")
               if not isinstance(data, dict) or not isinstance(data.get(k), list)]
    if missing:
        raise ToolchainError(f"'{f}' lacks the list{'s' * (len(missing) > 1)} {', '.join(missing)}; a COCO "
                             f"detection file has images, annotations and categories (an empty annotations "
                             f"list is fine: every image is then a negative)")
    return f, data


def _coco_categories(f: Path, categories: list) -> Tuple[List[str], Dict[Any, int]]:
    """Class names sorted by category id, and category id -> contiguous class index."""
    for cat in categories:
        if not (isinstance(cat, dict) and _is_id(cat.get("id")) and isinstance(cat.get("name"), str)
                and cat["name"].strip()):
            raise ToolchainError(f"'{f}': the category {cat!r} needs an integer id and a non-empty name")
    if not categories:
        raise ToolchainError(f"'{f}' has no categories; list each class as {{\"id\": 1, \"name\": \"fish\"}}")
    _no_repeats(f, "category id", [c["id"] for c in categories])
    _no_repeats(f, "category name", [c["name"].strip() for c in categories],
                "two ids of one name would be one class under two indices")
    ordered = sorted(categories, key=lambda c: c["id"])
    return [c["name"].strip() for c in ordered], {c["id"]: i for i, c in enumerate(ordered)}


def _coco_images(f: Path, images: list) -> Dict[Any, Tuple[str, Optional[Tuple[int, int]]]]:
    """image id -> (file_name, declared (width, height) or None)."""
    for im in images:
        if not (isinstance(im, dict) and _is_id(im.get("id")) and isinstance(im.get("file_name"), str)
                and im["file_name"]):
            raise ToolchainError(f"'{f}': the image entry {im!r} needs an integer id and a file_name")
    _no_repeats(f, "image id", [im["id"] for im in images], "annotations could not say which image they belong to")
    _no_repeats(f, "file_name", [im["file_name"] for im in images], "the same picture would count twice")
    out = {}
    for im in images:
        w, h = im.get("width"), im.get("height")
        out[im["id"]] = (im["file_name"], (int(w), int(h)) if _is_id(w) and _is_id(h) else None)
    return out


def _parse_yolo(root: Path, role: str, data_roots: Sequence[str] = ()) -> ParsedSplit:
    classes = read_yolo_names(root, data_roots)
    images_dir, labels_dir = root / "images", root / "labels"
    entries, problems, unknown = [], [], []
    seen_labels = set()
    images = sorted(p for p in images_dir.rglob("*") if _is_image(p))
    allowed = DataRoots(root, data_roots)
    allowed.check_links(root, [images_dir, labels_dir])
    allowed.check_links(images_dir, images)
    allowed.check_links(labels_dir, [p for p in labels_dir.rglob("*.txt")])
    for img in images:
        label_file = labels_dir / img.relative_to(images_dir).with_suffix(".txt")
        boxes: List[_Box] = []
        if label_file.is_file():
            seen_labels.add(label_file)
            lines = label_file.read_text(encoding="utf-8", errors="replace").splitlines()
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                where = f"{label_file}:{number}"
                box, why = _yolo_line(line)
                if why:
                    problems.append(f"{where}: {why} (the line is {line.strip()!r})")
                elif box[0] >= len(classes):
                    unknown.append((where, box[0]))
                else:
                    boxes.append(_Box(where, box[1], box[0]))
        entries.append(_Entry(img, None, boxes))
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ToolchainError(f"{role}: YOLO label lines that do not parse:\n  " + "\n  ".join(problems[:_SHOWN]) +
                             more + "\nEach line is 'class cx cy w h': an integer class index and four numbers, "
                             "the box's centre and size as fractions (0..1) of the image's width and height")
    if unknown:
        shown = "; ".join(f"{where} class {c}" for where, c in unknown[:_SHOWN])
        more = f"; and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
        raise ToolchainError(f"{role}: YOLO labels use class indices that the class names do not cover ({shown}"
                             f"{more}); the {len(classes)} names ({', '.join(classes)}) allow 0 to "
                             f"{len(classes) - 1}")
    skipped = {}
    for label_file in sorted(labels_dir.rglob("*.txt")):
        if label_file not in seen_labels and label_file.name != "classes.txt":
            stem = images_dir / label_file.relative_to(labels_dir).with_suffix("")
            skipped[str(label_file)] = (f"a label file with no image (looked for {stem}.<"
                                        f"{'|'.join(e.lstrip('.') for e in IMAGE_EXTENSIONS[:3])}|...>)")
    return ParsedSplit(str(root), role, "yolo", classes, entries, normalised=True, skipped=skipped)


def _yolo_line(line: str) -> Tuple[Optional[Tuple[int, Tuple[float, ...]]], str]:
    """((class, normalised xyxy), "") or (None, what is wrong with the line)."""
    tokens = line.split()
    if len(tokens) != 5:
        hint = " (a polygon: YOLO segmentation labels are not boxes)" if len(tokens) > 5 and len(tokens) % 2 else ""
        return None, f"{len(tokens)} values{hint}; a box line has 5"
    try:
        values = [float(t) for t in tokens]
    except ValueError:
        return None, "not all values are numbers"
    if not all(math.isfinite(v) for v in values):
        return None, "a value is not finite"
    if not values[0].is_integer() or values[0] < 0:
        return None, f"the class '{tokens[0]}' is not a non-negative integer"
    cx, cy, w, h = values[1:]
    return (int(values[0]), (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)), ""


def read_yolo_names(root: str | Path, data_roots: Sequence[str] = ()) -> List[str]:
    """The class names of a YOLO split: classes.txt or data.yaml's names, in the split folder, its labels/, or
    the folder above (first found); a symlinked names file must lead inside its folder or ``data_roots``."""
    import yaml

    root = Path(root)
    for folder in (root, root / "labels", root.parent):
        txt, yml = folder / "classes.txt", folder / "data.yaml"
        DataRoots(folder, data_roots).check_links(folder, [txt, yml])
        if txt.is_file():
            names = [line.strip() for line in txt.read_text(encoding="utf-8").splitlines()]
            names = [n for n in names if n]
            where = txt
        elif yml.is_file():
            try:
                raw = load_yaml(yml.read_text(encoding="utf-8"), f"'{yml}'") or {}
            except yaml.YAMLError as exc:
                raise ToolchainError(f"'{yml}' is not valid YAML: {exc}") from None
            names = raw.get("names") if isinstance(raw, dict) else None
            if isinstance(names, dict) and all(isinstance(k, int) for k in names):
                if sorted(names) != list(range(len(names))):
                    raise ToolchainError(f"'{yml}': names has keys {sorted(names)}; they must be 0..{len(names) - 1}")
                names = [names[k] for k in sorted(names)]
            if not (isinstance(names, list) and all(isinstance(n, str) and n.strip() for n in names)):
                raise ToolchainError(f"'{yml}' needs names: a list of class names in index order (or a mapping "
                                     f"index -> name); got {names!r}")
            names, where = [n.strip() for n in names], yml
        else:
            continue
        if not names:
            raise ToolchainError(f"'{where}' lists no class names")
        _no_repeats(where, "class name", names, "two indices of one name would be one class under two labels")
        return names
    raise ToolchainError(f"YOLO split '{root}' has no class names: put classes.txt (one name per line, in index "
                         f"order) or data.yaml (names: [...]) in '{root}', '{root / 'labels'}' or '{root.parent}'")


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _no_repeats(f: Path, what: str, values: Sequence[Any], why: str = "") -> None:
    twice = [v for v, n in Counter(values).items() if n > 1]
    if twice:
        shown = ", ".join(repr(v) for v in twice[:_SHOWN]) + (f" and {len(twice) - _SHOWN} more"
                                                              if len(twice) > _SHOWN else "")
        raise ToolchainError(f"'{f}' repeats the {what}{'s' * (len(twice) > 1)} {shown}; each must be unique"
                             + (f" ({why})" if why else ""))


def _grouped(found: Dict[Any, List[Any]], what: str) -> str:
    parts = [f"{what} {k!r} ({len(v)} annotation{'s' * (len(v) != 1)}, e.g. id {v[0]})" for k, v in found.items()]
    return "; ".join(parts[:_SHOWN]) + (f"; and {len(parts) - _SHOWN} more" if len(parts) > _SHOWN else "")


def check_same_detection_classes(train: Sequence[str], other: Sequence[str], role: str) -> None:
    """Every split must list train's classes in train's order, or an index would mean two classes."""
    if list(other) != list(train):
        raise ToolchainError(f"{role} classes {list(other)} differ from train classes {list(train)}; every split "
                             f"needs the same class list in the same order (COCO: the same categories with the same "
                             f"ids; YOLO: the same names in the same order)")


def read_detection_classes(root: str | Path, fmt: str = "auto", data_roots: Sequence[str] = ()) -> List[str]:
    """A split's class names from its annotation files alone (COCO categories by id, or YOLO names)."""
    root = Path(root)
    if detect_format(root, "train", fmt) == "yolo":
        return read_yolo_names(root, data_roots)
    f, data = _coco_json(root, data_roots)
    return _coco_categories(f, data["categories"])[0]


# ---------------------------------------------------------------------------------------------------
# scanning: every image decoded once, boxes converted to pixels, clipped, or dropped with the reason


@dataclass
class DetectionSplit:
    """A split's records (see the module docstring), the images skipped (path -> why), the boxes dropped
    (where -> why), and how many boxes were clipped to their image by more than EDGE_TOLERANCE."""

    root: str
    role: str
    format: str
    classes: List[str]
    records: List[Dict[str, Any]]
    skipped: Dict[str, str] = field(default_factory=dict)
    dropped_boxes: Dict[str, str] = field(default_factory=dict)
    clipped: int = 0


def scan_detection_split(root: str | Path, role: str, fmt: str = "auto",
                         data_roots: Sequence[str] = ()) -> DetectionSplit:
    """Parse a split and decode each image once: records at each image's own resolution.

    Raises:
        ToolchainError: what :func:`parse_detection_split` raises, or no image is readable.
    """
    parsed = parse_detection_split(root, role, fmt, data_roots)
    records, skipped, dropped, clipped = [], dict(parsed.skipped), {}, 0
    for entry in parsed.entries:
        im, why = read_image(entry.path)
        if im is None:
            skipped[str(entry.path)] = why
            continue
        w, h = im.size
        if entry.declared and entry.declared != (w, h):
            skipped[str(entry.path)] = (f"annotations.json says {entry.declared[0]}x{entry.declared[1]} but the file "
                                        f"is {w}x{h}; its boxes were drawn on another size (an image rotated or "
                                        f"resized after labeling?), so they would be misplaced")
            continue
        boxes, labels = [], []
        for box in entry.boxes:
            xyxy = box.xyxy
            if parsed.normalised:
                xyxy = (xyxy[0] * w, xyxy[1] * h, xyxy[2] * w, xyxy[3] * h)
            kept, why, was_clipped = _clip(xyxy, w, h, box.crowd, parsed.normalised)
            if why:
                dropped[box.key] = why
                continue
            clipped += was_clipped
            boxes.append([round(v, 4) for v in kept])
            labels.append(box.label)
        records.append({"path": str(entry.path), "width": w, "height": h, "boxes": boxes, "labels": labels})
    if not records:
        raise ToolchainError(f"{role} folder '{root}' has no readable labeled images ({len(skipped)} skipped; e.g. "
                             f"'{next(iter(skipped))}': {next(iter(skipped.values()))})")
    return DetectionSplit(str(root), role, parsed.format, parsed.classes, records, dict(sorted(skipped.items())),
                          dropped, clipped)


def _clip(xyxy: Tuple[float, ...], w: int, h: int, crowd: bool, normalised: bool):
    """(clipped box, "", clipped by more than the tolerance) or (None, why it is dropped, False)."""
    x1, y1, x2, y2 = xyxy
    shown = "[" + ", ".join(f"{v:.1f}" for v in xyxy) + "] xyxy px"
    if crowd:  # COCO's crowd regions mark areas to ignore, not one object each
        return None, "an iscrowd region (COCO marks ignore areas this way, not objects)", False
    if x2 - x1 <= 0 or y2 - y1 <= 0:
        return None, f"non-positive size (width {x2 - x1:.2f}, height {y2 - y1:.2f}; {shown})", False
    if x2 - x1 < EDGE_TOLERANCE or y2 - y1 < EDGE_TOLERANCE:
        return None, f"smaller than a pixel (width {x2 - x1:.2f}, height {y2 - y1:.2f}; {shown})", False
    c = (min(max(x1, 0.0), float(w)), min(max(y1, 0.0), float(h)), min(max(x2, 0.0), float(w)),
         min(max(y2, 0.0), float(h)))
    if c[2] - c[0] < EDGE_TOLERANCE or c[3] - c[1] < EDGE_TOLERANCE:
        where = "entirely outside" if c[2] <= c[0] or c[3] <= c[1] else "all but a sliver under a pixel outside"
        pixels = normalised and max(abs(v) for v in xyxy) > 2 * max(w, h)
        hint = " (YOLO coordinates are fractions 0..1 of the image, not pixels)" if pixels else ""
        return None, f"{where} the {w}x{h} image ({shown}){hint}", False
    return c, "", max(abs(a - b) for a, b in zip(c, xyxy)) > EDGE_TOLERANCE


# ---------------------------------------------------------------------------------------------------
# the label budget and the counts the index and the report give


def images_per_class(records: Sequence[Dict[str, Any]], num_classes: int) -> List[int]:
    """How many images contain each class."""
    counts = [0] * num_classes
    for r in records:
        for c in set(r["labels"]):
            counts[c] += 1
    return counts


def boxes_per_class(records: Sequence[Dict[str, Any]], num_classes: int) -> List[int]:
    counts = [0] * num_classes
    for r in records:
        for c in r["labels"]:
            counts[c] += 1
    return counts


def select_labeled(records: Sequence[Dict[str, Any]], num_classes: int, per_class: int,
                   seed: int) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """``data.labeled_per_class`` for detection: images are labeled whole (every box of a chosen image is kept),
    so the budget picks images until each class appears in at least ``per_class`` of them, where the split has
    that many.  Rarest class first (a rare class's images also bring common classes, never the reverse), each
    class from one seeded shuffle of the images in path order, so the choice is the same on every machine.
    Returns (chosen, rest), both in path order; negatives (no box) are never chosen."""
    order = sorted(records, key=lambda r: r["path"])
    random.Random(seed).shuffle(order)
    have = images_per_class(order, num_classes)
    chosen_ids: set = set()
    counts = [0] * num_classes
    for c in sorted(range(num_classes), key=lambda k: (have[k], k)):
        for i, r in enumerate(order):
            if counts[c] >= per_class:
                break
            if i not in chosen_ids and c in r["labels"]:
                chosen_ids.add(i)
                for k in set(r["labels"]):
                    counts[k] += 1
    chosen = sorted((order[i] for i in chosen_ids), key=lambda r: r["path"])
    rest = sorted((r for i, r in enumerate(order) if i not in chosen_ids), key=lambda r: r["path"])
    return chosen, rest


def write_coco(path: str | Path, records: Sequence[Dict[str, Any]], classes: Sequence[str], images_dir: str | Path,
               info: Optional[Dict[str, Any]] = None) -> None:
    """Records as a COCO detection file (category ids 1..C in class order, file names relative to
    ``images_dir``; a record's ``scores``, when it has them, become each box's ``score``, as COCO results carry
    it): what the procedural task and ``toolchain pseudo-label`` write, written atomically."""
    from vfm_toolchain.core.files import atomic_write_bytes

    images, annotations = [], []
    for image_id, r in enumerate(records, start=1):
        images.append({"id": image_id, "file_name": Path(r["path"]).relative_to(images_dir).as_posix(),
                       "width": r["width"], "height": r["height"]})
        scores = r.get("scores") or [None] * len(r["labels"])
        for (x1, y1, x2, y2), label, score in zip(r["boxes"], r["labels"], scores):
            w, h = x2 - x1, y2 - y1
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": label + 1,
                                "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0,
                                **({"score": round(float(score), 6)} if score is not None else {})})
    data = {"info": info or {}, "images": images, "annotations": annotations,
            "categories": [{"id": i + 1, "name": name} for i, name in enumerate(classes)]}
    atomic_write_bytes(Path(path), json.dumps(data).encode())


# ---------------------------------------------------------------------------------------------------
# transforms and the dataset: a plain resize to (h, w), boxes scaled per axis with the pixels


# Crop scale ranges of the training geometry: the area of the image a random crop keeps.  Light keeps most of
# it (objects cut by the border are few); strong zooms further, for few labels of large objects.
_CROP_SCALE = {"light": (0.5, 1.0), "strong": (0.3, 1.0)}


def detection_transform(pp: Preprocess, train: bool, aspect: float = 1.0, augment: str = "light",
                        flip: float = 0.5, crop: bool = True) -> Callable:
    """The box-aware geometry (torchvision.transforms.v2 with tv_tensors.BoundingBoxes), called as
    ``transform(image, {"boxes": BoundingBoxes, "labels": Tensor})``.

    Evaluation: a plain resize to ``pp.hw`` (boxes scale per axis).  Training: a horizontal flip with
    probability ``flip``; with ``crop`` a random resized crop of the area range of ``augment`` whose aspect is
    around the image's own (``aspect`` = width / height, 3/4 to 4/3 of it), so the squash to the model's size
    matches the plain resize it sees at test time, else the plain resize; a colour jitter; and
    SanitizeBoundingBoxes, which drops the boxes a crop left under 2 px a side, with their labels."""
    from torchvision.transforms import v2 as T

    resize = T.Resize(pp.hw, interpolation=_interp(pp.interpolation), antialias=True)
    if not train:
        return resize
    if augment not in _CROP_SCALE:
        raise ToolchainError(f"unknown detection augmentation '{augment}'; use light or strong")
    geometry = T.RandomResizedCrop(pp.hw, scale=_CROP_SCALE[augment], ratio=(aspect * 3 / 4, aspect * 4 / 3),
                                   interpolation=_interp(pp.interpolation), antialias=True) if crop else resize
    return T.Compose([T.RandomHorizontalFlip(p=flip), geometry, T.ColorJitter(0.2, 0.2, 0.2),
                      T.SanitizeBoundingBoxes(min_size=2.0)])


class DetectionDataset(torch.utils.data.Dataset):
    """Records -> ``(image, target)``: the image normalised (3, H, W) at the model's size, and

    ``{"boxes": FloatTensor[N, 4] xyxy in input pixels, "labels": LongTensor[N], "scale": (sx, sy),
    "orig_size": (h, w), "index": i}``

    where ``scale`` is input size / original size per axis, so a prediction in input pixels maps back to the
    image's own resolution by dividing x by sx and y by sy (:func:`vfm_toolchain.detmetrics.to_original`), and
    ``index`` is the record's position (its own boxes, at its own resolution, are what a prediction is scored
    against).  Training draws a random crop with probability ``crop`` (else the plain resize), a flip and a
    colour jitter; ``augment: strong`` adds photometric RandAugment on the image (colour ops move no box).

    An image that became unreadable after the scan yields a black image with no boxes and is counted in
    ``self.failed`` instead of killing a loader worker.
    """

    def __init__(self, records: Sequence[Dict[str, Any]], pp: Preprocess, train: bool, augment: str = "light",
                 crop: float = 0.5):
        from vfm_toolchain.data.augment import photometric_augment

        self.records, self.pp, self.train, self.augment, self.crop = list(records), pp, train, augment, crop
        self.resize = detection_transform(pp, train=False)
        self.photometric = photometric_augment(2, 9) if train and augment == "strong" else None
        self.failed = 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as TF

        rec = self.records[i]
        w, h = rec["width"], rec["height"]
        im = load_image(rec["path"])
        boxes = torch.tensor(rec["boxes"], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor(rec["labels"], dtype=torch.int64)
        if im is None or im.size != (w, h):  # replaced or damaged after the scan: nothing to learn or score here
            self.failed += 1
            im, boxes, labels = Image.new("RGB", (w, h)), boxes[:0], labels[:0]
        img = tv_tensors.Image(TF.pil_to_tensor(im))
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w)), "labels": labels}
        if self.train:  # the crop's aspect follows this image's, so the transform is made per image
            crop = bool(torch.rand(()) < self.crop)
            img, target = detection_transform(self.pp, True, w / h, self.augment, crop=crop)(img, target)
        else:
            img, target = self.resize(img, target)
        if self.photometric is not None:
            img = self.photometric(img)
        x = TF.normalize(img.float() / 255.0, self.pp.mean, self.pp.std).as_subclass(torch.Tensor)
        H, W = self.pp.hw
        return x, {"boxes": target["boxes"].as_subclass(torch.Tensor).float(), "labels": target["labels"],
                   "scale": (W / w, H / h), "orig_size": (h, w), "index": i}


def detection_collate(batch):
    """Images stacked, targets kept as a list (each image has its own number of boxes)."""
    return torch.stack([x for x, _ in batch]), [t for _, t in batch]
