"""What a format is: one registered function and the declaration the rest of the toolchain reads.

``@register_format(name, options=..., runtime=..., ...)`` declares, in the format's own file:

- ``options``   a :class:`FormatOptions` subclass, the schema of what a recipe may set under
                ``export.options.<name>``; an unknown or ill-typed option is an error before any stage runs
- ``runtime``   the runtime family that loads the artifact (``bench.runtimes`` entries that run it, the
                device bundle's loader); ``None`` when nothing here or on a device can run it
- ``source``    ``model`` (exported from the folded PyTorch model) or ``onnx`` (built from the fp32 ONNX
                artifact of the same build, so ``onnx`` must come first in ``export.formats``)
- ``bundle``    whether the artifact travels in a device bundle (a TensorRT engine does not: it loads only on
                the GPU model and TensorRT version that built it)
- ``batch_profile`` whether the artifact is built for the batch sizes the build feeds it (a TensorRT engine's
                optimisation profile), which then belong to the export stage's key
- ``targets``   the deployment targets the artifact is meant for (the recipe's ``target`` values: ``cpu`` for any
                CPU through ONNX Runtime, ``x86``, ``android``, ``ios``, ``nvidia``): the report names one artifact
                per target from the measured rows
- ``requires``  the Python modules the format cannot be made or checked without, and ``install`` how to get
                them: a recipe naming the format fails before any stage when one is missing
- ``detection`` whether a detector can be exported to it (final boxes from the graph's NMS, or candidates that the
                runtime layer's NMS finishes); a detection recipe naming one that cannot is refused before any stage
- ``suffix``, ``devices``, ``precision`` for ``toolchain list formats`` and the report (``precision`` is
                ``options.precision`` where the options choose it; the artifact's record says which it got)

The export stage hands each format its validated options and :class:`ExportInputs` (what the build supplies:
the ONNX artifact, calibration images, metadata), and reads nothing else about it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry, did_you_mean
from vfm_toolchain.recipe import TARGETS  # what the report names an artifact for; the recipe's ``target`` values
from vfm_toolchain.stage import register_recipe_check

__all__ = ["EDGE_INSTALL", "FORMATS", "TARGETS", "ExportResult", "ExportInputs", "FormatOptions", "Int8FormatOptions",
           "Skipped",
           "register_format", "format_options", "export_chain", "export_format", "missing_modules", "check_options_are_used"]

FORMATS = Registry("export format")


EDGE_INSTALL = "pip install 'vfm-toolchain[edge]' (ExecuTorch, LiteRT, OpenVINO, NCNN; make installs it)"


class Skipped(Exception):
    """The format cannot be produced on this machine; the message is the reason recorded in the build."""


class FormatOptions(BaseModel):
    """Options every format takes; each format's schema extends this and rejects keys it does not know."""

    model_config = ConfigDict(extra="forbid")
    parity_atol: Optional[float] = Field(None, gt=0, description="this format's fp32 parity tolerance "
                                                                 "(default: export.parity_atol)")

    def calibrates(self) -> bool:
        """Whether this artifact needs int8 calibration images (the stage samples them once per model)."""
        return getattr(self, "precision", None) == "int8"


class Int8FormatOptions(FormatOptions):
    """What every int8 format takes beside its own options: the accuracy-aware fallback (export/fallback.py)."""

    fallback: bool = Field(True, description="when the int8 artifact misses export.max_accuracy_drop, put its most "
                                             "sensitive layers back in float, a few more at a time, until it passes "
                                             "or is no faster than fp32 (export/fallback.py); false: refuse it")

    def calibrates(self) -> bool:
        return True


@dataclass
class ExportInputs:
    """What the export stage supplies to a format beside its options."""

    onnx: Optional[Path] = None                 # the build's fp32 ONNX artifact (formats with source="onnx")
    calibration: Optional[np.ndarray] = None    # preprocessed transfer-set images, when ``calibrates()``
    metadata: Dict[str, Any] = field(default_factory=dict)  # classes, preprocessing, recipe hash, version
    preprocess: Optional[Dict[str, Any]] = None
    classes: Optional[List[str]] = None         # classifiers only
    batches: List[int] = field(default_factory=lambda: [1])  # every batch size the build feeds the artifact
    cache_dir: Optional[Path] = None            # the store's shared folder (caches reused across builds)
    # judge(runner) -> {"test_score", "fp32_test_score", "accuracy_drop", "passed"}: the build's accuracy gate for
    # reduced precision (test split against the fp32 model, export.max_accuracy_drop), for formats that choose
    # between candidates by it; None outside a build
    judge: Optional[Callable[[Any], Dict[str, Any]]] = None
    log: Optional[Callable[[str], None]] = None  # progress lines for the person watching (the stage's log)
    _plans: Dict[int, Tuple[List[Tuple[str, float]], Dict[str, List[str]]]] = field(default_factory=dict, repr=False)

    def fallback_plan(self, model, example, fmt: str) -> Tuple[List[Tuple[str, float]], Dict[str, List[str]]]:
        """The model's weighted layers, most int8-sensitive first, and the layers writing each one's input
        (export/fallback.py): measured once per model on the calibration images, shared by every int8 format."""
        if id(model) not in self._plans:
            from vfm_toolchain.export.fallback import SENSITIVITY_IMAGES, input_producers, layer_sensitivity

            images = self.need_calibration(fmt)
            self.say(f"{fmt}: ranking layers by int8 sensitivity on {min(len(images), SENSITIVITY_IMAGES)} "
                     f"transfer images")
            self._plans[id(model)] = (layer_sensitivity(model, images, log=self.say), input_producers(model, example))
        return self._plans[id(model)]

    def say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    def need_calibration(self, fmt: str) -> np.ndarray:
        if self.calibration is None or len(self.calibration) == 0:
            raise ToolchainError(f"{fmt} needs calibration images (the transfer set or the labeled images)")
        return self.calibration

    def need_onnx(self, fmt: str) -> Path:
        if not self.onnx:
            raise ToolchainError(f"{fmt} is built from the fp32 ONNX artifact: put 'onnx' before '{fmt}' in "
                                 f"export.formats")
        return Path(self.onnx)


@dataclass
class ExportResult:
    path: Path
    meta: Dict[str, Any] = field(default_factory=dict)
    # run(batch) -> outputs on this machine, or None when the artifact cannot execute here
    runner: Optional[Any] = None
    parity_skipped: Optional[str] = None
    accuracy: Optional[Dict[str, Any]] = None  # the verdict of ``ExportInputs.judge`` when the format asked for it


def register_format(name: str, *, options=FormatOptions, runtime: Optional[str], source: str = "model",
                    bundle: bool = True, batch_profile: bool = False, requires: Tuple[str, ...] = (),
                    install: Optional[str] = None, targets: Tuple[str, ...] = (), suffix: str, devices: str,
                    precision: str = "fp32", detection: bool = True) -> Callable:
    """Register ``fn(model, example, out_dir, options, inputs) -> ExportResult`` with its declaration."""
    if source not in ("model", "onnx"):
        raise ValueError(f"format {name}: source must be 'model' or 'onnx'")
    if set(targets) - set(TARGETS):
        raise ValueError(f"format {name}: targets must be among {TARGETS}")
    if requires and not install:
        raise ValueError(f"format {name}: say how to install {requires} (install=...)")
    return FORMATS.register(name, options=options, runtime=runtime, source=source, bundle=bundle,
                            batch_profile=batch_profile, requires=tuple(requires), install=install,
                            targets=tuple(targets), suffix=suffix,
                            devices=devices, precision=precision, detection=detection)


def missing_modules(name: str) -> List[str]:
    """The modules format ``name`` requires that this Python cannot import."""
    import importlib.util

    return [m for m in FORMATS.meta(name)["requires"] if importlib.util.find_spec(m) is None]


def format_options(name: str, raw: Optional[Dict[str, Any]] = None) -> FormatOptions:
    """``export.options.<name>`` validated against the format's schema; errors name the key and what is allowed."""
    schema = FORMATS.meta(name)["options"]
    try:
        return schema(**(raw or {}))
    except ValidationError as exc:
        allowed = ", ".join(schema.model_fields)
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or name}: {e['msg']}"
                             + (did_you_mean(str(e["loc"][-1]), list(schema.model_fields))
                                if e["type"] == "extra_forbidden" else "")
                             for e in exc.errors())
        raise ToolchainError(f"export.options.{name}: {problems} ({name} takes: {allowed})") from None


@register_recipe_check
def check_options_are_used(recipe) -> None:
    """Options for a format this build does not make would be dropped without a word (a build asked for int8
    with ``export.options.onnx_int8`` but without ``onnx_int8`` in ``export.formats`` ships no int8 model).
    A format is used when ``export.formats`` lists it, or when ``student.target`` names it (the candidate
    students are exported to it with these options, ``toolchain candidates`` included)."""
    e = recipe.export
    used = set(e.formats) | {recipe.student.target}
    for name in e.options:
        if name in used:
            continue
        FORMATS.check(name)  # a misspelt format name: the valid names and a suggestion come first
        raise ToolchainError(
            f"export.options.{name} sets options for '{name}', which this build does not make (export.formats: "
            f"{', '.join(e.formats) or 'none'}); add '{name}' to export.formats (e.g. --set \"export.formats="
            f"[{', '.join([*e.formats, name])}]\"), or remove export.options.{name}")


def export_chain(formats: Sequence[str], model, example, out_dir: Path,
                 options: Optional[Dict[str, Any]] = None, inputs: Optional[ExportInputs] = None,
                 calibrate: Optional[Callable[[], np.ndarray]] = None, folder: Optional[Callable[[str], Path]] = None
                 ) -> Iterator[Tuple[str, Union[ExportResult, Skipped]]]:
    """The one way the toolchain makes artifacts (the export stage, student selection, the export benchmark, the
    API, the tests): each of ``formats`` in order into ``out_dir/<format>``, yielding ``(format, result)``, or
    ``(format, Skipped)`` for one this machine cannot make.  A format built from the fp32 ONNX (``source="onnx"``)
    gets it from an earlier ``onnx`` in ``formats``, from ``inputs.onnx``, or else made here first into
    ``out_dir/onnx`` with ``options["onnx"]``.  ``options`` maps a format to what a recipe writes under
    ``export.options.<format>`` (validated here) or to its validated :class:`FormatOptions`; ``calibrate()`` supplies
    int8 calibration images the first time a format needs them; ``folder(format)`` overrides where one goes."""
    inputs = inputs if inputs is not None else ExportInputs()
    options = options or {}
    folder = folder or (lambda fmt: Path(out_dir) / fmt)

    def opts(fmt: str) -> FormatOptions:
        given = options.get(fmt)
        return given if isinstance(given, FormatOptions) else format_options(fmt, given)

    for fmt in formats:
        chosen = opts(fmt)
        if FORMATS.meta(fmt)["source"] == "onnx" and inputs.onnx is None:
            inputs.onnx = _make("onnx", model, example, folder("onnx"), opts("onnx"), inputs).path
        if chosen.calibrates() and inputs.calibration is None and calibrate is not None:
            inputs.calibration = calibrate()
        try:
            res = _make(fmt, model, example, folder(fmt), chosen, inputs)
        except Skipped as why:
            yield fmt, why
            continue
        if fmt == "onnx":
            inputs.onnx = res.path  # what the formats after it that are built from the fp32 ONNX take
        yield fmt, res


def _make(fmt: str, model, example, folder: Path, options: FormatOptions, inputs: ExportInputs) -> ExportResult:
    folder.mkdir(parents=True, exist_ok=True)
    return FORMATS.get(fmt)(model, example, folder, options, inputs)


def export_format(name: str, model, example, out_dir: Path, options: Optional[Dict[str, Any]] = None,
                  **inputs: Any) -> ExportResult:
    """One format outside a build (benchmarks, notebooks, tests), through :func:`export_chain`: ``options`` as a
    recipe writes them under ``export.options.<name>``, ``inputs`` the fields of :class:`ExportInputs` (``onnx=``,
    ``calibration=``, ``metadata=``, ...).  The artifact lands in ``out_dir`` (with the fp32 ONNX it is built from
    in ``out_dir/onnx`` when ``onnx=`` is not given); a format this machine cannot make raises :class:`Skipped`."""
    out_dir = Path(out_dir)
    (fmt, res), = export_chain([name], model, example, out_dir, {name: options}, ExportInputs(**inputs),
                               folder=lambda fmt: out_dir if fmt == name else out_dir / fmt)
    if isinstance(res, Skipped):
        raise res
    return res
