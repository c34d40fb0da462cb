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
The two sizes must be equal: a recipe check refuses others before the first stage (see
:func:`check_detection_distill` for why the teacher is not run at the student's size instead).
"""
from __future__ import annotations

import hashlib
import os
from functools import partial
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from PIL import Image

from vfm_toolchain.students.detection import build_student_detector
from vfm_toolchain.students.detection_distill import (DenseDetection, NeckImitation, choose_pseudo_threshold,
                                                      flat_neck, neck_width)
from vfm_toolchain.students.models import create_student, student_preprocess, student_name
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.students.objectives import OBJECTIVES, student_map_size
from vfm_toolchain.teachers.backbones import BACKBONES, create_backbone
from vfm_toolchain.teachers.curate import transfer_paths
from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.console import Track
from vfm_toolchain.devices import inference_autocast, inference_batch_size, on_device
from vfm_toolchain.data import Preprocess, crop_ratios, load_image, seeded, size_text
from vfm_toolchain.pools import read_item
from vfm_toolchain.prepare import load_index, sample_paths
from vfm_toolchain.store import sha256_file
from vfm_toolchain.sizes import image_hw
from vfm_toolchain.stage import (ReportContext, ReportSection, Score, Stage, StageContext, StageOutput,
                                 percent, register_recipe_check, register_stage)
from vfm_toolchain import distributed
from vfm_toolchain.training import detection_metrics, evaluate, fit, loader, metric_name, train_options
from vfm_toolchain.tasks import task_of

__all__ = ["StudentDistill", "TransferViews", "check_detection_distill", "distill_paths"]

def _teacher_hw(recipe):
    """The teacher's input (h, w): teacher.image_size, else its architecture's own size; None when its library
    does not say without building it (the stage checks the built teacher then)."""
    t = recipe.teacher
    if t.image_size is not None:
        return image_hw(t.image_size)
    try:
        geometry = BACKBONES.meta(t.name).get("geometry")
        return geometry(t.name.split(":", 1)[1], t.weights).default if geometry else None
    except Exception:  # an unknown name: the teacher's own check says so with the valid names
        return None


def _size_mismatch(teacher_hw, student_hw) -> str:
    th, tw = teacher_hw
    sh, sw = student_hw
    return (f"detection distillation needs the teacher and the student at one input size (the teacher at "
            f"{th}x{tw}, the student at {sh}x{sw}, h x w): the teacher's box targets are per location of its "
            f"stride-8/16/32 grid, which is the student's grid only at the same size. Set teacher.image_size to "
            f"student.image_size ({sh if sh == sw else [sh, sw]}). The teacher is not run at the student's size "
            f"instead: which FPN level finds an object depends on its size in pixels, so a teacher finetuned at "
            f"one size gives worse targets at another")


@register_recipe_check
def check_detection_distill(recipe) -> None:
    """Said before the first stage: the detection-only distill options on another task; for detection, the
    teacher and the student at the same input size (task-oriented and neck imitation read per-location
    outputs of both) and a feature loss that compares maps.

    Why refuse rather than run the teacher at the student's size: the teacher was finetuned at its own size,
    and which FPN level is responsible for an object depends on the object's size in pixels (FCOS's size
    ranges), so at another size the teacher would give its targets from the levels it was not trained to use
    for those objects (and a ViT teacher's position grid is fixed at its size).  Equal sizes make the
    locations the same by construction; saying so costs the user one line."""
    d = recipe.distill
    if recipe.data.task != "detection":  # its fields on another task are refused at load (toolchain/recipe.py)
        return
    if d.mode == "task_agnostic" and (d.detection_targets != "dense" or d.pseudo_threshold is not None):
        raise ToolchainError("distill.detection_targets / pseudo_threshold choose what the student learns from the "
                             "teacher's predictions (distill.mode task_oriented); task_agnostic imitates the "
                             "teacher's FPN maps: remove them (from the command line, over a recipe that sets them: "
                             "--set distill.detection_targets=dense --set distill.pseudo_threshold=null, their "
                             "defaults) or set distill.mode: task_oriented")
    if d.mode == "task_agnostic" and d.feature_loss == "contrastive":
        raise ToolchainError("distill.feature_loss contrastive compares one global vector per image; detection's "
                             "task-agnostic transfer regresses the teacher's FPN maps per location: use cosine, "
                             "smooth_l1 or auto (cosine)")
    if d.mode == "task_oriented" and d.detection_targets == "dense" and d.pseudo_threshold is not None:
        raise ToolchainError(f"distill.pseudo_threshold {d.pseudo_threshold} applies to pseudo boxes; "
                             f"distill.detection_targets is dense: set it to both, or remove "
                             f"pseudo_threshold")
    teacher_hw = _teacher_hw(recipe)
    student_hw = image_hw(recipe.student.image_size)
    if teacher_hw is not None and tuple(teacher_hw) != tuple(student_hw):
        raise ToolchainError(_size_mismatch(teacher_hw, student_hw))


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


def _detection_how(d, result) -> str:
    """The report's words for how a detector was distilled."""
    if d.mode == "task_agnostic":
        return "task-agnostic distillation: the student's FPN maps regress the finetuned teacher's (neck imitation)"
    dense = "dense targets at every location (quality focal loss on class probabilities, GIoU and quality where " \
            "the teacher is confident)"
    choice = result.get("pseudo_threshold") or {}
    pseudo = f"the teacher's boxes above {choice.get('threshold', d.pseudo_threshold)} as pseudo labels " \
             f"({choice.get('chosen_on', 'threshold chosen on val')})"
    what = {"dense": dense, "both": f"{dense} plus {pseudo}"}[d.detection_targets]
    return f"task-oriented distillation from the finetuned detector: {what}"


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
    version = "4"  # views seeded by the image's bytes, not its path; 3: fp16 targets, segmentation logits at the
    # teacher's stride, student-side augmentation
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
        extra: Dict[str, Any] = {}
        if task == "detection":
            student, objective_name, objective, teacher, teacher_fn, tpp, extra = self._detection(ctx, name, index,
                                                                                                  spp)
        else:
            student = create_student(name, len(classes), r.student.weights, task)
            objective_name, teacher, teacher_fn, tpp = self._teacher(ctx, student)
            objective = OBJECTIVES.get(objective_name)(
                student, temperature=d.temperature, teacher_dim=getattr(teacher, "out_dim", None),
                projection_dim=d.projection_dim, teacher_projection=self._teacher_projection(r),
                student_map=student_map_size(student, spp.hw), negatives=d.negatives,
                loss=d.feature_objective()[1])
        online = d.teacher_outputs == "online"
        from vfm_toolchain.augment import photometric_augment

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
        save_model(ctx.workdir / "model", student, student_task(task).spec(name, classes, spp))
        result = {**extra, "model": "model", "history": history, "transfer_images": len(paths), "mode": d.mode,
                  "objective": objective_name, "views": None if online else d.views,
                  "student_augment": a.model_dump() if augment is not None else None,
                  "teacher_cache_mb": None if t_cache is None else round(t_cache.nbytes / 2 ** 20, 2),
                  "teacher_outputs": ("online (a fresh augmented view per step)" if online
                                      else f"cached once per (image, view), {d.views} views"),
                  "teacher_seconds": round(cache_seconds, 2), "train_seconds": round(train_seconds, 2),
                  "unreadable_transfer_images": views.failed}
        metric = metric_name(task)
        if task == "detection":
            result.update(self._detection_metrics(ctx, student, index, spp, d.mode == "task_oriented"))
        elif d.mode == "task_oriented":  # the head was trained: it can be evaluated
            result["metrics"] = {f"{split}_{metric}": evaluate(student, index[split], spp, task, len(classes))
                                 for split in ("test", "val")}
            ctx.log.info("after distillation: test %s %.4f", metric, result["metrics"][f"test_{metric}"])
            if t_cache is not None and t_cache.ndim == 3:
                result["teacher_view_agreement"] = float(
                    (np.asarray(t_cache[:, 0]).argmax(-1) == np.asarray(t_cache[:, -1]).argmax(-1)).mean())
        else:  # features were matched; the classifier is trained by student.finetune
            result["metrics"] = {f"test_{metric}": None, f"val_{metric}": None}
        return result

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """The student and how the teacher's knowledge reached it; its score before finetuning."""
        r, d, m = build.recipe, build.recipe.distill, metric_name(build.recipe.data.task)
        student = f"`{student_name(build)}`" + (" (chosen by `student.name: auto`: see Student selection)"
                                                 if r.student.name == "auto" else "")
        if r.data.task == "detection":
            how = _detection_how(d, out.result)
        elif d.mode == "task_oriented":
            how = f"task-oriented distillation from the finetuned teacher (KL, T={d.temperature})"
        elif d.features == "global":
            how = "task-agnostic distillation from the frozen pretrained teacher (global features, contrastive)"
        else:
            how = "task-agnostic distillation from the frozen pretrained teacher (patch features, cosine)"
        teaching = out.result.get("teacher_outputs") or d.teacher_outputs
        summary = [f"student {student} at {size_text(r.student.image_size)}; {how}, {d.epochs} epochs, "
                   f"teacher outputs {teaching}"]
        test_map = out.result.get("metrics", {}).get("test_map")
        if r.data.task == "detection" and test_map is not None:
            summary.append(f"student after distillation: test mAP50 {percent(out.result['metrics']['test_map50'])}, "
                           f"mAP@[.5:.95] {percent(test_map)}")
        scores = [Score(f"student_after_distill_{m}", "student, after distillation (before finetune)",
                        out.result.get("metrics", {}).get(f"test_{m}"))]
        return ReportSection(summary=summary, scores=scores)

    @staticmethod
    def _detection(ctx, name: str, index, spp: Preprocess):
        """Detection's student, objective and teacher: (student, objective name, objective, teacher, function
        images -> raw teacher output, teacher preprocessing, result entries).  Task-oriented teaching and neck
        imitation both read the finetuned detection teacher (students/detection_distill.py says why)."""
        from vfm_toolchain.teachers.detection import Detector

        r, d = ctx.recipe, ctx.recipe.distill
        classes = index["classes"]
        student = build_student_detector(name, len(classes), r.student.weights)
        teacher = load_model(ctx.input("teacher.finetune").path("model"))
        if not isinstance(teacher, Detector):
            raise ToolchainError(f"teacher.finetune's model is a {type(teacher).__name__}, not a detector; rebuild "
                                 f"teacher.finetune for data.task detection")
        tpp = teacher.backbone.preprocess
        if tuple(tpp.hw) != tuple(spp.hw):  # the recipe check says this first wherever it can read the size
            raise ToolchainError(_size_mismatch(tpp.hw, spp.hw))
        if teacher.strides != student.strides:
            raise ToolchainError(f"teacher strides {list(teacher.strides)} and student strides "
                                 f"{list(student.strides)} differ: the locations would not line up")
        for p in teacher.parameters():
            p.requires_grad_(False)
        if d.mode == "task_agnostic":
            loss = "cosine" if d.feature_loss == "auto" else d.feature_loss  # seed 004's choice for maps
            objective = NeckImitation(student, neck_width(teacher), spp.hw, loss=loss)
            return student, "detection_neck", objective, teacher, partial(flat_neck, teacher), tpp, {}
        extra: Dict[str, Any] = {"detection_targets": d.detection_targets}
        threshold = None
        if d.detection_targets != "dense":
            if d.pseudo_threshold is not None:
                choice = {"threshold": d.pseudo_threshold, "chosen_on": "distill.pseudo_threshold"}
            else:
                choice = choose_pseudo_threshold(teacher, index["val"], tpp)
            threshold = float(choice["threshold"])
            extra["pseudo_threshold"] = choice
            ctx.log.info("pseudo boxes: the teacher's detections scoring above %.2f (%s)", threshold,
                         choice["chosen_on"])
        objective = DenseDetection(student, spp.hw, d.detection_targets, threshold)
        return student, "detection_dense", objective, teacher, teacher.forward_dense, tpp, extra

    @staticmethod
    def _detection_metrics(ctx, student, index, spp: Preprocess, trained_head: bool) -> Dict[str, Any]:
        """COCO mAP50, mAP@[.5:.95] and per-class AP of the distilled detector on test and val at each image's own
        resolution (the teacher's keys); None after neck imitation, which leaves the head untrained."""
        if not trained_head:
            return {"metrics": {f"{s}_{k}": None for s in ("test", "val") for k in ("map50", "map")}}
        metrics = detection_metrics(student, index, spp, index["classes"], splits=("test", "val"))
        ctx.log.info("after distillation: test mAP50 %.4f, mAP %.4f", metrics["test_map50"], metrics["test_map"])
        return {"metrics": metrics}

    @staticmethod
    def _teacher_projection(recipe) -> bool:
        p = recipe.distill.projection
        return (not recipe.teacher.name.startswith("open_clip:")) if p == "auto" else p == "both"

    @staticmethod
    def _teacher(ctx, student):
        """(objective name, teacher module, function images -> raw teacher output, teacher preprocessing)."""
        r, d = ctx.recipe, ctx.recipe.distill
        if d.mode == "task_oriented":
            teacher = load_model(ctx.input("teacher.finetune").path("model"))
            # a segmentation teacher's logits at its own output stride: 64x fewer values to cache than at
            # the input size, upsampled inside the loss exactly as the teacher's forward would
            fn = getattr(teacher, "forward_logits", teacher)
            return "task_oriented", teacher, fn, teacher.backbone.preprocess
        # task-agnostic transfer distills the frozen pretrained VFM, not the finetuned one (seed 004 Fig. 1d)
        backbone = create_backbone(r.teacher.name, r.teacher.weights, r.teacher.image_size)
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
