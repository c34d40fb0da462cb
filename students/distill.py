"""``student.distill``: knowledge transfer from the teacher to the student on the transfer set.

Task-oriented (seed 004 sec. 2, Fig. 1b): the student matches the finetuned teacher's softened
predictions.  Task-agnostic (Fig. 1d): it matches the frozen pretrained VFM's global features
(contrastive) or patch features (cosine).  The objectives live in :mod:`students.objectives`.

Teacher outputs are either cached once per (image, view): each transfer image has ``views`` seeded views
(view 0 is the plain image, the others random crops/flips/jitter drawn from a per-view seed), a bank of K
views in half precision, memory-mapped, of which every epoch draws one per image, so the teacher never
runs again; or computed online on a fresh augmented view every step, which costs a teacher forward per
step but never repeats a view.  Either way the student's copy of the view gets a fresh photometric
augmentation each time (``distill.student_augment``): it moves no pixel, so the teacher's target for the
view still holds (see StudentAugment in the recipe for why geometric ops are not applied there).
Segmentation teachers' logits are cached at their own output stride (8) and upsampled inside the loss.
Detection (students/detection_distill.py): teacher and student share the strides 8 / 16 / 32 and the input
size, so the teacher's class probabilities, boxes and quality at every location (and, as
``distill.detection_targets`` asks, its post-NMS boxes) are cached per (image, view) as one half-precision row,
and the view both models see is the same one, so a crop or flip of a view moves the targets with the pixels.
The two sizes must be equal: a recipe check refuses others before the first stage (students/tasks/detection.py
says why the teacher is not run at the student's size instead).
"""
from __future__ import annotations

import hashlib
import os
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from PIL import Image

from vfm_toolchain import distributed
from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.core.console import Track
from vfm_toolchain.data.images import Preprocess, crop_ratios, load_image, seeded, size_text
from vfm_toolchain.data.pools import read_item
from vfm_toolchain.devices import inference_autocast, inference_batch_size, on_device
from vfm_toolchain.prepare import load_index, sample_paths
from vfm_toolchain.stage import (ReportContext, ReportSection, Score, Stage, StageContext, StageOutput,
                                 register_stage)
from vfm_toolchain.store import sha256_file
from vfm_toolchain.students.models import student_preprocess, student_name
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.tasks import task_of
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.curate import transfer_paths
from vfm_toolchain.training import fit, loader, train_options

__all__ = ["StudentDistill", "TransferViews", "distill_paths", "feature_teacher", "finetuned_teacher"]

def _view_seed(seed: int, content: str, view: int) -> int:
    return zlib.crc32(f"{seed}|{content}|{view}".encode())


def content_id(item: str) -> str:
    """The sha256 of an image's bytes (a file or a tar member): what seeds its views.  Not its path: the same
    recipe built into stores at different places (generated data lives in the store) must give the same bytes,
    as its stage keys are the same."""
    try:
        src = read_item(item)  # a tar member that is not there raises KeyError here
        return sha256_file(Path(src)) if isinstance(src, str) else hashlib.sha256(src.read()).hexdigest()
    except (OSError, KeyError):  # unreadable: counted by view(); any fixed seed will do for its blank view
        return "unreadable"


class TransferViews(torch.utils.data.Dataset):
    """Seeded views of transfer images, as a (teacher tensor, student tensor) pair per (image, view)."""

    def __init__(self, paths: List[str], views: int, seed: int, teacher_pp: Preprocess, student_pp: Preprocess,
                 online: bool = False, student_augment=None):
        from torchvision.transforms import v2 as T

        self.paths, self.views, self.seed, self.online = paths, views, seed, online
        self.student_augment = student_augment  # uint8 (3, H, W) -> uint8, fresh per (epoch, image)
        self.epoch = 0
        self.tpp, self.spp = teacher_pp, student_pp
        # views are cut at the larger of the two models' sizes, side by side (h, w), and resized down per model
        self.size = tuple(max(t, s) for t, s in zip(teacher_pp.hw, student_pp.hw))
        self.aug = T.Compose([T.RandomResizedCrop(self.size, scale=(0.5, 1.0), ratio=crop_ratios(self.size),
                                                  antialias=True),
                              T.RandomHorizontalFlip(), T.ColorJitter(0.3, 0.3, 0.3)])
        self.choice = np.zeros(len(paths), dtype=np.int64)
        self.contents: List[Optional[str]] = [None] * len(paths)  # content_id per image, read on first use
        self.failed = 0
        self.student_cache: Dict[Tuple[int, int], np.ndarray] = {}  # (image, view) -> uint8 HWC at student size
        self.cache_limit = 0

    def enable_cache(self, max_bytes: int) -> None:
        """Keep each view's student-size pixels after the first epoch that draws it, within ``max_bytes``.

        Views are fixed by their seeds, so caching changes nothing but speed."""
        self.cache_limit = max_bytes // (self.spp.hw[0] * self.spp.hw[1] * 3)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        rng = np.random.default_rng(self.seed * 7919 + epoch)
        if self.online:  # a new seeded view of every image each epoch (never view 0, the plain image)
            self.choice = rng.integers(1, 1 << 40, len(self.paths))
        else:
            self.choice = rng.integers(0, self.views, len(self.paths))

    def view(self, i: int, v: int) -> Image.Image:
        im = load_image(self.paths[i])
        if im is None:
            self.failed += 1
            im = Image.new("RGB", self.size[::-1])  # PIL sizes are (w, h)
        if v == 0:
            return im.resize(self.size[::-1], Image.BILINEAR)
        if self.contents[i] is None:
            self.contents[i] = content_id(self.paths[i])
        # devices=[]: the CPU generator alone.  By default fork_rng also saves every CUDA generator, which in a
        # DataLoader worker forked from a process that already uses CUDA fails ("Cannot re-initialize CUDA")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_view_seed(self.seed, self.contents[i], v))
            return self.aug(im)

    @staticmethod
    def _normalize(pix: np.ndarray, pp: Preprocess) -> torch.Tensor:
        x = torch.from_numpy(pix.astype(np.float32) / 255.0).permute(2, 0, 1)  # (3, H, W)
        return (x - torch.tensor(pp.mean).view(3, 1, 1)) / torch.tensor(pp.std).view(3, 1, 1)

    def _augment(self, pix: np.ndarray, i: int) -> np.ndarray:
        """The student's fresh photometric augmentation, seeded by (seed, epoch, image): a resumed run
        replays it."""
        if self.student_augment is None:
            return pix
        with torch.random.fork_rng(devices=[]):  # the CPU generator alone, as in view()
            torch.manual_seed(zlib.crc32(f"{self.seed}|{self.epoch}|{i}|student".encode()))
            out = self.student_augment(torch.from_numpy(np.array(pix)).permute(2, 0, 1))  # a writable copy
        return out.permute(1, 2, 0).numpy()

    @staticmethod
    def _pixels(im: Image.Image, pp: Preprocess) -> np.ndarray:
        return np.asarray(im.resize(pp.hw[::-1], Image.BILINEAR), dtype=np.uint8)

    @classmethod
    def _tensor(cls, im: Image.Image, pp: Preprocess) -> torch.Tensor:
        return cls._normalize(cls._pixels(im, pp), pp)

    def teacher_input(self, i: int, v: int) -> torch.Tensor:
        return self._tensor(self.view(i, v), self.tpp)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        v = int(self.choice[i])
        if self.online:  # the teacher sees the same view as the student, at its own size
            im = self.view(i, v)
            student = self._normalize(self._augment(self._pixels(im, self.spp), i), self.spp)
            return student, self._tensor(im, self.tpp), i, v
        pix = self.student_cache.get((i, v))
        if pix is None:
            pix = self._pixels(self.view(i, v), self.spp)
            if len(self.student_cache) < self.cache_limit:
                self.student_cache[(i, v)] = pix
        return self._normalize(self._augment(pix, i), self.spp), i, v


class _TeacherInputs(torch.utils.data.Dataset):
    """View ``v`` of every transfer image at the teacher's size, for a DataLoader (its workers decode)."""

    def __init__(self, views: TransferViews, v: int):
        self.views, self.v = views, v

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.views.teacher_input(i, self.v)


@torch.no_grad()
def cache_teacher_outputs(teacher: torch.nn.Module, teacher_fn, target_fn, views: TransferViews, path, log,
                          batch_size: Union[int, str] = "auto") -> np.ndarray:
    """Teacher targets for every (image, view), written to a memory-mapped ``.npy`` that is filled view by
    view; returns it opened read-only.  Patch grids of a large pool do not fit in memory, so nothing here
    holds more than one batch.  ``batch_size`` ``auto`` is the device policy's (measured on CUDA)."""
    n = len(views)
    tmp = path.with_name(path.name + ".partial")
    out = None
    with Track(f"caching teacher outputs ({views.views} views x {n} images)", n * views.views, unit="img",
               log=log) as bar, on_device(teacher) as dev:  # teacher_fn is the teacher or one of its methods
        shape = tuple(views.teacher_input(0, 0).shape)
        batch_size = inference_batch_size(batch_size, lambda b: teacher_fn(torch.zeros(b, *shape, device=dev)))
        log.debug("teacher outputs in batches of %d on %s", batch_size, dev)
        for v in range(views.views):
            bar.set(view=f"{v + 1}/{views.views}")
            start = 0
            for x in loader(_TeacherInputs(views, v), None, batch_size, shuffle=False):
                with inference_autocast():
                    t = teacher_fn(x.to(dev, non_blocking=True))
                arr = target_fn(t.float()).cpu().numpy()
                if out is None:
                    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=arr.dtype,
                                                    shape=(n, views.views, *arr.shape[1:]))
                out[start:start + len(x), v] = arr
                start += len(x)
                bar.advance(len(x))
            log.debug("teacher outputs cached for view %d/%d of %d images", v + 1, views.views, n)
    out.flush()
    del out
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def distill_paths(recipe, index, curate: StageOutput, prepare: StageOutput, log=None) -> List[str]:
    """The images distillation reads, in the order its cached teacher rows follow: the transfer set, then, with
    ``distill.labeled_images``, the labeled training images it does not already hold (their labels unused here)."""
    paths = transfer_paths(curate, prepare)
    if recipe.distill.labeled_images:  # the teacher's outputs on them, never their labels (student.finetune's)
        known = set(paths)
        labeled = [p for p in sample_paths(index["train"]) if p not in known]
        if log is not None:
            log.info(f"distilling on {len(paths)} transfer images and {len(labeled)} labeled images (their labels "
                     f"unused here)")
        paths = paths + labeled
    return paths


@register_stage
class StudentDistill(Stage):
    name = "student.distill"
    inputs = ("data.prepare", "teacher.finetune", "teacher.curate")
    optional_inputs = ("student.select",)  # student.name: auto
    version = "4"  # what each version changed is in git log
    distributed = True  # under torchrun: DistributedDataParallel, each rank a slice of every batch

    def config(self, recipe) -> Dict[str, Any]:
        # Gramian heads train with the labels (student.finetune): changing them does not redo distillation
        exclude = task_of(recipe).foreign("distill")  # fields only another task reads
        if not recipe.distill.labeled_images:  # off: the key of every store made before the option
            exclude.add("labeled_images")
        # distill.label_smoothing was declared (never read) until issue 65: its old value keeps the stored keys
        return {"student": {k: v for k, v in recipe.student.arch_dump().items() if k != "gramian"},
                "distill": {**recipe.distill.model_dump(mode="json", exclude=exclude), "label_smoothing": 0.0},
                "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r, d = ctx.recipe, ctx.recipe.distill
        index = load_index(ctx.input("data.prepare"))
        classes = index["classes"]
        paths = distill_paths(r, index, ctx.input("teacher.curate"), ctx.input("data.prepare"), ctx.log)
        spp = student_preprocess(r.student.image_size)
        task = task_of(index).name
        seeded(r.seed)
        name = student_name(ctx)
        part = student_task(task)
        student, objective_name, objective, teacher, teacher_fn, tpp, extra = part.distill_setup(ctx, name, index,
                                                                                                 spp)
        online = d.teacher_outputs == "online"
        from vfm_toolchain.data.augment import photometric_augment

        a = d.student_augment  # an erased rectangle would leave per-pixel targets nothing to see there
        augment = photometric_augment(a.ops, a.magnitude,
                                      a.erasing if "random_erasing" in task_of(task).supports else 0.0)
        views = TransferViews(paths, d.views, r.seed, tpp, spp, online=online, student_augment=augment)
        views.enable_cache(0 if online else d.cache_mb << 20)
        teacher.eval()

        t_cache = None
        t0 = time.time()
        if online:
            teacher.to(distributed.device())  # online: the teacher stays beside the student for the whole run
        else:  # rank 0 fills the cache once; under torchrun the other ranks wait, then read it
            path = ctx.workdir / "teacher_targets.npy"
            if ctx.rank == 0 and not path.is_file():
                cache_teacher_outputs(teacher, teacher_fn, objective.target, views, path, ctx.log, d.teacher_batch_size)
            distributed.barrier()
            t_cache = np.load(path, mmap_mode="r")
            del teacher, teacher_fn
        cache_seconds = time.time() - t0

        def step(model, batch):
            if online:
                x, xt, i, _ = batch
                with torch.no_grad():
                    target = objective.target(teacher_fn(xt))
            else:
                x, i, v = batch
                rows = np.stack([t_cache[a, b] for a, b in zip(i.tolist(), v.tolist())])
                target = torch.from_numpy(rows).to(x.device)
            return model(x, target, i)

        t1 = time.time()
        history = fit(objective, [{"params": list(objective.parameters()), "lr": d.lr}], views, d.batch_size, step,
                      d.epochs, ctx.workdir / "train_state.pt", ctx.log, seed=r.seed, weight_decay=d.weight_decay,
                      warmup_epochs=d.warmup_epochs, name="distill", on_epoch_start=views.set_epoch,
                      **train_options(d))
        train_seconds = time.time() - t1
        if ctx.rank != 0:
            return {}
        save_model(ctx.workdir / "model", student, student_task(task).spec(name, classes, spp, **r.student.form()))
        result = {**extra, "model": "model", "history": history, "transfer_images": len(paths), "mode": d.mode,
                  "objective": objective_name, "views": None if online else d.views,
                  "student_augment": a.model_dump() if augment is not None else None,
                  "teacher_cache_mb": None if t_cache is None else round(t_cache.nbytes / 2 ** 20, 2),
                  "teacher_outputs": ("online (a fresh augmented view per step)" if online
                                      else f"cached once per (image, view), {d.views} views"),
                  "teacher_seconds": round(cache_seconds, 2), "train_seconds": round(train_seconds, 2),
                  "unreadable_transfer_images": views.failed}
        result.update(part.distill_metrics(ctx, student, index, spp, t_cache))
        return result

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """The student and how the teacher's knowledge reached it; its score before finetuning."""
        r, d = build.recipe, build.recipe.distill
        task, part = task_of(r), student_task(r.data.task)
        student = f"`{student_name(build)}`" + (" (chosen by `student.name: auto`: see Student selection)"
                                                 if r.student.name == "auto" else "")
        teaching = out.result.get("teacher_outputs") or d.teacher_outputs
        summary = [f"student {student} at {size_text(r.student.image_size)}; {part.distill_how(d, out.result)}, "
                   f"{d.epochs} epochs, teacher outputs {teaching}"]
        metrics = out.result.get("metrics", {})
        if metrics.get(f"test_{task.metric}") is not None:
            summary.append(f"student after distillation: {task.summary(metrics)}")
        scores = [Score(f"student_after_distill_{task.metric}", "student, after distillation (before finetune)",
                        metrics.get(f"test_{task.metric}"))]
        return ReportSection(summary=summary, scores=scores)



def finetuned_teacher(ctx) -> Tuple[torch.nn.Module, Any, Preprocess]:
    """(teacher, function images -> raw teacher output, teacher preprocessing) of task-oriented distillation: the
    finetuned teacher.  A segmentation teacher gives its logits at its own output stride (``forward_logits``): 64x
    fewer values to cache than at the input size, upsampled inside the loss exactly as the teacher's forward
    would."""
    teacher = load_model(ctx.input("teacher.finetune").path("model"))
    return teacher, getattr(teacher, "forward_logits", teacher), teacher.backbone.preprocess


def feature_teacher(recipe) -> Tuple[str, torch.nn.Module, Any, Preprocess]:
    """(objective name, teacher, function images -> features, preprocessing) of task-agnostic distillation: the
    frozen pretrained VFM, not the finetuned one (seed 004 Fig. 1d), its global or its patch features."""
    d = recipe.distill
    backbone = create_backbone(recipe.teacher.name, recipe.teacher.weights, recipe.teacher.image_size)
    for p in backbone.parameters():
        p.requires_grad_(False)
    name = d.feature_objective()[0]
    if d.features == "global":
        backbone.out_dim = backbone.num_features
        return name, backbone, backbone, backbone.preprocess
    with torch.no_grad():
        probe = backbone.eval().forward_patches(torch.zeros(1, 3, *backbone.preprocess.hw))
    backbone.out_dim = int(probe.shape[1])
    return name, backbone, backbone.forward_patches, backbone.preprocess
