"""The detection student: the registered model's backbone under an FPN neck and an FCOS head at strides 8 / 16 / 32
(students/detection.py), distilled from the finetuned detection teacher (students/detection_distill.py).

Teacher and student must share the input size.  Why refuse rather than run the teacher at the student's size: the
teacher was finetuned at its own size, and which FPN level is responsible for an object depends on the object's
size in pixels (FCOS's size ranges), so at another size the teacher would give its targets from the levels it was
not trained to use for those objects (and a ViT teacher's position grid is fixed at its size).  Equal sizes make
the locations the same by construction; saying so costs the user one line.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.students.tasks.base import STUDENT_TASKS, DistillSetup, StudentTask


@STUDENT_TASKS.register("detection")
class DetectionStudent(StudentTask):
    name = "detection"
    result = {"task": "detection"}

    def check(self, recipe: Any) -> None:
        """The student's size fits its detector (every side a multiple of 32, of 64 for MobileViT-V2, whose last stage
        pads an odd grid and would move the stride-32 locations off the teacher's: ``student_detection_multiple``),
        for the named student or every candidate of ``name: auto``.  The multiple of 32 itself is checked when the
        recipe loads.  Then the distill options that go together, and the teacher's and the student's input sizes
        equal."""
        from vfm_toolchain.core.sizes import image_hw, nearest_sizes
        from vfm_toolchain.students.detection import student_detection_multiple
        from vfm_toolchain.students.models import DEFAULT_CANDIDATES

        s = recipe.student
        hw = image_hw(s.image_size)
        names = [s.name] if s.name != "auto" else (s.candidates or DEFAULT_CANDIDATES)
        need = {n: student_detection_multiple(n) for n in names}
        misfit = sorted((n for n, m in need.items() if any(side % m for side in hw)), key=names.index)
        if not misfit:
            _check_distill(recipe)
            return
        multiple = max(need[n] for n in misfit)
        spelled = str(hw[0]) if hw[0] == hw[1] else f"[{hw[0]}, {hw[1]}]"
        fix = f"nearest valid: student.image_size {nearest_sizes(hw, multiple)}"
        if s.name != "auto":
            raise ToolchainError(f"student.image_size {spelled} is not a multiple of {multiple} on each side, which "
                                 f"the detection form of {s.name} needs (MobileViT's last stage pads an odd grid, "
                                 f"which would move its stride-32 locations off the teacher's); {fix}")
        raise ToolchainError(f"student.image_size {spelled} is not a multiple of {multiple} on each side, which the "
                             f"detection form of {len(misfit)} of the student.name: auto candidates needs "
                             f"({', '.join(misfit)}: MobileViT's last stage pads an odd grid); {fix}, or list "
                             f"student.candidates without them")

    def create(self, name: str, num_classes: int, weights: str = "none", head_norm: str = "group") -> Any:
        from vfm_toolchain.students.detection import build_student_detector

        return build_student_detector(name, num_classes, weights, head_norm=head_norm)

    def spec(self, name: str, classes: Sequence[str], preprocess: Any,
             gramian: Optional[Dict[str, Any]] = None, head_norm: str = "group") -> Dict[str, Any]:
        from vfm_toolchain.students.detection import detection_student_spec

        return detection_student_spec(name, classes, preprocess, head_norm=head_norm)

    def head_only(self, model: Any) -> Any:
        """The neck and head train; the backbone stays as distillation left it."""
        from vfm_toolchain.students.finetune import DetectorHeadOnly

        return DetectorHeadOnly(model)

    # ---- student.distill

    def distill_setup(self, ctx: Any, name: str, index: Dict[str, Any], spp: Any) -> DistillSetup:
        """Task-oriented teaching (dense targets, pseudo boxes) and neck imitation both read the finetuned
        detection teacher (students/detection_distill.py says why)."""
        from vfm_toolchain.blocks.detection import Detector
        from vfm_toolchain.checkpoint import load_model
        from vfm_toolchain.students.detection_distill import (DenseDetection, NeckImitation, choose_pseudo_threshold,
                                                              flat_neck, neck_width)

        r, d = ctx.recipe, ctx.recipe.distill
        student = self.create(name, len(index["classes"]), r.student.weights, **r.student.form())
        teacher = load_model(ctx.input("teacher.finetune").path("model"))
        if not isinstance(teacher, Detector):
            raise ToolchainError(f"teacher.finetune's model is a {type(teacher).__name__}, not a detector; rebuild "
                                 f"teacher.finetune for data.task detection")
        tpp = teacher.backbone.preprocess
        if tuple(tpp.hw) != tuple(spp.hw):  # the recipe check says this first wherever it can read the size
            raise ToolchainError(_size_mismatch(tpp.hw, spp.hw))
        if teacher.strides != student.strides:
            raise ToolchainError(f"teacher strides {list(teacher.strides)} and student strides "
                                 f"{list(student.strides)} differ: the locations would not line up")
        for p in teacher.parameters():
            p.requires_grad_(False)
        if d.mode == "task_agnostic":
            loss = "cosine" if d.feature_loss == "auto" else d.feature_loss  # seed 004's choice for maps
            objective = NeckImitation(student, neck_width(teacher), spp.hw, loss=loss)
            return student, "detection_neck", objective, teacher, partial(flat_neck, teacher), tpp, {}
        extra: Dict[str, Any] = {"detection_targets": d.detection_targets}
        threshold = None
        if d.detection_targets != "dense":
            if d.pseudo_threshold is not None:
                choice = {"threshold": d.pseudo_threshold, "chosen_on": "distill.pseudo_threshold"}
            else:
                choice = choose_pseudo_threshold(teacher, index["val"], tpp)
            threshold = float(choice["threshold"])
            extra["pseudo_threshold"] = choice
            ctx.log.info("pseudo boxes: the teacher's detections scoring above %.2f (%s)", threshold,
                         choice["chosen_on"])
        objective = DenseDetection(student, spp.hw, d.detection_targets, threshold)
        return student, "detection_dense", objective, teacher, teacher.forward_dense, tpp, extra

    def distill_metrics(self, ctx: Any, student: Any, index: Dict[str, Any], spp: Any,
                        t_cache: Any) -> Dict[str, Any]:
        """COCO mAP50, mAP@[.5:.95] and per-class AP of the distilled detector on test and val at each image's own
        resolution (the teacher's keys); None after neck imitation, which leaves the head untrained."""
        from vfm_toolchain.training import detection_metrics

        if ctx.recipe.distill.mode != "task_oriented":
            return {"metrics": {f"{s}_{k}": None for s in ("test", "val") for k in ("map50", "map")}}
        metrics = detection_metrics(student, index, spp, index["classes"], splits=("test", "val"))
        ctx.log.info("after distillation: test mAP50 %.4f, mAP %.4f", metrics["test_map50"], metrics["test_map"])
        return {"metrics": metrics}

    def distill_how(self, d: Any, result: Dict[str, Any]) -> str:
        if d.mode == "task_agnostic":
            return ("task-agnostic distillation: the student's FPN maps regress the finetuned teacher's (neck "
                    "imitation)")
        dense = ("dense targets at every location (quality focal loss on class probabilities, GIoU and quality where "
                 "the teacher is confident)")
        choice = result.get("pseudo_threshold") or {}
        pseudo = (f"the teacher's boxes above {choice.get('threshold', d.pseudo_threshold)} as pseudo labels "
                  f"({choice.get('chosen_on', 'threshold chosen on val')})")
        what = {"dense": dense, "both": f"{dense} plus {pseudo}"}[d.detection_targets]
        return f"task-oriented distillation from the finetuned detector: {what}"

    def raw_output(self, model: Any) -> Callable:
        return model.forward_dense

    def qat_objective(self, recipe: Any, distill_result: Dict[str, Any], model: Any, image_hw: Any) -> Any:
        from vfm_toolchain.students.detection_distill import DenseDetection

        threshold = (distill_result.get("pseudo_threshold") or {}).get("threshold")
        return DenseDetection(model, image_hw, distill_result.get("detection_targets", "dense"), threshold)

    # ---- report and label-next

    def report(self, section: Any, key: str, title: str, result: Dict[str, Any], sheet: str) -> None:
        """mAP50 and mAP@[.5:.95] on val and test, the per-class APs, and the model's column of the sheet."""
        from vfm_toolchain.teachers.finetune import add_detection_report

        add_detection_report(section, key, f"{title} (detection)", result, sheet=sheet)

    def label_next_parts(self, teacher: Any, student: Any, uncertainty: str,
                         box_threshold: float) -> Tuple[Any, Any, Any]:
        """Over the teacher's boxes, the largest binary entropy of a box's score; 1 - F1 of the student's boxes
        matched to the teacher's; the class of the teacher's best box."""
        from vfm_toolchain.students.label_next import detection_parts

        return detection_parts(teacher, student, box_threshold)

    def classes_seen(self, teacher: Any, num_classes: int, box_threshold: float, min_share: float) -> Any:
        """The class of every box scoring at least ``box_threshold``."""
        import numpy as np

        seen = np.zeros((len(teacher), num_classes), dtype=bool)
        for row, t in zip(seen, teacher):
            row[t["labels"][t["scores"] >= box_threshold].numpy()] = True
        return seen


def _teacher_hw(recipe) -> Optional[Tuple[int, int]]:
    """The teacher's input (h, w): teacher.image_size, else its architecture's own size; None when its library
    does not say without building it (the stage checks the built teacher then)."""
    from vfm_toolchain.core.sizes import image_hw
    from vfm_toolchain.teachers.backbones import BACKBONES

    t = recipe.teacher
    if t.image_size is not None:
        return image_hw(t.image_size)
    try:
        geometry = BACKBONES.meta(t.name).get("geometry")
        return geometry(t.name.split(":", 1)[1], t.weights).default if geometry else None
    except Exception:  # an unknown name: the teacher's own check says so with the valid names
        return None


def _size_mismatch(teacher_hw, student_hw) -> str:
    th, tw = teacher_hw
    sh, sw = student_hw
    return (f"detection distillation needs the teacher and the student at one input size (the teacher at "
            f"{th}x{tw}, the student at {sh}x{sw}, h x w): the teacher's box targets are per location of its "
            f"stride-8/16/32 grid, which is the student's grid only at the same size. Set teacher.image_size to "
            f"student.image_size ({sh if sh == sw else [sh, sw]}). The teacher is not run at the student's size "
            f"instead: which FPN level finds an object depends on its size in pixels, so a teacher finetuned at "
            f"one size gives worse targets at another")


def _check_distill(recipe) -> None:
    """The distill options that go together for a detector, and one input size for teacher and student
    (task-oriented teaching and neck imitation read per-location outputs of both: the module docstring)."""
    from vfm_toolchain.core.sizes import image_hw

    d = recipe.distill
    if d.mode == "task_agnostic" and (d.detection_targets != "dense" or d.pseudo_threshold is not None):
        raise ToolchainError("distill.detection_targets / pseudo_threshold choose what the student learns from the "
                             "teacher's predictions (distill.mode task_oriented); task_agnostic imitates the "
                             "teacher's FPN maps: remove them (from the command line, over a recipe that sets them: "
                             "--set distill.detection_targets=dense --set distill.pseudo_threshold=null, their "
                             "defaults) or set distill.mode: task_oriented")
    if d.mode == "task_agnostic" and d.feature_loss == "contrastive":
        raise ToolchainError("distill.feature_loss contrastive compares one global vector per image; detection's "
                             "task-agnostic transfer regresses the teacher's FPN maps per location: use cosine, "
                             "smooth_l1 or auto (cosine)")
    if d.mode == "task_oriented" and d.detection_targets == "dense" and d.pseudo_threshold is not None:
        raise ToolchainError(f"distill.pseudo_threshold {d.pseudo_threshold} applies to pseudo boxes; "
                             f"distill.detection_targets is dense: set it to both, or remove "
                             f"pseudo_threshold")
    teacher_hw = _teacher_hw(recipe)
    student_hw = image_hw(recipe.student.image_size)
    if teacher_hw is not None and tuple(teacher_hw) != tuple(student_hw):
        raise ToolchainError(_size_mismatch(teacher_hw, student_hw))
