"""Multi-label data: images with several tags each (products, attributes, moderation; which animals a photo shows).

A split folder holds ``images/`` and one of:

* ``tags.csv``: a header ``image,tags``, then one row per image: its file under ``images/`` and its tags joined by
  ``;`` (an empty cell: an image that shows none of them, a true negative for every tag).  The tag list is
  ``train/classes.txt`` (one per line) when there is one, else every tag train's csv uses, sorted;
* ``annotations.json`` (COCO): an image's tags are the categories of its boxes (data/detection.py reads the
  file), so a detection set is a tagging set too.

Samples are ``[path, [tag ids]]``.  Nothing here decodes an image except :func:`scan_tag_split`, which decodes each
once (a corrupt one is skipped with why).  Paths a csv names stay inside ``<split>/images`` or ``data.roots``
(core/roots.py).
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.roots import DataRoots, refuse_outside

__all__ = ["TAGS_FILE", "TagSplit", "tag_layout", "read_tag_classes", "parse_tag_split", "scan_tag_split",
           "tag_counts", "write_tags_csv"]

TAGS_FILE = "tags.csv"
SEPARATOR = ";"
LAYOUTS = (f"<split>/images + <split>/{TAGS_FILE} (columns image,tags; tags joined by '{SEPARATOR}') or "
           f"<split>/images + <split>/annotations.json (COCO: an image's tags are its boxes' categories)")


@dataclass
class TagSplit:
    """A split's tag names, its samples ``[path, [tag ids]]`` and the images skipped (path -> why)."""

    root: str
    role: str
    layout: str
    classes: List[str]
    samples: List[list]
    skipped: Dict[str, str] = field(default_factory=dict)


def tag_layout(root: str | Path, role: str) -> str:
    """``csv`` or ``coco``: the layout of a split folder.

    Raises:
        ToolchainError: the folder is missing, or has neither file or both.
    """
    root = Path(root)
    if not root.is_dir():
        raise ToolchainError(f"{role} folder '{root}' does not exist (a multi-label split is {LAYOUTS})")
    has_csv, has_coco = (root / TAGS_FILE).is_file(), (root / "annotations.json").is_file()
    if has_csv and has_coco:
        raise ToolchainError(f"{role} folder '{root}' has both {TAGS_FILE} and annotations.json; keep the one that "
                             f"holds the tags")
    if not (has_csv or has_coco):
        raise ToolchainError(f"{role} folder '{root}' has neither {TAGS_FILE} nor annotations.json (a multi-label "
                             f"split is {LAYOUTS})")
    if not (root / "images").is_dir():
        raise ToolchainError(f"{role} folder '{root}' needs an images/ folder beside its "
                             f"{TAGS_FILE if has_csv else 'annotations.json'}")
    return "csv" if has_csv else "coco"


def _read_csv(root: Path, role: str) -> List[Tuple[int, str, List[str]]]:
    """(line number, image as written, tags) per row of ``root/tags.csv``."""
    f = root / TAGS_FILE
    try:
        text = f.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolchainError(f"'{f}' cannot be read as UTF-8 text ({exc})") from None
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["image", "tags"]:
        raise ToolchainError(f"'{f}' must start with the header 'image,tags' (then one row per image: its file "
                             f"under images/ and its tags joined by '{SEPARATOR}'); its first line is "
                             f"{','.join(rows[0]) if rows else 'empty'!r}")
    out, seen = [], {}
    for line, row in enumerate(rows[1:], 2):
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) > 2:
            raise ToolchainError(f"'{f}' line {line} has {len(row)} cells; a row is image,tags with the tags joined "
                                 f"by '{SEPARATOR}' (quote a cell that holds a comma)")
        image = row[0].strip()
        if image in seen:
            raise ToolchainError(f"'{f}' names '{image}' on lines {seen[image]} and {line}; give each image one row "
                                 f"with all its tags")
        seen[image] = line
        tags = [t.strip() for t in (row[1] if len(row) > 1 else "").split(SEPARATOR) if t.strip()]
        out.append((line, image, sorted(set(tags))))
    return out


def read_tag_classes(root: str | Path, data_roots: Sequence[str] = ()) -> List[str]:
    """A train split's tag names from its files alone: classes.txt, else the csv's tags sorted, else COCO's
    categories."""
    root = Path(root)
    if tag_layout(root, "train") == "coco":
        from vfm_toolchain.data.detection import read_detection_classes

        return read_detection_classes(root, "coco", data_roots)
    listed = root / "classes.txt"
    if listed.is_file():
        names = [n.strip() for n in listed.read_text(encoding="utf-8").splitlines() if n.strip()]
        if len(set(names)) != len(names):
            raise ToolchainError(f"'{listed}' names a tag twice; each line is one tag")
        return names
    return sorted({t for _, _, tags in _read_csv(root, "train") for t in tags})


def parse_tag_split(root: str | Path, role: str, classes: Optional[Sequence[str]] = None,
                    data_roots: Sequence[str] = ()) -> TagSplit:
    """A split's samples from its files, no image opened (a csv path outside ``images/`` and ``data_roots`` is
    refused first).  ``classes``: train's tag names, which every other split's tags must be among.

    Raises:
        ToolchainError: a wrong layout or header, a tag outside ``classes``, a path outside, nothing left.
    """
    root = Path(root)
    layout = tag_layout(root, role)
    if layout == "coco":
        from vfm_toolchain.data.detection import parse_detection_split

        parsed = parse_detection_split(root, role, "coco", data_roots)
        names = parsed.classes
        if classes is not None and list(names) != list(classes):
            raise ToolchainError(f"{role} annotations.json has the categories {names}, train's are {list(classes)}; "
                                 f"a tag must mean the same in every split")
        samples = [[str(e.path), sorted({b.label for b in e.boxes})] for e in parsed.entries]
        return TagSplit(str(root), role, layout, list(names), samples, dict(parsed.skipped))
    names = list(classes) if classes is not None else read_tag_classes(root, data_roots)
    index = {n: i for i, n in enumerate(names)}
    rows = _read_csv(root, role)
    unknown = {}
    for line, _, tags in rows:
        for t in tags:
            if t not in index:
                unknown.setdefault(t, line)
    if unknown:
        shown = ", ".join(f"'{t}' (line {n})" for t, n in list(unknown.items())[:5])
        raise ToolchainError(f"'{root / TAGS_FILE}' uses tags that train's tag list does not have: {shown}. The tags "
                             f"are {', '.join(names)} (train's classes.txt, else every tag train's csv uses); fix the "
                             f"rows or add the tags to train")
    images = root / "images"
    DataRoots(root, data_roots).check_links(root, [images])
    allowed = DataRoots(images, data_roots)
    refuse_outside(root / TAGS_FILE, [(f"line {line}", image) for line, image, _ in rows
                                      if not allowed.admits(images / image)], allowed)
    samples, skipped = [], {}
    for line, image, tags in rows:
        path = images / image
        if not path.is_file():
            skipped[str(path)] = f"named on line {line} of {TAGS_FILE} but the file does not exist"
            continue
        samples.append([str(path), sorted(index[t] for t in tags)])
    if not samples:
        raise ToolchainError(f"{role} folder '{root}' has no usable tagged images ({len(skipped)} skipped)")
    return TagSplit(str(root), role, layout, names, sorted(samples), dict(sorted(skipped.items())))


def scan_tag_split(root: str | Path, role: str, classes: Optional[Sequence[str]] = None,
                   data_roots: Sequence[str] = ()) -> TagSplit:
    """:func:`parse_tag_split` with every image decoded once: an unreadable one is skipped with why."""
    from vfm_toolchain.data.images import read_image

    split = parse_tag_split(root, role, classes, data_roots)
    kept = []
    for path, tags in split.samples:
        im, why = read_image(path)
        if im is None:
            split.skipped[path] = why
            continue
        kept.append([path, tags])
    if not kept:
        raise ToolchainError(f"{role} folder '{root}' has no readable tagged images ({len(split.skipped)} skipped; "
                             f"e.g. '{next(iter(split.skipped))}': {next(iter(split.skipped.values()))})")
    split.samples, split.skipped = kept, dict(sorted(split.skipped.items()))
    return split


def tag_counts(samples: Sequence[list], num_classes: int) -> List[int]:
    """Images showing each tag."""
    counts = [0] * num_classes
    for _, tags in samples:
        for t in tags:
            counts[t] += 1
    return counts


def write_tags_csv(path: str | Path, rows: Sequence[Tuple[str, Sequence[str]]]) -> None:
    """``tags.csv`` of (image under images/, tag names) rows, written at once."""
    from vfm_toolchain.core.files import atomic_write_bytes

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["image", "tags"])
    for image, tags in rows:
        w.writerow([image, SEPARATOR.join(tags)])
    atomic_write_bytes(Path(path), buf.getvalue().encode())
