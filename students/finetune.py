"""``student.finetune`` (distilled student on the labels) and ``student.baseline`` (labels only)."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable, Dict

import torch
from torch import nn

from vfm_toolchain.students.gramian import gramian_loss
from vfm_toolchain.probe import linear_probe
from vfm_toolchain.students.models import create_student, student_preprocess, student_spec, with_gramian_heads, student_name
from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.data import seeded
from vfm_toolchain.recipe import FinetuneConfig
from vfm_toolchain.prepare import load_index
from vfm_toolchain.stage import (ReportContext, ReportSection, Score, Stage, StageContext, StageOutput, percent,
                             register_stage)
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.training import evaluate, fit_classifier, metric_name

__all__ = ["StudentFinetune", "StudentBaseline"]


class HeadOnly(nn.Module):
    """Trains the classifier of a timm model on frozen features: the body stays in eval mode (BatchNorm
    statistics included) and without gradients."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.head = model.get_classifier()
        for p in model.parameters():
            p.requires_grad_(False)
        for p in self.head.parameters():
            p.requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()
        self.head.train(mode)
        return self


def _train_and_report(ctx: StageContext, make_model: Callable[[], nn.Module], cfg: FinetuneConfig,
                      name: str, student: str) -> Dict[str, Any]:
    """Train ``student`` (its registered name) from ``make_model()`` once per learning rate (``cfg.lr_sweep`` or
    just ``cfg.lr``), keep the best on val, report every run."""
    r = ctx.recipe
    index = load_index(ctx.input("data.prepare"))
    task, n_classes = index.get("task", "classification"), len(index["classes"])
    metric = metric_name(task)
    pp = student_preprocess(r.student.image_size)
    lrs = cfg.lr_sweep or [cfg.lr]
    gramian = r.student.gramian.model_dump() if r.student.gramian.heads else None
    criterion = None
    if gramian and task == "segmentation":
        raise ToolchainError("student.gramian heads are classifiers; set student.gramian.heads: 0 for segmentation")
    if gramian:  # seed 003: extra heads and their decorrelation loss while training on labels
        ce = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        criterion = lambda out, y: gramian_loss(out, y, ce, gramian["decorrelation"])
    runs, best = [], None
    for lr in lrs:
        seeded(r.seed)
        model = make_model()
        if gramian:
            model = with_gramian_heads(model, len(index["classes"]), gramian)
        trained = HeadOnly(model) if cfg.head_only else model
        params = [p for p in trained.parameters() if p.requires_grad]
        tag = f"lr_{lr:g}" if len(lrs) > 1 else ""
        history = fit_classifier(trained, [{"params": params, "lr": lr}], index["train"], pp,
                                 cfg.model_copy(update={"lr": lr}),
                                 ctx.workdir / tag / "train_state.pt" if tag else ctx.workdir / "train_state.pt",
                                 ctx.log, r.seed, f"{name} {tag}".strip(), val_items=index["val"],
                                 criterion=criterion, task=task, num_classes=n_classes)
        run = {"lr": lr, f"val_{metric}": evaluate(model, index["val"], pp, task, n_classes), "history": history}
        runs.append(run)
        if best is None or run[f"val_{metric}"] > best[0][f"val_{metric}"]:
            best = (run, model)
    if ctx.rank != 0:
        return {}
    run, model = best
    save_model(ctx.workdir / "model", model, student_spec(student, n_classes, pp, index["classes"], gramian,
                                                           task))
    metrics = {f"val_{metric}": run[f"val_{metric}"],
               f"test_{metric}": evaluate(model, index["test"], pp, task, n_classes)}
    ctx.log.info("%s: lr %g, val %s %.4f, test %s %.4f", name, run["lr"], metric, metrics[f"val_{metric}"], metric,
                 metrics[f"test_{metric}"])
    return {"model": "model", "metrics": metrics, "history": run["history"], "lr": run["lr"],
            "head_only": cfg.head_only,
            "sweep": [{"lr": x["lr"], f"val_{metric}": x[f"val_{metric}"]} for x in runs] if len(lrs) > 1 else None,
            "params": sum(p.numel() for p in model.parameters())}


def _train_key(cfg: FinetuneConfig) -> Dict[str, Any]:
    """The training settings as part of a stage key.  A setting added after builds were stored is left out at
    its default (which trains as before it existed), so those builds stay valid."""
    key = cfg.model_dump(mode="json")
    if not key["mix_off_epochs"]:
        del key["mix_off_epochs"]
    return key


@register_stage
class StudentFinetune(Stage):
    name = "student.finetune"
    version = "2"  # linear-probe head start: the L2 grid reaches 10
    inputs = ("data.prepare", "student.distill")
    distributed = True

    def config(self, recipe) -> Dict[str, Any]:
        return {"finetune": _train_key(recipe.finetune), "seed": recipe.seed,
                "gramian": recipe.student.gramian.model_dump(mode="json")}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        distilled = ctx.input("student.distill")
        cfg, start = ctx.recipe.finetune, load_model(distilled.path("model"))
        index = load_index(ctx.input("data.prepare"))
        task = index.get("task", "classification")
        probe = cfg.head_start == "probe" or (cfg.head_start == "auto" and task == "classification"
                                                and distilled.result.get("mode") == "task_agnostic")
        probe_result = None
        if probe:
            if task != "classification":
                raise ToolchainError("finetune.head_start 'probe' fits a linear classifier; for segmentation use "
                                     "'keep' or 'auto'")
            probe_result = linear_probe(start, index["train"], index["val"],
                                        student_preprocess(ctx.recipe.student.image_size), len(index["classes"]),
                                        ctx.log)
        name = json.loads((distilled.path("model") / "spec.json").read_text())["name"]
        result = _train_and_report(ctx, lambda: copy.deepcopy(start), cfg, "student finetune", name)
        return {**result, "head_start": "probe" if probe else "distilled", "probe": probe_result} if result else result

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """How the distilled student learnt the labels (the learning rates tried, Gramian heads); its score is the
        one the exported student has."""
        r, f, res = build.recipe, build.recipe.finetune, out.result
        m = metric_name(r.data.task)
        line = f"{f.epochs} epochs of {'head-only' if f.head_only else 'full'} finetuning on the labels"
        if res.get("sweep"):
            key = next(k for k in res["sweep"][0] if k.startswith("val_"))
            tried = ", ".join(f"{x['lr']:g} ({100 * x[key]:.1f}%)" for x in res["sweep"])
            line += f" (learning rates tried, {key.replace('_', ' ')}: {tried}; kept {res['lr']:g})"
        if r.student.gramian.heads:
            g = r.student.gramian
            line += (f"; {g.heads} Gramian heads with decorrelation {g.decorrelation} during training (seed 003), "
                     f"deployed with {'no extra head' if g.deploy == 'none' else 'one of them'}")
        return ReportSection(summary=[f"then {line}"],
                             scores=[Score(f"student_distilled_{m}", "student, distilled + finetuned",
                                           res.get("metrics", {}).get(f"test_{m}"), model="student", plot="distilled")])


@register_stage
class StudentBaseline(Stage):
    name = "student.baseline"
    inputs = ("data.prepare",)
    optional_inputs = ("student.select",)  # student.name: auto
    distributed = True

    def config(self, recipe) -> Dict[str, Any]:
        key = {"student": recipe.student.arch_dump(), "train": _train_key(self._cfg(recipe)),
               "seed": recipe.seed}
        if recipe.baseline.drop_path:  # only when set, so the builds stored before it stay valid
            key["drop_path"] = recipe.baseline.drop_path
        return key

    def skip_reason(self, recipe):
        return None if recipe.baseline.enabled else "baseline.enabled is false"

    @staticmethod
    def _cfg(recipe) -> FinetuneConfig:
        return recipe.baseline.train_config(recipe.finetune)

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r = ctx.recipe
        index = load_index(ctx.input("data.prepare"))
        n, task = len(index["classes"]), index.get("task", "classification")
        name = student_name(ctx)
        return _train_and_report(ctx, lambda: create_student(name, n, r.student.weights, task,
                                                                drop_path=r.baseline.drop_path),
                                 self._cfg(r), "student baseline", name)

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """The same student on the labels only: what the teacher is measured against."""
        m = metric_name(build.recipe.data.task)
        b = out.result.get("metrics", {}).get(f"test_{m}")
        # the same architecture, never exported: the plot draws it at the student's eager latency
        section = ReportSection(scores=[Score(f"student_baseline_{m}", "student, labels only", b, model="student",
                                              plot="label-only student", exported=False)])
        distilled = build.inputs.get(StudentFinetune.name)
        d = distilled.result.get("metrics", {}).get(f"test_{m}") if distilled is not None else None
        if b is not None and d is not None:
            verdict = "helped" if d > b else "did NOT help"
            section.findings.append(f"The teacher {verdict}: {percent(d)} vs {percent(b)} for the same student trained "
                                    f"on the labels only ({100 * (d - b):+.1f} points).")
        return section
