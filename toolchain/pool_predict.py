"""Models over unlabeled pool images, batch by batch: what ``toolchain label-next`` scores and ``toolchain
pseudo-label`` writes.

Every model sees each image through its own preprocessing (teacher and student sizes differ), decoded once.  Per
batch :func:`predict_pool` yields the images' positions in the list, their own sizes and, per model, its
predictions: class probabilities ``[B, C]`` (classification), per-pixel class probabilities ``[B, C, h, w]`` at the
model's output resolution (segmentation), or per image ``{"boxes" (K, 4) xyxy in the image's own pixels,
"scores", "labels"}`` (detection, the model's own decoding and NMS at ``score_thresh``): ``Task.predict``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, List, Sequence, Tuple

import torch
from PIL import Image
from torch import nn

from vfm_toolchain.core.console import track
from vfm_toolchain.data.images import Preprocess, eval_transform, load_image
from vfm_toolchain.devices import loader_kwargs, on_device
from vfm_toolchain.tasks import task_of

__all__ = ["predict_pool"]


class _Views(torch.utils.data.Dataset):
    """Each image once through every model's eval transform; an image that became unreadable is black and
    counted in ``failed`` (the data index left out the ones unreadable when it was made)."""

    def __init__(self, paths: Sequence[str], pps: Sequence[Preprocess]):
        self.paths, self.transforms = list(paths), [eval_transform(pp) for pp in pps]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        im = load_image(self.paths[i])
        ok = im is not None
        im = im if ok else Image.new("RGB", (32, 32))
        return i, (im.height, im.width), ok, [t(im) for t in self.transforms]


def _collate(batch):
    index, sizes, ok, views = zip(*batch)
    return list(index), list(sizes), list(ok), [torch.stack(v) for v in zip(*views)]


@torch.no_grad()
def predict_pool(models: Sequence[Tuple[nn.Module, Preprocess]], paths: Sequence[str], task: str,
                 batch_size: int = 32, score_thresh: float = 0.05, what: str = "pool images"
                 ) -> Iterator[Tuple[List[int], List[Tuple[int, int]], List[bool], List[Any]]]:
    """``(positions, (h, w) sizes, readable flags, [per-model predictions])`` per batch (module docstring)."""
    kind = task_of(task)
    ds = _Views(paths, [pp for _, pp in models])
    batches = torch.utils.data.DataLoader(ds, batch_size=batch_size, collate_fn=_collate, **loader_kwargs())
    for model, _ in models:
        model.eval()
    with contextlib.ExitStack() as stack:
        devices = [stack.enter_context(on_device(m)) for m, _ in models]
        for index, sizes, ok, views in track(batches, math.ceil(len(ds) / batch_size), f"predicting {len(ds)} {what}",
                                             unit="batch"):
            outs = []
            for (model, pp), device, x in zip(models, devices, views):
                outs.append(kind.predict(model, x.to(device, non_blocking=True), pp, sizes, score_thresh))
            yield index, sizes, ok, outs

