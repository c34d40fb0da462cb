"""``teacher.finetune``: teach the task to the foundation model with its adapter and a linear head, or,
for segmentation, at output stride 8 with a DeepLabV3 head (seed 004 A.1), or, for detection, under an FPN
neck and an FCOS head at strides 8 / 16 / 32 (teachers/detection.py).

``teacher.lp_ft`` trains in two steps (Kumar et al., 2022): the head first on the frozen backbone, then head
and adapter together from that head (for detection the "head" is everything new on the backbone: the neck,
the FCOS head and, for a ViT, its feature pyramid).  A random head's first gradients through the backbone distort the
pretrained features; a fitted one does not.  With a few hundred labels either the probe or the finetuned
model can win, so both are scored on val and the better one is the teacher (the result says which)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from vfm_toolchain.checkpoint import save_model
from vfm_toolchain.data.images import seeded, size_text
from vfm_toolchain.prepare import load_index, sample_paths
from vfm_toolchain.probe import linear_probe
from vfm_toolchain.stage import ReportContext, ReportSection, Score, Stage, StageContext, StageOutput, register_stage
from vfm_toolchain.tasks import task_of
from vfm_toolchain.teachers.adapters import PretrainContext, adapter_regularizer, pretrain_adapter
from vfm_toolchain.teachers.tasks import teacher_task
from vfm_toolchain.training import evaluate, metric_name

__all__ = ["TeacherFinetune", "add_detection_report", "ap_points", "teacher_metrics"]


@register_stage
class TeacherFinetune(Stage):
    name = "teacher.finetune"
    inputs = ("data.prepare",)
    distributed = True  # under torchrun every rank trains a slice of each batch (DDP); rank 0 saves

    def config(self, recipe) -> Dict[str, Any]:
        return {"teacher": recipe.teacher.model_dump(mode="json"), "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        """The task's teacher (teachers/tasks/), trained on the labels at the recipe's seed."""
        t, seed = ctx.recipe.teacher, ctx.recipe.seed
        index = load_index(ctx.input("data.prepare"))
        classes = index["classes"]
        seeded(seed)
        part = teacher_task(task_of(index).name)
        model = part.create(t, classes)
        pp = model.backbone.preprocess
        extra = part.before_training(ctx, model, index, pp)
        extra_loss = None
        if part.adapter_phases:
            trainable, total = _pretrain_and_describe(ctx, model, sample_paths(index["train"]), index["pool"], pp,
                                                      part.what)
            extra_loss = adapter_regularizer(model.backbone, t.adapter)
        else:
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
        history, lp_ft = train_teacher(ctx, model, index, pp, extra_loss=extra_loss)
        if ctx.rank != 0:
            return {}
        save_model(ctx.workdir / "model", model, part.spec(t, classes, pp, model))
        metrics = teacher_metrics(model, index, pp)
        ctx.log.info("%s: %s", part.what, task_of(index).describe(metrics))
        return {"model": "model", "metrics": metrics, **extra, "history": history, **part.result, "lp_ft": lp_ft,
                "trainable_params": trainable, "params": total, "preprocess": pp.to_dict(),
                "adapter": t.adapter.name}

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        t, r = build.recipe.teacher, out.result
        m = metric_name(build.recipe.data.task)
        summary = [f"teacher `{t.name}` (adapter `{t.adapter.name}`, weights `{t.weights}`)"]
        section = ReportSection(
            summary=summary,
            scores=[Score(f"teacher_{m}", "teacher (finetuned)", r.get("metrics", {}).get(f"test_{m}"),
                          model="teacher", plot="teacher")],
            record={"teacher": {k: r.get(k) for k in ("adapter", "trainable_params", "params")}})
        teacher_task(build.recipe.data.task).report(section, r)
        return section


def teacher_metrics(model, index, pp) -> Dict[str, Any]:
    """A teacher's val and test scores in its task's metric (detection: mAP50, mAP and per-class AP)."""
    return task_of(index).scores(model, index, pp)


def ap_points(v: Optional[float]) -> str:
    """An AP in [0, 1] as detection papers write it (points, 0-100), or n/a."""
    return "n/a" if v is None or v != v else f"{100 * v:.1f}"


def add_detection_report(section: ReportSection, model: str, title: str, result: Dict[str, Any],
                         sheet: str = "") -> None:
    """What a detection stage adds to the report besides its mAP50 row: its own section with mAP50 and
    mAP@[.5:.95] on val and test and the test AP of each class, ``<model>_map`` among build.json's metrics and
    the per-class APs under build.json's ``per_class_ap.<model>``; with ``sheet``, its saved detector as that
    column of the report's sheet of test images."""
    m = result.get("metrics", {})
    if sheet and result.get("model"):
        section.sheet[sheet] = result["model"]
    section.title = title
    section.lines += ["| split | mAP50 | mAP@[.5:.95] |", "|---|---|---|",
                      *(f"| {split} | {ap_points(m.get(f'{split}_map50'))} | {ap_points(m.get(f'{split}_map'))} |"
                        for split in ("val", "test"))]
    per_class = m.get("test_per_class_ap") or {}
    if per_class:
        section.lines += ["", "Test AP@[.5:.95] per class (n/a: no box of the class in the test set): " +
                          ", ".join(f"{name} {ap_points(ap)}" for name, ap in per_class.items())]
    section.record.setdefault("metrics", {})[f"{model}_map"] = m.get("test_map")
    section.record.setdefault("per_class_ap", {})[model] = per_class


def _pretrain_and_describe(ctx: StageContext, model, train_paths, pool, pp, what: str):
    """An adapter's label-free phase where it has one (grappa), then the size of what trains, said once;
    returns (trainable, total) parameter counts."""
    t = ctx.recipe.teacher
    pretrain_adapter(model.backbone, t.adapter, PretrainContext(train_paths, pool, pp, ctx.recipe.seed, t.batch_size,
                                                                ctx.workdir, ctx.log))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    ctx.log.info("%s %s (%s adapter): %.2fM of %.2fM parameters train, input %s",
                 what, t.name, t.adapter.name, trainable / 1e6, total / 1e6, size_text(pp.size))
    return trainable, total


def _groups(model, head_lr: float, lr: float) -> List[Dict[str, Any]]:
    """The new parts (a classifier's head; a detector's neck, head and feature pyramid) at ``head_lr``, the
    backbone's trainable parameters (its adapter) at ``lr``."""
    new = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    backbone = [p for p in model.backbone.parameters() if p.requires_grad]
    return [{"params": new, "lr": head_lr}] + ([{"params": backbone, "lr": lr}] if backbone else [])


def _trainer(index, pp, ctx: StageContext) -> Callable[..., List[Dict]]:
    """``train(model, groups, cfg, state_file, name, extra_loss=None)``: the task's training on the labels, with
    its val metric at fit_classifier's cadence."""
    task = task_of(index)
    return lambda model, groups, cfg, state, name, extra_loss=None: task.fit(
        model, groups, index, pp, cfg, ctx.workdir / state, ctx.log, ctx.recipe.seed, name, extra_loss=extra_loss)


def train_teacher(ctx: StageContext, model, index, pp, extra_loss=None) -> Tuple[List[Dict], Optional[Dict]]:
    """Train head and adapter on the labels, directly or as LP-FT (module docstring); returns the history and,
    for LP-FT, what the probe and the finetuned model scored on val and which was kept."""
    t = ctx.recipe.teacher
    task = task_of(index).name
    classes = index["classes"]
    n = len(classes)
    train = _trainer(index, pp, ctx)
    if not t.lp_ft:
        return train(model, _groups(model, t.head_lr or t.lr, t.lr), t, "train_state.pt", "teacher",
                     extra_loss), None
    m = metric_name(task)
    if "linear_probe" in task_of(task).supports:  # a logistic regression on the frozen features, L2 chosen on val
        probe = linear_probe(model, index["train"], index["val"], pp, n, ctx.log)
    else:  # a DeepLabV3 head, or a detector's neck and head, is not linear: train it alone on the frozen backbone
        frozen = [p for p in model.backbone.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        train(model, _groups(model, t.head_lr or t.lr, t.lr), t.model_copy(update={"epochs": t.probe_epochs}),
              "probe_state.pt", "teacher probe")  # the head alone now
        for p in frozen:
            p.requires_grad_(True)
        probe = {"epochs": t.probe_epochs}
    probe_val = evaluate(model, index["val"], pp, task, n, classes)
    probe_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ctx.log.info("LP-FT: probe val %s %.4f; now head and adapter from it at lr %g", m, probe_val, t.lr)
    # the head is already fitted: it moves at the backbone's rate, not head_lr (a large step would undo it)
    history = train(model, _groups(model, t.lr, t.lr), t, "train_state.pt", "teacher", extra_loss)
    finetuned_val = evaluate(model, index["val"], pp, task, n, classes)
    kept = "finetuned" if finetuned_val >= probe_val else "probe"
    if kept == "probe":
        model.load_state_dict(probe_state)
    ctx.log.info("LP-FT: val %s probe %.4f, finetuned %.4f: the %s is the teacher", m, probe_val, finetuned_val, kept)
    return history, {"probe": probe, f"probe_val_{m}": probe_val, f"finetuned_val_{m}": finetuned_val, "kept": kept}
