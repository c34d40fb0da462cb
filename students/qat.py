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

It is a stage of its own, ``student.qat``, after ``student.finetune`` and before export: its key is ``export.qat``
(the recipe field that asks for it stays where a user sets it) and its inputs', so changing an export format
retrains nothing.  It saves the folded network (``folded_student``: the student rebuilt from its spec and folded,
students/fold.py, then these weights), which export.convert exports as its own model, ``student_qat``, to the
build's int8 formats (and the fp32 ONNX they are built from), beside the plain student: the report's artifact table
shows PTQ and QAT per format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.stage import ReportContext, ReportSection, Stage, StageContext, StageOutput, register_stage

__all__ = ["QAT_MODEL", "StudentQAT", "quantization_aware", "fake_int8_weight", "fake_uint8_input",
           "weighted_layers"]

QAT_MODEL = "student_qat"  # the export.models entry that asks for it

# int8 as the formats quantize it, simulated in float: what quantization-aware training trains through and what the
# export floor's int8 fallback (export/fallback.py) ranks layers by
WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.Linear)


def weighted_layers(model: nn.Module) -> List[str]:
    """Module names of the layers int8 quantizers turn into integer kernels: convolutions and linear layers."""
    return [name for name, m in model.named_modules() if isinstance(m, WEIGHTED) and name]


def fake_int8_weight(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per slice of dim 0 (a Conv's or Linear's output channels; a transposed
    convolution's input channels, close enough for a ranking)."""
    amax = w.detach().abs().flatten(1).amax(1).clamp(min=1e-12)
    scale = (amax / 127).view(-1, *([1] * (w.dim() - 1)))
    return (w / scale).round().clamp(-127, 127) * scale


def fake_uint8_input(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Asymmetric 8-bit per tensor over the observed range (zero included, as the quantizers keep it exact)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-12) / 255
    zero = round(-lo / scale)
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


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


@register_stage
class StudentQAT(Stage):
    name = "student.qat"
    version = "2"
    inputs = ("data.prepare", "student.finetune", "teacher.finetune", "teacher.curate")
    optional_inputs = ("student.distill",)  # its cached teacher rows (export.qat.target: teacher) and objective

    def config(self, recipe) -> Dict[str, Any]:
        return {"qat": recipe.export.qat.model_dump(mode="json"), "seed": recipe.seed}

    def skip_reason(self, recipe):
        return None if QAT_MODEL in recipe.export.models else f"export.models has no {QAT_MODEL}"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        """The folded student trained against ``student.distill``'s cached teacher rows for the same (image, view)
        pairs, rebuilt here exactly as distillation made them, or against the fp32 student's own outputs."""
        import copy
        import json
        import time

        from vfm_toolchain import distributed
        from vfm_toolchain.checkpoint import load_model, save_model
        from vfm_toolchain.data.images import Preprocess
        from vfm_toolchain.prepare import load_index
        from vfm_toolchain.students.distill import TransferViews, distill_paths
        from vfm_toolchain.students.fold import fold_model, folded_spec
        from vfm_toolchain.students.tasks import student_task
        from vfm_toolchain.tasks import task_of

        r = ctx.recipe
        index = load_index(ctx.input("data.prepare"))
        folder = ctx.input("student.finetune").path("model")
        spec = json.loads((folder / "spec.json").read_text())
        pp = Preprocess.from_dict(spec["preprocess"])
        folded, _ = fold_model(load_model(folder), spec, torch.zeros(1, 3, *pp.hw))
        distill = ctx.inputs.get("student.distill")
        paths = distill_paths(r, index, ctx.input("teacher.curate"), ctx.input("data.prepare"))
        teacher_spec = json.loads(ctx.input("teacher.finetune").path("model").joinpath("spec.json").read_text())
        views = TransferViews(paths, r.distill.views, r.seed, Preprocess.from_dict(teacher_spec["preprocess"]), pp)
        views.enable_cache(r.distill.cache_mb << 20)
        part = student_task(task_of(index).name)
        t_cache, reference = None, None
        if r.export.qat.target == "student":  # the fp32 student's own raw outputs, in the form the teacher's were
            # beside the trained copy, on the device the training runs on (fit moves only what it trains)
            reference = part.raw_output(copy.deepcopy(folded).eval().to(distributed.device()))
        else:
            cache = distill.path("teacher_targets.npy") if distill is not None else None
            if cache is None or not cache.is_file():
                raise ToolchainError(f"export.models {QAT_MODEL} learns from the teacher outputs student.distill "
                                     f"cached (teacher_targets.npy), which this build has none of: build "
                                     f"student.distill with distill.teacher_outputs: cached, set export.qat.target: "
                                     f"student, or drop {QAT_MODEL}")
            t_cache = np.load(cache, mmap_mode="r")
            if tuple(t_cache.shape[:2]) != (len(paths), r.distill.views):
                raise ToolchainError(f"student.distill cached {tuple(t_cache.shape[:2])} (images, views) of teacher "
                                     f"outputs, not the {len(paths)} x {r.distill.views} this recipe's transfer set "
                                     f"makes; rebuild student.distill")
        objective = part.qat_objective(r, distill.result if distill is not None else {}, folded, pp.hw)
        against = "the fp32 student's outputs" if reference is not None else "the teacher's cached outputs"
        ctx.log.info("%s: quantization-aware training, %d epochs on %d transfer images x %d views against %s",
                     QAT_MODEL, r.export.qat.epochs, len(paths), r.distill.views, against)
        t0 = time.time()
        model = quantization_aware(folded, objective, views, t_cache, r.export.qat, ctx.workdir, ctx.log, r.seed,
                                   reference)
        if ctx.rank != 0:
            return {}
        save_model(ctx.workdir / "model", model.cpu(), folded_spec(spec))
        return {"model": "model", "target": r.export.qat.target, "against": against, "epochs": r.export.qat.epochs,
                "transfer_images": len(paths), "views": r.distill.views, "seconds": round(time.time() - t0, 2),
                "unreadable_transfer_images": views.failed}

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """What the QAT student learnt from; its artifacts' scores are export's rows."""
        res = out.result
        return ReportSection(summary=[
            f"quantization-aware training of the folded student (`{QAT_MODEL}`): {res.get('epochs')} epochs on "
            f"{res.get('transfer_images')} transfer images x {res.get('views')} views against {res.get('against')}, "
            f"weights on their int8 grid; exported beside the student to the int8 formats"])
