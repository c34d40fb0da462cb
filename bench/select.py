"""``student.select``: with ``student.name: auto``, choose the student by latency on the target, before any training.

Every candidate (``student.candidates``, default ``DEFAULT_CANDIDATES``) is built at the recipe's image size
with the task's head (classifier, the DeepLabV3 segmentation form, or the FPN + FCOS detector with its NMS, as
``export.detection`` ships it) and random weights, folded like the export stage folds (reparameterization,
BatchNorm), exported to the target's format and timed at batch 1:

- ``student.target: <format>`` (onnx, openvino, executorch, litert, onnx_int8, ...): here, through the runtime
  that format declares; ``pytorch``: the folded eager model on the build's device.
- ``student.target: results.json``: a device's measurements of a candidate bundle
  (``toolchain candidates recipe.yaml --bundle out/``, then ``python run_bench.py`` on the device).

Latency depends on the architecture, never on the weights, so random weights time exactly what training
will produce; the one exception is a detector's NMS, which random weights (every score near the head's 1% prior,
under the score threshold) give almost no boxes: the network is timed exactly, the NMS at its cheapest.  A local measurement is cached in the store's shared folder per (candidate, input size, task,
classes, format and its options, target machine, runtime), so another recipe on the same target reuses it.

The rule: among the candidates whose ``student.budget_stat`` latency (p50 by default) fits
``student.budget_ms``, the one with the most multiply-accumulates (ties: more parameters).  At one budget,
compute is the best cheap predictor of accuracy the candidate families share: seed 004 Table 5 and the timm
ImageNet results rank these families' sizes by MACs within a family, and a proxy training run on every
candidate would cost more than the build it chooses for.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from vfm_toolchain.core.console import Track
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_json
from vfm_toolchain.data.images import image_hw, size_text
from vfm_toolchain.devices import cpu_name
from vfm_toolchain.prepare import class_count, load_index
from vfm_toolchain.stage import ReportContext, ReportSection, Stage, StageContext, StageOutput, register_stage
from vfm_toolchain.store import hash_obj, sha256_file
from vfm_toolchain.students.models import DEFAULT_CANDIDATES, STUDENTS, check_timm_name, create_student, student_preprocess
from vfm_toolchain.tasks import task_of

__all__ = ["StudentSelect", "candidate_names", "CANDIDATE_COLUMNS", "candidate_cells", "build_candidate",
           "measure_candidates", "device_candidates", "choose", "is_results_file", "read_candidate_results",
           "write_candidate_bundle", "RULE"]

RULE = ("the candidate with the most multiply-accumulates whose batch-1 {stat} latency on the target fits "
        "student.budget_ms (ties: more parameters)")


def candidate_names(recipe) -> List[str]:
    names = recipe.student.candidates or DEFAULT_CANDIDATES
    for n in names:
        STUDENTS.check(n)
        check_timm_name(n)
    if len(set(names)) != len(names):
        raise ToolchainError(f"student.candidates names a student twice: {names}")
    return list(names)


def is_results_file(target: str) -> bool:
    """``student.target`` names a file (a device's results) rather than a format: a .json, a path, or anything that
    exists there, a folder included, so that a folder is refused as one (check_target), not as an unknown format."""
    from vfm_toolchain.export.formats import FORMATS

    if target == "pytorch" or target in FORMATS:
        return False
    return target.endswith(".json") or "/" in target or os.sep in target or Path(target).exists()


CANDIDATE_COLUMNS = ("candidate", "family", "params", "MACs", "p50 ms", "p90 ms")


def candidate_cells(c: Dict[str, Any]) -> List[str]:
    """One measured candidate as the text of ``CANDIDATE_COLUMNS``, for the CLI's table and the report's."""
    ok = c["status"] == "ok"
    millions = lambda v: "" if v is None else f"{v / 1e6:.2f} M"
    return [c["name"], c.get("family") or "", millions(c.get("params")), millions(c.get("macs")),
            f"{c['p50_ms']:.2f}" if ok else "", f"{c['p90_ms']:.2f}" if ok else ""]


def _target_format(target: str) -> Optional[str]:
    """The export format a local target is timed in; None for ``pytorch`` (the folded eager model)."""
    from vfm_toolchain.export.formats import FORMATS

    if target == "pytorch":
        return None
    if target not in FORMATS:
        FORMATS.check(target)  # raises with the list and a did-you-mean
    if FORMATS.meta(target)["runtime"] is None:
        raise ToolchainError(f"student.target '{target}': nothing on this machine runs {target} artifacts; name a "
                             f"format with a runtime, pytorch, or a device's results.json")
    return target


def check_target(recipe) -> None:
    """Before any stage: the target names a format with a runtime, pytorch, or an existing results file."""
    t = recipe.student.target
    if is_results_file(t):
        read_candidate_results(t)
        return
    _target_format(t)


def read_candidate_results(target: str) -> Dict[str, Any]:
    """``student.target``'s results file, checked whole (bench.bundle.read_results): a candidates bundle's, with
    finite positive latencies; a missing file, a folder, or a build bundle's results are refused with the fix."""
    from vfm_toolchain.bench.bundle import read_results

    path = Path(target)
    if path.is_dir():
        inside = path / "results.json"
        raise ToolchainError(f"student.target '{target}' is a folder; give the results.json that the candidates "
                             f"bundle's run_bench.py wrote" + (f" ({inside} is there)" if inside.is_file() else
                                                               " (`toolchain candidates RECIPE --bundle DIR`, then "
                                                               "python run_bench.py on the device)"))
    if not path.exists():
        raise ToolchainError(f"student.target '{target}' does not exist; write it on the device with the bundle of "
                             f"`toolchain candidates RECIPE --bundle OUT` (python run_bench.py there)")
    return read_results(path, "student.target", "candidates")


def _machine() -> Dict[str, Any]:
    """What makes a local timing valid elsewhere: the processor and the library versions."""
    from importlib.metadata import PackageNotFoundError, version

    libs = {}
    for pkg in ("torch", "onnxruntime", "openvino", "executorch", "ai-edge-litert", "tensorrt"):
        try:
            libs[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return {"machine": platform.machine(), "cpu": cpu_name(), "cores": os.cpu_count(), "libs": libs}


def build_candidate(name: str, num_classes: int, task: str, size, detection: Optional[Dict[str, Any]] = None,
                    form: Optional[Dict[str, Any]] = None) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """The candidate with random weights, folded as the export stage folds it, as the artifact holds it (a detector
    with its NMS: ``detection`` is the recipe's ``export.detection``), with its params and MACs (the network's);
    ``form``: the recipe's ``StudentConfig.form`` (a detector's head norm)."""
    from vfm_toolchain.bench.latency import count_macs
    from vfm_toolchain.students.fold import deployable, fold_model

    model = create_student(name, num_classes, "none", task, **(form or {})).eval()
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(1, 3, *image_hw(size))
    folded, _ = fold_model(model, {"family": "student", "name": name}, x)
    return deployable(folded, detection), {"params": params, "macs": count_macs(folded, size)}


def _detection(recipe) -> Optional[Dict[str, Any]]:
    """The NMS settings a detection candidate ships with; None for the other tasks."""
    return task_of(recipe).artifact_settings(recipe)


def export_candidate(folded: torch.nn.Module, fmt: str, size, out_dir: Path, options: Dict[str, Any],
                     preprocess: Dict[str, Any], classes: Optional[List[str]], cache_dir: Optional[Path]):
    """Export to ``fmt`` through the export chain, as the export stage does (the fp32 ONNX first for formats built
    from it); int8 formats calibrate on random inputs: their latency does not depend on the ranges."""
    from vfm_toolchain.export.formats import export_format

    x = torch.randn(1, 3, *image_hw(size))
    calibration = np.random.default_rng(0).standard_normal((8, 3, *image_hw(size))).astype(np.float32)
    return export_format(fmt, folded, x, out_dir / fmt, options, calibration=calibration, preprocess=preprocess,
                         classes=classes, batches=[1], cache_dir=cache_dir,
                         metadata={"classes": classes or [], "preprocess": preprocess, "model": "candidate"})


def _time(run, size, bench) -> Dict[str, Any]:
    from vfm_toolchain.export.runtimes.measure import measure_stable

    x = np.random.default_rng(0).standard_normal((1, 3, *image_hw(size))).astype(np.float32)
    stats = measure_stable(run, x, bench.warmup, bench.iters, bench.repeats, bench.max_cv, bench.max_tail)
    return {k: stats[k] for k in ("p50_ms", "p90_ms", "p99_ms", "cv", "rounds") if k in stats} | \
        ({"unstable": stats["unstable"]} if stats.get("unstable") else {})


def measure_candidates(recipe, names: List[str], num_classes: int, task: str, cache: Optional[Path], log,
                       classes: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    """One row per candidate timed here on ``student.target`` (format or pytorch), reusing cached rows."""
    from vfm_toolchain.export.convert import artifact_digest
    from vfm_toolchain.export.formats import FORMATS, Skipped
    from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable, options_for

    s, b = recipe.student, recipe.bench
    fmt = _target_format(s.target)
    size = s.image_size
    options = recipe.export.options.get(fmt, {}) if fmt else {}
    pp = student_preprocess(size).to_dict()
    machine = _machine()
    rows: List[Dict[str, Any]] = []
    bar = Track(f"timing {len(names)} candidate students on {s.target} at {size_text(size)}", len(names),
                unit="candidate", log=log)
    with bar, tempfile.TemporaryDirectory(prefix="candidates_") as tmp:
        for name in names:
            key = hash_obj({"candidate": name, "size": list(image_hw(size)), "task": task, "classes": num_classes,
                            "format": s.target, "options": options, "machine": machine, "threads": b.threads,
                            "iters": b.iters, "warmup": b.warmup,
                            **({"nms": _detection(recipe)} if _detection(recipe) is not None else {}),
                            **({"form": s.form()} if s.form() else {})})
            cached = cache / f"{key}.json" if cache is not None else None
            if cached is not None and cached.is_file():
                row = json.loads(cached.read_text())
                rows.append({**row, "cached": True})
                bar.advance()
                log.info("%-26s cached: p50 %s ms", name, _ms(row.get("p50_ms")))
                continue
            row: Dict[str, Any] = {"name": name, "family": STUDENTS.meta(name).get("family")}
            try:
                folded, counts = build_candidate(name, num_classes, task, size, _detection(recipe), s.form())
                row.update(counts)
                if fmt is None:
                    run = RUNTIMES.get("pytorch")(folded, b.threads)
                else:
                    res = export_candidate(folded, fmt, size, Path(tmp) / name, options, pp, classes, cache)
                    row["bytes"] = artifact_digest(res.path)["bytes"]  # with ONNX external data, a .mlpackage
                    runtime = FORMATS.meta(fmt)["runtime"]  # with a detector's runtime NMS where it has one
                    run = RUNTIMES.get(runtime)(res.path, b.threads, **options_for(runtime, res.meta))
                row.update(_time(run, size, b), status="ok")
                del run
            except (Skipped, Unavailable) as why:
                raise ToolchainError(f"student.target '{s.target}' cannot be timed on this machine ({why}); time the "
                                     f"candidates on the device: `toolchain candidates RECIPE --bundle OUT`, then "
                                     f"--set student.target=results.json") from None
            except ToolchainError as exc:  # a candidate that cannot take this task or size: listed, not fatal
                row.update(status="failed", reason=str(exc))
            except Exception as exc:  # an exporter that rejects one architecture: listed with the reason
                row.update(status="failed", reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            shutil.rmtree(Path(tmp) / name, ignore_errors=True)
            rows.append(row)
            if cached is not None and row["status"] == "ok" and not row.get("unstable"):
                cached.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(cached, row)
            bar.advance()
            log.info("%-26s %s", name, f"p50 {row['p50_ms']:.2f} ms  p90 {row['p90_ms']:.2f} ms  "
                                       f"{(row.get('macs') or 0) / 1e6:.0f} M MACs" if row["status"] == "ok"
                     else f"failed: {row['reason']}")
    return rows


def device_candidates(recipe, names: List[str], num_classes: int, task: str) -> Tuple[List[Dict[str, Any]], Dict]:
    """Rows from a device's results.json (the candidate bundle's run_bench.py), batch 1, matched by name."""
    res = read_candidate_results(recipe.student.target)
    hw = list(image_hw(recipe.student.image_size))
    by_name = {}
    for r in res["bench"]:
        if r.get("batch") == 1:
            by_name[r.get("model")] = r
    rows = []
    for name in names:
        row: Dict[str, Any] = {"name": name, "family": STUDENTS.meta(name).get("family")}
        r = by_name.get(name)
        if r is None:
            skipped = [s["reason"] for s in res.get("skipped", []) if s.get("artifact", "").split(" ")[0] == name]
            row.update(status="failed", reason=f"not measured on the device ({skipped[0]})" if skipped else
                       "not in the device's results (a candidate bundle of other candidates?)")
        elif list(image_hw(r["image_size"])) != hw:
            row.update(status="failed", reason=f"measured at {size_text(r['image_size'])}, the recipe's student is "
                                               f"{size_text(recipe.student.image_size)}: bundle the candidates again")
        else:
            row.update({k: r.get(k) for k in ("params", "macs", "bytes", "p50_ms", "p90_ms", "p99_ms", "cv",
                                              "unstable")}, status="ok", runtime=r.get("runtime"),
                       provider=r.get("provider"))
            if row.get("macs") is None or row.get("params") is None:
                _, counts = build_candidate(name, num_classes, task, recipe.student.image_size, _detection(recipe),
                                            recipe.student.form())
                row.update(counts)
        rows.append(row)
    return rows, res.get("device", {})


def choose(rows: List[Dict[str, Any]], budget_ms: float, stat: str) -> str:
    """Apply RULE to the rows (marking each with ``chosen`` and ``why``); the chosen name.  A row whose timing was
    unstable (a busy machine) still takes part by its percentile, which such noise moves least, and says so."""
    col = f"{stat}_ms"
    fits = [r for r in rows if r["status"] == "ok" and r[col] <= budget_ms]
    for r in rows:
        if r["status"] != "ok":
            r["why"] = r["reason"]
        elif r[col] > budget_ms:
            r["why"] = f"over budget: {stat} {r[col]:.2f} ms > {budget_ms:g} ms"
    if not fits:
        timed = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r[col])
        fastest = f"; the fastest, {timed[0]['name']}, takes {timed[0][col]:.2f} ms" if timed else \
            "; no candidate could be timed"
        raise ToolchainError(f"no candidate student fits student.budget_ms {budget_ms:g} ({stat}){fastest}. Raise "
                             f"the budget, lower student.image_size, or add smaller student.candidates")
    best = max(fits, key=lambda r: (r.get("macs") or 0, r.get("params") or 0))
    for r in fits:
        r["why"] = "most MACs within budget" if r is best else f"within budget, fewer MACs than {best['name']}"
    for r in rows:
        r["chosen"] = r is best
        if r.get("unstable"):
            r["why"] += f" (timing unstable: {r['unstable']})"
    return best["name"]


@register_stage
class StudentSelect(Stage):
    name = "student.select"
    version = "1"
    inputs = ("data.prepare",)

    def config(self, recipe) -> Dict[str, Any]:
        s = recipe.student
        cfg = {"candidates": candidate_names(recipe), "budget_ms": s.budget_ms, "stat": s.budget_stat,
               "image_size": s.image_size, "target": s.target, "bench": recipe.bench.model_dump(mode="json")}
        if _detection(recipe) is not None:  # the NMS is part of what is timed
            cfg["detection"] = _detection(recipe)
        if s.form():  # so is the head's form
            cfg["form"] = s.form()
        if is_results_file(s.target):  # a new results file is a new measurement
            cfg["target_sha256"] = sha256_file(Path(s.target))
        else:
            cfg["options"] = recipe.export.options.get(s.target, {})
        return cfg

    def skip_reason(self, recipe):
        return None if recipe.student.name == "auto" else "student.name is given"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r = ctx.recipe
        s = r.student
        index = load_index(ctx.input("data.prepare"))
        task, classes = task_of(index).name, index["classes"]
        names = candidate_names(r)
        device = None
        if is_results_file(s.target):
            ctx.log.info("reading %d candidates' latency from the device results %s", len(names), s.target)
            rows, device = device_candidates(r, names, len(classes), task)
        else:
            cache = ctx.shared / "candidate_latency" if ctx.shared is not None else None
            rows = measure_candidates(r, names, len(classes), task, cache, ctx.log,
                                      task_of(task).classifier_labels(classes))
        chosen = choose(rows, s.budget_ms, s.budget_stat)
        row = next(x for x in rows if x["chosen"])
        ctx.log.info("chose %s: %s %.2f ms within %g ms, %.0f M MACs", chosen, s.budget_stat,
                     row[f"{s.budget_stat}_ms"], s.budget_ms, (row.get("macs") or 0) / 1e6)
        return {"chosen": chosen, "rule": RULE.format(stat=s.budget_stat), "budget_ms": s.budget_ms,
                "stat": s.budget_stat, "target": s.target, "device": device, "image_size": s.image_size,
                "candidates": rows}

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """Every candidate, its latency on the target, which was chosen and why."""
        res, dev = out.result, out.result.get("device") or {}
        where = (f"the device results `{res['target']}` ({dev.get('machine', '?')}, "
                 f"{dev.get('processor') or dev.get('system', '')})"
                 if is_results_file(res["target"]) else f"`{res['target']}` on this machine, batch 1")
        lines = [f"Budget {res['budget_ms']:g} ms ({res['stat']}) on {where}. Rule: {res['rule']}.", "",
                 "| " + " | ".join(CANDIDATE_COLUMNS + ("chosen", "why")) + " |",
                 "|---" * (len(CANDIDATE_COLUMNS) + 2) + "|"]
        for c in sorted(res["candidates"], key=lambda c: (c["status"] != "ok", c.get("p50_ms") or 0)):
            cells = candidate_cells(c) + ["**yes**" if c.get("chosen") else "",
                                          c.get("why", "") + (" (cached)" if c.get("cached") else "")]
            lines.append("| " + " | ".join(cells) + " |")
        return ReportSection(title="Student selection", lines=lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def write_candidate_bundle(recipe, out: Path, fmt: str, cache_dir: Optional[Path], log) -> Path:
    """The candidate students of ``student.name: auto`` (random weights: latency only), folded and exported to
    ``fmt``, with the runner; the device's results.json then goes to ``--set student.target=results.json``."""
    from vfm_toolchain.bench.bundle import bundle_kinds, copy_artifact, finish_bundle, prepare_out
    from vfm_toolchain.export.convert import artifact_digest
    from vfm_toolchain.export.formats import FORMATS
    from vfm_toolchain.export.runtimes import options_for

    FORMATS.check(fmt)
    if fmt not in bundle_kinds():
        raise ToolchainError(f"format '{fmt}' does not travel in a bundle; use one of {', '.join(bundle_kinds())}")
    out = Path(out)
    prepare_out(out)
    names = candidate_names(recipe)
    task = recipe.data.task
    n_classes = class_count(recipe)
    size = recipe.student.image_size
    pp = student_preprocess(size).to_dict()
    entries, failed = [], []
    with Track(f"exporting {len(names)} candidates to {fmt}", len(names), unit="candidate", log=log) as bar, \
            tempfile.TemporaryDirectory(prefix="candidates_") as tmp:
        for name in names:
            try:
                folded, counts = build_candidate(name, n_classes, task, size, _detection(recipe),
                                                 recipe.student.form())
                res = export_candidate(folded, fmt, size, Path(tmp) / name, recipe.export.options.get(fmt, {}), pp,
                                       None, cache_dir)
                file = copy_artifact(res.path, out, f"{name}_{fmt}")
                runtime = FORMATS.meta(fmt)["runtime"]
                entries.append({"label": f"{name} {fmt}", "model": name, "kind": fmt, "file": file,
                                "runtime": runtime, **artifact_digest(res.path), "image_size": size, **counts,
                                # a detector whose format holds no NMS: the device times it with the runtime's
                                "runtime_options": options_for(runtime, res.meta)})
            except Exception as exc:  # one architecture an exporter rejects: listed, the others still bundled
                failed.append(name)
                log.warning("candidate %s: %s: %s", name, type(exc).__name__, str(exc).splitlines()[0][:200])
            bar.advance()
    if not entries:
        raise ToolchainError(f"no candidate could be exported to {fmt}; see the warnings above")
    about = (f"The candidate students of `{recipe.name}` (student.name: auto) at {size}, random weights (latency "
             f"does not depend on them), exported to {fmt}." + (f" Not exported: {', '.join(failed)}." if failed else "")
             + " Back on the build machine:\n\n    toolchain build RECIPE --set student.name=auto "
             "--set student.budget_ms=... --set student.target=results.json")
    bench_cfg = recipe.bench.model_dump()
    return finish_bundle(out, f"{recipe.name} candidates", entries, {**bench_cfg, "batch_sizes": [1]}, about,
                         "candidates")
