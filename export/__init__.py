"""Export: one file per format, the parity gate and the ``export.convert`` stage (the fold passes it runs first are
the students' floor's, students/fold.py, which quantization-aware training shares)."""
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.export import formats, convert, doctor_checks  # noqa: F401  (register)
from vfm_toolchain.export.formats import FORMATS
from vfm_toolchain.stage import register_recipe_check
from vfm_toolchain.students.qat import QAT_MODEL
from vfm_toolchain.tasks import task_of

__all__ = ["FORMATS"]


@register_recipe_check
def _check_formats(recipe) -> None:
    """Names, per-format options against each format's schema, order, and the modules each format requires.
    (Formats missing something outside the user's reach, TensorRT without a GPU, Core ML prediction off macOS,
    are skipped at build time with the reason instead.)"""
    from vfm_toolchain.export.formats.base import format_options, missing_modules

    e = recipe.export
    for name, raw in e.options.items():  # names and values first; unused options: check_options_are_used
        FORMATS.check(name)  # an unknown format name: the valid names and a suggestion
        format_options(name, raw)
    for i, fmt in enumerate(e.formats):
        meta = FORMATS.meta(fmt)
        if meta["source"] == "onnx" and "onnx" not in e.formats[:i]:
            raise ToolchainError(f"export.formats: '{fmt}' is built from the fp32 ONNX artifact; list 'onnx' "
                                 f"before it")
        missing = missing_modules(fmt)
        if missing:
            raise ToolchainError(f"export.formats has '{fmt}', which needs {', '.join(missing)}, not installed "
                                 f"here: {meta['install']}")


# What a detector exports is each format's declaration (``register_format(..., detection=)``): ONNX and OpenVINO hold
# the NMS in their graph; ExecuTorch, LiteRT and TensorRT engines return candidates the runtime layer's NMS finishes
# (export/runtimes/nms.py); Core ML is a pipeline ending in its NonMaximumSuppression model (converted here,
# predicted on macOS).  fp32 is checked box by box against PyTorch, fp16 / int8 and Core ML by test mAP50 against fp32.


def task_formats(need: str) -> list:
    """The registered formats that declare ``need`` (a task's ``artifact_capability``: ``detection``)."""
    return [f for f in FORMATS.list() if FORMATS.meta(f).get(need)]


@register_recipe_check
def _check_task_formats(recipe) -> None:
    """A build asking for a format its task's model cannot be exported to yet (a detector's NMS) is refused here,
    before the first stage, never after training with a half-made artifact."""
    task = task_of(recipe)
    need = task.artifact_capability
    if not need:  # a plain network: every format takes it
        return
    e = recipe.export
    allowed = task_formats(need)
    others = [f for f in e.formats if f not in allowed]
    target = recipe.student.target
    timed_as_format = target in FORMATS  # not pytorch (the eager model) nor a device's results.json
    if recipe.student.name == "auto" and timed_as_format and target not in allowed:
        others.append(f"{target} (student.target)")
    if others:
        keep = [f for f in e.formats if f in allowed] or allowed
        raise ToolchainError(
            f"export.formats: data.task {task.name} exports {', '.join(allowed)} ({task.artifact_words}); "
            f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not available for {task.name} (its "
            f"registration says {need}=False). Set export.formats to [{', '.join(keep)}] "
            f"(--set 'export.formats=[{','.join(keep)}]')"
            + (" and student.target: onnx" if recipe.student.name == "auto" and timed_as_format and
               target not in allowed else ""))


@register_recipe_check
def check_qat(recipe) -> None:
    """``student_qat`` needs what it learns from: task-oriented distillation with cached teacher outputs, and an
    int8 format to export it to.  Said before the first stage."""
    if QAT_MODEL not in recipe.export.models:
        return
    from vfm_toolchain.export.formats.base import format_options

    d = recipe.distill
    problems = []
    if d.mode != "task_oriented":
        problems.append("distill.mode is task_agnostic, whose cached targets are features, not the predictions QAT "
                        "learns from (set distill.mode: task_oriented)")
    if d.teacher_outputs != "cached" and recipe.export.qat.target == "teacher":
        problems.append("distill.teacher_outputs is online, so no teacher outputs are cached to learn from (set "
                        "distill.teacher_outputs: cached, or export.qat.target: student)")
    if not any(format_options(f, recipe.export.options.get(f)).calibrates() for f in recipe.export.formats):
        problems.append("no int8 format in export.formats to export it to (add onnx_int8, executorch_int8, "
                        "tflite_int8 or openvino_int8)")
    if recipe.export.qat.epochs < 1:
        problems.append("export.qat.epochs is 0")
    if problems:
        raise ToolchainError(f"export.models {QAT_MODEL}: " + "; ".join(problems))
