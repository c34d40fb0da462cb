"""``report``: ``report.md`` a person reads, a plot, and the machine-readable parts of ``build.json``.

The report knows no stage's result.  Each stage describes its own (``Stage.report`` returns a ``ReportSection``,
toolchain/stage.py); the report asks them in the order the build ran them and assembles:

- the header, "What was built" (the stages' summary bullets) and the accuracy table (their scores, and the
  findings under it);
- each stage's own section, in pipeline order;
- first, right under the title, what the user asked the build (issue 66): the artifact to ship for the recipe's
  ``target`` (or for each target an exported artifact serves), how accurate, fast and large it is, and every
  artifact left out and why (:func:`first_screen`, from build.json's ``artifacts`` and ``bench``);
- what only the whole build can say: the recommended artifact per model and deployment target, the
  accuracy-vs-latency plot (from the stages' points) and, for detection, the sheet of test images with each
  detector's boxes beside the ground truth (from the stages' ``sheet`` models, bench/detection_sheet.py);
- every stage's status, and every warning.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from vfm_toolchain.bench import layer_report
from vfm_toolchain.bench.detection_sheet import build_sheet
from vfm_toolchain.core.files import atomic_write, atomic_write_bytes
from vfm_toolchain.stage import (PIPELINE, STAGES, Point, ReportContext, ReportSection, Score, Stage, StageContext,
                                 StageOutput, metric_label, percent, register_stage)
from vfm_toolchain.training import metric_name

__all__ = ["Report", "stage_sections", "report_markdown", "first_screen", "recommendations", "pareto_front"]


def stage_sections(recipe, outputs: Dict[str, StageOutput], history: List[Dict[str, Any]]) -> Dict[str, ReportSection]:
    """Each stage's section by stage name, asked in the order the build ran them (pipeline order), so a stage sees
    the sections of those before it.  A skipped stage has no output and says nothing."""
    build = ReportContext(recipe, outputs)
    for h in history:
        out = outputs.get(h["name"])
        if out is None or h["name"] == Report.name:
            continue
        section = STAGES.get(h["name"])().report(out, build)
        if section is not None:
            build.sections[h["name"]] = section
    return build.sections


def build_record(sections: Dict[str, ReportSection]) -> Dict[str, Any]:
    """build.json's machine-readable parts: the scores as ``metrics``, and what each stage put in its record (a
    dict that two stages fill, such as ``teacher``, merges)."""
    record: Dict[str, Any] = {"metrics": {}, "artifacts": [], "bench": []}  # present, if empty: scripts index them
    for section in sections.values():
        record["metrics"].update({s.key: s.value for s in section.scores})
        for k, v in section.record.items():
            both = isinstance(v, dict) and isinstance(record.get(k), dict)
            record[k] = {**record[k], **v} if both else v
    return record


def report_markdown(recipe, sections: Dict[str, ReportSection], history: List[Dict[str, Any]],
                    recs: List[Dict[str, str]], warnings: List[str], has_plot: bool, sheet: str = "",
                    screen: Sequence[str] = ()) -> str:
    """``report.md``: the title, the first screen (``screen``, :func:`first_screen`), then the build's parts, the
    stages last."""
    L = [f"# Build report: {recipe.name}", "", *screen]
    summary = [f"- {line}" for s in sections.values() for line in s.summary]
    if summary:
        L += ["## What was built", "", *summary, ""]
    scores = [x for s in sections.values() for x in s.scores]
    if scores:
        L += ["## Accuracy (held-out test set)", "", f"| model | test {metric_label(metric_name(recipe.data.task))} |",
              "|---|---|", *(f"| {x.label} | {percent(x.value)} |" for x in scores), ""]
        for finding in (f for s in sections.values() for f in s.findings):
            L += [finding, ""]
    for s in sections.values():
        if s.title:
            L += [f"## {s.title}", ""]
        if s.lines:
            L += s.lines + [""]
    if sheet:
        L += ["## Test images", "", sheet, "", "![test images with boxes](detections.png)", ""]
    if recs:
        L += ["## Recommended artifact per target", "", "| model | target | artifact | why |", "|---|---|---|---|"]
        L += [f"| {x['model']} | {x['target']} | {x['artifact']} | {x['why']} |" for x in recs] + [""]
    if has_plot:
        L += ["![accuracy vs latency](accuracy_vs_latency.png)", ""]
    L += ["## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
    for h in history:
        if h["name"] == Report.name:
            continue
        L.append(f"| {h['name']} | {h['status']} | {h.get('seconds') or h.get('ran_seconds') or 0:.1f} | "
                 f"{h.get('reason') or ''} |")
    L += ["", "## Warnings", ""] + ([f"- {w}" for w in warnings] or ["none"]) + [""]
    return "\n".join(L)


# which measured rows speak for a target: the runtime family that ran, and for ONNX Runtime the provider
_SERVES = {
    "cpu": lambda fam, provider: fam == "onnxruntime" and "cpu" in provider,
    "x86": lambda fam, provider: fam in ("onnxruntime", "openvino") and "cpu" in provider,
    "nvidia": lambda fam, provider: fam == "tensorrt" or (fam == "onnxruntime" and ("cuda" in provider or
                                                                                    "tensorrt" in provider)),
    "android": lambda fam, provider: fam in ("executorch", "litert", "ncnn"),
    "ios": lambda fam, provider: fam == "coreml",
}
_NOT_TIMED = {"ios": "Core ML runs on macOS / iOS only", "nvidia": "no TensorRT engine or CUDA ONNX Runtime timed here",
              "android": "no ExecuTorch / LiteRT / NCNN runtime timed here", "x86": "no CPU runtime timed here",
              "cpu": "no ONNX Runtime CPU row timed here"}
_ON_DEVICE = "time it on the device with `toolchain bench --bundle`"


def _serves(target: str, row: Dict[str, Any]) -> bool:
    from vfm_toolchain.export.runtimes import RUNTIMES

    return _SERVES[target](RUNTIMES.meta(row["runtime"])["runs"], (row.get("provider") or row["runtime"]).lower())


def _label(a: Dict[str, Any]) -> str:
    """How the measured rows name an artifact: ``student onnx_int8``."""
    return f"{a['model']} {a['kind']}"


def _first_rows(bench: List[Dict[str, Any]]) -> Tuple[int, List[Dict[str, Any]]]:
    """The smallest batch timed (1 unless the recipe left it out) and every row at it on a runtime known here."""
    from vfm_toolchain.export.runtimes import RUNTIMES

    first = min((r["batch"] for r in bench), default=1)
    return first, [r for r in bench if r["batch"] == first and r["runtime"] in RUNTIMES]


def _timed(target: str, cands: List[Dict[str, Any]], rows: List[Dict[str, Any]]) -> List[Tuple[float, int, Dict]]:
    """(p50, index in ``cands``, row) of every steady row of ``cands`` on a runtime that speaks for ``target``,
    fastest first (an unstable row is not a measurement)."""
    return sorted(((r["p50_ms"], i, r) for i, a in enumerate(cands) for r in rows
                   if r["artifact"] == _label(a) and not r.get("unstable") and _serves(target, r)),
                  key=lambda t: t[:2])


def _targets(a: Dict[str, Any]) -> Tuple[str, ...]:
    from vfm_toolchain.export.formats import FORMATS

    return FORMATS.meta(a["kind"])["targets"] if a["kind"] in FORMATS else ()


def recommendations(bench: List[Dict[str, Any]], artifacts: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """One artifact per model and deployment target (the targets each format declares), from build.json's measured
    rows, chosen as the first screen chooses (:func:`_choose`) among the model's artifacts that passed their gate
    (every ``ok`` artifact did): the fastest steady batch-1 row on a runtime that speaks for the target; where
    nothing was timed for a target, the first candidate in ``export.formats`` order, saying so."""
    from vfm_toolchain.export.formats.base import TARGETS

    ok = [a for a in artifacts if a.get("status") == "ok"]
    first, rows = _first_rows(bench)
    out = []
    for model in sorted({a["model"] for a in ok}):
        mine = [a for a in ok if a["model"] == model]
        for target in TARGETS:
            if not any(target in _targets(a) for a in mine):
                continue
            pick, row, _, slower = _choose(target, mine, rows, float("inf"), "")
            if row is not None:
                gate = "passed its accuracy gate" if pick.get("accuracy_drop") is not None else "passed parity"
                rest = "; ".join(f"{a['kind']} {ms:.2f} ms" for a, ms in slower)
                why = (f"fastest at batch {first} on {row['runtime']} here: {row['p50_ms']:.2f} ms"
                       + (f" (vs {rest})" if rest else "") + f"; {gate}")
                if target == "android":
                    why += "; XNNPACK on this x86 CPU is indicative only: confirm on the phone (android_bench.sh)"
            else:
                why = f"not timed here ({_NOT_TIMED[target]}); time it on the device: toolchain bench --bundle"
            out.append({"model": model, "target": target, "artifact": pick["kind"], "why": why})
    return out


def _gate_failure(a: Dict[str, Any], max_drop: float, metric: str) -> Optional[str]:
    """Why an artifact with an accuracy verdict (reduced precision: its own test score against fp32) fails its
    gate, with the numbers; None when it has no verdict or passed."""
    drop = a.get("accuracy_drop")
    if drop is None or (a.get("status") == "ok" and a.get("passed", True) and drop <= max_drop + 1e-12):
        return None
    return (f"failed its accuracy gate: test {metric_label(a.get('metric') or metric)} {percent(a.get('test_score'))} "
            f"against fp32 {percent(a.get('fp32_test_score'))}, {100 * drop:.1f} points down "
            f"(export.max_accuracy_drop allows {100 * max_drop:.1f})")


def _runtime_text(row: Dict[str, Any]) -> str:
    """The runtime and the provider that ran: ``onnxruntime / CPUExecutionProvider``."""
    provider = row.get("provider")
    return row["runtime"] + (f" / {provider}" if provider and provider.lower() != row["runtime"] else "")


def _choose(target: str, artifacts: List[Dict[str, Any]], rows: List[Dict[str, Any]], max_drop: float,
            metric: str) -> Tuple[Optional[Dict[str, Any]], Optional[Dict[str, Any]], Dict[str, str],
                                  List[Tuple[Dict[str, Any], float]]]:
    """For one target: the artifact to ship (the fastest steady row among the artifacts that serve it and passed
    their gate, the student's before the teacher's; untimed: the first in ``export.formats`` order), its row
    (None: not timed here), why each other artifact was left out, by label, and the slower timed candidates with
    their best p50."""
    def unfit(a: Dict[str, Any]) -> Optional[str]:
        if a.get("status") not in ("ok", "failed") or (a.get("status") == "failed" and "accuracy_drop" not in a):
            return f"not made here: {a.get('reason') or a.get('status')}"
        return _gate_failure(a, max_drop, metric)

    why = {_label(a): unfit(a) for a in artifacts if unfit(a)}
    serving = [a for a in artifacts if _label(a) not in why and target in _targets(a)]
    cands = [a for a in serving if a["model"] != "teacher"] or serving
    for a in artifacts:
        if _label(a) in why:
            continue
        if target not in _targets(a):
            why[_label(a)] = f"made for {', '.join(_targets(a)) or 'no target'}, not {target}"
        elif a not in cands:
            why[_label(a)] = "the teacher, exported for comparison: the student is what ships"
    timed = _timed(target, cands, rows)
    pick, row = (cands[timed[0][1]], timed[0][2]) if timed else (cands[0] if cands else None, None)
    best = {}
    for ms, i, r in timed:
        best.setdefault(i, (ms, r))
    slower = [(cands[i], ms) for i, (ms, _) in best.items() if cands[i] is not pick]
    for i, a in enumerate(cands):
        if a is pick:
            continue
        if i in best:
            why[_label(a)] = (f"slower: {best[i][0]:.2f} ms p50 on {_runtime_text(best[i][1])} against "
                              f"{timed[0][0]:.2f} ms")
        else:
            shaky = [r for r in rows if r["artifact"] == _label(a) and r.get("unstable") and _serves(target, r)]
            why[_label(a)] = (f"its timing here was unstable ({shaky[0]['unstable']}), so not compared" if shaky else
                              f"not timed here for {target}" + ("" if timed else
                                                                "; the first exported is named instead"))
    return pick, row, why, slower


def _accuracy_text(a: Dict[str, Any], scores: Sequence[Score], metric: str, cell: bool = False) -> str:
    """The pick's test score: its own where the export stage measured it through the artifact, else the score of
    the PyTorch model it was exported from (which it matched at parity), saying which; ``cell``: for a table."""
    label = "" if cell else f" test {metric_label(a.get('metric') or metric)}"
    if a.get("test_score") is not None:
        ref = ("fp32", a.get("fp32_test_score")) if a.get("fp32_test_score") is not None else \
            ("PyTorch", a.get("pytorch_test_map50"))
        return (f"{percent(a['test_score'])}{label}, measured through this artifact"
                + (f" ({ref[0]}: {percent(ref[1])})" if ref[1] is not None else ""))
    s = next((s for s in scores if s.model == a["model"] and s.exported and s.value is not None), None)
    if s is None:
        return f"{label or 'test score'} not measured".strip()
    how = (f"parity not checked here: {a['parity_skipped']}" if a.get("parity_skipped") else
           "matched at parity" if cell else "this artifact matched it at parity")
    return (f"{percent(s.value)}, the PyTorch {a['model']}'s; {how}" if cell else
            f"{percent(s.value)}{label}, the PyTorch {a['model']}'s ({s.label}); {how}")


def _shaky(target: str, pick: Dict[str, Any], rows: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """An unstable row of the pick on a runtime that speaks for ``target``: it was timed, but not steadily."""
    return next((r for r in rows if r["artifact"] == _label(pick) and r.get("unstable") and _serves(target, r)), None)


def _latency_text(target: str, row: Optional[Dict[str, Any]], first: int, machine: Optional[str],
                  cell: bool = False, shaky: Optional[Dict[str, Any]] = None) -> str:
    """The pick's p50 and what ran it, and its speed-up over the fp32 ONNX artifact timed side by side (the bench
    row's ``side_by_side_speedup``), or why it was not timed and how to time it; ``cell``: for a table under which
    the machine is named once."""
    if row is None and shaky is not None:  # timed, but too noisy to stand for the artifact: say so, not "untimed"
        return (f"timed here but unstable ({shaky['unstable']}; {shaky['p50_ms']:.2f} ms p50 is no measurement): "
                f"rerun on an idle machine, or {_ON_DEVICE}")
    if row is None:
        return f"not timed here: {_NOT_TIMED[target]}; {_ON_DEVICE}"
    text = (f"{row['p50_ms']:.2f} ms p50 on {_runtime_text(row)}, measured here" if cell else
            f"{row['p50_ms']:.2f} ms p50 at batch {first} on {_runtime_text(row)}, measured here on "
            f"{machine or 'this machine'}")
    ratio = row.get("side_by_side_speedup")
    if ratio:
        text += (f" ({ratio:.2f}x ONNX Runtime fp32 side by side)" if cell else
                 f"; {ratio:.2f}x the speed of the fp32 `onnx` artifact on ONNX Runtime, timed side by side")
    return text + ("; XNNPACK on this CPU is indicative only: confirm on the phone" if target == "android" else "")


def _artifact_text(a: Dict[str, Any]) -> str:
    from vfm_toolchain.export.formats import FORMATS

    declared = FORMATS.meta(a["kind"])["precision"] if a["kind"] in FORMATS else ""
    precision = a.get("precision") or ("" if declared.startswith("options.") else declared)
    return f"`{a.get('path') or a['kind']}` ({_label(a)}{', ' + precision if precision else ''})"


def first_screen(recipe, artifacts: List[Dict[str, Any]], bench: List[Dict[str, Any]], scores: Sequence[Score],
                 machine: Optional[str] = None) -> List[str]:
    """The report's first screen (issue 66), the answer to what the build was asked: for ``recipe.target`` (None:
    each target an artifact that passed its gate serves) the artifact to ship, its test score, its batch-1 p50
    and where it was measured (or why it was not, and how to time it), its size, then every artifact left out
    and why.  From build.json's ``artifacts`` and ``bench`` and the stages' scores; [] when nothing was exported
    and no target was asked for."""
    from vfm_toolchain.export.formats import FORMATS
    from vfm_toolchain.export.formats.base import TARGETS

    metric, max_drop = metric_name(recipe.data.task), recipe.export.max_accuracy_drop
    first, rows = _first_rows(bench)
    chosen = {t: _choose(t, artifacts, rows, max_drop, metric) for t in ([recipe.target] if recipe.target else TARGETS)}
    if not recipe.target:  # the targets something that passed its gate serves
        chosen = {t: c for t, c in chosen.items() if c[0] is not None}
    asked = list(chosen)
    if not asked:
        return []
    L = ["## Ship this", ""]
    if recipe.target:
        t = recipe.target
        pick, row, why, _ = chosen[t]
        if pick is None:
            fit = [f for f in FORMATS.list() if t in FORMATS.meta(f)["targets"]]
            L += [f"For **{t}** (the recipe's `target`) nothing this build exported can ship: add one of "
                  f"{', '.join(fit)} to `export.formats`.", ""]
        else:
            L += [f"For **{t}** (the recipe's `target`), ship {_artifact_text(pick)}.", "",
                  f"- Accuracy: {_accuracy_text(pick, scores, metric)}",
                  f"- Latency: {_latency_text(t, row, first, machine, shaky=_shaky(t, pick, rows))}",
                  f"- Size: {pick['bytes'] / 1e6:.2f} MB on disk"]
            layers = layer_report.first_screen_line((row or {}).get("layers"))
            L += [layers] if layers else []
        left = [(_label(a), why[_label(a)]) for a in artifacts if _label(a) in why]
    else:
        L += ["No `target` in the recipe (`toolchain init --target` writes one): the artifact to ship for each target "
              "this build exported for.", "",
              f"| target | ship | test {metric_label(metric)} | batch-{first} latency | size |",
              "|---|---|---|---|---|"]
        for t, (pick, row, _, _) in chosen.items():
            L.append(f"| {t} | {_artifact_text(pick)} | {_accuracy_text(pick, scores, metric, cell=True)} | "
                     f"{_latency_text(t, row, first, machine, cell=True, shaky=_shaky(t, pick, rows))} | "
                     f"{pick['bytes'] / 1e6:.2f} MB |")
        if any(row is not None for _, row, _, _ in chosen.values()):
            L += ["", f"Measured here on {machine or 'this machine'}, steady p50 at batch {first}."]
        shares = [(t, (row or {}).get("layers") or {}) for t, (_, row, _, _) in chosen.items()]
        pct = layer_report.pct
        shares = [f"{t} {pct(x.get('delegated_mac_share'))} / {pct(x.get('int8_mac_share'))}" for t, x in shares
                  if x.get("delegated_mac_share") is not None or x.get("int8_mac_share") is not None]
        if shares:
            L += ["", f"Share of the MACs delegated / in int8 (see Where the time goes): {'; '.join(shares)}."]
        shipped = {_label(p) for p, _, _, _ in chosen.values()}
        left = []
        for a in artifacts:
            if _label(a) in shipped:
                continue
            per: Dict[str, List[str]] = {}  # why, for the targets it serves: one reason, the targets it holds for
            for t in asked:
                if t in _targets(a) and _label(a) in chosen[t][2]:
                    per.setdefault(chosen[t][2][_label(a)], []).append(t)
            own = _gate_failure(a, max_drop, metric) or (None if a.get("status") == "ok" else
                                                         chosen[asked[0]][2].get(_label(a)))
            left.append((_label(a), own or "; ".join(f"for {', '.join(ts)}: {w}" for w, ts in per.items()) or
                         f"made for {', '.join(_targets(a)) or 'no target'}"))
        L.append("")
    if left:
        L += (["- Left out:"] if recipe.target else ["Left out:", ""]) + \
             [f"{'  ' if recipe.target else ''}- {name}: {reason}" for name, reason in left]
    return L + [""]


def pareto_front(points: List[Point]) -> List[Point]:
    """The points no other point beats on both latency (lower) and score (higher), fastest first."""
    front, best = [], float("-inf")
    for p in sorted(points, key=lambda q: (q.latency_ms, -q.score)):
        if p.score > best:
            front.append(p)
            best = p.score
    return front


def _plot(path: Path, points: List[Point], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    front = pareto_front(points)
    if len(front) > 1:  # the choices worth making: nothing else is both faster and more accurate
        ax.step([p.latency_ms for p in front], [100 * p.score for p in front], where="post", color="grey",
                alpha=0.5, linestyle="--", label="Pareto front")
        ax.legend(fontsize=8, loc="lower right")
    for i, p in enumerate(sorted(points, key=lambda q: q.latency_ms)):
        ax.scatter(p.latency_ms, 100 * p.score, s=50, marker=p.marker)
        ax.annotate(p.label, (p.latency_ms, 100 * p.score), textcoords="offset points",
                    xytext=(6, 6 if i % 2 == 0 else -12), fontsize=8)  # alternate so neighbours do not overlap
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.35, y=0.15)
    ax.set_xlabel("p50 latency at batch 1 (ms, log scale)")
    ax.set_ylabel(ylabel)
    ax.set_title("Accuracy vs latency")
    ax.grid(alpha=0.3)
    fig.tight_layout()

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png")

    atomic_write(path, write)
    plt.close(fig)


class _Version:
    """The report's version: its own, and every stage's ``report_version``, so that a stage rewording its section
    rebuilds the report in the next build (the stages themselves stay cached)."""

    def __init__(self, own: str):
        self.own = own

    def __get__(self, obj, cls) -> str:
        return ";".join([self.own] + [f"{n}:{STAGES.get(n).report_version}" for n in STAGES.list()])


@register_stage
class Report(Stage):
    name = "report"
    version = _Version("14")  # 11: the stages write their own sections; 12: the detection sheet; 13: the first screen;
    # 14: its line on the shipped artifact's layers
    inputs = ()
    optional_inputs = tuple(n for n in PIPELINE if n != "report")  # whatever the build made

    def config(self, recipe) -> Dict[str, Any]:
        return {"name": recipe.name, "target": recipe.target}  # the first screen answers for the target

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        outputs = {k: v for k, v in ctx.inputs.items() if v is not None}
        sections = stage_sections(ctx.recipe, outputs, ctx.history)
        publish = ["report.md"]
        for name, section in sections.items():
            for rel, src in section.files.items():
                _copy(outputs[name].dir / src, ctx.workdir / rel)
                if Path(rel).parts[0] not in publish:
                    publish.append(Path(rel).parts[0])
        record = build_record(sections)
        points = [p for s in sections.values() for p in s.points]
        if points:
            _plot(ctx.workdir / "accuracy_vs_latency.png", points, f"test {_plot_metric(ctx.recipe.data.task)} (%)")
            publish.append("accuracy_vs_latency.png")
        warnings = []
        for h in ctx.history:  # what the results say, then what the sections add
            if h["name"] in outputs:
                warnings += outputs[h["name"]].result.get("warnings", [])
                warnings += sections[h["name"]].warnings if h["name"] in sections else []
        columns = [(label, outputs[name].dir / rel) for name, sec in sections.items() for label, rel in sec.sheet.items()]
        sheet = build_sheet(ctx, outputs, columns, warnings) if columns else ""
        if sheet:
            publish.append("detections.png")
        recs = recommendations(record["bench"], record["artifacts"])
        screen = first_screen(ctx.recipe, record["artifacts"], record["bench"],
                              [x for s in sections.values() for x in s.scores], _machine(outputs))
        md = report_markdown(ctx.recipe, sections, ctx.history, recs, warnings, bool(points), sheet, screen)
        atomic_write_bytes(ctx.workdir / "report.md", md.encode())
        return {"publish": publish, **record, "warnings": warnings}


def _machine(outputs: Dict[str, StageOutput]) -> Optional[str]:
    """Where the build's rows were timed, as the stage that timed them recorded it ("AMD EPYC 7B13 (2 threads)"):
    a cached stage may have run on another machine than this report."""
    return next((o.result["machine"] for o in outputs.values()
                 if isinstance(o.result, dict) and o.result.get("bench") and o.result.get("machine")), None)


def _plot_metric(task: str) -> str:
    """The metric the plot's points are in: a detector's are mAP50 (the deployment-facing figure, and the issue's
    target for artifacts), whatever the accuracy table leads with."""
    return metric_label(metric_name(task))


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():  # a Core ML .mlpackage; a resumed report finds it half copied
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)
