"""Quantization-aware training with the teacher as the target (issue 39, ``export.models: [..., student_qat]``).

The folded student (BatchNorm and reparameterization already in its weights, the network the formats quantize) is
trained for ``export.qat.epochs`` on the transfer set against the teacher's outputs that ``student.distill`` cached
for the same (image, view) pairs, with the same objective (KL on logits or logit maps, the dense detection loss):
no labels, and no teacher run.  During training every weighted layer (convolution, linear) sees its weights and its
input through fake quantization with a straight-through gradient, quantized as the int8 formats will quantize them:
weights symmetric int8 per output channel, the input asymmetric 8-bit per tensor over the running min/max of what
it has seen (MinMax, the formats' calibration).  At the end the weights are written on their int8 grid.

With ``export.qat.target: student`` the target is instead the fp32 student's own output on the same views (a frozen
copy of the folded student, run beside it): still no labels, and what finetuning on the labels added stays.  The
teacher's outputs pull a finetuned student back toward what it was distilled to (on Aquarium the QAT student's
fp32 ONNX lost 1.2 mAP50 points to the teacher target; docs/results.md).

One QAT serves every int8 format: each format then calibrates and quantizes this model as it does any other, and a
weight already on its per-channel grid quantizes to itself, while the activation ranges the formats measure are the
ranges the training saw.  (Framework-specific QAT -- PT2E's ``prepare_qat_pt2e``, NNCF's QAT -- would tie the model
to one format each; what they add, learned ranges, the MinMax ranges here approximate.)  Tensors between
non-weighted ops (a residual add's output) are quantized by the formats but not simulated here.

The QAT model is exported as its own model, ``student_qat``, to the build's int8 formats (and the fp32 ONNX they are
built from), beside the plain student: the report's artifact table shows PTQ and QAT per format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.stage import register_recipe_check
from vfm_toolchain.export.fallback import WEIGHTED, fake_int8_weight, fake_uint8_input

__all__ = ["QAT_MODEL", "quantization_aware", "check_qat"]

QAT_MODEL = "student_qat"  # the export.models entry that asks for it


class _WeightOnGrid(nn.Module):
    """Parametrization: the weight as int8 per channel sees it, with the gradient passing straight through."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (fake_int8_weight(w) - w).detach()


class _InputQuant:
    """Forward pre-hook: the layer's input through 8-bit per-tensor fake quantization over the running min/max
    (updated in training mode), straight-through gradient."""

    def __init__(self):
        self.lo, self.hi = float("inf"), float("-inf")

    def __call__(self, module, args):
        x = args[0]
        if module.training or self.lo > self.hi:
            with torch.no_grad():
                self.lo, self.hi = min(self.lo, float(x.min())), max(self.hi, float(x.max()))
        return (x + (fake_uint8_input(x, self.lo, self.hi) - x).detach(), *args[1:])


def quantization_aware(model: nn.Module, objective: nn.Module, views, t_cache: Optional[np.ndarray], cfg,
                       workdir: Path, log, seed: int, reference: Optional[Callable] = None) -> nn.Module:
    """Train ``model`` (inside ``objective``) with fake-quantized weights and inputs on ``views`` against the cached
    teacher rows ``t_cache[image, view]``, or, with ``reference`` (``export.qat.target: student``), against what
    ``reference`` (the fp32 student's raw output, the form the teacher's was cached in) gives on the same batch;
    returns it in eval mode with its weights on their int8 grid."""
    from vfm_toolchain.training import fit, train_options

    layers = [m for m in model.modules() if isinstance(m, WEIGHTED)]
    hooks = []
    for layer in layers:
        parametrize.register_parametrization(layer, "weight", _WeightOnGrid())
        hooks.append(layer.register_forward_pre_hook(_InputQuant()))

    def step(objective, batch):
        x, i, v = batch
        if reference is not None:
            with torch.no_grad():
                target = objective.target(reference(x).float())
            return objective(x, target, i)
        rows = np.stack([t_cache[a, b] for a, b in zip(i.tolist(), v.tolist())])
        return objective(x, torch.from_numpy(rows).to(x.device), i)

    try:
        fit(objective, [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.lr}], views,
            cfg.batch_size, step, cfg.epochs, Path(workdir) / "qat_state.pt", log, seed=seed,
            weight_decay=cfg.weight_decay, warmup_epochs=cfg.warmup_epochs, name="qat",
            on_epoch_start=views.set_epoch, **train_options(cfg))
    finally:
        for h in hooks:
            h.remove()
        for layer in layers:  # the weights written on their grid: each format's int8 reproduces them exactly
            parametrize.remove_parametrizations(layer, "weight", leave_parametrized=True)
    return model.eval()


@register_recipe_check
def check_qat(recipe) -> None:
    """``student_qat`` needs what it learns from: task-oriented distillation with cached teacher outputs, and an
    int8 format to export it to.  Said before the first stage."""
    if QAT_MODEL not in recipe.export.models:
        return
    from vfm_toolchain.export.formats.base import format_options

    d = recipe.distill
    problems: List[str] = []
    if d.mode != "task_oriented":
        problems.append("distill.mode is task_agnostic, whose cached targets are features, not the predictions QAT "
                        "learns from (set distill.mode: task_oriented)")
    if d.teacher_outputs != "cached" and recipe.export.qat.target == "teacher":
        problems.append("distill.teacher_outputs is online, so no teacher outputs are cached to learn from (set "
                        "distill.teacher_outputs: cached, or export.qat.target: student)")
    if not any(format_options(f, recipe.export.options.get(f)).calibrates() for f in recipe.export.formats):
        problems.append("no int8 format in export.formats to export it to (add onnx_int8, executorch_int8, "
                        "tflite_int8 or openvino_int8)")
    if recipe.export.qat.epochs < 1:
        problems.append("export.qat.epochs is 0")
    if problems:
        raise ToolchainError(f"export.models {QAT_MODEL}: " + "; ".join(problems))
