"""One training loop for every stage that trains (teacher finetune, distillation, finetune, baseline).

AdamW with linear warm-up and cosine decay; optionally an exponential moving average of the weights (timm's
ModelEmaV3), which is what gets validated and kept; a checkpoint after every epoch and optionally every N steps
(model, averaged weights, optimizer, scheduler, RNG states, epoch and batch), exact resume from it; a stop on a non-finite
loss that keeps the last good checkpoint; DistributedDataParallel under torchrun, bfloat16 autocast on
GPU, gradient accumulation.  The stage supplies the dataset and the loss of a batch; the loop owns the
data order, the devices and the rest.
"""
from __future__ import annotations

import logging
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from vfm_toolchain import distributed
from vfm_toolchain.checkpoint import load_training_state, save_training_state
from vfm_toolchain.core.console import Track, track
from vfm_toolchain.core.errors import NonFiniteLossError, ToolchainError
from vfm_toolchain.devices import (generator_state, loader_kwargs, on_device, set_generator_state,
                                   training_autocast)
from vfm_toolchain.tasks import LEGACY_TASK, task_of

__all__ = ["fit", "fit_classifier", "fit_detector", "evaluate", "detection_scores", "detection_metrics", "metric_name",
           "miou",
           "train_options", "TrainBatches", "cosine_schedule", "rng_state", "set_rng_state"]


def cosine_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def rng_state() -> Dict[str, Any]:
    # numpy's state is stored as tensors and numbers so the checkpoint loads with weights_only=True
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": generator_state(), "python": random.getstate(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    set_generator_state(state.get("cuda"))  # absent from checkpoints written before it was saved
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


class TrainBatches(torch.utils.data.Sampler):
    """The batches of one epoch: a permutation seeded by (seed, epoch), cut into global batches of
    ``batch_size``; under DDP each global batch is split across the ranks, so the ranks together see exactly
    what one process would.  A last batch that would leave a rank fewer than 2 images is dropped
    (BatchNorm cannot train on one image; the order changes every epoch, so no image is lost for good).
    ``skip`` resumes in the middle of an epoch (the data position)."""

    def __init__(self, n: int, batch_size: int, seed: int, epoch: int, skip: int = 0, rank: int = 0,
                 world: int = 1, shuffle: bool = True):
        self.skip, self.rank, self.world = skip, rank, world
        g = torch.Generator().manual_seed(seed * 1000003 + epoch)
        order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
        self.batches = [order[b:b + batch_size] for b in range(0, n, batch_size)]
        if len(self.batches) > 1 and len(self.batches[-1]) < 2 * world:
            self.batches.pop()

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)

    def __iter__(self):
        for batch in self.batches[self.skip:]:
            yield np.array_split(np.asarray(batch), self.world)[self.rank].tolist()


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    return batch


def fit(model: torch.nn.Module,
        param_groups: Sequence[Dict[str, Any]],
        dataset,
        batch_size: int,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        epochs: int,
        ckpt_path: Path,
        log: logging.Logger,
        seed: int = 0,
        weight_decay: float = 0.05,
        warmup_epochs: int = 0,
        name: str = "train",
        on_epoch_start: Optional[Callable[[int], None]] = None,
        on_epoch_end: Optional[Callable[[int], Dict[str, float]]] = None,
        accumulate: int = 1,
        amp: bool = True,
        checkpoint_steps: Optional[int] = None,
        ema: float = 0.0,
        collate_fn: Optional[Callable[[list], Any]] = None) -> List[Dict[str, float]]:
    """Train ``model`` on ``dataset`` for ``epochs``; resumes from ``ckpt_path`` when it exists.

    The data order is a function of (seed, epoch), so a resumed run, mid-epoch included, sees the same
    batches as an uninterrupted one.  Under torchrun the model is wrapped in DistributedDataParallel and
    each global batch is split across the ranks; on GPU the forward runs in bfloat16 autocast (``amp``).
    ``accumulate`` batches make one optimizer step.  With ``ema`` (a decay in (0, 1)) an exponential moving
    average of the weights follows every optimizer step; ``on_epoch_end`` sees the averaged weights and the model
    returned holds them.  The model is back on the CPU when this returns.  ``collate_fn`` batches the dataset's
    samples (default: torch's, which stacks; detection keeps each image's boxes apart).

    Raises:
        NonFiniteLossError: a loss became NaN/Inf; the last checkpoint is kept.
    """
    ckpt_path = Path(ckpt_path)
    device = distributed.device()
    model.to(device)
    ddp = distributed.world() > 1 and torch.distributed.is_initialized()
    train_model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    steps_per_epoch = len(TrainBatches(len(dataset), batch_size, seed, 0, world=distributed.world()))
    opt_steps = math.ceil(steps_per_epoch / accumulate)
    opt = torch.optim.AdamW(param_groups, weight_decay=weight_decay)
    sched = cosine_schedule(opt, epochs * opt_steps, warmup_epochs * opt_steps)
    average = _ema(model, ema, epochs * opt_steps, log, name)
    start, skip, history = 0, 0, []
    state = load_training_state(ckpt_path)
    if state is not None:
        model.load_state_dict(state["model"])
        if average is not None and state.get("ema") is not None:
            average.module.load_state_dict(state["ema"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        history = list(state["history"])
        if state.get("batch") is not None:  # stopped inside an epoch: continue at the next batch
            start, skip = state["epoch"], state["batch"]
        else:
            start = state["epoch"] + 1
        log.info("%s: resumed from %s at epoch %d/%d%s", name, ckpt_path.name, start + 1, epochs,
                 f", batch {skip}" if skip else "")

    def save(epoch: int, batch: Optional[int], partial=None) -> None:
        if distributed.is_main():
            save_training_state(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                            "ema": None if average is None else average.module.state_dict(),
                                            "scheduler": sched.state_dict(), "rng": rng_state(), "epoch": epoch,
                                            "batch": batch, "history": history, "partial": partial})
        distributed.barrier()

    # one bar over the whole run: its ETA is the stage's, its loss the running mean of the epoch
    bar = Track(f"{name} epoch {start + 1}/{epochs}", (epochs - start) * steps_per_epoch - skip, unit="batch", log=log)
    with bar:
        for epoch in range(start, epochs):
            bar.describe(f"{name} epoch {epoch + 1}/{epochs}")
            model.train()
            if on_epoch_start is not None:
                on_epoch_start(epoch)
            sampler = TrainBatches(len(dataset), batch_size, seed, epoch, skip, distributed.rank(), distributed.world())
            # its own generator: the loader's base seed must not come from the global RNG, whose state the
            # checkpoint restores mid-epoch
            batches = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                                  generator=torch.Generator().manual_seed(seed * 1000003 + epoch),
                                                  **({"collate_fn": collate_fn} if collate_fn else {}),
                                                  **loader_kwargs())
            t0 = time.time()
            total, count = (state["partial"] if skip and state.get("partial") else (0.0, 0))
            for b, batch in enumerate(batches, start=skip):
                with training_autocast(amp):
                    loss = loss_fn(train_model, _to(batch, device))
                if not torch.isfinite(loss):
                    kept = f"the last checkpoint is kept at {ckpt_path}" if ckpt_path.exists() else \
                        "no earlier checkpoint exists"
                    raise NonFiniteLossError(
                        f"{name}: loss became {loss.item()} at epoch {epoch + 1}, step {b + 1}; {kept}. "
                        f"Lower the learning rate (now {opt.param_groups[0]['lr']:.3g}) or check the inputs."
                    )
                (loss / accumulate).backward()
                if (b + 1) % accumulate == 0 or b + 1 == steps_per_epoch:
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    if average is not None:  # the scheduler's count is the optimizer steps so far, resumed too
                        average.update(model, step=sched.last_epoch)
                    if checkpoint_steps and (b + 1) % checkpoint_steps == 0 and b + 1 < steps_per_epoch:
                        save(epoch, b + 1, (total + loss.item(), count + 1))
                total += loss.item()
                count += 1
                bar.set(loss=total / count)
                bar.advance()
            skip = 0
            mean_loss = total / max(1, count)
            if ddp:  # the logged loss is the mean over ranks
                t = torch.tensor([mean_loss], device=device)
                torch.distributed.all_reduce(t)
                mean_loss = float(t.item()) / distributed.world()
            row = {"epoch": epoch + 1, "loss": mean_loss, "seconds": round(time.time() - t0, 2)}
            if on_epoch_end is not None:
                with _averaged(model, average):
                    row.update(on_epoch_end(epoch))
            history.append(row)
            # about ten lines a run on screen (first, last, every tenth, any with val scores); all in build.log
            extra = {k: v for k, v in row.items() if k not in ("epoch", "loss", "seconds")}
            shown = extra or epoch in (start, epochs - 1) or (epoch + 1) % max(1, epochs // 10) == 0
            log.log(logging.INFO if shown else logging.DEBUG, "%s epoch %d/%d  loss %.4f  %.1fs%s", name,
                    epoch + 1, epochs, row["loss"], row["seconds"], "".join(f"  {k} {v:.4f}" for k, v in extra.items()))
            save(epoch, None)
    if average is not None:
        model.load_state_dict(average.module.state_dict())
    model.to("cpu")
    return history


def _ema(model: torch.nn.Module, decay: float, total_steps: int, log: logging.Logger, name: str):
    """timm's ModelEmaV3 of ``model`` at ``decay``, or None for 0.  Its warm-up (decay 1 - (1 + step)^(-2/3),
    capped at ``decay``) keeps the first steps from averaging in the random start: a few-label run is only
    hundreds of steps long.  The same warm-up means a cap above 1 - total_steps^(-2/3) is never reached, so a
    higher ``decay`` changes nothing; the log says so rather than let a setting look like it mattered."""
    if not decay:
        return None
    from timm.utils import ModelEmaV3

    average = ModelEmaV3(model, decay=decay, use_warmup=True)
    reached = average.get_decay(total_steps)  # the last update's decay, by timm's own schedule (fit passes step=)
    if reached < decay:
        log.warning("%s: ema %g is above the %.4f that timm's warm-up reaches by the last of %d optimizer steps, so "
                    "the average is the same as at %.4f (about the last %d steps); more steps would use it",
                    name, decay, reached, total_steps, reached, round(1 / (1 - reached)))
    return average


@contextmanager
def _averaged(model: torch.nn.Module, average):
    """The averaged weights in ``model`` for the duration (validation scores what the stage keeps), then the
    trained ones back."""
    if average is None:
        yield
        return
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(average.module.state_dict())
    try:
        yield
    finally:
        model.load_state_dict(trained)


# ---------------------------------------------------------------------------------------------------
# supervised classification on (path, label) lists, shared by teacher finetune, student finetune, baseline


def loader(items, transform, batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0):
    """A DataLoader over (path, label) items or a dataset, with the device policy's workers and pinned memory."""
    from vfm_toolchain.data.images import ImageListDataset

    ds = items if isinstance(items, torch.utils.data.Dataset) else ImageListDataset(items, transform)
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g,
                                       drop_last=False, **loader_kwargs())


@torch.no_grad()
def predict_logits(model: torch.nn.Module, items, preprocess, batch_size: int = 64) -> tuple:
    """Logits and labels over (path, label) items with the model's eval transform."""
    from vfm_toolchain.data.images import eval_transform

    model.eval()
    outs, labels = [], []
    with on_device(model) as device:
        for x, y in track(loader(items, eval_transform(preprocess), batch_size, shuffle=False),
                          math.ceil(len(items) / batch_size), f"scoring {len(items)} images", unit="batch"):
            outs.append(model(x.to(device, non_blocking=True)).float().cpu())
            labels.append(y)
    return torch.cat(outs), torch.cat(labels)


def metric_name(task: str) -> str:
    """The main metric of a task (toolchain/tasks/): ``top1`` for classification, ``miou`` for segmentation,
    ``map50`` (COCO AP at IoU 0.5) for detection, the number a few-label detector is compared by (seed 004's
    tables, issue 38)."""
    return task_of(task).metric


def evaluate(model: torch.nn.Module, items, preprocess, task: str = LEGACY_TASK,
             num_classes: Optional[int] = None, classes: Optional[Sequence[str]] = None) -> float:
    """The task's main metric (:func:`metric_name`) over a split: top-1 accuracy, mean IoU over the split (one
    confusion matrix over all its pixels), or COCO mAP50 over detection records at each image's own resolution.

    Detection needs the class count, as ``classes`` (names) or ``num_classes``; the names only label the
    per-class APs, which :func:`detection_scores` returns with the rest."""
    return task_of(task).evaluate(model, items, preprocess, num_classes, classes)


def detection_scores(model: torch.nn.Module, records, preprocess, classes: Sequence[str],
                     batch_size: int = 16) -> Dict[str, Any]:
    """COCO mAP of a detector over a split's records (:func:`vfm_toolchain.detmetrics.detection_map`):
    ``{"map", "map50", "map75", "per_class_ap": {name: AP@[.5:.95] or None}}``.  ``model`` has ``forward_levels``
    and ``decode`` (:class:`vfm_toolchain.blocks.detection.Detector`, or a wrapper that passes them on)."""
    from vfm_toolchain.detmetrics import detection_map

    model.eval()
    with on_device(model) as device:
        return detection_map(lambda x: model.decode(model.forward_levels(x.to(device, non_blocking=True))),
                             records, preprocess, classes, batch_size)


def miou(model: torch.nn.Module, items, preprocess, num_classes: int, batch_size: int = 16) -> float:
    """Mean IoU at each mask's own resolution (segmetrics.py)."""
    from vfm_toolchain.segmetrics import segmentation_miou

    model.eval()
    with on_device(model) as device:
        return segmentation_miou(lambda x: model(x.to(device, non_blocking=True)), items, preprocess, num_classes,
                                 batch_size)


def detection_metrics(model: torch.nn.Module, index: Dict[str, Any], preprocess, classes: Sequence[str],
                      splits: Sequence[str] = ("val", "test")) -> Dict[str, Any]:
    """A detector's scores on the splits of a data index as a stage's ``metrics``: ``<split>_map50`` first (the
    main metric; ``test_map50`` is the first ``test_`` key a reader of the metrics finds), then ``<split>_map``
    (mAP@[.5:.95]) and ``<split>_per_class_ap`` ({class: AP@[.5:.95], None for a class with no box there})."""
    scores = {split: detection_scores(model, index[split], preprocess, classes) for split in splits}
    return {**{f"{s}_map50": scores[s]["map50"] for s in splits}, **{f"{s}_map": scores[s]["map"] for s in splits},
            **{f"{s}_per_class_ap": scores[s]["per_class_ap"] for s in splits}}


def top1(model: torch.nn.Module, items, preprocess, batch_size: int = 64) -> float:
    # the fraction right, by hand: torchmetrics' multiclass_accuracy says the same, but importing it pulls in
    # transformers, scipy.signal and matplotlib (4.6 s on a 2-core machine first thing; ~1 s after PEFT's imports)
    if not items:
        return float("nan")
    logits, labels = predict_logits(model, items, preprocess, batch_size)
    return float((logits.argmax(1) == labels).double().mean())


def fit_classifier(model: torch.nn.Module, param_groups, train_items, preprocess, cfg, ckpt_path: Path,
                   log: logging.Logger, seed: int, name: str, val_items=None,
                   extra_loss: Optional[Callable[[], torch.Tensor]] = None,
                   criterion: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                   task: str = LEGACY_TASK, num_classes: Optional[int] = None) -> List[Dict[str, float]]:
    """Cross-entropy training on labeled images with ``cfg.augment`` augmentation (``cfg`` is a TrainConfig),
    per pixel for segmentation (ignoring label 255); ``extra_loss()`` (an adapter's regulariser) is added to
    every step's loss; ``criterion(output, y)`` replaces the cross-entropy (e.g. several heads)."""
    from vfm_toolchain.data.segmentation import IGNORE_INDEX

    ds = task_of(task).train_dataset(train_items, preprocess, getattr(cfg, "augment", "light"))
    ce = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing, ignore_index=IGNORE_INDEX)
    device = distributed.device()
    mix = _mixer(cfg, num_classes)  # the recipe refused mixing for segmentation and gramian heads
    mix_until = cfg.epochs - getattr(cfg, "mix_off_epochs", 0)  # mixes epochs [0, mix_until)
    epoch_now = [0]

    def on_start(epoch: int) -> None:
        epoch_now[0] = epoch
        if mix is not None and epoch == mix_until and distributed.is_main():
            log.info("%s: mixup/cutmix off for the last %d epochs", name, cfg.epochs - mix_until)

    def step(m, batch):
        x, y = batch
        if mix is not None and epoch_now[0] < mix_until:
            x, soft = mix(x, y)
            out = m(x)
            loss = torch.nn.functional.cross_entropy(out, soft)  # probabilities as targets: smoothed in soft
        else:
            out = m(x)
            loss = criterion(out, y) if criterion is not None else ce(out, y)
        return loss + extra_loss().to(device) if extra_loss is not None else loss

    on_end = None
    if val_items:
        on_end = lambda epoch: {f"val_{metric_name(task)}": evaluate(model, val_items, preprocess, task, num_classes)} \
            if (epoch + 1) % max(1, cfg.epochs // 5) == 0 or epoch + 1 == cfg.epochs else {}
    return fit(model, param_groups, ds, cfg.batch_size, step, cfg.epochs, ckpt_path, log, seed=seed,
               weight_decay=cfg.weight_decay, warmup_epochs=cfg.warmup_epochs, name=name, on_epoch_start=on_start,
               on_epoch_end=on_end, **train_options(cfg))


def _mixer(cfg, num_classes: Optional[int]) -> Optional[Callable[[torch.Tensor, torch.Tensor],
                                                                   Tuple[torch.Tensor, torch.Tensor]]]:
    """timm's Mixup/CutMix as ``(x, y) -> (mixed x, soft targets)`` when ``cfg.mixup`` or ``cfg.cutmix`` is set,
    else None.  Pairs are a batch and its reverse, so an odd batch leaves its middle image unmixed (its
    target smoothed like the others')."""
    alpha, cut = getattr(cfg, "mixup", 0.0), getattr(cfg, "cutmix", 0.0)
    if not alpha and not cut:
        return None
    from timm.data import Mixup
    from timm.data.mixup import mixup_target

    mixer = Mixup(mixup_alpha=alpha, cutmix_alpha=cut, label_smoothing=cfg.label_smoothing, num_classes=num_classes)

    def mix(x: torch.Tensor, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if len(x) % 2 == 0:
            return mixer(x, y)
        if len(x) == 1:
            return x, mixup_target(y, num_classes, smoothing=cfg.label_smoothing)
        mid = len(x) // 2  # timm pairs image i with image n-1-i: drop the middle one, mix, put it back
        keep = torch.cat([torch.arange(mid), torch.arange(mid + 1, len(x))])
        xm, ym = mixer(x[keep], y[keep])
        single = mixup_target(y[mid:mid + 1], num_classes, smoothing=cfg.label_smoothing)
        return torch.cat([xm[:mid], x[mid:mid + 1], xm[mid:]]), torch.cat([ym[:mid], single, ym[mid:]])

    return mix


def fit_detector(model: torch.nn.Module, param_groups, train_records, preprocess, cfg, ckpt_path: Path,
                 log: logging.Logger, seed: int, name: str, val_records=None, classes: Optional[Sequence[str]] = None,
                 extra_loss: Optional[Callable[[], torch.Tensor]] = None) -> List[Dict[str, float]]:
    """Train a detector on labeled records (:mod:`vfm_toolchain.data.detection`) with the box-aware ``cfg.augment``
    geometry; the loss is the detector's own (focal + GIoU + quality, :meth:`Detector.loss`) plus
    ``extra_loss()`` (an adapter's regulariser).  ``model`` is the module trained (a :class:`Detector`, or a
    wrapper with ``loss``, ``forward_levels`` and ``decode``); its ``forward`` must return the per-level
    outputs, which is what runs through DistributedDataParallel.  With ``val_records`` the val mAP50 (and mAP)
    is measured at the cadence :func:`fit_classifier` measures its val metric (about five times a run, and
    after the last epoch); ``classes`` names the classes (their number must be the detector's).  ``cfg`` is a
    TrainConfig with ``augment``: its AMP, accumulation, checkpoint and EMA options apply as for classifiers."""
    from vfm_toolchain.data.detection import DetectionDataset, detection_collate

    # the export floor may leave a detector answering one dense tensor (Detector.dense_output); training needs
    # the per-level outputs that its loss reads
    if getattr(model, "dense_output", False):
        model.dense_output = False
    ds = DetectionDataset(train_records, preprocess, train=True, augment=getattr(cfg, "augment", "light"))
    device = distributed.device()

    def step(m, batch):
        x, targets = batch
        # through the (possibly DDP-wrapped) module, so every rank's gradients are reduced; the loss reads only
        # the outputs and the targets
        out = m(x)
        loss = model.loss(out, targets)["total"]
        return loss + extra_loss().to(device) if extra_loss is not None else loss

    if classes is not None and len(classes) != model.num_classes:
        raise ToolchainError(f"{name}: {len(classes)} class names ({', '.join(list(classes)[:5])}"
                             f"{', ...' if len(classes) > 5 else ''}) for a detector of {model.num_classes} classes; "
                             f"the model must be built for the data's classes")
    on_end = None
    if val_records:
        names = list(classes) if classes is not None else [str(i) for i in range(model.num_classes)]

        def on_end(epoch: int) -> Dict[str, float]:
            if (epoch + 1) % max(1, cfg.epochs // 5) and epoch + 1 != cfg.epochs:
                return {}
            scores = detection_scores(model, val_records, preprocess, names)
            return {"val_map50": scores["map50"], "val_map": scores["map"]}
    return fit(model, param_groups, ds, cfg.batch_size, step, cfg.epochs, ckpt_path, log, seed=seed,
               weight_decay=cfg.weight_decay, warmup_epochs=cfg.warmup_epochs, name=name, on_epoch_end=on_end,
               collate_fn=detection_collate, **train_options(cfg))


def train_options(cfg) -> Dict[str, Any]:
    """The scaling knobs every TrainConfig carries, as ``fit`` keyword arguments."""
    return {"accumulate": cfg.accumulate, "amp": cfg.amp, "checkpoint_steps": cfg.checkpoint_steps, "ema": cfg.ema}
