"""A linear probe: the first classifier of a feature-distilled student, and the LP of a teacher's LP-FT.

Task-agnostic distillation trains the body only, so the student reaches the label finetune with a random
classifier.  With a few hundred labels that is a handful of optimizer steps, most of them spent pushing the
random head's gradients back through a good body (the loss barely moves: measured on CIFAR-10 at 25 labels
per class, 2.30 -> 1.87 over 15 epochs).  Fitting the head first as a multinomial logistic regression on
the frozen features and then finetuning everything is the linear-probe-then-finetune recipe
(Kumar et al., 2022); the L2 strength is chosen on val.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import Preprocess

__all__ = ["linear_probe", "classifier_inputs"]

# measured on CIFAR-10, 25 labels per class, feature-distilled FastViT-T8: val top-1 43.2 / 45.6 / 48.8 / 47.2%
# at 0.01 / 0.1 / 1 / 10, so the grid reaches well past the usual 1e-4 .. 1e-1
_L2_GRID = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


@torch.no_grad()
def classifier_inputs(model: nn.Module, items, preprocess: Preprocess, batch_size: int = 64
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The features that reach the model's classifier (``get_classifier()``) and the labels, eval mode."""
    from vfm_toolchain.core.console import track
    from vfm_toolchain.data.images import eval_transform
    from vfm_toolchain.devices import on_device
    from vfm_toolchain.training import loader

    head = _linear_head(model)
    feats: List[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, inp, out: feats.append(inp[0].detach().float().cpu()))
    labels = []
    was_training = model.training
    model.eval()
    try:
        with on_device(model) as device:
            for x, y in track(loader(items, eval_transform(preprocess), batch_size, shuffle=False),
                              -(-len(items) // batch_size), f"probe features of {len(items)} images", unit="batch"):
                model(x.to(device, non_blocking=True))
                labels.append(y)
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(feats).flatten(1), torch.cat(labels)


def _linear_head(model: nn.Module) -> nn.Linear:
    head = model.get_classifier() if hasattr(model, "get_classifier") else None
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise ToolchainError(f"a linear probe needs a model whose get_classifier() is an nn.Linear with a bias, got "
                             f"{type(head).__name__}; for a student set finetune.head_start: keep")
    return head


def _fit(x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float, iters: int = 200) -> Tuple[torch.Tensor, torch.Tensor]:
    w = torch.zeros(n_classes, x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=iters, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(x @ w.T + b, y) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), b.detach()


def linear_probe(model: nn.Module, train_items: Sequence, val_items: Optional[Sequence], preprocess: Preprocess,
                 n_classes: int, log: Optional[logging.Logger] = None) -> Dict[str, Any]:
    """Replace the model's linear classifier, in place, by a logistic regression fitted on its frozen
    features; returns what was chosen (L2 strength, train and val accuracy of the probe)."""
    head = _linear_head(model)
    if head.out_features != n_classes:
        raise ToolchainError(f"the model's classifier has {head.out_features} outputs, the task {n_classes} classes")
    x, y = classifier_inputs(model, train_items, preprocess)
    # Standardised features condition L-BFGS; the scale is folded back into the Linear below.
    mu, sd = x.mean(0, dtype=torch.float64), x.double().std(0).clamp_min(1e-6)
    z = (x.double() - mu) / sd
    zv = yv = None
    if val_items:
        xv, yv = classifier_inputs(model, val_items, preprocess)
        zv = (xv.double() - mu) / sd
    best = None
    for l2 in (_L2_GRID if zv is not None else (1e-3,)):
        w, b = _fit(z, y, n_classes, l2)
        val = float(((zv @ w.T + b).argmax(1) == yv).double().mean()) if zv is not None else float("nan")
        if best is None or val > best[0]:
            best = (val, l2, w, b)
    val, l2, w, b = best
    with torch.no_grad():  # w z + b = (w / sd) x + (b - (w / sd) mu)
        ws = w / sd
        head.weight.copy_(ws.to(head.weight.dtype))
        head.bias.copy_((b - ws @ mu).to(head.bias.dtype))
    train_acc = float(((z @ w.T + b).argmax(1) == y).double().mean())
    if log:
        log.info("linear probe: l2 %g, train top1 %.4f, val top1 %.4f", l2, train_acc, val)
    return {"l2": l2, "train_top1": train_acc, "val_top1": None if zv is None else val}
