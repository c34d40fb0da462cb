"""``student.finetune`` (distilled student on the labels) and ``student.baseline`` (labels only).

Detection trains the student detector (students/detection.py) on the labeled boxes with its own loss
(``fit_detector``); its main metric is mAP50 (val picks the learning rate of a sweep), and mAP@[.5:.95] and the
per-class APs are recorded beside it."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import seeded
from vfm_toolchain.prepare import load_index
from vfm_toolchain.probe import linear_probe
from vfm_toolchain.recipe import FinetuneConfig
from vfm_toolchain.stage import (ReportContext, ReportSection, Score, Stage, StageContext, StageOutput,
                             metric_label, register_stage)
from vfm_toolchain.students.gramian import gramian_loss
from vfm_toolchain.students.models import create_student, student_preprocess, with_gramian_heads, student_name
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.tasks import task_of
from vfm_toolchain.teachers.curate import stored_val_overlap
from vfm_toolchain.training import evaluate, metric_name

__all__ = ["StudentFinetune", "StudentBaseline", "DetectorHeadOnly", "keep_best"]


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


class DetectorHeadOnly(nn.Module):
    """Trains a detector's neck and head on its frozen backbone (``finetune.head_only`` for detection): the
    backbone stays in eval mode (BatchNorm statistics included) and without gradients.  Passes on what
    ``fit_detector`` and the scoring call (``forward`` gives the per-level outputs)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_classes = model.num_classes
        for p in model.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor):
        return self.model.forward_levels(x)

    def forward_levels(self, x: torch.Tensor):
        return self.model.forward_levels(x)

    def loss(self, outputs, targets):
        return self.model.loss(outputs, targets)

    def decode(self, outputs, **kwargs):
        return self.model.decode(outputs, **kwargs)

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.backbone.eval()
        return self


def _train_and_report(ctx: StageContext, make_model: Callable[[], nn.Module], cfg: FinetuneConfig,
                      name: str, student: str, distilled: Optional[nn.Module] = None,
                      overlap: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Train ``student`` (its registered name) from ``make_model()`` once per learning rate (``cfg.lr_sweep`` or
    just ``cfg.lr``), keep the best on val, report every run.  With ``distilled`` (student.finetune) the distilled
    weights compete too (:func:`keep_best`; ``overlap``: the transfer set's distance to each val image)."""
    r = ctx.recipe
    index = load_index(ctx.input("data.prepare"))
    task, classes = task_of(index).name, index["classes"]
    n_classes = len(classes)
    metric = metric_name(task)
    pp = student_preprocess(r.student.image_size)
    lrs = cfg.lr_sweep or [cfg.lr]
    gramian = r.student.gramian.model_dump() if r.student.gramian.heads else None
    criterion = None
    if gramian and "gramian_heads" not in task_of(task).supports:
        raise ToolchainError(f"student.gramian heads are classifiers; set student.gramian.heads: 0 for {task}")
    if gramian:  # seed 003: extra heads and their decorrelation loss while training on labels
        ce = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        criterion = lambda out, y: gramian_loss(out, y, ce, gramian["decorrelation"])
    runs, best = [], None
    for lr in lrs:
        seeded(r.seed)
        model = make_model()
        if gramian:
            model = with_gramian_heads(model, n_classes, gramian)
        trained = student_task(task).head_only(model) if cfg.head_only else model
        params = [p for p in trained.parameters() if p.requires_grad]
        tag = f"lr_{lr:g}" if len(lrs) > 1 else ""
        state = ctx.workdir / tag / "train_state.pt" if tag else ctx.workdir / "train_state.pt"
        run_cfg, run_name = cfg.model_copy(update={"lr": lr}), f"{name} {tag}".strip()
        history = task_of(task).fit(trained, [{"params": params, "lr": lr}], index, pp, run_cfg, state, ctx.log,
                                    r.seed, run_name, criterion=criterion)
        run = {"lr": lr, f"val_{metric}": evaluate(model, index["val"], pp, task, n_classes, classes),
               "history": history}
        runs.append(run)
        if best is None or run[f"val_{metric}"] > best[0][f"val_{metric}"]:
            best = (run, model)
    if ctx.rank != 0:
        return {}
    run, model = best
    choice = None
    if distilled is not None:
        choice = keep_best(cfg, run[f"val_{metric}"], overlap,
                           lambda: evaluate(distilled, index["val"], pp, task, n_classes, classes), metric)
        (ctx.log.warning if choice["shipped"] == "distilled" or choice.get("warning") else ctx.log.info)(
            "%s: ships the %s weights: %s", name, choice["shipped"], choice["reason"])
        # the other candidate's test score, beside the shipped one's, so a reader sees what the rule did (test
        # never decides)
        other = model if choice["shipped"] == "distilled" else distilled
        choice[f"other_test_{metric}"] = evaluate(other, index["test"], pp, task, n_classes, classes)
        if choice["shipped"] == "distilled":
            model, gramian = distilled, None  # distillation trained no Gramian heads
    save_model(ctx.workdir / "model", model, student_task(task).spec(student, classes, pp, gramian,
                                                                     **ctx.recipe.student.form()))
    # the run kept, scored once more on val and test (detection: mAP and the per-class APs beside its mAP50)
    metrics = task_of(task).scores(model, index, pp)
    ctx.log.info("%s: %s, %s", name, "distilled weights shipped" if model is distilled else f"lr {run['lr']:g}",
                 task_of(task).describe(metrics))
    return {"model": "model", "metrics": metrics, "history": run["history"], "lr": run["lr"],
            "head_only": cfg.head_only, **student_task(task).result,
            "sweep": [{"lr": x["lr"], f"val_{metric}": x[f"val_{metric}"]} for x in runs] if len(lrs) > 1 else None,
            "params": sum(p.numel() for p in model.parameters()), **({"choice": choice} if choice else {})}


def keep_best(cfg: FinetuneConfig, finetuned_val: float, overlap: Optional[Dict[str, Any]],
              distilled_val: Callable[[], float], metric: str) -> Dict[str, Any]:
    """Which weights student.finetune ships: the finetuned ones unless the distilled ones score at least as well
    on val, and val may judge only when it is independent of what the student was distilled on.

    Finetuning on a few labels can undo what distillation taught (a quickstart lost val 76.7% -> 71.7%), so the
    distilled weights are a candidate like every learning rate of a sweep.  But a val set whose images the
    transfer set nearly contains (video frames beside the val frames) favours the distilled weights for having
    seen it: when more than ``cfg.val_overlap_max`` of the val images have a transfer image within
    ``cfg.val_overlap_distance``, the finetuned weights ship and the choice says why.  Returns the record kept in
    the stage result: ``shipped`` (distilled | finetuned), ``reason``, the val scores compared, ``warning``
    when val could not judge."""
    name = metric_label(metric)
    fmt = lambda v: f"{100 * v:.2f}%" if metric != "miou" else f"{100 * v:.2f}"
    if not cfg.keep_best:
        return {"shipped": "finetuned", "reason": "finetune.keep_best is false"}
    record: Dict[str, Any] = {"val_finetuned": finetuned_val}
    if overlap is not None and overlap["nearest"]:
        near = sum(d <= cfg.val_overlap_distance for d in overlap["nearest"])
        share = near / len(overlap["nearest"])
        record["val_overlap"] = {"distance": cfg.val_overlap_distance, "val_images_near": near,
                                 "val_images": len(overlap["nearest"]), "share": round(share, 4),
                                 "max_share": cfg.val_overlap_max}
        if share > cfg.val_overlap_max:
            return {**record, "shipped": "finetuned", "warning": True,
                    "reason": f"val is not independent of the transfer set: {near} of {len(overlap['nearest'])} "
                              f"val images have a transfer image within {cfg.val_overlap_distance:g} "
                              f"(val_overlap.csv), more than finetune.val_overlap_max {cfg.val_overlap_max:g}, so val "
                              f"does not choose between distilled and finetuned weights; hold out val images from "
                              f"another source (another video, another day) to let it"}
    elif overlap is None:
        record["val_overlap"] = None  # not measured (the curate stage kept no val embeddings): val judges
    if finetuned_val != finetuned_val:  # NaN: no val split
        return {**record, "shipped": "finetuned", "reason": "no val images to judge by"}
    record["val_distilled"] = d = distilled_val()
    if finetuned_val > d:
        return {**record, "shipped": "finetuned",
                "reason": f"val {name} {fmt(finetuned_val)} after finetuning against {fmt(d)} distilled"}
    return {**record, "shipped": "distilled",
            "reason": f"finetuning did not beat the distilled weights on val ({name} {fmt(finetuned_val)} against "
                      f"{fmt(d)} distilled)"}


# which weights student.finetune ships: in its own key, never in the baseline's (which has no distilled weights)
KEEP_BEST_FIELDS = ("keep_best", "val_overlap_distance", "val_overlap_max")


def _train_key(cfg: FinetuneConfig) -> Dict[str, Any]:
    """The training settings as part of a stage key.  A setting added after builds were stored is left out at
    its default (which trains as before it existed), so those builds stay valid."""
    key = cfg.model_dump(mode="json", exclude=set(KEEP_BEST_FIELDS))
    if not key["mix_off_epochs"]:
        del key["mix_off_epochs"]
    return key


@register_stage
class StudentFinetune(Stage):
    name = "student.finetune"
    version = "3"  # keep_best: the distilled weights ship when finetuning does not beat them on an independent val
    inputs = ("data.prepare", "student.distill")
    optional_inputs = ("teacher.curate",)  # how close the transfer set came to val (keep_best)
    distributed = True

    def config(self, recipe) -> Dict[str, Any]:
        f = recipe.finetune
        return {"finetune": _train_key(f), "seed": recipe.seed,
                "gramian": recipe.student.gramian.model_dump(mode="json"),
                "keep_best": {k: getattr(f, k) for k in KEEP_BEST_FIELDS}}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        distilled = ctx.input("student.distill")
        cfg, start = ctx.recipe.finetune, load_model(distilled.path("model"))
        index = load_index(ctx.input("data.prepare"))
        task = task_of(index).name
        probeable = "linear_probe" in task_of(task).supports
        probe = cfg.head_start == "probe" or (cfg.head_start == "auto" and probeable
                                                and distilled.result.get("mode") == "task_agnostic")
        probe_result = None
        if probe:
            if not probeable:
                raise ToolchainError(f"finetune.head_start 'probe' fits a linear classifier; for {task} use "
                                     f"'keep' or 'auto'")
            probe_result = linear_probe(start, index["train"], index["val"],
                                        student_preprocess(ctx.recipe.student.image_size), len(index["classes"]),
                                        ctx.log)
        name = json.loads((distilled.path("model") / "spec.json").read_text())["name"]
        curate = ctx.inputs.get("teacher.curate")
        overlap = (stored_val_overlap(curate, ctx.input("data.prepare"), ctx.workdir)
                   if curate is not None and cfg.keep_best and ctx.rank == 0 else None)
        result = _train_and_report(ctx, lambda: copy.deepcopy(start), cfg, "student finetune", name,
                                   distilled=start, overlap=overlap)
        return {**result, "head_start": "probe" if probe else "distilled", "probe": probe_result} if result else result

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """How the distilled student learnt the labels (the learning rates tried, Gramian heads); its score is the
        one the exported student has."""
        r, f, res = build.recipe, build.recipe.finetune, out.result
        task = task_of(r)
        m = task.metric
        line = f"{f.epochs} epochs of {'head-only' if f.head_only else 'full'} finetuning on the labels"
        if res.get("sweep"):
            tried = ", ".join(f"{x['lr']:g} ({task.score_text(x[f'val_{m}'])})" for x in res["sweep"])
            line += f" (learning rates tried, val {task.metric_label}: {tried}; kept {res['lr']:g})"
        if r.student.gramian.heads:
            g = r.student.gramian
            line += (f"; {g.heads} Gramian heads with decorrelation {g.decorrelation} during training (seed 003), "
                     f"deployed with {'no extra head' if g.deploy == 'none' else 'one of them'}")
        choice = res.get("choice")
        shipped = (choice or {}).get("shipped", "finetuned")
        if choice:
            line += f"; shipped the {shipped} weights: {choice['reason']}"
        label = ("student, distilled (finetuning did not beat it on val)" if shipped == "distilled"
                 else "student, distilled + finetuned")
        section = ReportSection(summary=[f"then {line}"],
                                scores=[Score(f"student_distilled_{m}", label,
                                              res.get("metrics", {}).get(f"test_{m}"), model="student",
                                              plot="distilled")])
        if choice and choice.get("warning"):
            section.warnings.append(f"student.finetune: {choice['reason']}")
        student_task(r.data.task).report(section, "student_distilled", "Student, distilled + finetuned", res,
                                         "distilled student")
        return section


@register_stage
class StudentBaseline(Stage):
    name = "student.baseline"
    inputs = ("data.prepare",)
    optional_inputs = ("student.select",)  # student.name: auto
    distributed = True

    def config(self, recipe) -> Dict[str, Any]:
        return {"student": recipe.student.arch_dump(), "train": _train_key(self._cfg(recipe)), "seed": recipe.seed}

    def skip_reason(self, recipe):
        return None if recipe.baseline.enabled else "baseline.enabled is false"

    @staticmethod
    def _cfg(recipe) -> FinetuneConfig:
        return recipe.baseline.train_config(recipe.finetune)

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r = ctx.recipe
        index = load_index(ctx.input("data.prepare"))
        n, task = len(index["classes"]), task_of(index).name
        name = student_name(ctx)
        return _train_and_report(ctx, lambda: create_student(name, n, r.student.weights, task, **r.student.form()),
                                 self._cfg(r), "student baseline", name)

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """The same student on the labels only: what the teacher is measured against."""
        task = task_of(build.recipe)
        m = task.metric
        b = out.result.get("metrics", {}).get(f"test_{m}")
        # the same architecture, never exported: the plot draws it at the student's eager latency
        section = ReportSection(scores=[Score(f"student_baseline_{m}", "student, labels only", b, model="student",
                                              plot="label-only student", exported=False)])
        distilled = build.inputs.get(StudentFinetune.name)
        d = distilled.result.get("metrics", {}).get(f"test_{m}") if distilled is not None else None
        student_task(task.name).report(section, "student_baseline", "Student, labels only", out.result,
                                       "label-only student")
        if b is not None and d is not None and b == b and d == d:
            section.findings.append(f"The teacher {'helped' if d > b else 'did NOT help'}: test {task.metric_label} "
                                    f"{task.score_text(d)} vs {task.score_text(b)} for the same student trained on "
                                    f"the labels only ({100 * (d - b):+.1f} points).")
        return section
