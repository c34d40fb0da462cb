"""The classification teacher: the backbone with its adapter and a linear head (teachers/model.py)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

from vfm_toolchain.teachers.tasks.base import TEACHER_TASKS, TeacherTask


@TEACHER_TASKS.register("classification")
class ClassificationTeacher(TeacherTask):
    name = "classification"

    def create(self, teacher: Any, classes: Sequence[str]) -> Any:
        from vfm_toolchain.teachers.model import create_teacher

        return create_teacher(teacher.name, teacher.weights, teacher.image_size, len(classes), teacher.adapter)

    def spec(self, teacher: Any, classes: Sequence[str], preprocess: Any, model: Any) -> Dict[str, Any]:
        from vfm_toolchain.teachers.model import teacher_spec

        return teacher_spec(teacher.name, teacher.image_size, len(classes), teacher.adapter, preprocess, classes,
                            normalize=model.normalize)

    def before_training(self, ctx: Any, model: Any, index: Dict[str, Any], preprocess: Any) -> Dict[str, Any]:
        """An adapter that keeps representatives of the training embeddings (LLU) gets them; a zero-shot head
        starts from the text tower's class-name embeddings, and is scored before any training."""
        from vfm_toolchain.teachers.adapters import init_adapter_from_features, needs_features
        from vfm_toolchain.teachers.model import embed_features, init_zero_shot_head
        from vfm_toolchain.training import top1

        t = ctx.recipe.teacher
        if needs_features(t.adapter):
            feats = embed_features(model, [p for p, _ in index["train"]], preprocess)
            init_adapter_from_features(model.backbone, t.adapter, feats)
        zero_shot = None
        if t.head_init == "zero_shot":
            init_zero_shot_head(model, index["classes"], t.prompts)
            zero_shot = {"val_top1": top1(model, index["val"], preprocess),
                         "test_top1": top1(model, index["test"], preprocess)}
            ctx.log.info("zero-shot head: val top-1 %.4f, test top-1 %.4f", zero_shot["val_top1"],
                         zero_shot["test_top1"])
        return {"zero_shot": zero_shot}
