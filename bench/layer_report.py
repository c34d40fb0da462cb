"""Where the time goes: the layer tables of bench.latency and of a device's results.json, read for a person.

A layer table is what one runtime file's ``layers`` returns (export/runtimes/base.py names its fields).  Here each
table gets, per row that fell back, the reason (:func:`annotate`: the runtime's own note for a layer its delegate
did not take; for a weighted layer left in float inside an int8 artifact, what the artifact's export record says
kept it so, joined by name where the runtime's names allow), a summary (:func:`summarize`: the share of the MACs
that ran delegated and in int8, the layers' time against the whole call, the ten slowest layers, every layer that
fell back) and its markdown (:func:`section_lines`, the report's "Where the time goes" and a device's section).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from vfm_toolchain.export.formats.onnx_quantized_format import WEIGHTED_OPS, layer_nodes, scope_module
from vfm_toolchain.export.runtimes.layers import RUNS

__all__ = ["BUDGET_MS", "pct", "profiled_runs", "annotate", "summarize", "compact", "section_lines",
           "first_screen_line"]

BUDGET_MS = 2000.0  # profiled time per artifact: a big model gets fewer profiled calls, never fewer than MIN_RUNS
MIN_RUNS, WARMUP = 10, 3
SLOWEST = 10
NAMES_PER_REASON = 12  # names listed per reason in the report; the table's file has every row
_WEIGHTED = re.compile(r"conv|matmul|gemm|fully_?connected|innerproduct|linear|mm\b|addmm", re.I)


def profiled_runs(p50_ms: Optional[float], iters: int) -> int:
    """How many calls to profile for a batch-1 call of ``p50_ms``: as many as the bench times (``iters``), from
    :data:`MIN_RUNS` to the runtimes' default (layers.py's ``RUNS``), fewer for a slow model, so the layer tables add
    about :data:`BUDGET_MS` of profiled calls per artifact at most."""
    most = int(max(MIN_RUNS, min(RUNS, iters)))
    if not p50_ms or p50_ms <= 0:
        return most
    return int(max(MIN_RUNS, min(most, BUDGET_MS // p50_ms)))


# --------------------------------------------------------------------------------------------------------------
# why a layer fell back

def _weighted(row: Dict[str, Any]) -> bool:
    return row.get("macs") is not None or bool(_WEIGHTED.search(str(row.get("type", ""))))


def _onnx_node(name: str) -> str:
    """An ONNX Runtime profiler row's name without ``_token_<n>``, the quantizer's ``_quant`` and the blocked
    layout's ``_nchwc`` (a blocked-layout node is named after its output: :func:`_onnx_names` reads it back; without
    the file, ``/a/Conv_output_0`` is read as the node ``/a/Conv``)."""
    name = re.sub(r"_token_\d+$", "", name)
    return re.sub(r"(_nchwc|_quant)$", "", name)


_FUSED = ("Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Tanh", "Add", "Sum")


def _onnx_names(path: Optional[Path]) -> Dict[str, tuple]:
    """``{a name the profiler may use: (node, module)}`` from the ONNX file where it is here: each weighted node
    under its own name and its output's, and under the output of an activation or sum ONNX Runtime fuses into it
    (a blocked-layout row is named after the fused node's output); ``module`` from its weight's name
    (``<module>.weight``) or its scope."""
    if path is None or not Path(path).is_file():
        return {}
    try:
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
        module = {node: m for m, nodes in layer_nodes(Path(path)).items() for node in nodes}
    except Exception:  # onnx missing, a file it cannot read: the profiler's names are all there is
        return {}
    names, producer = {}, {}
    for node in graph.node:
        if node.op_type in WEIGHTED_OPS:
            entry = (node.name, module.get(node.name) or scope_module(node.name))
            names[node.name] = entry
            for out in node.output:
                names[out], producer[out] = entry, entry
        elif node.op_type in _FUSED and node.input and node.input[0] in producer:
            for out in node.output:
                names[out] = producer[node.input[0]]
    return names


def _fallback_text(record: Dict[str, Any]) -> str:
    f = record.get("fallback") or {}
    steps = f.get("steps") or []
    if len(steps) >= 2:
        return (f"kept float by the accuracy fallback (test {100 * steps[0]['test_score']:.1f}% fully int8 -> "
                f"{100 * steps[-1]['test_score']:.1f}% with {len(f.get('float_layers', []))} layers float)")
    return "kept float by the accuracy fallback"


def _float_reasons(record: Dict[str, Any], path: Optional[Path]) -> Callable[[Dict[str, Any]], str]:
    """``reason(row)`` for a weighted layer left in float in the int8 artifact ``record`` describes."""
    kind = str(record.get("kind", ""))
    fallback = set((record.get("fallback") or {}).get("float_layers") or [])
    slow = record.get("slow_layers_ms") or {}
    kept_slow = set(record.get("layers_fp32") or [])
    names = _onnx_names(path) if kind.startswith("onnx") else {}
    unjoined = "the quantizer left it float; no export record names it"

    def onnx(row):
        node = _onnx_node(row["name"])
        node, module = names.get(node) or (re.sub(r"_output_\d+$", "", node), scope_module(node))
        if node in slow:
            a, b = slow[node]
            return f"int8 is slower here (layer profile: {a:.3f} ms fp32, {b:.3f} ms int8 on the build's CPU)"
        if node in kept_slow:
            return "int8 is slower here (layer profile)"
        if module in fallback or any(module.startswith(m + ".") for m in fallback):
            return _fallback_text(record)
        if node.count("/") <= 1 and record.get("postprocess_fp32_nodes"):
            return "a detector's decoding, kept float (boxes in pixels share no int8 grid with scores)"
        return unjoined

    def openvino(row):
        names = {row["name"], *re.findall(r"[^\s,]+", (row.get("note") or "").replace("fused with", ""))}
        for name in names & set(slow):
            a, b = slow[name]
            return f"int8 is slower here (layer profile: {a:.3f} ms fp32, {b:.3f} ms int8 on the build's CPU)"
        if names & fallback:
            return "reverted to float by NNCF's accuracy control (the accuracy fallback)"
        return unjoined

    def executorch(row):
        kept = record.get("float_modules") or []
        if not kept:
            return unjoined
        why = [record["float_reason"]] if record.get("float_reason") else []
        if fallback:
            why.append(_fallback_text(record))
        names = ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else "")
        return (f"kept float: float_modules {names}" + (f" ({'; '.join(why)})" if why else "")
                + "; XNNPACK's op names do not say which module this one is")

    def litert(row):
        why = []
        if row.get("type") in (record.get("float_ops") or []):
            why.append("the output layer is kept float (float_output)")
        if fallback:
            why.append(f"or {_fallback_text(record)}" if why else _fallback_text(record))
        return " ".join(why) if why else unjoined

    return {"onnx": onnx, "openvino": openvino, "executorch": executorch, "tflite": litert}.get(
        kind.split("_")[0], lambda row: unjoined)


def annotate(table: Dict[str, Any], record: Optional[Dict[str, Any]] = None, path: Optional[Path] = None) -> Dict:
    """``table`` with ``fell_back`` on each row: why it did not run as the artifact means it to (``None`` when it
    did).  A row its runtime's delegate did not take (``delegated`` False) gives the runtime's note; in an int8
    artifact (``record``: its export record), a weighted layer in float gives what kept it float, by name where the
    runtime keeps the model's names (ONNX Runtime, OpenVINO; ``path``: the ONNX file, to read modules from its
    weights), else what the record says of the artifact as a whole (ExecuTorch, LiteRT)."""
    record = record or {}
    int8 = record.get("precision") == "int8"
    reason_float = _float_reasons(record, path) if int8 else None
    backend = table.get("backend") or "the delegate"
    for row in table.get("rows", []):
        why = None
        if row.get("delegated") is False:
            why = f"not on {backend}: {row.get('note') or 'the runtime ran it elsewhere'}"
        elif int8 and _weighted(row) and row.get("precision") in ("fp32", "fp16", "bf16"):
            why = reason_float(row)
        row["fell_back"] = why
    return table


# --------------------------------------------------------------------------------------------------------------
# what a table says

def _share(part: int, whole: int) -> Optional[float]:
    return round(part / whole, 4) if whole else None


def summarize(table: Dict[str, Any], model_macs: Optional[int] = None) -> Dict[str, Any]:
    """The figures the report shows of one table: MAC shares (delegated, int8), the layers' time against the
    profiled calls', the ten slowest rows and every row that fell back (rows as in the table, ``fell_back``
    included).  Where the runtime gives MACs for under 90% of the model's (``model_macs``, PyTorch's count: a
    delegate's payload is opaque to ExecuTorch's plan), the delegated share is what the undelegated rows leave of
    the model's MACs and the int8 share is unknown, and ``mac_note`` says so."""
    rows = table.get("rows", [])
    known = sum(r["macs"] for r in rows if r.get("macs"))
    off = sum(r["macs"] for r in rows if r.get("macs") and r.get("delegated") is False)
    int8 = sum(r["macs"] for r in rows if r.get("macs") and r.get("precision") == "int8")
    said = all(r.get("delegated") is not None for r in rows if r.get("macs"))
    inside = sum(r["macs"] for r in rows if r.get("macs") and r.get("delegated"))
    note = None
    if model_macs and known < 0.9 * model_macs and not inside and any(r.get("delegated") for r in rows):
        # the delegate's payload is opaque (ExecuTorch's plan): only the layers outside it have MACs
        note = (f"the runtime gives MACs for {known / model_macs:.0%} of the model's {model_macs / 1e6:.1f}M, none "
                f"inside its delegate: the delegated share is what the layers outside it leave, the int8 share unknown")
        delegated, int8_share = (max(0.0, round(1 - off / model_macs, 4)) if said else None), None
    else:
        if model_macs and known < 0.9 * model_macs:
            note = (f"shares of the {known / 1e6:.1f}M MACs the runtime gives shapes for ({known / model_macs:.0%} of "
                    f"PyTorch's count, {model_macs / 1e6:.1f}M)")
        delegated, int8_share = (_share(known - off, known) if said else None), _share(int8, known)
    total, summed = table.get("total_ms"), table.get("layer_ms_sum")
    timed = [r for r in rows if r.get("ms") is not None]
    return {"runtime": table.get("runtime"), "provider": table.get("provider"), "backend": table.get("backend"),
            "runs": table.get("runs"), "rows": len(rows), "timed": bool(table.get("timed")),
            "why_untimed": table.get("why_untimed"), "total_ms": total, "layer_ms_sum": summed,
            "sum_over_total": round(summed / total, 3) if summed is not None and total else None,
            "macs_known": known, "delegated_mac_share": delegated, "int8_mac_share": int8_share, "mac_note": note,
            "slowest": sorted(timed, key=lambda r: -r["ms"])[:SLOWEST] if table.get("timed") else [],
            "fell_back": [r for r in rows if r.get("fell_back")]}


def compact(summary: Dict[str, Any], file: Optional[str]) -> Dict[str, Any]:
    """What build.json's bench row keeps of a summary."""
    return {"file": file, **{k: summary.get(k) for k in ("timed", "why_untimed", "sum_over_total",
                                                          "delegated_mac_share", "int8_mac_share")}}


# --------------------------------------------------------------------------------------------------------------
# markdown

def pct(v: Optional[float]) -> str:
    """A share as the layer tables write it: ``87%``, or ``n/a``."""
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _ms(v: Optional[float]) -> str:
    return "" if v is None else (f"{v:.3f}" if v < 1 else f"{v:.2f}")


def _cut(text: str, n: int = 64, tail: bool = True) -> str:
    """``text`` for a table cell in at most ``n`` characters: a layer name's end (where its op is), a reason's
    start."""
    text = str(text).replace("|", "/").replace("\n", " ")
    if len(text) <= n:
        return text
    return "..." + text[-(n - 3):] if tail else text[:n - 3] + "..."


def _time_text(s: Dict[str, Any]) -> str:
    if not s["timed"]:
        return f"untimed: {_cut(s.get('why_untimed') or 'the runtime does not time layers', 160, tail=False)}"
    return f"{_ms(s['layer_ms_sum'])} of {_ms(s['total_ms'])} ms ({pct(s['sum_over_total'])})"


def _gap_text(s: Dict[str, Any]) -> Optional[str]:
    """Why the layers' time and the whole call's differ by more than a fifth, where they do."""
    ratio, total, summed = s.get("sum_over_total"), s.get("total_ms"), s.get("layer_ms_sum")
    if ratio is None or 0.8 <= ratio <= 1.2 or not s.get("rows"):
        return None
    if ratio < 0.8:
        gap = total - summed
        return (f"The layers account for {pct(ratio)} of the call: the other {_ms(gap)} ms is the runtime's own time "
                f"between and around its {s['rows']} layers (about {1e3 * gap / s['rows']:.0f} us each, profiler "
                f"included), which no layer row holds.")
    return (f"The layers add up to {pct(ratio)} of the call: the runtime's layer timer overlaps (layers run "
            f"in parallel, or a timer includes its wait).")


def section_lines(entries: List[Dict[str, Any]], where: str, files: Optional[str] = None) -> List[str]:
    """The markdown of "Where the time goes": one overview row per (artifact, runtime), then per table the ten
    slowest layers and every layer that fell back with why, folded (``<details>``) so the report stays short.
    ``entries``: ``{"artifact", "runtime", "summary"}`` or ``{"artifact", "runtime", "reason"}`` (no table);
    ``where``: the machine; ``files``: where the full tables are, for the sentence that says so."""
    if not entries:
        return []
    L = [f"Each runtime's own account of its layers at batch 1 on {where} (export/runtimes/: the profiled calls' "
         f"mean per layer, where it ran and in which precision; MACs are its convolutions and matrix products)"
         + (f"; every row of every table in `{files}`." if files else "."), "",
         "| artifact | runtime | MACs delegated | MACs int8 | layers vs whole call | slowest layer | fell back |",
         "|---|---|---|---|---|---|---|"]
    for e in entries:
        s = e.get("summary")
        if s is None:
            reason = _cut(e.get("reason"), 160, tail=False)
            L.append(f"| {e['artifact']} | {e['runtime']} | | | no table: {reason} | | |")
            continue
        top = s["slowest"][0] if s["slowest"] else None
        slow = f"{_cut(top['name'], 40)} ({top['type']}, {_ms(top['ms'])} ms)" if top else ""
        L.append(f"| {e['artifact']} | {e['runtime']} ({s.get('backend')}) | {pct(s['delegated_mac_share'])} | "
                 f"{pct(s['int8_mac_share'])} | {_time_text(s)} | {slow} | {len(s['fell_back'])} |")
    for e in entries:
        s = e.get("summary")
        if s is None or not (s["slowest"] or s["fell_back"] or s.get("mac_note") or _gap_text(s)):
            continue
        L += ["", f"<details><summary>{e['artifact']} on {e['runtime']}: "
                  f"{'the ten slowest layers, ' if s['slowest'] else ''}{len(s['fell_back'])} fell back</summary>", ""]
        if s.get("mac_note"):
            L += [f"MACs: {s['mac_note']}.", ""]
        if _gap_text(s):
            L += [_gap_text(s), ""]
        if s["slowest"]:
            whole = s["layer_ms_sum"] or 0.0
            L += ["| layer | type | ms | of the layers | precision | where |", "|---|---|---|---|---|---|"]
            L += [f"| {_cut(r['name'])} | {r['type']} | {_ms(r['ms'])} | {pct(r['ms'] / whole if whole else None)} "
                  f"| {r['precision']} | {r['where']}{' (' + r['kernel'] + ')' if r.get('kernel') else ''} |"
                  for r in s["slowest"]]
            L.append("")
        by_reason: Dict[str, List[Dict[str, Any]]] = {}
        for r in s["fell_back"]:
            by_reason.setdefault(r["fell_back"], []).append(r)
        if by_reason:
            L += ["Fell back:", ""]
            for why, rows in by_reason.items():
                names = ", ".join(f"`{_cut(r['name'])}`" for r in rows[:NAMES_PER_REASON])
                more = f" and {len(rows) - NAMES_PER_REASON} more" if len(rows) > NAMES_PER_REASON else ""
                spent = sum(r["ms"] or 0.0 for r in rows)
                L.append(f"- {why}: {len(rows)} layer{'s' if len(rows) > 1 else ''}"
                         f"{f' ({_ms(spent)} ms)' if spent else ''}: {names}{more}")
            L.append("")
        L.append("</details>")
    return L


def first_screen_line(layers: Optional[Dict[str, Any]]) -> Optional[str]:
    """The first screen's line on the shipped artifact's layers (a bench row's compact ``layers``)."""
    if not layers or (layers.get("delegated_mac_share") is None and layers.get("int8_mac_share") is None):
        return None
    return (f"- Layers: {pct(layers.get('delegated_mac_share'))} of the MACs delegated, "
            f"{pct(layers.get('int8_mac_share'))} in int8 (see Where the time goes)")
