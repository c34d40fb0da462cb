"""``student.finetune`` (distilled student on the labels) and ``student.baseline`` (labels only)."""
from __future__ import annotations

import json
from typing import Any, Dict

from students.models import create_student, student_preprocess, student_spec
from toolchain.checkpoint import load_model, save_model
from toolchain.data import seeded
from toolchain.recipe import TrainConfig
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.training import fit_classifier, top1

__all__ = ["StudentFinetune", "StudentBaseline"]


def _train_and_report(ctx: StageContext, model, cfg: TrainConfig, name: str) -> Dict[str, Any]:
    r = ctx.recipe
    index = load_index(ctx.input("data.prepare"))
    pp = student_preprocess(r.student.image_size)
    history = fit_classifier(model, [{"params": list(model.parameters()), "lr": cfg.lr}], index["train"], pp, cfg,
                             ctx.workdir / "train_state.pt", ctx.log, r.seed, name, val_items=index["val"])
    save_model(ctx.workdir / "model", model, student_spec(r.student.name, len(index["classes"]), pp,
                                                           index["classes"]))
    metrics = {"val_top1": top1(model, index["val"], pp), "test_top1": top1(model, index["test"], pp)}
    ctx.log.info("%s: val top-1 %.4f, test top-1 %.4f", name, metrics["val_top1"], metrics["test_top1"])
    return {"model": "model", "metrics": metrics, "history": history,
            "params": sum(p.numel() for p in model.parameters())}


@register_stage
class StudentFinetune(Stage):
    name = "student.finetune"
    inputs = ("data.prepare", "student.distill")

    def config(self, recipe) -> Dict[str, Any]:
        return {"finetune": recipe.finetune.model_dump(mode="json"), "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        seeded(ctx.recipe.seed)
        model = load_model(ctx.input("student.distill").path("model"))
        return _train_and_report(ctx, model, ctx.recipe.finetune, "student finetune")


@register_stage
class StudentBaseline(Stage):
    name = "student.baseline"
    inputs = ("data.prepare",)

    def config(self, recipe) -> Dict[str, Any]:
        return {"student": recipe.student.model_dump(mode="json"), "train": self._cfg(recipe).model_dump(mode="json"),
                "seed": recipe.seed}

    def skip_reason(self, recipe):
        return None if recipe.baseline.enabled else "baseline.enabled is false"

    @staticmethod
    def _cfg(recipe) -> TrainConfig:
        b, f = recipe.baseline, recipe.finetune
        return f.model_copy(update={"epochs": b.epochs if b.epochs is not None else f.epochs,
                                    "lr": b.lr if b.lr is not None else f.lr})

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r = ctx.recipe
        seeded(r.seed)
        index = load_index(ctx.input("data.prepare"))
        model = create_student(r.student.name, len(index["classes"]), r.student.weights)
        return _train_and_report(ctx, model, self._cfg(r), "student baseline")
