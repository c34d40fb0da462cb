"""``bench.latency``: PyTorch eager before and after folding, and every exported artifact its runtime can run.

Each candidate is measured on its own (``measure_stable``: steady rounds, or the row says it was not), then every
candidate of a model once more side by side at the smallest batch: timed in turn, a few calls each, round after
round, so drift in a busy machine's speed hits them alike and the ratios (int8 against fp32, one runtime against
another) stand where one row may have caught a slow minute.  A detector is timed as it ships, NMS included: the eager
rows time it wrapped as the export wrapped it (``DetectorWithNMS`` with the export's NMS settings), the artifact
returns its final detections; its MACs are the dense network's (NMS has none the counter sees).  Each artifact also
gets its runtime's layer table at batch 1 (``layers/``, bench/layer_report.py), "Where the time goes" in the report.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from vfm_toolchain import devices
from vfm_toolchain.bench import layer_report
from vfm_toolchain.bench.memory_probe import probe_memory
from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.core.console import Track
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_json
from vfm_toolchain.data.images import ImageSize, Preprocess, image_hw
from vfm_toolchain.export.convert import MODEL_SOURCES
from vfm_toolchain.export.formats import FORMATS
from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable, layers_for, options_for
from vfm_toolchain.export.runtimes.measure import latency_cell, measure_stable, round_robin
from vfm_toolchain.export.runtimes.nms import nms_seconds
from vfm_toolchain.stage import (Point, ReportContext, ReportSection, Score, Stage, StageContext, StageOutput,
                                 metric_label, register_stage)
from vfm_toolchain.students.fold import deployable, fold_model
from vfm_toolchain.students.qat import QAT_MODEL
from vfm_toolchain.tasks import task_of

__all__ = ["BenchLatency", "count_macs", "precision_changes"]

# the fields of a row that build.json keeps (scripts and the device bundle read them), the second group where
# measured
RECORD_FIELDS = ("artifact", "runtime", "batch", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "throughput_ips", "params",
                 "bytes", "image_size")
RECORD_OPTIONAL = ("macs", "peak_memory_bytes", "cv", "tail", "rounds", "unstable", "provider", "fell_back", "nms_ms",
                   "layers", "side_by_side_ms", "side_by_side_speedup")
SIDE_BY_SIDE = {"rounds": 10, "per_round": 5, "warmup": 3}  # calls per candidate in the side-by-side pass


@register_stage
class BenchLatency(Stage):
    name = "bench.latency"
    version = "8"  # what each version changed is in git log
    inputs = ("export.convert",)
    optional_inputs = ("student.finetune", "teacher.finetune", "student.qat")  # the models behind the artifacts

    def read_inputs(self, recipe) -> Sequence[str]:
        """student.qat only in the builds that export it: the others' keys stay as they were."""
        return (*self.inputs, *(s for s in self.optional_inputs
                                if s != "student.qat" or QAT_MODEL in recipe.export.models))

    def config(self, recipe) -> Dict[str, Any]:
        return {"bench": recipe.bench.model_dump(mode="json")}

    def skip_reason(self, recipe):
        return None if recipe.bench.runtimes else "bench.runtimes is empty"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        b = ctx.recipe.bench
        export = ctx.input("export.convert")
        runtimes = timed_runtimes(b.runtimes, export.result["artifacts"])
        rows: List[Dict[str, Any]] = []
        unavailable: List[Dict[str, Any]] = []
        tables: List[Dict[str, Any]] = []  # one per (artifact, runtime): its layer table's summary, or why none
        models = sorted({a["model"] for a in export.result["artifacts"]})
        for which in models:
            folder = ctx.input(MODEL_SOURCES[which]).path("model")
            spec = json.loads((folder / "spec.json").read_text())
            pp = Preprocess.from_dict(spec["preprocess"])
            eager = load_model(folder)
            params = sum(p.numel() for p in eager.parameters())
            try:
                folded, _ = fold_model(eager, spec, torch.zeros(1, 3, *pp.hw))
            except ToolchainError:  # an adapter that does not fold: export said so; there is no folded model
                folded = None
            macs = count_macs(folded or eager, pp.hw)
            # a detector is timed as it ships: with the NMS the export put in its graph, under the same settings
            nms = nms_settings(export.result, ctx.recipe)
            eager = deployable(eager, nms)
            folded = deployable(folded, nms) if folded is not None else None
            candidates = []
            if "pytorch" in runtimes and which != QAT_MODEL:  # the QAT student lives in its artifacts only
                candidates.append((f"{which} eager (unfolded)", "pytorch", eager, None))
                if folded is not None:
                    candidates.append((f"{which} eager (folded)", "pytorch", folded, None))
            for art in export.result["artifacts"]:
                if art["model"] != which or art.get("status") != "ok":
                    continue
                family = FORMATS.meta(art["kind"])["runtime"] if art["kind"] in FORMATS else None
                for rt in runtimes:
                    if family is not None and RUNTIMES.meta(rt)["runs"] == family:
                        candidates.append((f"{which} {art['kind']}", rt, export.dir / art["path"], art))
            bar = Track(f"timing {which}: {len(candidates)} artifacts x {len(b.batch_sizes)} batch sizes",
                        len(candidates) * len(b.batch_sizes), unit="row", log=ctx.log)
            with bar:
                for label, rt, obj, art in candidates:
                    try:
                        run = RUNTIMES.get(rt)(obj, b.threads, **options_for(rt, art))
                    except Unavailable as why:
                        unavailable.append({"artifact": label, "runtime": rt, "reason": str(why)})
                        ctx.log.info("%-28s %-12s unavailable: %s", label, rt, why)
                        if art is not None:  # its layer table's row says why there is none
                            tables.append({"artifact": label, "runtime": rt, "reason": f"not run here: {why}"})
                        continue
                    peaks = {}
                    if b.memory:  # in a fresh process per candidate: see bench/memory_probe.py
                        source = folder if art is None else obj
                        peaks = probe_memory(rt, source, pp.hw, b.batch_sizes, b.threads, fold=obj is folded,
                                             detection=nms if art is None else None)
                    for bs in b.batch_sizes:
                        x = np.random.default_rng(0).standard_normal((bs, 3, *pp.hw)).astype(np.float32)
                        if nms_seconds(run) is not None:
                            run.nms_log.clear()
                        stats = measure_stable(run, x, b.warmup, b.iters, b.repeats, b.max_cv, b.max_tail)
                        if nms_seconds(run) is not None:  # the runtime layer's NMS in those same calls
                            stats["nms_ms"] = float(np.median(run.nms_log) * 1000.0)
                        row = {"artifact": label, "model": which, "runtime": rt, "batch": bs, "image_size": pp.size,
                               "params": params, "macs": macs, "bytes": art["bytes"] if art else None,
                               "peak_memory_bytes": peaks.get(bs), "provider": getattr(run, "provider", None),
                               "fell_back": getattr(run, "fell_back", None) or None,
                               **stats}
                        rows.append(row)
                        bar.advance()
                        ctx.log.info("%-28s %-12s batch %3d  p50 %.2f ms  p90 %.2f ms%s", label, rt, bs, row["p50_ms"],
                                     row["p90_ms"], f"  UNSTABLE ({row['unstable']})" if row.get("unstable") else "")
                    del run
                    if art is not None:  # an artifact: its runtime's account of its layers, at batch 1
                        mine = [r for r in rows if r["artifact"] == label and r["runtime"] == rt]
                        tables.append(layer_table(ctx, rt, obj, art, label, pp.hw, mine, macs))
            side_by_side(ctx, candidates, rows, pp.hw)
        threads = b.threads or torch.get_num_threads()
        result = {"bench": rows, "unavailable": unavailable, "layers": tables, "threads": threads,
                  "machine": devices.describe(threads),
                  "memory": "peak resident memory the runtime added, measured in a fresh process per artifact "
                            "(weights, workspace, activations at that batch)" if b.memory else "not measured"}
        if "detection" in export.result:
            result["detection"] = export.result["detection"]
        return result

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """Every row measured, what could not be measured and why, what reduced precision bought, and the
        accuracy-vs-latency points (each artifact at its model's test score)."""
        rows, unavailable = out.result.get("bench", []), out.result.get("unavailable", [])
        artifacts = build.input("export.convert").result.get("artifacts", [])
        kept = [{k: r[k] for k in RECORD_FIELDS} | {k: r.get(k) for k in RECORD_OPTIONAL} for r in rows]
        section = ReportSection(record={"bench": kept}, points=_points(rows, artifacts, build))
        if not rows and not unavailable:
            return section
        section.title = "Latency"
        L = section.lines
        machine = out.result.get("machine") or f"this machine, {out.result.get('threads')} threads"
        L += [f"Measured on {machine}.", "",
              "| artifact | runtime | batch | p50 ms | p90 ms | p99 ms | images/s | params | MACs | size | "
              "peak memory |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        L += [f"| {x['artifact']} | {_runtime(x)} | {x['batch']} | {latency_cell(x)} | {latency_cell(x, 'p90_ms')} | "
              f"{latency_cell(x, 'p99_ms')} | {_ips(x)} | {x['params'] / 1e6:.2f}M | {_giga(x.get('macs'))} | "
              f"{_size(x['bytes'])} | {_size(x.get('peak_memory_bytes'))} |" for x in rows]
        L += [f"\n{x['artifact']} on {x['runtime']} at batch {x['batch']}: {x['unstable']}; rerun on an idle machine "
              f"(`toolchain build` re-measures when the bench settings change)" for x in rows if x.get("unstable")]
        first = min((x["batch"] for x in rows), default=1)
        L += [f"\n{x['artifact']} on {x['runtime']}: ran on {x['provider']} after {'; '.join(x['fell_back'])}"
              for x in rows if x.get("fell_back") and x["batch"] == first]
        L += [f"\nnot measured: {u['artifact']} on {u['runtime']} ({u['reason']})" for u in unavailable]
        nms = out.result.get("detection")
        if nms:  # what a detection row includes, and what its inputs cannot show
            L += [f"\nDetection rows include the NMS (score > {nms['score_thresh']}, IoU {nms['iou']}, at most "
                  f"{nms['max_det']} per image), in the eager rows as in the artifact's graph; the inputs are random "
                  f"noise, as on the device bundle, so the NMS sees the candidates noise gives, not a busy scene's. "
                  f"MACs are the dense detector's. The plot draws each artifact at its own test mAP50 and the eager "
                  f"rows at the PyTorch model's."]
            shares = [x for x in rows if x.get("nms_ms") is not None]
            if shares:  # formats whose graph holds no NMS: the runtime layer's NumPy NMS finishes them
                L += ["\nNMS outside the graph (ExecuTorch, LiteRT: export/runtimes/nms.py, the NMS an app ports), "
                      "included in p50 above: " + "; ".join(
                          f"{x['artifact']} batch {x['batch']} {x['nms_ms']:.2f} ms of {x['p50_ms']:.2f} ms"
                          for x in shares)]
        paired = [x for x in rows if x.get("side_by_side_ms") is not None]
        if paired:
            L += ["", f"Side by side at batch {paired[0]['batch']}: each model's candidates timed in turn, "
                      f"{SIDE_BY_SIDE['rounds']} rounds of {SIDE_BY_SIDE['per_round']} calls, the median of each; "
                      f"drift in the machine's speed hits them alike, so these ratios hold where a row above may "
                      f"have caught a slow minute.", "", "| artifact | runtime | side by side ms | speed-up over "
                      "ONNX Runtime fp32 (`onnx`) |", "|---|---|---|---|"]
            L += [f"| {x['artifact']} | {_runtime(x)} | {x['side_by_side_ms']:.2f} | "
                  f"{_speedup(x)} |" for x in paired]
        changes = precision_changes(rows, artifacts)
        if changes:
            L += [""] + changes
        tables = out.result.get("layers") or []
        if tables:  # each artifact's layer table: a section of its own right after the latency rows
            L += ["", "## Where the time goes", ""] + layer_report.section_lines(tables, machine, "layers/")
            section.files.update({e["file"]: e["file"] for e in tables if e.get("file")})
        return section


def layer_table(ctx: StageContext, rt: str, path: Path, art: Dict[str, Any], label: str, hw, mine: List[Dict],
                model_macs: Optional[int]) -> Dict[str, Any]:
    """The runtime's layer table of one artifact at batch 1 (its file's ``layers``, with the entry's and the export
    record's options, as ``load`` got them), each fallen-back row with why (bench/layer_report.py), written to
    ``layers/<artifact>__<runtime>.json``; its summary goes in the result and in the smallest batch's row.  A
    runtime without one, or one that fails, gives the reason instead: never the stage's failure."""
    entry = {"artifact": label, "runtime": rt}
    first = min(mine, key=lambda r: r["batch"]) if mine else None
    fn = layers_for(rt)
    if fn is None:
        entry["reason"] = f"{rt}'s runtime file has no layers()"
    else:
        t0 = time.perf_counter()
        # as many profiled calls as the bench times (bench.iters, 10 at least, 50 at most), fewer for a slow model
        runs = layer_report.profiled_runs(first["p50_ms"] / first["batch"] if first else None, ctx.recipe.bench.iters)
        x = np.random.default_rng(0).standard_normal((1, 3, *hw)).astype(np.float32)
        try:
            table = fn(path, x, ctx.recipe.bench.threads, warmup=layer_report.WARMUP, runs=runs,
                       **options_for(rt, art))
            layer_report.annotate(table, art, path)
            rel = f"layers/{label.replace(' ', '_')}__{rt}.json"
            atomic_write_json(ctx.workdir / rel, table)
            entry.update(file=rel, summary=layer_report.summarize(table, model_macs))
            ctx.log.info("%-28s %-12s layer table: %d rows, %d runs, %.1f s", label, rt, len(table["rows"]), runs,
                         time.perf_counter() - t0)
        except Unavailable as why:
            entry["reason"] = str(why).splitlines()[0] if str(why) else "unavailable"
        except Exception as exc:  # a profiler this runtime build lacks, an odd graph: said, never the stage's failure
            entry["reason"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            ctx.log.warning("%s on %s: no layer table (%s)", label, rt, entry["reason"])
    if first is not None:
        first["layers"] = layer_report.compact(entry["summary"], entry["file"]) if "summary" in entry else \
            {"file": None, "timed": False, "why_untimed": entry["reason"], "sum_over_total": None,
             "delegated_mac_share": None, "int8_mac_share": None}
    return entry


def side_by_side(ctx: StageContext, candidates: List[tuple], rows: List[Dict[str, Any]], hw) -> None:
    """The model's candidates that got a row, timed side by side at the smallest batch (``round_robin``,
    ``SIDE_BY_SIDE`` calls each): each of their rows at that batch gets ``side_by_side_ms``, the median of its calls
    there, and ``side_by_side_speedup``, how many times faster than the model's fp32 ONNX artifact on ONNX Runtime
    it ran in the pass (the usual baseline of an on-device runtime) where that artifact was in it.  Every runtime is
    loaded at once for it; one that will not load again is left out of the pass."""
    b = ctx.recipe.bench
    batch = min(b.batch_sizes)
    timed = {(r["artifact"], r["runtime"]) for r in rows if r["batch"] == batch}
    runs = {}
    for label, rt, obj, art in candidates:
        if (label, rt) in timed:
            try:
                runs[f"{label} on {rt}"] = RUNTIMES.get(rt)(obj, b.threads, **options_for(rt, art))
            except Unavailable:
                continue
    if len(runs) < 2:
        return
    ctx.log.info("timing %d candidates side by side at batch %d: %d rounds of %d calls each", len(runs), batch,
                 SIDE_BY_SIDE["rounds"], SIDE_BY_SIDE["per_round"])
    x = np.random.default_rng(0).standard_normal((batch, 3, *hw)).astype(np.float32)
    p50 = round_robin(runs, x, **SIDE_BY_SIDE)
    for r in rows:
        key = f"{r['artifact']} on {r['runtime']}"
        if r["batch"] == batch and key in p50:
            r["side_by_side_ms"] = round(float(p50[key]), 4)
    for r in rows:
        ratio = _side_by_side_ratio(r, rows)
        if ratio:
            r["side_by_side_speedup"] = round(ratio, 4)
    del runs


def _speedup(row: Dict[str, Any]) -> str:
    return f"{row['side_by_side_speedup']:.2f}x" if row.get("side_by_side_speedup") else ""


def _side_by_side_ratio(row: Dict[str, Any], rows: List[Dict[str, Any]]) -> Optional[float]:
    """The row's ``side_by_side_speedup``; None without both medians, or for the baseline itself."""
    model = row["artifact"].split(" ", 1)[0]
    base = next((r for r in rows if r["artifact"] == f"{model} onnx" and r["runtime"].startswith("onnxruntime")
                 and r["batch"] == row["batch"] and r.get("side_by_side_ms")), None)
    if base is None or base is row or not row.get("side_by_side_ms"):
        return None
    return base["side_by_side_ms"] / row["side_by_side_ms"]


def nms_settings(export_result: Dict[str, Any], recipe) -> Optional[Dict[str, Any]]:
    """What the artifacts ship with (a detector's NMS settings) as the export stage recorded it, else as the
    recipe's task says (toolchain/tasks/ ``artifact_settings``); None when the task ships the network alone."""
    return export_result.get("detection") or task_of(recipe).artifact_settings(recipe)


def timed_runtimes(requested: List[str], artifacts: List[Dict[str, Any]]) -> List[str]:
    """``bench.runtimes`` with ``auto`` expanded: pytorch, then for each exported artifact's family the runtime of
    the same name (the family's default: ``onnxruntime`` takes the best provider present)."""
    out: List[str] = []
    for rt in requested:
        if rt != "auto":
            RUNTIMES.check(rt)
            names = [rt]
        else:
            families = [FORMATS.meta(a["kind"])["runtime"] for a in artifacts
                        if a.get("status") == "ok" and a["kind"] in FORMATS]
            names = ["pytorch"] + [f for f in families if f in RUNTIMES]
        for n in names:
            if n not in out:
                out.append(n)
    return out


@torch.no_grad()
def count_macs(model: torch.nn.Module, size: ImageSize) -> Optional[int]:
    """Multiply-accumulates of one image of ``size``, a side or (h, w) (PyTorch's FLOP counter over matmuls,
    convolutions and attention, halved); None when the model cannot be traced by it."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    dense = getattr(model, "dense_output", None)  # a detector: its network's one dense tensor, no NMS
    try:
        if dense is not None:
            model.dense_output = True
        with counter:
            model.eval()(torch.zeros(1, 3, *image_hw(size)))
    except Exception:  # an op the counter cannot dispatch: report MACs as unknown, never fail the bench
        return None
    finally:
        if dense is not None:
            model.dense_output = dense
    return int(counter.get_total_flops()) // 2


def _runtime(row: Dict[str, Any]) -> str:
    """The runtime, and for ONNX Runtime the execution provider that actually ran."""
    provider = row.get("provider")
    return f"{row['runtime']} ({provider.replace('ExecutionProvider', '')})" if provider else row["runtime"]


def _ips(row: Dict[str, Any]) -> str:
    return "" if row.get("unstable") else f"{row['throughput_ips']:.0f}"


def _giga(n: Optional[int]) -> str:
    return "" if n is None else f"{n / 1e9:.2f}G"


def _size(nbytes: Optional[int]) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:.1f} MB"


_MARKERS = "os^D"  # one per model on the plot; "x" is the model that was not exported


def _points(rows: List[Dict[str, Any]], artifacts: List[Dict[str, Any]], build: ReportContext) -> List[Point]:
    """One point per (artifact, runtime) steadily timed at batch 1, at the test score of the model it was exported
    from (a reduced-precision artifact at its own measured score), named as that score asks; a model of the same
    architecture that was not exported (the labels-only student) once, at the unfolded eager latency."""
    own = {f"{a['model']} {a['kind']}": a["test_score"] for a in artifacts if a.get("test_score") is not None}
    models = sorted({r["model"] for r in rows})
    detection = _detection_scores(artifacts, build)
    points = []
    for r in (r for r in rows if r["batch"] == 1 and not r.get("unstable")):
        label, model, ms = r["artifact"], r["model"], r["p50_ms"]
        runtime = f" [{r['runtime']}]" if r["runtime"] not in ("pytorch", "onnxruntime") else ""
        for s in build.scores(model):
            if detection is not None:  # mAP50 on the plot, whatever the accuracy table's main metric
                s = detection(s, model)
            if s.plot is None or s.value is None:
                continue
            if s.exported:
                marker = _MARKERS[models.index(model) % len(_MARKERS)]
                points.append(Point(f"{s.plot}{label[len(model):]}{runtime}", ms, own.get(label, s.value), marker))
            elif "unfolded" in label:
                points.append(Point(s.plot, ms, s.value, "x"))
    return points


def _detection_scores(artifacts: List[Dict[str, Any]], build: ReportContext):
    """For a detection build, ``score(s, model)``: the score ``s`` with mAP50 for its value, so the plot is in one
    metric: an exported model's is the test mAP50 the export stage measured on the PyTorch model (each artifact
    is drawn at its own, through ``own``), a model that was not exported its stage's ``test_map50`` (None when
    that stage reports none: the point is left out rather than drawn in another metric).  None otherwise."""
    pytorch = {a["model"]: a["pytorch_test_map50"] for a in artifacts if a.get("pytorch_test_map50") is not None}
    if not pytorch:  # no artifact scored as a detector
        return None
    stage_of = {id(s): name for name, sec in build.sections.items() for s in sec.scores}

    def score(s: Score, model: str) -> Score:
        if s.exported:
            value = pytorch.get(model)
        else:
            out = build.inputs.get(stage_of.get(id(s), ""))
            value = (out.result.get("metrics") or {}).get("test_map50") if out is not None else None
        return dataclasses.replace(s, value=value)

    return score


def _fp32_sibling(a: Dict[str, Any], artifacts: List[Dict[str, Any]]) -> str:
    """The fp32 artifact of the same model and runtime family (onnx for onnx_int8, executorch for executorch_int8)."""
    family = FORMATS.meta(a["kind"])["runtime"]
    for b in artifacts:
        if b["model"] == a["model"] and b.get("status") == "ok" and b.get("accuracy_drop") is None and \
                FORMATS.meta(b["kind"])["runtime"] == family and b.get("precision", "fp32") == "fp32":
            return f"{b['model']} {b['kind']}"
    return f"{a['model']} onnx"


def precision_changes(bench: List[Dict[str, Any]], artifacts: List[Dict[str, Any]]) -> List[str]:
    """One line per reduced-precision artifact: its accuracy drop and its batch-1 latency against the fp32
    artifact of its runtime family on the same runtime (and their ratio side by side where both were in that pass),
    the two numbers that decide whether to ship it."""
    p50 = {(r["artifact"], r["runtime"]): r["p50_ms"] for r in bench if r["batch"] == 1 and not r.get("unstable")}
    paired = {(r["artifact"], r["runtime"]): r["side_by_side_ms"] for r in bench
              if r["batch"] == 1 and r.get("side_by_side_ms")}
    lines = []
    for a in artifacts:
        if a.get("accuracy_drop") is None:
            continue
        label, base = f"{a['model']} {a['kind']}", _fp32_sibling(a, artifacts)
        for (art, rt), ms in p50.items():
            if art == label and (base, rt) in p50:
                both = (label, rt) in paired and (base, rt) in paired
                lines.append(f"- {label}: test {metric_label(a['metric'])} {100 * a['test_score']:.1f}% "
                             f"({-100 * a['accuracy_drop']:+.1f} points against fp32), p50 {ms:.2f} ms against "
                             f"{p50[(base, rt)]:.2f} ms fp32 on {rt} ({ms / p50[(base, rt)]:.2f}x"
                             + (f"; side by side {paired[(label, rt)] / paired[(base, rt)]:.2f}x)" if both else ")"))
    return lines

