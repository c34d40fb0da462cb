"""Students: MobileViT-V2 and FastViT from timm (registered by name), a few other mobile families (MobileNetV4,
RepViT, EfficientViT), and any timm model as ``timm:<name>``.

Classification students are timm models with a linear head on the final pooled features
(seed 004 A.1); segmentation students a DeepLabV3 head at output stride 8 (students/segmentation.py);
detection students the teacher's FPN neck and FCOS head at strides 8 / 16 / 32 (students/detection.py).  The spec saved beside the weights rebuilds the architecture without training code.
"""
from __future__ import annotations

from typing import Any, Dict

import timm
from torch import nn

from vfm_toolchain.checkpoint import MODEL_FAMILIES, load_matching, load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry, did_you_mean
from vfm_toolchain.data.images import ImageSize, Preprocess
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.tasks import LEGACY_TASK, task_of

__all__ = ["STUDENTS", "DEFAULT_CANDIDATES", "create_student", "student_spec"]

STUDENTS = Registry("student", prefix_sep=":")

_MOBILEVIT = ["mobilevitv2_050", "mobilevitv2_075", "mobilevitv2_100", "mobilevitv2_125", "mobilevitv2_150",
              "mobilevitv2_175", "mobilevitv2_200"]
_FASTVIT = ["fastvit_t8", "fastvit_t12", "fastvit_s12", "fastvit_sa12", "fastvit_sa24", "fastvit_sa36",
            "fastvit_ma36"]
# strong timm mobile families beside the two the seeds name, for latency-budgeted builds (bench/select.py)
_MOBILE = {"MobileNetV4": ["mobilenetv4_conv_small", "mobilenetv4_conv_medium", "mobilenetv4_hybrid_medium"],
           "RepViT": ["repvit_m0_9", "repvit_m1_1", "repvit_m1_5"],
           "EfficientViT": ["efficientvit_b0", "efficientvit_b1", "efficientvit_b2"]}


def _timm_arch(name: str) -> str:
    return name.split(":", 1)[1] if name.startswith("timm:") else name


def _register(name: str, family: str):
    STUDENTS.register(name, family=family, reparameterizable=family in ("FastViT", "RepViT"))(_timm_arch)


for _n in _MOBILEVIT:
    _register(_n, "MobileViT-V2")
for _n in _FASTVIT:
    _register(_n, "FastViT")
for _family, _names in _MOBILE.items():
    for _n in _names:
        _register(_n, _family)

# ``student.name: auto`` chooses among these unless ``student.candidates`` names others
DEFAULT_CANDIDATES = [*_MOBILEVIT, *_FASTVIT, *(n for names in _MOBILE.values() for n in names)]
STUDENTS.register("timm:", family="any timm model", reparameterizable=False)(_timm_arch)


def check_timm_name(name: str) -> str:
    arch = STUDENTS.get(name)(name)
    if arch.split(".")[0] not in timm.list_models():
        raise ToolchainError(f"unknown timm model '{arch}'.{did_you_mean(arch, timm.list_models())}")
    return arch


def create_student(name: str, num_classes: int, weights: str = "none", task: str = LEGACY_TASK,
                   **form: Any) -> nn.Module:
    """Build a student in the form of ``task`` (students/tasks/): a classifier, its segmentation form (output
    stride 8 + DeepLabV3 head), or its detection form (FPN neck + FCOS head at strides 8 / 16 / 32); a checkpoint
    in ``weights`` fills what it fits (the backbone, for the dense forms); ``form``: that form's options the recipe
    sets (``StudentConfig.form``).

    Raises:
        ToolchainError: unknown student or timm name, missing / unsafe checkpoint, offline 'pretrained'.
    """
    check_timm_name(name)
    return student_task(task).create(name, num_classes, weights, **form)


def create_classifier(name: str, num_classes: int, weights: str = "none") -> nn.Module:
    """A registered student as a classifier of ``num_classes``; a checkpoint fills all but its classifier."""
    arch = check_timm_name(name)
    try:
        model = timm.create_model(arch, pretrained=weights == "pretrained", num_classes=num_classes)
    except Exception as exc:
        raise ToolchainError(f"could not build student '{name}' with weights '{weights}': {exc}") from None
    if weights not in ("none", "pretrained"):
        state = {k: v for k, v in load_state_dict_safely(weights).items()
                 if not k.startswith(model.default_cfg.get("classifier", "head"))}
        missing, unexpected = load_matching(model, state, weights, f"student '{name}'")
        body_missing = [k for k in missing if not k.startswith(model.default_cfg.get("classifier", "head"))]
        if body_missing or unexpected:
            raise ToolchainError(f"checkpoint '{weights}' does not fit student '{name}': missing {body_missing[:4]}, "
                                 f"unexpected {unexpected[:4]}")
    return model


def student_spec(name: str, num_classes: int, preprocess: Preprocess, classes, gramian=None,
                 task: str = LEGACY_TASK) -> Dict[str, Any]:
    """``gramian``: the GramianConfig dict when the model carries Gramian heads (seed 003)."""
    return {"family": "student", "name": name, "num_classes": num_classes, "preprocess": preprocess.to_dict(),
            "classes": list(classes), "reparameterizable": STUDENTS.meta(name)["reparameterizable"],
            "gramian": gramian, "task": task}


def with_gramian_heads(model: nn.Module, num_classes: int, gramian: Dict[str, Any]) -> nn.Module:
    from vfm_toolchain.students.gramian import GramianStudent

    return GramianStudent(model, num_classes, gramian["heads"], gramian["dim"], gramian["deploy"])


def student_preprocess(image_size: ImageSize) -> Preprocess:
    return Preprocess(image_size)  # timm's ImageNet mean/std, bilinear


@MODEL_FAMILIES.register("student")
def build_student_from_spec(spec: Dict[str, Any]) -> nn.Module:
    model = create_student(spec["name"], spec["num_classes"], "none", task_of(spec).name)
    if (spec.get("gramian") or {}).get("heads"):
        model = with_gramian_heads(model, spec["num_classes"], spec["gramian"])
    model.preprocess = Preprocess.from_dict(spec["preprocess"])
    return model


def student_name(ctx) -> str:
    """The student this build trains: ``student.name``, or the one the ``student.select`` stage (bench/select.py,
    a stage of the bench floor: it exports and times candidates) chose for ``auto``."""
    name = ctx.recipe.student.name
    if name != "auto":
        return name
    return ctx.input("student.select").result["chosen"]
