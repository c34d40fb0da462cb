"""One training loop for every stage that trains (teacher finetune, distillation, finetune, baseline).

AdamW with linear warm-up and cosine decay, a checkpoint after every epoch (model, optimizer, scheduler,
RNG states, epoch), exact resume from it, and a stop on a non-finite loss that keeps the last good
checkpoint.  The stage supplies the batches of an epoch and the loss of a batch; the loop owns the rest.
"""
from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from toolchain.checkpoint import load_training_state, save_training_state
from toolchain.errors import NonFiniteLossError
from toolchain.progress import progress

__all__ = ["fit", "cosine_schedule", "rng_state", "set_rng_state"]


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
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]}


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def fit(model: torch.nn.Module,
        param_groups: Sequence[Dict[str, Any]],
        epoch_batches: Callable[[int], Iterable],
        steps_per_epoch: int,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        epochs: int,
        ckpt_path: Path,
        log: logging.Logger,
        weight_decay: float = 0.05,
        warmup_epochs: int = 0,
        name: str = "train",
        on_epoch_end: Optional[Callable[[int], Dict[str, float]]] = None) -> List[Dict[str, float]]:
    """Train ``model`` for ``epochs``; resumes from ``ckpt_path`` when it exists.

    ``epoch_batches(epoch)`` must be deterministic given the epoch (seed the sampler with it), so a
    resumed run sees the same data order as an uninterrupted one.

    Raises:
        NonFiniteLossError: a loss became NaN/Inf; the checkpoint of the last finished epoch is kept.
    """
    ckpt_path = Path(ckpt_path)
    opt = torch.optim.AdamW(param_groups, weight_decay=weight_decay)
    sched = cosine_schedule(opt, epochs * steps_per_epoch, warmup_epochs * steps_per_epoch)
    start, history = 0, []
    state = load_training_state(ckpt_path)
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start, history = state["epoch"] + 1, list(state["history"])
        log.info("%s: resumed from %s after epoch %d/%d", name, ckpt_path.name, start, epochs)
    for epoch in range(start, epochs):
        model.train()
        t0, total, count = time.time(), 0.0, 0
        batches = progress(epoch_batches(epoch), steps_per_epoch, f"{name} epoch {epoch + 1}/{epochs}")
        for step, batch in enumerate(batches):
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                kept = f"the checkpoint of epoch {start - 1 if epoch == start else epoch - 1} is kept at {ckpt_path}" \
                    if ckpt_path.exists() else "no earlier checkpoint exists"
                raise NonFiniteLossError(
                    f"{name}: loss became {loss.item()} at epoch {epoch + 1}, step {step + 1}; {kept}. "
                    f"Lower the learning rate (now {opt.param_groups[0]['lr']:.3g}) or check the inputs."
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
            count += 1
        row = {"epoch": epoch + 1, "loss": total / max(1, count), "seconds": round(time.time() - t0, 2)}
        if on_epoch_end is not None:
            row.update(on_epoch_end(epoch))
        history.append(row)
        log.info("%s epoch %d/%d  loss %.4f  %s", name, epoch + 1, epochs, row["loss"],
                 "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("epoch", "loss", "seconds")))
        save_training_state(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                        "scheduler": sched.state_dict(), "rng": rng_state(), "epoch": epoch,
                                        "history": history})
    return history


# ---------------------------------------------------------------------------------------------------
# supervised classification on (path, label) lists, shared by teacher finetune, student finetune, baseline


def loader(items, transform, batch_size: int, shuffle: bool, seed: int = 0, epoch: int = 0,
           workers: int = 0):
    from toolchain.data import ImageListDataset

    ds = items if isinstance(items, torch.utils.data.Dataset) else ImageListDataset(items, transform)
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g,
                                       num_workers=workers, drop_last=False)


@torch.no_grad()
def predict_logits(model: torch.nn.Module, items, preprocess, batch_size: int = 64) -> tuple:
    """Logits and labels over (path, label) items with the model's eval transform."""
    from toolchain.data import eval_transform

    model.eval()
    outs, labels = [], []
    for x, y in loader(items, eval_transform(preprocess), batch_size, shuffle=False):
        outs.append(model(x).float())
        labels.append(y)
    return torch.cat(outs), torch.cat(labels)


def top1(model: torch.nn.Module, items, preprocess, batch_size: int = 64) -> float:
    from torchmetrics.functional.classification import multiclass_accuracy

    if not items:
        return float("nan")
    logits, labels = predict_logits(model, items, preprocess, batch_size)
    return float(multiclass_accuracy(logits, labels, num_classes=logits.shape[1], average="micro"))


def fit_classifier(model: torch.nn.Module, param_groups, train_items, preprocess, cfg, ckpt_path: Path,
                   log: logging.Logger, seed: int, name: str, val_items=None,
                   extra_loss: Optional[Callable[[], torch.Tensor]] = None) -> List[Dict[str, float]]:
    """Cross-entropy training on labeled images with standard augmentation (``cfg`` is a TrainConfig);
    ``extra_loss()`` (an adapter's regulariser) is added to every step's loss."""
    from toolchain.data import ImageListDataset, train_transform

    ds = ImageListDataset(train_items, train_transform(preprocess))
    ce = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    def step(m, batch):
        x, y = batch
        loss = ce(m(x), y)
        return loss + extra_loss() if extra_loss is not None else loss

    on_end = None
    if val_items:
        on_end = lambda epoch: {"val_top1": top1(model, val_items, preprocess)} \
            if (epoch + 1) % max(1, cfg.epochs // 5) == 0 or epoch + 1 == cfg.epochs else {}
    steps = math.ceil(len(ds) / cfg.batch_size)
    return fit(model, param_groups, lambda e: loader(ds, None, cfg.batch_size, True, seed, e), steps, step,
               cfg.epochs, ckpt_path, log, cfg.weight_decay, cfg.warmup_epochs, name, on_end)
