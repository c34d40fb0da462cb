"""Retrieval queries of a detection task (issue 38): the labeled images and, new, their objects.

A whole image ranks the pool by its scene (the tank, the street); an object crop ranks it by the object, which
is what a detector has to learn to find.  With whole images alone a class that appears in three images brings
in as few transfer images as its three scenes do, however many objects the other classes have.  So each box
is cropped with a little context and embedded like an image, and the budget is split by shares: the whole
images share ``1 - object_share`` equally, the crops share ``object_share`` with an equal part per class, split
equally over that class's objects (``query_weights``).  ``query_balanced_image`` grows each query's list in
proportion to its share (teachers/strategies/query_balanced.py), so a rare class's few objects each bring in
many images and a common class's many objects a few each.

A crop keeps the encoder's aspect: the box plus ``context`` of its size on each side is widened (or heightened)
to the encoder input's aspect, never squashed, and moved inside the image where it reaches past an edge.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

from vfm_toolchain.data.images import Preprocess, eval_transform, load_image

__all__ = ["MIN_CROP", "ObjectQuery", "object_queries", "crop_region", "ObjectCrops", "query_weights",
           "per_class_counts", "sample_path"]

MIN_CROP = 16  # px: a smaller crop of a tiny box holds too little of the object to embed, so it takes context


@dataclass(frozen=True)
class ObjectQuery:
    """One labeled box as a retrieval query: its record's index, the box's index on the record, its class."""

    record: int
    box: int
    label: int


def sample_path(sample: Any) -> str:
    """The image path of an index sample: a detection record (a dict), or [path, label or mask]."""
    return sample["path"] if isinstance(sample, dict) else sample[0]


def object_queries(records: Sequence[Dict[str, Any]]) -> List[ObjectQuery]:
    """Every box of every labeled record, in record order."""
    return [ObjectQuery(i, j, int(label)) for i, r in enumerate(records) for j, label in enumerate(r["labels"])]


def crop_region(box: Sequence[float], width: int, height: int, aspect: float,
                context: float) -> Tuple[int, int, int, int]:
    """The crop (x1, y1, x2, y2) in whole pixels around ``box`` (xyxy) on a ``width`` x ``height`` image: the box
    grown by ``context`` of its size on each side, at least MIN_CROP a side, widened or heightened to ``aspect``
    (height / width of the encoder input), no larger than the image and moved inside it."""
    x1, y1, x2, y2 = (float(v) for v in box)
    w = max((x2 - x1) * (1 + 2 * context), MIN_CROP)
    h = max((y2 - y1) * (1 + 2 * context), MIN_CROP)
    if h / w < aspect:
        h = w * aspect
    else:
        w = h / aspect
    w, h = min(w, width), min(h, height)
    left = min(max((x1 + x2) / 2 - w / 2, 0.0), width - w)
    top = min(max((y1 + y2) / 2 - h / 2, 0.0), height - h)
    ix1, iy1 = int(np.floor(left)), int(np.floor(top))
    return ix1, iy1, max(ix1 + 1, min(width, int(np.ceil(left + w)))), max(iy1 + 1, min(height, int(np.ceil(top + h))))


class ObjectCrops(torch.utils.data.Dataset):
    """The crops of ``queries`` as ``(image tensor, 0)`` through the encoder's eval transform, as
    :class:`~vfm_toolchain.data.images.ImageListDataset` gives whole images.  Boxes of one image come one after the
    other, so the last decoded image is kept; an image that became unreadable gives black crops, counted in
    ``failed``."""

    def __init__(self, records: Sequence[Dict[str, Any]], queries: Sequence[ObjectQuery], pp: Preprocess,
                 context: float):
        self.records, self.queries, self.context = records, list(queries), context
        self.aspect = pp.hw[0] / pp.hw[1]
        self.transform = eval_transform(pp)
        self.failed = 0
        self._last: Tuple[int, Optional[Image.Image]] = (-1, None)

    def __len__(self) -> int:
        return len(self.queries)

    def crop(self, k: int) -> Image.Image:
        q = self.queries[k]
        rec = self.records[q.record]
        if self._last[0] != q.record:
            self._last = (q.record, load_image(rec["path"]))
        im = self._last[1]
        if im is None or im.size != (rec["width"], rec["height"]):  # changed after data.prepare scanned it
            self.failed += 1
            return Image.new("RGB", (MIN_CROP, MIN_CROP))
        return im.crop(crop_region(rec["boxes"][q.box], rec["width"], rec["height"], self.aspect, self.context))

    def __getitem__(self, k: int):
        return self.transform(self.crop(k)), 0


def query_weights(n_images: int, labels: Sequence[int], object_share: float) -> np.ndarray:
    """Each query's share of the budget, whole images first, then the objects in ``labels`` order (module
    docstring); shares sum to 1 over the queries there are."""
    labels = np.asarray(labels, dtype=np.int64)
    if not len(labels):
        return np.full(n_images, 1.0 / n_images)
    image_part = 1.0 - object_share if n_images else 0.0
    object_part = 1.0 - image_part
    per_image = np.full(n_images, image_part / max(n_images, 1))
    classes, counts = np.unique(labels, return_counts=True)
    per_class = object_part / len(classes)
    per_object = per_class / counts[np.searchsorted(classes, labels)]
    return np.concatenate([per_image, per_object])


def per_class_counts(records: Sequence[Dict[str, Any]], classes: Sequence[str], queries: Sequence[ObjectQuery],
                     weights: np.ndarray, n_images: int, selected_queries: np.ndarray,
                     budget: int) -> Dict[str, Dict[str, Any]]:
    """Per class: the labeled images it is in, its object queries, its objects' share of the budget (and that
    share in images), and the transfer images its object queries brought in."""
    out = {}
    by_query = np.bincount(np.asarray(selected_queries, dtype=np.int64), minlength=len(weights))
    for c, name in enumerate(classes):
        mine = [n_images + k for k, q in enumerate(queries) if q.label == c]
        share = float(weights[mine].sum()) if mine else 0.0
        out[name] = {"images": sum(1 for r in records if c in r["labels"]), "object_queries": len(mine),
                     "share": round(share, 4), "share_images": round(share * budget, 1),
                     "selected": int(by_query[mine].sum()) if mine else 0}
    return out
