"""``report``: ``report.md`` a person reads, a plot, and the machine-readable parts of ``build.json``."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from bench.measure import latency_cell
from export.convert import artifact_files
from toolchain.sizes import size_text
from toolchain.stage import PIPELINE, Stage, StageContext, register_stage
from toolchain.store import atomic_write, atomic_write_bytes
from toolchain.training import metric_name

__all__ = ["Report"]


def _transfer_line(r, inp) -> str:
    d = r.distill
    dist = inp.get("student.distill")
    teaching = dist.result.get("teacher_outputs", "") if dist is not None else ""
    if d.mode == "task_oriented":
        what = f"task-oriented distillation from the finetuned teacher (KL, T={d.temperature})"
    elif d.features == "global":
        what = "task-agnostic distillation from the frozen pretrained teacher (global features, contrastive)"
    else:
        what = "task-agnostic distillation from the frozen pretrained teacher (patch features, cosine)"
    return f"{what}, {d.epochs} epochs, teacher outputs {teaching or d.teacher_outputs}"


def _finetune_line(r, inp) -> str:
    f = r.finetune
    ft = inp.get("student.finetune")
    res = ft.result if ft is not None else {}
    how = "head-only" if f.head_only else "full"
    line = f"{f.epochs} epochs of {how} finetuning on the labels"
    if res.get("sweep"):
        key = next(k for k in res["sweep"][0] if k.startswith("val_"))
        tried = ", ".join(f"{x['lr']:g} ({100 * x[key]:.1f}%)" for x in res["sweep"])
        line += f" (learning rates tried, {key.replace('_', ' ')}: {tried}; kept {res['lr']:g})"
    if r.student.gramian.heads:
        g = r.student.gramian
        line += (f"; {g.heads} Gramian heads with decorrelation {g.decorrelation} during training (seed 003), "
                 f"deployed with {'no extra head' if g.deploy == 'none' else 'one of them'}")
    return line


_LABEL = {"top1": "top-1", "miou": "mIoU"}


def _pct(v: Optional[float]) -> str:
    return "n/a" if v is None or v != v else f"{100 * v:.1f}%"


def _size(nbytes: Optional[int]) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:.1f} MB"


def _runtime(row: Dict[str, Any]) -> str:
    """The runtime, and for ONNX Runtime the execution provider that actually ran."""
    provider = row.get("provider")
    return f"{row['runtime']} ({provider.replace('ExecutionProvider', '')})" if provider else row["runtime"]


def _batches(bench: List[Dict[str, Any]]) -> List[int]:
    return sorted({r["batch"] for r in bench})


def _ips(row: Dict[str, Any]) -> str:
    return "" if row.get("unstable") else f"{row['throughput_ips']:.0f}"


def _giga(n: Optional[int]) -> str:
    return "" if n is None else f"{n / 1e9:.2f}G"


def _fp32_sibling(a: Dict[str, Any], artifacts: List[Dict[str, Any]]) -> str:
    """The fp32 artifact of the same model and runtime family (onnx for onnx_int8, executorch for executorch_int8)."""
    from export.formats import FORMATS

    family = FORMATS.meta(a["kind"])["runtime"]
    for b in artifacts:
        if b["model"] == a["model"] and b.get("status") == "ok" and b.get("accuracy_drop") is None and \
                FORMATS.meta(b["kind"])["runtime"] == family and b.get("precision", "fp32") == "fp32":
            return f"{b['model']} {b['kind']}"
    return f"{a['model']} onnx"


def precision_changes(bench: List[Dict[str, Any]], artifacts: List[Dict[str, Any]]) -> List[str]:
    """One line per reduced-precision artifact: its accuracy drop and its batch-1 latency against the fp32
    artifact of its runtime family on the same runtime, the two numbers that decide whether to ship it."""
    p50 = {(r["artifact"], r["runtime"]): r["p50_ms"] for r in bench if r["batch"] == 1 and not r.get("unstable")}
    lines = []
    for a in artifacts:
        if a.get("accuracy_drop") is None:
            continue
        label, base = f"{a['model']} {a['kind']}", _fp32_sibling(a, artifacts)
        for (art, rt), ms in p50.items():
            if art == label and (base, rt) in p50:
                lines.append(f"- {label}: test {a['metric']} {100 * a['test_score']:.1f}% "
                             f"({-100 * a['accuracy_drop']:+.1f} points against fp32), p50 {ms:.2f} ms against "
                             f"{p50[(base, rt)]:.2f} ms fp32 on {rt} ({ms / p50[(base, rt)]:.2f}x)")
    return lines


# which measured rows speak for a target: the runtime family that ran, and for ONNX Runtime the provider
_SERVES = {
    "x86": lambda fam, provider: fam in ("onnxruntime", "openvino") and "cpu" in provider,
    "nvidia": lambda fam, provider: fam == "tensorrt" or (fam == "onnxruntime" and ("cuda" in provider or
                                                                                    "tensorrt" in provider)),
    "android": lambda fam, provider: fam in ("executorch", "litert"),
    "ios": lambda fam, provider: fam == "coreml",
}
_NOT_TIMED = {"ios": "Core ML runs on macOS / iOS only", "nvidia": "no NVIDIA GPU here",
              "android": "no ExecuTorch / LiteRT runtime timed here", "x86": "no CPU runtime timed here"}


def _serves(target: str, row: Dict[str, Any]) -> bool:
    from bench.runtimes import RUNTIMES

    return _SERVES[target](RUNTIMES.meta(row["runtime"])["runs"], (row.get("provider") or row["runtime"]).lower())


def recommendations(bench: List[Dict[str, Any]], artifacts: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """One artifact per model and deployment target (the targets each format declares), from the measured rows:
    the fastest steady batch-1 row on a runtime that speaks for the target among artifacts that passed their gate
    (every ``ok`` artifact did). A slower artifact is never recommended over a faster one that passed; where
    nothing was timed for a target, the first candidate in ``export.formats`` order, saying so."""
    from bench.runtimes import RUNTIMES
    from export.formats import FORMATS
    from export.formats.base import TARGETS

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


def pareto_front(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The points no other point beats on both latency (lower) and score (higher), fastest first."""
    front, best = [], float("-inf")
    for p in sorted(points, key=lambda q: (q["latency"], -q["score"])):
        if p["score"] > best:
            front.append(p)
            best = p["score"]
    return front


def _plot(path: Path, points: List[Dict[str, Any]], ylabel: str = "test top-1 (%)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    front = pareto_front(points)
    if len(front) > 1:  # the choices worth making: nothing else is both faster and more accurate
        ax.step([p["latency"] for p in front], [100 * p["score"] for p in front], where="post", color="grey",
                alpha=0.5, linestyle="--", label="Pareto front")
        ax.legend(fontsize=8, loc="lower right")
    for i, p in enumerate(sorted(points, key=lambda q: q["latency"])):
        ax.scatter(p["latency"], 100 * p["score"], s=50, marker=p.get("marker", "o"))
        ax.annotate(p["label"], (p["latency"], 100 * p["score"]), textcoords="offset points",
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


@register_stage
class Report(Stage):
    name = "report"
    version = "10"  # the student selection table
    inputs = ("data.prepare",)
    optional_inputs = tuple(n for n in PIPELINE if n not in ("data.prepare", "report"))

    def config(self, recipe) -> Dict[str, Any]:
        return {"name": recipe.name}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        inp = {k: v for k, v in ctx.inputs.items() if v is not None}
        res = lambda name: inp[name].result if name in inp else {}
        m = metric_name(res("data.prepare").get("task", "classification"))
        metrics = {
            f"teacher_{m}": res("teacher.finetune").get("metrics", {}).get(f"test_{m}"),
            f"student_baseline_{m}": res("student.baseline").get("metrics", {}).get(f"test_{m}"),
            f"student_distilled_{m}": res("student.finetune").get("metrics", {}).get(f"test_{m}"),
            f"student_after_distill_{m}": res("student.distill").get("metrics", {}).get(f"test_{m}"),
        }
        artifacts = []
        for a in res("export.convert").get("artifacts", []):
            a = dict(a)
            if a.get("status") == "ok":
                src = inp["export.convert"].dir / a["path"]
                dst = ctx.workdir / "artifacts" / a["model"] / src.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                for f in artifact_files(src):  # ONNX external data travels with its model
                    (shutil.copytree if f.is_dir() else shutil.copy2)(f, dst.parent / f.name)
                a["path"] = str(Path("artifacts") / a["model"] / src.name)
            artifacts.append(a)
        bench = res("bench.latency").get("bench", [])
        warnings = [w for name in inp for w in inp[name].result.get("warnings", [])]
        data = res("data.prepare")
        if any(data.get("corrupt", {}).values()):
            warnings.append(f"corrupt images skipped: {data['corrupt']}")

        points = self._points(metrics, bench, m, artifacts)
        publish = ["report.md"]
        for pic in res("teacher.curate").get("pictures", []):  # the transfer set, as a person sees it
            shutil.copy2(inp["teacher.curate"].dir / pic, ctx.workdir / f"transfer_{pic}")
            publish.append(f"transfer_{pic}")
        if points:
            _plot(ctx.workdir / "accuracy_vs_latency.png", points, f"test {_LABEL[m]} (%)")
            publish.append("accuracy_vs_latency.png")
        if artifacts:
            publish.append("artifacts")
        md = self._markdown(ctx, inp, metrics, artifacts, bench, warnings, data, bool(points), m)
        atomic_write_bytes(ctx.workdir / "report.md", md.encode())
        return {"publish": publish, "metrics": metrics, "artifacts": artifacts,
                "bench": [{k: r[k] for k in ("artifact", "runtime", "batch", "p50_ms", "p90_ms", "p99_ms",
                                               "mean_ms", "throughput_ips", "params", "bytes", "image_size")}
                          | {k: r.get(k) for k in ("macs", "peak_memory_bytes", "cv", "tail", "rounds", "unstable",
                                                    "provider", "fell_back")}
                          for r in bench],
                "warnings": warnings, "data": {"counts": data.get("counts"), "corrupt": data.get("corrupt")},
                "teacher": {"adapter": res("teacher.finetune").get("adapter"),
                            "trainable_params": res("teacher.finetune").get("trainable_params"),
                            "params": res("teacher.finetune").get("params"),
                            "embed_images_per_s": res("teacher.curate").get("embed_images_per_s")}}

    @staticmethod
    def _points(metrics, bench, m, artifacts) -> List[Dict[str, Any]]:
        """One point per (artifact, runtime) at batch 1; a reduced-precision artifact is placed at its own
        measured test score, the others at their model's."""
        own = {f"{a['model']} {a['kind']}": a["test_score"] for a in artifacts if a.get("test_score") is not None}
        pts = []
        for r in (r for r in bench if r["batch"] == 1 and not r.get("unstable")):
            label, lat = r["artifact"], r["p50_ms"]
            runtime = f" [{r['runtime']}]" if r["runtime"] not in ("pytorch", "onnxruntime") else ""
            if label.startswith("student") and metrics[f"student_distilled_{m}"] is not None:
                score = own.get(label, metrics[f"student_distilled_{m}"])
                pts.append({"label": f"distilled {label[8:]}{runtime}", "latency": lat, "score": score})
                if metrics[f"student_baseline_{m}"] is not None and "unfolded" in label:
                    pts.append({"label": "label-only student", "latency": lat,
                                "score": metrics[f"student_baseline_{m}"], "marker": "x"})
            if label.startswith("teacher") and metrics[f"teacher_{m}"] is not None:
                pts.append({"label": f"{label}{runtime}", "latency": lat, "score": own.get(label, metrics[f"teacher_{m}"]),
                            "marker": "s"})
        return pts

    @staticmethod
    def _markdown(ctx, inp, metrics, artifacts, bench, warnings, data, has_plot, m) -> str:
        r = ctx.recipe
        L = [f"# Build report: {r.name}", ""]
        L += ["## What was built", "",
              f"- teacher `{r.teacher.name}` (adapter `{r.teacher.adapter.name}`, weights `{r.teacher.weights}`)",
              f"- transfer set: `{r.curate.strategy}`, budget {r.curate.budget}",
              f"- student {_student(r, inp)} at {size_text(r.student.image_size)}; {_transfer_line(r, inp)}, then "
              f"{_finetune_line(r, inp)}",
              f"- data: {data.get('counts')} images, {len(data.get('classes', []))} classes; corrupt skipped: "
              f"{data.get('corrupt')}", ""]
        L += ["## Accuracy (held-out test set)", "", f"| model | test {_LABEL[m]} |", "|---|---|",
              f"| teacher (finetuned) | {_pct(metrics[f'teacher_{m}'])} |",
              f"| student, labels only | {_pct(metrics[f'student_baseline_{m}'])} |",
              f"| student, after distillation (before finetune) | {_pct(metrics[f'student_after_distill_{m}'])} |",
              f"| student, distilled + finetuned | {_pct(metrics[f'student_distilled_{m}'])} |", ""]
        b, d = metrics[f"student_baseline_{m}"], metrics[f"student_distilled_{m}"]
        if b is not None and d is not None:
            verdict = "helped" if d > b else "did NOT help"
            L += [f"The teacher {verdict}: {_pct(d)} vs {_pct(b)} for the same student trained on the labels only "
                  f"({100 * (d - b):+.1f} points).", ""]
        L += _selection_lines(inp.get("student.select"))
        cur = inp.get("teacher.curate")
        if cur is not None:
            s = cur.result["stats"]
            L += ["## Transfer set", "", f"{s['selected']} of {s['pool']} pool images by `{s['strategy']}`; "
                  f"teacher embedding throughput {cur.result['embed_images_per_s']:.0f} images/s.", "",
                  "| pool folder | selected |", "|---|---|"]
            roots = list(s["from_pool_root"])
            common = os.path.commonpath(roots) if len(roots) > 1 else os.path.dirname(roots[0])
            L += [f"| `{os.path.relpath(k, common)}` | {v} |" for k, v in s["from_pool_root"].items()] + [""]
            removed = s.get("removed") or {}
            L += [f"Removed before selection: {removed.get('duplicates', 0)} near-duplicates, "
                  f"{removed.get('leakage', 0)} near-copies of val/test images. Search index `{s.get('index')}`"
                  + "".join(f", {k.replace('_', ' ')} {v:.3f}" for k, v in s.items() if k.startswith("recall_at"))
                  + ".", ""]
            L += _search_lines(s.get("search"))
            if "per_query_mean" in s:
                L += [f"Per query: {s['per_query_min']} to {s['per_query_max']} images (mean {s['per_query_mean']}); "
                      f"{s['queries_without_images']} queries brought in none (`coverage.csv` in the curate stage). "
                      f"{s.get('precomputed', 0)} pool embeddings were precomputed; embedded by "
                      f"{s.get('embedded_by', 1)} process(es).", ""]
            L += [f"![{p}](transfer_{p})" for p in cur.result.get("pictures", [])] + [""]
        if artifacts:
            L += ["## Artifacts", "", "| model | format | status | size | parity max abs diff | notes |",
                  "|---|---|---|---|---|---|"]
            for a in artifacts:
                if a.get("status") == "ok":
                    par = a.get("parity_max_abs_diff")
                    par = f"{par:.2e}" if par is not None else f"not checked: {a.get('parity_skipped')}"
                    note = f"opset {a['opset_written']}" if "opset_written" in a else a.get("precision", "")
                    if "accuracy_drop" in a:
                        note += (f", test {_LABEL[a['metric']]} {_pct(a['test_score'])} vs fp32 "
                                 f"{_pct(a['fp32_test_score'])} (max diff is not the gate)")
                    if a.get("layout_reason"):  # an int8 layout chosen by timing: which and why
                        note += f"; int8 layout {a['layout']}: {a['layout_reason']}"
                    if a.get("layers_fp32"):  # measured per layer: int8 made these slower on the build's CPU
                        note += f"; {len(a['layers_fp32'])} layers kept fp32 (slower in int8 on this CPU)"
                    L.append(f"| {a['model']} | {a['kind']} | `{a['path']}` | {a['bytes'] / 1e6:.2f} MB | {par} | {note} |")
                else:
                    L.append(f"| {a['model']} | {a['kind']} | skipped | | | {a.get('reason')} |")
            folds = inp["export.convert"].result.get("folds", {})
            for which, recs in folds.items():
                L.append("")
                L.append(f"Fold passes ({which}): " + ", ".join(
                    f"{x['pass']} (max dev {x['max_abs_diff']:.1e})" if "max_abs_diff" in x else f"{x['pass']} skipped"
                    for x in recs))
            L.append("")
        if bench:
            L += ["## Latency", "", f"Measured on this machine, {inp['bench.latency'].result.get('threads')} threads.",
                  "", "| artifact | runtime | batch | p50 ms | p90 ms | p99 ms | images/s | params | MACs | size | "
                  "peak memory |", "|---|---|---|---|---|---|---|---|---|---|---|"]
            L += [f"| {x['artifact']} | {_runtime(x)} | {x['batch']} | {latency_cell(x)} | {latency_cell(x, 'p90_ms')} | "
                  f"{latency_cell(x, 'p99_ms')} | {_ips(x)} | {x['params'] / 1e6:.2f}M | "
                  f"{_giga(x.get('macs'))} | {_size(x['bytes'])} | {_size(x.get('peak_memory_bytes'))} |"
                  for x in bench]
            L += [f"\n{x['artifact']} on {x['runtime']} at batch {x['batch']}: {x['unstable']}; rerun on an idle "
                  f"machine (`toolchain build` re-measures when the bench settings change)" for x in bench
                  if x.get("unstable")]
            L += [f"\n{x['artifact']} on {x['runtime']}: ran on {x['provider']} after {'; '.join(x['fell_back'])}"
                  for x in bench if x.get("fell_back") and x["batch"] == _batches(bench)[0]]
            L += [f"\nnot measured: {u['artifact']} on {u['runtime']} ({u['reason']})"
                  for u in inp["bench.latency"].result.get("unavailable", [])]
            L += [""] + precision_changes(bench, artifacts)
            L.append("")
        recs = recommendations(bench, artifacts)
        if recs:
            L += ["## Recommended artifact per target", "", "| model | target | artifact | why |", "|---|---|---|---|"]
            L += [f"| {x['model']} | {x['target']} | {x['artifact']} | {x['why']} |"
                  for x in recs] + [""]
        if has_plot:
            L += ["![accuracy vs latency](accuracy_vs_latency.png)", ""]
        L += ["## Stages", "", "| stage | status | seconds | note |", "|---|---|---|---|"]
        for h in ctx.history:
            if h["name"] == "report":
                continue
            L.append(f"| {h['name']} | {h['status']} | {h.get('seconds') or h.get('ran_seconds') or 0:.1f} | "
                     f"{h.get('reason') or ''} |")
        L += ["", "## Warnings", ""] + ([f"- {w}" for w in warnings] or ["none"]) + [""]
        return "\n".join(L)


def _student(r, inp) -> str:
    sel = inp.get("student.select")
    if sel is None:
        return f"`{r.student.name}`"
    return f"`{sel.result['chosen']}` (chosen by `student.name: auto`: see Student selection)"


def _selection_lines(sel) -> list:
    """The candidate table of ``student.name: auto``: every candidate, its latency on the target, chosen, why."""
    if sel is None:
        return []
    from bench.select import CANDIDATE_COLUMNS, candidate_cells, is_results_file

    res, dev = sel.result, sel.result.get("device") or {}
    where = (f"the device results `{res['target']}` ({dev.get('machine', '?')}, "
             f"{dev.get('processor') or dev.get('system', '')})"
             if is_results_file(res["target"]) else f"`{res['target']}` on this machine, batch 1")
    L = ["## Student selection", "", f"Budget {res['budget_ms']:g} ms ({res['stat']}) on {where}. Rule: {res['rule']}.",
         "", "| " + " | ".join(CANDIDATE_COLUMNS + ("chosen", "why")) + " |", "|---" * (len(CANDIDATE_COLUMNS) + 2) + "|"]
    order = sorted(res["candidates"], key=lambda c: (c["status"] != "ok", c.get("p50_ms") or 0))
    for c in order:
        cells = candidate_cells(c) + ["**yes**" if c.get("chosen") else "",
                                      c.get("why", "") + (" (cached)" if c.get("cached") else "")]
        L.append("| " + " | ".join(cells) + " |")
    return L + [""]


def _search_lines(search) -> list:
    """How the pool index was chosen and tuned (teachers/search.py): the rule's reason, the build time and
    every search setting tried on the sample of queries."""
    if not search or search.get("spec") == "flat":
        return []
    where = " on the GPU" if search.get("on_gpu") else ""
    note = f"; {search['gpu_note']}" if search.get("gpu_note") else ""
    L = [f"Index `{search['spec']}` ({search['why']}), built in {search['build_seconds']:.1f} s{where}{note}."]
    tuning = search.get("tuning")
    if tuning and tuning.get("trials"):
        L += [f"Tuned on {tuning['sample']} queries until the 95% lower bound of recall@{tuning['k']} reached "
              f"{tuning['target']}: chose {tuning['params']}.", "", "| setting | recall | 95% lower bound | ms / query |",
              "|---|---|---|---|"]
        L += [f"| {', '.join(f'{k} {v}' for k, v in t.items() if k not in ('recall', 'recall_low', 'ms_per_query'))} | "
              f"{t['recall']:.3f} | {t.get('recall_low', t['recall']):.3f} | {t['ms_per_query']:.3f} |"
              for t in tuning["trials"]]
    return L + [""]

