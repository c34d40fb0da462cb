"""The Python API: what the command line does, for notebooks and scripts (docs/api.md has a runnable example).

    from vfm_toolchain import api

    result = api.build("recipes/quickstart.yaml", overrides={"student.name": "fastvit_s12"}, out="runs/exp1")
    result.metrics["student_distilled_top1"]
    result.artifact("student", "onnx").path          # the deployable file, checked against PyTorch
    api.time_artifact(result.artifact("student", "onnx").path, "onnxruntime", image_size=64)
    api.doctor()                                     # what this machine offers for a build: [{status, what, ...}]

Every function takes a recipe as a YAML path or a dict (the same sections and checks as the file), and
overrides as ``{"dotted.key": value}`` (or the command line's ``"dotted.key=value"`` strings).  Failures raise
:class:`vfm_toolchain.core.errors.ToolchainError` with the message the command line prints.  Like ``toolchain/cli.py``
this module sits on top of every area, so it is the one place besides the CLI that imports them all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import Recipe, apply_overrides, load_recipe, parse_overrides, recipe_from_dict

__all__ = ["Artifact", "BuildResult", "StudyResult", "ExportedModel", "InitResult", "load", "build", "study", "label_next",
           "pseudo_label", "init", "target_formats", "export", "time_artifact",
           "doctor"]

RecipeLike = Union[str, Path, Mapping[str, Any], Recipe]
Overrides = Union[Mapping[str, Any], Sequence[str], None]


@dataclass(frozen=True)
class Artifact:
    """One exported file of a build, as ``build.json`` records it."""

    model: str                  # student | teacher
    kind: str                   # the export format: onnx, onnx_int8, coreml, ...
    status: str                 # ok | skipped | failed
    path: Optional[Path]        # absolute; None when nothing was written
    sha256: Optional[str]
    bytes: Optional[int]
    parity: Optional[float]     # max |diff| to the folded PyTorch model (fp32 formats), when checked here
    reason: Optional[str]       # why it was skipped or failed
    record: Dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class BuildResult:
    """What a build made: its status, metrics, artifacts, latency rows, report and the full record."""

    name: str
    status: str                 # complete (a failed build raises instead)
    out_dir: Path
    report: Optional[Path]      # report.md, when the report stage ran
    metrics: Dict[str, Optional[float]]
    artifacts: List[Artifact]
    bench: List[Dict[str, Any]]
    stages: List[Dict[str, Any]]
    record: Dict[str, Any] = field(repr=False, default_factory=dict)

    def artifact(self, model: str, kind: str) -> Artifact:
        """The artifact of ``model`` in format ``kind``; a clear error naming what the build made otherwise."""
        for a in self.artifacts:
            if a.model == model and a.kind == kind:
                return a
        made = ", ".join(f"{a.model} {a.kind}" for a in self.artifacts) or "none"
        raise ToolchainError(f"build {self.name} has no {model} {kind} artifact (it made: {made}); add {kind} to "
                             f"export.formats")


@dataclass(frozen=True)
class StudyResult:
    out_dir: Path
    rows: List[Dict[str, Any]]
    summary: Dict[str, Any]
    markdown: Path              # study.md: the table a person reads


@dataclass(frozen=True)
class ExportedModel:
    """One model exported and checked outside a build."""

    format: str
    path: Path
    sha256: str
    bytes: int
    parity: Optional[float]     # max |diff| to the model's own outputs on the example, when it runs here
    parity_skipped: Optional[str]
    meta: Dict[str, Any] = field(repr=False, default_factory=dict)


def load(recipe: RecipeLike, overrides: Overrides = None) -> Recipe:
    """A validated recipe from a YAML path, a dict or a Recipe, with ``overrides`` applied (relative paths in
    a file resolve against its folder, in a dict against the working folder)."""
    items = _override_items(overrides)
    if isinstance(recipe, Recipe):
        if not items:
            return recipe
        recipe = recipe.model_dump(mode="json")
    if isinstance(recipe, Mapping):
        return recipe_from_dict(apply_overrides(dict(recipe), parse_overrides(items)))
    return load_recipe(recipe, items)


def build(recipe: RecipeLike, overrides: Overrides = None, out: Union[str, Path, None] = None,
          store: Union[str, Path, None] = None, only: Optional[Sequence[str]] = None,
          argv: Optional[Sequence[str]] = None, track: bool = False) -> BuildResult:
    """Build ``recipe`` into ``out`` (default ``runs/<name>``) through ``store`` (default the user's store), as
    ``toolchain build`` does (it calls this); finished stages are reused.  ``argv`` is recorded in the build's
    ``argv.json`` (default: this process's).  ``track``: an MLflow run of the build, as the recipe's
    ``tracking.mlflow`` says or with its defaults (docs/tracking.md).  Raises on bad input or a failed stage."""
    from vfm_toolchain import tracking
    from vfm_toolchain.runner import build as run_build
    from vfm_toolchain.store import default_store_root

    r = load(recipe, overrides)
    if track:
        r = tracking.enable(r)
    out_dir = Path(out) if out is not None else Path("runs") / r.name
    record = run_build(r, out_dir, Path(store) if store is not None else default_store_root(),
                       argv=list(argv) if argv is not None else None, only=list(only) if only else None)
    return _result(record, out_dir)


def study(recipe: RecipeLike, overrides: Overrides = None, out: Union[str, Path, None] = None,
          store: Union[str, Path, None] = None, track: bool = False) -> StudyResult:
    """The label-efficiency study (``toolchain study``): every study.method at every study.budget and seed.
    ``track``: an MLflow parent run with a nested run per build (docs/tracking.md)."""
    from vfm_toolchain import tracking
    from vfm_toolchain.store import default_store_root
    from vfm_toolchain.study import run_study

    r = load(recipe, overrides)
    if track:
        r = tracking.enable(r)
    out_dir = Path(out) if out is not None else Path("runs") / f"{r.name}_study"
    res = run_study(r, out_dir, Path(store) if store is not None else default_store_root())
    return StudyResult(out_dir=out_dir, rows=res["rows"], summary=res["summary"], markdown=out_dir / "study.md")


def label_next(recipe: RecipeLike, n: int, overrides: Overrides = None, out: Union[str, Path, None] = None,
               store: Union[str, Path, None] = None, **options) -> Dict[str, Any]:
    """``toolchain label-next``: rank the recipe's pool after its build and choose ``n`` images to label next
    (students/label_next.py documents the score); writes into ``out`` (default ``runs/<name>_label_next``) and
    returns a summary.  ``options``: uncertainty, w_uncertainty, w_disagreement, w_typicality, candidates,
    box_threshold, typicality_k, min_share."""
    from vfm_toolchain.store import default_store_root
    from vfm_toolchain.students.label_next import label_next as rank

    r = load(recipe, overrides)
    out_dir = Path(out) if out is not None else Path("runs") / f"{r.name}_label_next"
    return rank(r, n, out_dir, Path(store) if store is not None else default_store_root(), **options)


def pseudo_label(recipe: RecipeLike, overrides: Overrides = None, out: Union[str, Path, None] = None,
                 store: Union[str, Path, None] = None, threshold: float = 0.5, copy: bool = False) -> Dict[str, Any]:
    """``toolchain pseudo-label``: the build's teacher labels the recipe's pool for review (students/pseudo_label.py
    lists what is written); into ``out`` (default ``runs/<name>_pseudo_labels``); returns a summary."""
    from vfm_toolchain.store import default_store_root
    from vfm_toolchain.students.pseudo_label import pseudo_label as write

    r = load(recipe, overrides)
    out_dir = Path(out) if out is not None else Path("runs") / f"{r.name}_pseudo_labels"
    return write(r, out_dir, Path(store) if store is not None else default_store_root(), threshold, copy)


@dataclass(frozen=True)
class InitResult:
    """What ``init`` found in a folder and the recipe it wrote."""

    recipe: Path                # the recipe written (absolute)
    text: str                   # its YAML
    found: List[str]            # what the folder holds, a line each
    problems: List[Dict[str, str]]  # {"what", "fix"}
    task: str
    splits: Optional[Path]      # the train / test folders init proposed, when the folder had no test split


def target_formats(target: str) -> tuple:
    """The export formats for a deployment target (their declared targets) that this environment can make, in an
    order the export stage takes (``onnx`` before what is built from it), and those left out with how to get
    them: ``([format], [(format, why)])``."""
    import importlib.util

    from vfm_toolchain.export.formats import FORMATS
    from vfm_toolchain.recipe import TARGETS

    if target not in TARGETS:
        raise ToolchainError(f"unknown target '{target}'; use one of {', '.join(TARGETS)}")
    chosen, left_out = [], []
    for name in FORMATS.list():
        meta = FORMATS.meta(name)
        if target not in meta["targets"]:
            continue
        missing = [m for m in meta["requires"] if importlib.util.find_spec(m) is None]
        if missing:
            left_out.append((name, f"needs {', '.join(missing)}: {meta['install'] or 'pip install ' + missing[0]}"))
        else:
            chosen.append(name)
    if any(FORMATS.meta(f)["source"] == "onnx" for f in chosen) and "onnx" not in chosen:
        chosen.insert(0, "onnx")
    chosen.sort(key=lambda f: FORMATS.meta(f)["source"] == "onnx")  # stable: made from the model first
    if not chosen:
        raise ToolchainError(f"no format for target {target} can be made in this environment: "
                             + "; ".join(f"{f} {why}" for f, why in left_out))
    return chosen, left_out


def init(data: Union[str, Path], out: Union[str, Path, None] = None, target: str = "cpu", task: Optional[str] = None,
         teacher: Optional[str] = None, seed: int = 0) -> InitResult:
    """``toolchain init``: read a folder of images (toolchain/init.py says which layouts), say what it holds, and
    write a short recipe for ``target`` that ``build`` takes as written (default ``<folder name>.yaml`` here).

    Raises:
        ToolchainError: a folder no task reads, data its readers refuse, or ``out`` already there.
    """
    from vfm_toolchain.init import choose_teacher, survey, write_recipe
    from vfm_toolchain.plugins import load_plugins
    from vfm_toolchain.tasks import TASKS
    from vfm_toolchain.teachers import detection_multiple

    load_plugins()
    data = Path(data)
    out_path = Path(out) if out is not None else Path(f"{data.resolve().name}.yaml")
    if out_path.exists():
        raise ToolchainError(f"'{out_path}' already exists; init does not overwrite a recipe: give another path "
                             f"with --out")
    formats, left_out = target_formats(target)
    chosen_teacher = (teacher, "pretrained", f"{teacher} (as asked)") if teacher else choose_teacher()
    found = survey(data, task, splits_out=out_path.resolve().parent / f"{out_path.stem}-splits", seed=seed)
    command = f"toolchain init {data} --target {target}" + (f" --task {task}" if task else "")
    one_size = TASKS.get(found.task).starter.get("one_size")  # detection: the teacher's grid is the student's
    multiple = detection_multiple(*chosen_teacher[:2]) if one_size else 32
    text = write_recipe(found, out_path, target, formats, left_out, chosen_teacher, command, multiple)
    return InitResult(out_path.resolve(), text, found.lines() + found.notes,
                      [{"what": p.what, "fix": p.fix} for p in found.problems], found.task, found.proposed)


def export(model, fmt: str, example, out_dir: Union[str, Path], options: Optional[Dict[str, Any]] = None,
           **inputs: Any) -> ExportedModel:
    """Export a PyTorch ``model`` to ``fmt`` (``toolchain list formats``) and check it against the model on
    ``example`` where its runtime runs here, as the export stage does.  ``options`` as a recipe writes them
    under ``export.options.<fmt>``; ``inputs`` are the format's extra inputs (``onnx=`` the fp32 ONNX a
    derived format starts from, ``calibration=`` images for int8, ...)."""
    import numpy as np
    import torch

    from vfm_toolchain.export.convert import artifact_digest
    from vfm_toolchain.export.formats import FORMATS, export_format
    from vfm_toolchain.plugins import load_plugins

    load_plugins()
    FORMATS.check(fmt)
    res = export_format(fmt, model.eval(), example, Path(out_dir), options, **inputs)
    parity = None
    if res.runner is not None:
        with torch.no_grad():
            want = model(example[:1]).float().numpy()
        got = np.asarray(res.runner(example[:1].numpy()), dtype=np.float32).reshape(want.shape)
        parity = float(np.abs(got - want).max())
    digest = artifact_digest(res.path)
    return ExportedModel(format=fmt, path=Path(res.path), sha256=digest["sha256"], bytes=digest["bytes"],
                         parity=parity, parity_skipped=None if res.runner is not None else
                         (res.parity_skipped or "its runtime does not run here"), meta=res.meta)


def time_artifact(path: Union[str, Path], runtime: str, image_size: Union[int, Sequence[int]], batch: int = 1,
                  warmup: int = 5, iters: int = 30, threads: Optional[int] = None) -> Dict[str, float]:
    """Latency of an artifact through a runtime (``toolchain list runtimes``), as the bench stage measures it:
    warm-up, then timed calls at ``batch`` on random input; p50/p90/p99/mean in ms and images per second."""
    import numpy as np
    import torch

    from vfm_toolchain.export.runtimes import RUNTIMES
    from vfm_toolchain.export.runtimes.measure import measure_latency
    from vfm_toolchain.plugins import load_plugins

    load_plugins()
    RUNTIMES.check(runtime)
    path = Path(path)
    if not path.exists():
        raise ToolchainError(f"artifact '{path}' does not exist; give the path of an exported file")
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    run = RUNTIMES.get(runtime)(path, threads or torch.get_num_threads())
    x = np.random.default_rng(0).standard_normal((batch, 3, h, w)).astype(np.float32)
    return measure_latency(run, x, warmup, iters)


def doctor(store: Union[str, Path, None] = None, out: Union[str, Path, None] = None) -> List[Dict[str, str]]:
    """``toolchain doctor``: what this machine and environment offer for a build, one dict per finding,
    ``{"status": ok | warn | missing | fail, "what", "detail", "fix"}`` (toolchain/doctor.py lists the checks).
    ``store`` (default the user's store) is read, never written; ``out`` is where builds go (default ``runs``)."""
    from vfm_toolchain.doctor import run_doctor

    return [f.as_dict() for f in run_doctor(Path(store) if store is not None else None,
                                            Path(out) if out is not None else None)]


def _override_items(overrides: Overrides) -> List[str]:
    """``"key=value"`` strings, the command line's form, so both forms meet the same parser and checks (a dict's
    values travel as JSON, which YAML reads back as the same value)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    if isinstance(overrides, (str, bytes)):
        raise ToolchainError(f"overrides: give a dict {{'dotted.key': value}} or a list of 'key=value' strings, "
                             f"not one string ({overrides!r})")
    return [str(o) for o in overrides]


def _result(record: Dict[str, Any], out_dir: Path) -> BuildResult:
    arts = [Artifact(model=a.get("model", ""), kind=a.get("kind", ""), status=a.get("status", ""),
                     path=(out_dir / a["path"]).resolve() if a.get("path") else None, sha256=a.get("sha256"),
                     bytes=a.get("bytes"), parity=a.get("parity_max_abs_diff"), reason=a.get("reason"), record=a)
            for a in record.get("artifacts", [])]
    report = out_dir / "report.md"
    return BuildResult(name=record["name"], status=record.get("status", "complete"), out_dir=out_dir,
                       report=report.resolve() if report.exists() else None, metrics=dict(record.get("metrics", {})),
                       artifacts=arts, bench=list(record.get("bench", [])), stages=list(record["stages"]),
                       record=json.loads(json.dumps(record)))
