"""``report``: ``report.md`` a person reads, a plot, and the machine-readable parts of ``build.json``.

The report knows no stage's result.  Each stage describes its own (``Stage.report`` returns a ``ReportSection``,
toolchain/stage.py); the report asks them in the order the build ran them and assembles:

- the header, "What was built" (the stages' summary bullets) and the accuracy table (their scores, and the
  findings under it);
- each stage's own section, in pipeline order;
- what only the whole build can say: the recommended artifact per deployment target (from build.json's
  ``artifacts`` and ``bench``), the accuracy-vs-latency plot (from the stages' points) and, for detection, the
  sheet of test images with each detector's boxes beside the ground truth (from the stages' ``sheet`` models,
  bench/detection_sheet.py);
- every stage's status, and every warning.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List

from vfm_toolchain.bench.detection_sheet import build_sheet
from vfm_toolchain.core.files import atomic_write, atomic_write_bytes
from vfm_toolchain.stage import (PIPELINE, STAGES, Point, ReportContext, ReportSection, Stage, StageContext, StageOutput,
                             metric_label, percent, register_stage)
from vfm_toolchain.training import metric_name

__all__ = ["Report", "stage_sections", "report_markdown", "recommendations", "pareto_front"]


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
                    recs: List[Dict[str, str]], warnings: List[str], has_plot: bool, sheet: str = "") -> str:
    L = [f"# Build report: {recipe.name}", ""]
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
    "x86": lambda fam, provider: fam in ("onnxruntime", "openvino") and "cpu" in provider,
    "nvidia": lambda fam, provider: fam == "tensorrt" or (fam == "onnxruntime" and ("cuda" in provider or
                                                                                    "tensorrt" in provider)),
    "android": lambda fam, provider: fam in ("executorch", "litert"),
    "ios": lambda fam, provider: fam == "coreml",
}
_NOT_TIMED = {"ios": "Core ML runs on macOS / iOS only", "nvidia": "no TensorRT engine or CUDA ONNX Runtime timed here",
              "android": "no ExecuTorch / LiteRT runtime timed here", "x86": "no CPU runtime timed here"}


def _serves(target: str, row: Dict[str, Any]) -> bool:
    from vfm_toolchain.export.runtimes import RUNTIMES

    return _SERVES[target](RUNTIMES.meta(row["runtime"])["runs"], (row.get("provider") or row["runtime"]).lower())


def recommendations(bench: List[Dict[str, Any]], artifacts: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """One artifact per model and deployment target (the targets each format declares), from build.json's measured
    rows: the fastest steady batch-1 row on a runtime that speaks for the target among artifacts that passed their
    gate (every ``ok`` artifact did). A slower artifact is never recommended over a faster one that passed; where
    nothing was timed for a target, the first candidate in ``export.formats`` order, saying so."""
    from vfm_toolchain.export.formats import FORMATS
    from vfm_toolchain.export.formats.base import TARGETS
    from vfm_toolchain.export.runtimes import RUNTIMES

    ok = [a for a in artifacts if a.get("status") == "ok"]
    first = min((r["batch"] for r in bench), default=1)
    rows = [r for r in bench if r["batch"] == first and not r.get("unstable") and r["runtime"] in RUNTIMES]
    out = []
    for model in sorted({a["model"] for a in ok}):
        for target in TARGETS:
            cands = [a for a in ok if a["model"] == model and target in FORMATS.meta(a["kind"])["targets"]]
            if not cands:
                continue
            timed = sorted(((r["p50_ms"], i, r) for i, a in enumerate(cands) for r in rows
                            if r["artifact"] == f"{model} {a['kind']}" and _serves(target, r)), key=lambda t: t[:2])
            if timed:
                ms, i, r = timed[0]
                pick = cands[i]
                rest = "; ".join(f"{cands[j]['kind']} {t:.2f} ms" for t, j, _ in timed[1:] if j != i)
                gate = "passed its accuracy gate" if pick.get("accuracy_drop") is not None else "passed parity"
                why = f"fastest at batch {first} on {r['runtime']} here: {ms:.2f} ms"
                why += (f" (vs {rest})" if rest else "") + f"; {gate}"
                if target == "android":
                    why += "; XNNPACK on this x86 CPU is indicative only: confirm on the phone (android_bench.sh)"
            else:
                pick = cands[0]
                why = (f"not timed here ({_NOT_TIMED[target]}); time it on the device: toolchain bench --bundle")
            out.append({"model": model, "target": target, "artifact": pick["kind"], "why": why})
    return out


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
    version = _Version("12")  # 11: the stages write their own sections; 12: the detection sheet
    inputs = ()
    optional_inputs = tuple(n for n in PIPELINE if n != "report")  # whatever the build made

    def config(self, recipe) -> Dict[str, Any]:
        return {"name": recipe.name}

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
        md = report_markdown(ctx.recipe, sections, ctx.history, recs, warnings, bool(points), sheet)
        atomic_write_bytes(ctx.workdir / "report.md", md.encode())
        return {"publish": publish, **record, "warnings": warnings}


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
