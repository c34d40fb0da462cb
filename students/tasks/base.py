"""The contract of a task's student part (see the package docstring)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from vfm_toolchain.core.registry import Registry
from vfm_toolchain.tasks.base import task_part

__all__ = ["STUDENT_TASKS", "StudentTask", "DistillSetup", "student_task"]

STUDENT_TASKS = Registry("student task")

# What student.distill trains and learns from: (student, objective name, objective around the student, teacher
# module, function images -> raw teacher output, teacher preprocessing, entries for the stage's result)
DistillSetup = Tuple[Any, str, Any, Any, Callable, Any, Dict[str, Any]]


class StudentTask:
    """How a task's student is built, distilled, saved, reported and ranked (students/models.py create_student,
    the distill, finetune and label-next code, export's quantization-aware training)."""

    name: str = ""
    result: Dict[str, Any] = {}  # entries student.finetune's and student.baseline's results always carry

    def check(self, recipe: Any) -> None:
        """The task's rules on its student and its distillation that only the model knows (before the first
        stage)."""

    def create(self, name: str, num_classes: int, weights: str = "none", **form: Any) -> Any:
        """The registered student ``name`` in the task's form, from ``weights`` ('none', 'pretrained' or a local
        checkpoint of the classification model); ``form``: the options of that form the task owns
        (``StudentConfig.form``: detection's ``head_norm``)."""
        raise NotImplementedError

    def spec(self, name: str, classes: Sequence[str], preprocess: Any,
             gramian: Optional[Dict[str, Any]] = None, **form: Any) -> Dict[str, Any]:
        """What is saved beside the weights (toolchain/checkpoint.py rebuilds the model from it): by default the
        ``student`` family's spec, which names the task (classification, segmentation)."""
        from vfm_toolchain.students.models import student_spec

        return student_spec(name, len(classes), preprocess, classes, gramian, self.name)

    def head_only(self, model: Any) -> Any:
        """``model`` with only its head trainable (``finetune.head_only``)."""
        from vfm_toolchain.students.finetune import HeadOnly

        return HeadOnly(model)

    # ---- student.distill (students/distill.py)

    # the objective that matches the finetuned teacher's predictions (students/objectives.py)
    task_objective: str = "task_oriented"

    def distill_setup(self, ctx: Any, name: str, index: Dict[str, Any], spp: Any) -> DistillSetup:
        """The student, the objective and the teacher of ``distill.mode``: task-oriented reads the finetuned
        teacher's predictions, task-agnostic the frozen pretrained VFM's features (seed 004 Fig. 1b, 1d)."""
        from vfm_toolchain.students.distill import feature_teacher, finetuned_teacher
        from vfm_toolchain.students.models import create_student
        from vfm_toolchain.students.objectives import OBJECTIVES, student_map_size

        r, d = ctx.recipe, ctx.recipe.distill
        student = create_student(name, len(index["classes"]), r.student.weights, self.name, **r.student.form())
        if d.mode == "task_oriented":
            objective_name, (teacher, fn, tpp) = self.task_objective, finetuned_teacher(ctx)
        else:
            objective_name, teacher, fn, tpp = feature_teacher(r)
        projection = d.projection
        objective = OBJECTIVES.get(objective_name)(
            student, temperature=d.temperature, teacher_dim=getattr(teacher, "out_dim", None),
            projection_dim=d.projection_dim,
            teacher_projection=(not r.teacher.name.startswith("open_clip:")) if projection == "auto"
            else projection == "both",
            student_map=student_map_size(student, spp.hw), negatives=d.negatives, loss=d.feature_objective()[1])
        return student, objective_name, objective, teacher, fn, tpp, {}

    def distill_metrics(self, ctx: Any, student: Any, index: Dict[str, Any], spp: Any,
                        t_cache: Any) -> Dict[str, Any]:
        """What the distilled student scores (a task-oriented head was trained, so it can be evaluated; after
        feature matching the head is student.finetune's, and the scores are None), and what the cache says."""
        from vfm_toolchain.tasks import task_of

        task = task_of(self.name)
        if ctx.recipe.distill.mode != "task_oriented":
            return {"metrics": {f"test_{task.metric}": None, f"val_{task.metric}": None}}
        metrics = task.scores(student, index, spp, ("test", "val"))
        ctx.log.info("after distillation: %s", task.describe(metrics, ("test",)))
        return {"metrics": metrics}

    def distill_how(self, d: Any, result: Dict[str, Any]) -> str:
        """The report's words for how the student was distilled."""
        if d.mode == "task_oriented":
            return f"task-oriented distillation from the finetuned teacher (KL, T={d.temperature})"
        if d.features == "global":
            return "task-agnostic distillation from the frozen pretrained teacher (global features, contrastive)"
        return "task-agnostic distillation from the frozen pretrained teacher (patch features, cosine)"

    def raw_output(self, model: Any) -> Callable:
        """The model's output in the form the teacher's was cached (export's quantization-aware training against
        the fp32 student)."""
        return model

    def qat_objective(self, recipe: Any, distill_result: Dict[str, Any], model: Any, image_hw: Any) -> Any:
        """The loss the student was distilled with, around ``model``: it reads the same cached teacher rows
        (students/qat.py)."""
        from vfm_toolchain.students.objectives import OBJECTIVES

        return OBJECTIVES.get(self.task_objective)(model, temperature=recipe.distill.temperature)

    # ---- the report (student.distill, student.finetune, student.baseline)

    def report(self, section: Any, key: str, title: str, result: Dict[str, Any], sheet: str) -> None:
        """What the task adds to a student stage's report section besides its main score's row (``key``: the
        model's name among build.json's metrics)."""

    # ---- label-next (students/label_next.py): the parts of an image's score

    def label_next_parts(self, teacher: Any, student: Any, uncertainty: str,
                         box_threshold: float) -> Tuple[Any, Any, Any]:
        """Per image of a batch of the teacher's and the student's pool predictions (toolchain/tasks' ``predict``):
        uncertainty and disagreement in [0, 1], and the predicted class (-1: none)."""
        raise NotImplementedError

    def classes_seen(self, teacher: Any, num_classes: int, box_threshold: float, min_share: float) -> Any:
        """[B, C] bool: the classes the teacher sees in each image of a batch of its predictions (one measure for
        the pool and the labeled images: label-next balances its choice over them)."""
        raise NotImplementedError


def student_task(name: str) -> StudentTask:
    """The student part of task ``name`` (toolchain/tasks/base.py ``task_part``)."""
    return task_part(STUDENT_TASKS, name, "student", "students/tasks/")
