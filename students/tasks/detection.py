"""The detection student: the registered model's backbone under an FPN neck and an FCOS head at strides 8 / 16 / 32
(students/detection.py)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from vfm_toolchain.students.tasks.base import STUDENT_TASKS, StudentTask


@STUDENT_TASKS.register("detection")
class DetectionStudent(StudentTask):
    name = "detection"

    def check(self, recipe: Any) -> None:
        """The student's input size fits its detector (every side a multiple of 32, of 64 for MobileViT-V2, whose
        last stage pads an odd grid and would move the stride-32 locations off the teacher's:
        ``student_detection_multiple``), for the named student or every candidate of ``name: auto``.  The multiple
        of 32 itself is checked when the recipe loads."""
        from vfm_toolchain.errors import ToolchainError
        from vfm_toolchain.sizes import image_hw, nearest_sizes
        from vfm_toolchain.students.detection import student_detection_multiple
        from vfm_toolchain.students.models import DEFAULT_CANDIDATES

        s = recipe.student
        hw = image_hw(s.image_size)
        names = [s.name] if s.name != "auto" else (s.candidates or DEFAULT_CANDIDATES)
        need = {n: student_detection_multiple(n) for n in names}
        misfit = sorted((n for n, m in need.items() if any(side % m for side in hw)), key=names.index)
        if not misfit:
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

    def create(self, name: str, num_classes: int, weights: str = "none") -> Any:
        from vfm_toolchain.students.detection import build_student_detector

        return build_student_detector(name, num_classes, weights)

    def spec(self, name: str, classes: Sequence[str], preprocess: Any,
             gramian: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        from vfm_toolchain.students.detection import detection_student_spec

        return detection_student_spec(name, classes, preprocess)

    def head_only(self, model: Any) -> Any:
        """The neck and head train; the backbone stays as distillation left it."""
        from vfm_toolchain.students.finetune import DetectorHeadOnly

        return DetectorHeadOnly(model)
