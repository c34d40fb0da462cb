"""``teacher.finetune``: teach the task to the foundation model with its adapter and a linear head, or,
for segmentation, at output stride 8 with a DeepLabV3 head (seed 004 A.1)."""
from __future__ import annotations

from typing import Any, Dict

from teachers.adapters import (PretrainContext, adapter_regularizer, init_adapter_from_features, needs_features,
                               pretrain_adapter)
from teachers.model import create_teacher, embed_features, init_zero_shot_head, teacher_spec
from toolchain.checkpoint import save_model
from toolchain.data import seeded
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.training import fit_classifier, miou, top1

__all__ = ["TeacherFinetune"]


@register_stage
class TeacherFinetune(Stage):
    name = "teacher.finetune"
    inputs = ("data.prepare",)
    distributed = True  # under torchrun every rank trains a slice of each batch (DDP); rank 0 saves

    def config(self, recipe) -> Dict[str, Any]:
        return {"teacher": recipe.teacher.model_dump(mode="json"), "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        t, seed = ctx.recipe.teacher, ctx.recipe.seed
        index = load_index(ctx.input("data.prepare"))
        classes = index["classes"]
        seeded(seed)
        if index.get("task") == "segmentation":
            return self._segmentation(ctx, index)
        model = create_teacher(t.name, t.weights, t.image_size, len(classes), t.adapter)
        pp = model.backbone.preprocess
        if needs_features(t.adapter):  # e.g. LLU keeps representatives of the training embeddings
            feats = embed_features(model, [p for p, _ in index["train"]], pp)
            init_adapter_from_features(model.backbone, t.adapter, feats)
        zero_shot = None
        if t.head_init == "zero_shot":
            init_zero_shot_head(model, classes, t.prompts)
            zero_shot = {"val_top1": top1(model, index["val"], pp), "test_top1": top1(model, index["test"], pp)}
            ctx.log.info("zero-shot head: val top-1 %.4f, test top-1 %.4f", zero_shot["val_top1"],
                         zero_shot["test_top1"])
        pretrain_adapter(model.backbone, t.adapter, PretrainContext(  # e.g. grappa's label-free phase
            [p for p, _ in index["train"]], index["pool"], pp, seed, t.batch_size, ctx.workdir, ctx.log))
        backbone_params = [p for p in model.backbone.parameters() if p.requires_grad]
        groups = [{"params": list(model.head.parameters()), "lr": t.head_lr or t.lr}]
        if backbone_params:
            groups.append({"params": backbone_params, "lr": t.lr})
        trainable = sum(p.numel() for g in groups for p in g["params"])
        total = sum(p.numel() for p in model.parameters())
        ctx.log.info("teacher %s (%s adapter): %.2fM of %.2fM parameters train, input %d px",
                     t.name, t.adapter.name, trainable / 1e6, total / 1e6, pp.size)
        history = fit_classifier(model, groups, index["train"], pp, t, ctx.workdir / "train_state.pt", ctx.log,
                                 seed, "teacher", val_items=index["val"],
                                 extra_loss=adapter_regularizer(model.backbone, t.adapter))
        if ctx.rank != 0:
            return {}
        spec = teacher_spec(t.name, t.image_size, len(classes), t.adapter, pp, classes, normalize=model.normalize)
        save_model(ctx.workdir / "model", model, spec)
        metrics = {"val_top1": top1(model, index["val"], pp), "test_top1": top1(model, index["test"], pp)}
        ctx.log.info("teacher: val top-1 %.4f, test top-1 %.4f", metrics["val_top1"], metrics["test_top1"])
        return {"model": "model", "metrics": metrics, "zero_shot": zero_shot, "history": history,
                "trainable_params": trainable,
                "params": total, "preprocess": pp.to_dict(), "adapter": t.adapter.name}

    def _segmentation(self, ctx: StageContext, index) -> Dict[str, Any]:
        from teachers.segmentation import create_segmentation_teacher, segmentation_teacher_spec

        t, seed, classes = ctx.recipe.teacher, ctx.recipe.seed, index["classes"]
        model = create_segmentation_teacher(t.name, t.weights, t.image_size, len(classes), t.adapter, t.output_stride)
        pp = model.backbone.preprocess
        backbone_params = [p for p in model.backbone.parameters() if p.requires_grad]
        groups = [{"params": list(model.head.parameters()), "lr": t.head_lr or t.lr}]
        if backbone_params:
            groups.append({"params": backbone_params, "lr": t.lr})
        history = fit_classifier(model, groups, index["train"], pp, t, ctx.workdir / "train_state.pt", ctx.log,
                                 seed, "teacher", val_items=index["val"], task="segmentation",
                                 num_classes=len(classes))
        if ctx.rank != 0:
            return {}
        save_model(ctx.workdir / "model", model, segmentation_teacher_spec(t.name, t.image_size, classes, t.adapter, pp,
                                                                       t.output_stride))
        metrics = {f"{split}_miou": miou(model, index[split], pp, len(classes)) for split in ("val", "test")}
        ctx.log.info("segmentation teacher: val mIoU %.4f, test mIoU %.4f", metrics["val_miou"], metrics["test_miou"])
        return {"model": "model", "metrics": metrics, "history": history, "task": "segmentation",
                "trainable_params": sum(p.numel() for g in groups for p in g["params"]),
                "params": sum(p.numel() for p in model.parameters()), "preprocess": pp.to_dict(),
                "adapter": t.adapter.name}
