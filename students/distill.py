"""``student.distill``: task-oriented knowledge transfer (seed 004 sec. 2, Fig. 1b).

The student learns to match the finetuned teacher's softened predictions on the transfer set.
Teacher outputs are computed once per (image, view) and cached: each transfer image has ``views``
seeded views (view 0 is the plain image, the others random crops/flips/jitter drawn from a per-view
seed), so every epoch the student sees a cached view and the teacher never runs again.
"""
from __future__ import annotations

import csv
import json
import math
import zlib
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from students.losses import kl_distillation
from students.models import create_student, student_preprocess, student_spec
from toolchain.checkpoint import load_model, save_model
from toolchain.data import Preprocess, load_image, seeded
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.store import atomic_write
from toolchain.training import fit, loader, top1

__all__ = ["StudentDistill", "TransferViews"]


def _view_seed(seed: int, path: str, view: int) -> int:
    return zlib.crc32(f"{seed}|{path}|{view}".encode())


class TransferViews(torch.utils.data.Dataset):
    """Seeded views of transfer images, as a (teacher tensor, student tensor) pair per (image, view)."""

    def __init__(self, paths: List[str], views: int, seed: int, teacher_pp: Preprocess, student_pp: Preprocess):
        from torchvision.transforms import v2 as T

        self.paths, self.views, self.seed = paths, views, seed
        self.tpp, self.spp = teacher_pp, student_pp
        self.size = max(teacher_pp.size, student_pp.size)
        self.aug = T.Compose([T.RandomResizedCrop(self.size, scale=(0.5, 1.0), antialias=True),
                              T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3, 0.3)])
        self.choice = np.zeros(len(paths), dtype=np.int64)
        self.failed = 0
        self.student_cache: Dict[Tuple[int, int], np.ndarray] = {}  # (image, view) -> uint8 HWC at student size
        self.cache_limit = 0

    def enable_cache(self, max_bytes: int) -> None:
        """Keep each view's student-size pixels after the first epoch that draws it, within ``max_bytes``.

        Views are fixed by their seeds, so caching changes nothing but speed."""
        self.cache_limit = max_bytes // (self.spp.size * self.spp.size * 3)

    def set_epoch(self, epoch: int) -> None:
        self.choice = np.random.default_rng(self.seed * 7919 + epoch).integers(0, self.views, len(self.paths))

    def view(self, i: int, v: int) -> Image.Image:
        im = load_image(self.paths[i])
        if im is None:
            self.failed += 1
            im = Image.new("RGB", (self.size, self.size))
        if v == 0:
            return im.resize((self.size, self.size), Image.BILINEAR)
        with torch.random.fork_rng():
            torch.manual_seed(_view_seed(self.seed, self.paths[i], v))
            return self.aug(im)

    @staticmethod
    def _normalize(pix: np.ndarray, pp: Preprocess) -> torch.Tensor:
        x = torch.from_numpy(pix.astype(np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
        return (x - torch.tensor(pp.mean).view(3, 1, 1)) / torch.tensor(pp.std).view(3, 1, 1)

    @classmethod
    def _tensor(cls, im: Image.Image, pp: Preprocess) -> torch.Tensor:
        return cls._normalize(np.asarray(im.resize((pp.size, pp.size), Image.BILINEAR), dtype=np.uint8), pp)

    def teacher_input(self, i: int, v: int) -> torch.Tensor:
        return self._tensor(self.view(i, v), self.tpp)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        v = int(self.choice[i])
        pix = self.student_cache.get((i, v))
        if pix is None:
            pix = np.asarray(self.view(i, v).resize((self.spp.size, self.spp.size), Image.BILINEAR), dtype=np.uint8)
            if len(self.student_cache) < self.cache_limit:
                self.student_cache[(i, v)] = pix
        return self._normalize(pix, self.spp), i, v


@torch.no_grad()
def cache_teacher_logits(teacher, views: TransferViews, batch_size: int, log) -> np.ndarray:
    teacher.eval()
    n, out = len(views), None
    for v in range(views.views):
        for start in range(0, n, batch_size):
            idx = range(start, min(n, start + batch_size))
            x = torch.stack([views.teacher_input(i, v) for i in idx])
            logits = teacher(x).float().numpy()
            if out is None:
                out = np.zeros((n, views.views, logits.shape[1]), dtype=np.float32)
            out[start:start + len(idx), v] = logits
        log.info("teacher outputs cached for view %d/%d of %d images", v + 1, views.views, n)
    return out


@register_stage
class StudentDistill(Stage):
    name = "student.distill"
    inputs = ("data.prepare", "teacher.finetune", "teacher.curate")

    def config(self, recipe) -> Dict[str, Any]:
        return {"student": recipe.student.model_dump(mode="json"), "distill": recipe.distill.model_dump(mode="json"),
                "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r, d = ctx.recipe, ctx.recipe.distill
        index = load_index(ctx.input("data.prepare"))
        classes = index["classes"]
        with open(ctx.input("teacher.curate").path("manifest.csv")) as fh:
            paths = [row["path"] for row in csv.DictReader(fh)]
        teacher = load_model(ctx.input("teacher.finetune").path("model"))
        spp = student_preprocess(r.student.image_size)
        views = TransferViews(paths, d.views, r.seed, teacher.backbone.preprocess, spp)
        views.enable_cache(d.cache_mb << 20)

        cache = ctx.workdir / "teacher_logits.npy"
        if cache.is_file():
            t_logits = np.load(cache)
        else:
            t_logits = cache_teacher_logits(teacher, views, 64, ctx.log)
            atomic_write(cache, lambda p: np.save(open(p, "wb"), t_logits))
        del teacher
        t_logits_t = torch.from_numpy(t_logits)

        seeded(r.seed)
        student = create_student(r.student.name, len(classes), r.student.weights)

        def epoch_batches(epoch):
            views.set_epoch(epoch)
            return loader(views, None, d.batch_size, True, r.seed, epoch)

        def step(model, batch):
            x, i, v = batch
            return kl_distillation(model(x), t_logits_t[i, v], d.temperature)

        history = fit(student, [{"params": list(student.parameters()), "lr": d.lr}], epoch_batches,
                      math.ceil(len(views) / d.batch_size), step, d.epochs, ctx.workdir / "train_state.pt",
                      ctx.log, d.weight_decay, d.warmup_epochs, "distill")
        save_model(ctx.workdir / "model", student, student_spec(r.student.name, len(classes), spp, classes))
        metrics = {"test_top1": top1(student, index["test"], spp), "val_top1": top1(student, index["val"], spp)}
        agreement = float((t_logits.argmax(-1)[:, 0] == t_logits.argmax(-1)[:, -1]).mean())
        ctx.log.info("after distillation: test top-1 %.4f", metrics["test_top1"])
        return {"model": "model", "metrics": metrics, "history": history, "transfer_images": len(paths),
                "views": d.views, "teacher_cache": "cached once per (image, view)",
                "teacher_view_agreement": agreement, "unreadable_transfer_images": views.failed}
