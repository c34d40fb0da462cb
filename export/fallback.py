"""Accuracy-aware int8 fallback (issue 39): when an int8 artifact misses the build's accuracy gate, its most
sensitive layers go back to float, a few more at a time, until it passes or int8 stops paying.

Two parts, shared by every int8 format whose quantizer takes a per-layer choice (``onnx_int8``,
``executorch_int8``, ``tflite_int8``; ``openvino_int8`` uses NNCF's own ``quantize_with_accuracy_control``):

- :func:`layer_sensitivity` ranks the model's weighted layers (convolutions and linear layers) once, in PyTorch, on
  transfer-set images (no labels): each layer alone is simulated in int8 the way the formats quantize it (weights
  symmetric per output channel, its input per tensor with the range observed on the same images) while every other
  layer stays float, and its score is how far that moves the model's output from fp32 (relative squared error; a
  detector's candidates are scored on their class scores, and on their boxes where the fp32 model is confident).
  Isolating one layer at a time is what NNCF's accuracy control and AIMET's per-layer analysis do; it costs one
  forward pass of the images per layer, far less than one quantize-and-score per layer in each format.
- :func:`fall_back` rebuilds the artifact with the top 1, 2, 4, 8, ... layers of that ranking in float, each with
  the layers that write its input (:func:`input_producers`: a quantized producer's output is read dequantized)
  (``make(layers) -> runner``, the format's own per-layer configuration), judges each with the build's gate and
  times it beside the fp32 artifact at batch 1; it stops at the first that passes, or when a candidate is no
  faster than fp32 (int8 no longer pays for what it loses; only where plain int8 was faster than fp32 here: where it
  was not, this machine is not where it pays and the gate alone decides), or when every layer was tried.  Every
  step is recorded
  (layers in float, test score, latency against fp32), so the report can say what the repair cost.

The gate scores the test split, as every reduced-precision artifact's gate does (export/convert.py): the number of
float layers is chosen by the same measurement that accepts the artifact, never by a second look at the test set.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from vfm_toolchain.students.qat import fake_int8_weight, fake_uint8_input, weighted_layers

__all__ = ["SENSITIVITY_IMAGES", "FALLBACK_TIMING", "layer_sensitivity", "fall_back", "fallback_summary",
           "input_producers", "step_record"]

SENSITIVITY_IMAGES = 16  # transfer images the ranking reads (a forward pass of them per layer)
FALLBACK_TIMING = {"warmup": 2, "rounds": 4, "per_round": 3}  # batch 1, int8 candidate and fp32 in turn
def _measured(model: nn.Module) -> Tuple[nn.Module, Callable[[Any, Any], float]]:
    """The network to run and how far an output is from the fp32 one.  A detector wrapped with its NMS is measured on
    its candidates (the NMS would turn small score moves into boxes appearing and vanishing): class scores by relative
    squared error, boxes by their relative squared error weighted by the fp32 model's top score at each location."""
    from vfm_toolchain.students.fold import holds_nms, nms_outside

    if holds_nms(model):
        net, _ = nms_outside(model)

        def distance(ref: torch.Tensor, out: torch.Tensor) -> float:
            s_ref, s_out = ref[..., 4:], out[..., 4:]
            w = s_ref.max(-1, keepdim=True).values
            box = (w * (out[..., :4] - ref[..., :4]) ** 2).sum() / (w * ref[..., :4] ** 2).sum().clamp(min=1e-12)
            return float((s_out - s_ref).pow(2).sum() / s_ref.pow(2).sum().clamp(min=1e-12) + box)

        return net, distance

    def relative(ref, out) -> float:
        ref, out = _flat(ref), _flat(out)
        return float((out - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-12))

    return model, relative


def _flat(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().flatten()
    if isinstance(out, dict):
        out = list(out.values())
    return torch.cat([_flat(o) for o in out])


@contextlib.contextmanager
def _one_layer_int8(layer: nn.Module, lo: float, hi: float) -> Iterator[None]:
    original = layer.weight.data
    layer.weight.data = fake_int8_weight(original)
    hook = layer.register_forward_pre_hook(lambda _m, args: (fake_uint8_input(args[0], lo, hi), *args[1:]))
    try:
        yield
    finally:
        hook.remove()
        layer.weight.data = original


@torch.no_grad()
def layer_sensitivity(model: nn.Module, images: np.ndarray, names: Optional[Sequence[str]] = None,
                      limit: int = SENSITIVITY_IMAGES, log: Optional[Callable[[str], None]] = None
                      ) -> List[Tuple[str, float]]:
    """``[(layer name, score)]`` for ``names`` (default: every weighted layer), most sensitive first (module
    docstring).  ``images`` are preprocessed NCHW float arrays (the calibration images); the first ``limit`` are
    read.  Names are the model's own module names, which the formats map to their layers."""
    net, distance = _measured(model.eval())
    x = torch.from_numpy(np.ascontiguousarray(images[:limit], dtype=np.float32))
    names = list(names) if names is not None else weighted_layers(net)
    modules = dict(net.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"layer_sensitivity: no module named {unknown[:3]} in the model")
    ranges: Dict[str, List[float]] = {n: [float("inf"), float("-inf")] for n in names}

    def observe(name):
        def hook(_m, args):
            r = ranges[name]
            r[0], r[1] = min(r[0], float(args[0].min())), max(r[1], float(args[0].max()))
        return hook

    hooks = [modules[n].register_forward_pre_hook(observe(n)) for n in names]
    try:
        ref = net(x)
    finally:
        for h in hooks:
            h.remove()
    scores = []
    for i, name in enumerate(names):
        with _one_layer_int8(modules[name], *ranges[name]):
            scores.append((name, distance(ref, net(x))))
        if log and (i + 1) % 20 == 0:
            log(f"int8 sensitivity: {i + 1}/{len(names)} layers")
    return sorted(scores, key=lambda s: -s[1])


def input_producers(model: nn.Module, example: torch.Tensor) -> Dict[str, List[str]]:
    """For each weighted layer, the weighted layers whose outputs reach its input through ops without weights (an
    activation, a residual add, a reshape), read from the ``torch.export`` graph's module stack.  A layer's input
    stays float only where those producers keep a float output: ONNX Runtime, the XNNPACK quantizer and the AI Edge
    Quantizer all quantize a quantized layer's output, which its consumers then read dequantized, float or not."""
    from vfm_toolchain.students.fold import holds_nms, nms_outside

    net = nms_outside(model)[0] if holds_nms(model) else model
    graph = torch.export.export(net.eval(), (example[:1],)).graph
    weighted = set(weighted_layers(net))
    owner: Dict[Any, str] = {}
    for node in graph.nodes:
        stack = list(node.meta.get("nn_module_stack", {}).values()) if node.op == "call_function" else []
        if stack and stack[-1][0] in weighted:
            owner[node] = stack[-1][0]
    producers: Dict[str, List[str]] = {name: [] for name in weighted}
    for node, name in owner.items():
        seen, todo = set(), [a for a in node.all_input_nodes if owner.get(a) != name]
        while todo:
            arg = todo.pop()
            if arg in seen or arg.op != "call_function":  # a parameter, a buffer or the model's input
                continue
            seen.add(arg)
            if arg in owner:
                if owner[arg] not in producers[name]:
                    producers[name].append(owner[arg])
            else:
                todo += arg.all_input_nodes
    return producers


def _counts(n: int) -> List[int]:
    """1, 2, 4, ... layers in float, ending with all ``n``."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n] if n else []


def fall_back(fmt: str, ranked: Sequence[Tuple[str, float]], make: Callable[[List[str]], Any],
              judge: Callable[[Any], Dict[str, Any]], ptq: Tuple[Any, Dict[str, Any]], fp32_runner: Any,
              example: np.ndarray, log: Optional[Callable[[str], None]] = None,
              producers: Optional[Dict[str, List[str]]] = None) -> Tuple[Any, Dict[str, Any]]:
    """Rebuild ``fmt`` with more of ``ranked`` in float until the gate passes (module docstring).

    ``make(layers)`` writes the artifact with those layers in float (over the previous candidate: the last one made
    is the one on disk) and returns its runner; ``ptq`` is the plain int8 artifact's ``(runner, verdict)``;
    ``fp32_runner`` runs the fp32 counterpart for the latency comparison; ``example`` is one input batch of 1.
    ``producers`` (:func:`input_producers`) adds to each layer put back in float the layers that write its input.
    Returns ``(runner, record)``: the runner of the artifact left on disk and the record of every step, with
    ``passed``.  When no step passes, the last one made is left (the stage then refuses it with the record)."""
    from vfm_toolchain.export.runtimes.measure import round_robin

    say = log or (lambda _m: None)
    x = np.ascontiguousarray(example[:1], dtype=np.float32)
    runner, verdict = ptq
    first = round_robin({"int8": runner, "fp32": fp32_runner}, x, **FALLBACK_TIMING)  # side by side, in turn
    fp32_ms = first["fp32"]
    # int8 that was no faster than fp32 here to begin with: this machine is not where it pays (an x86 CPU for a
    # phone's format, a small input), so its latency here cannot say when to stop; the gate alone does
    pays_here = first["int8"] < fp32_ms
    steps = [step_record(0, verdict, first["int8"], fp32_ms)]
    record: Dict[str, Any] = {"ranked_layers": len(ranked), "steps": steps, "passed": False, "float_layers": [],
                              "fp32_p50_ms": round(fp32_ms, 3), "speed_decides": pays_here}
    say(f"{fmt}: test {verdict['test_score']:.4f} is {verdict['accuracy_drop']:.4f} below fp32, over the gate; "
        f"putting its most sensitive of {len(ranked)} layers back in float")
    for k in _counts(len(ranked)):
        layers = _with_producers([name for name, _ in ranked[:k]], producers or {})
        runner = make(layers)
        verdict = judge(runner)
        times = round_robin({"int8": runner, "fp32": fp32_runner}, x, **FALLBACK_TIMING)
        steps.append(step_record(k, verdict, times["int8"], times["fp32"]))
        record["float_layers"] = layers
        say(f"{fmt}: {k} most sensitive layers ({len(layers)} with those writing their inputs) in float: test "
            f"{verdict['test_score']:.4f} (drop {verdict['accuracy_drop']:.4f}), {times['int8']:.2f} ms against "
            f"fp32 {times['fp32']:.2f} ms at batch 1")
        if verdict["passed"]:
            record.update(passed=True, verdict=verdict,
                          reason=f"passed with the {k} most sensitive of {len(ranked)} layers in float "
                                 f"({len(layers)} with the layers writing their inputs)")
            return runner, record
        if pays_here and times["int8"] >= times["fp32"]:
            record.update(verdict=verdict, reason=f"stopped at {k} layers in float: no faster than fp32 "
                                                  f"({times['int8']:.2f} against {times['fp32']:.2f} ms) and still "
                                                  f"over the gate")
            return runner, record
    record.update(verdict=verdict, reason=f"every one of the {len(ranked)} layers in float and still over the gate "
                                          f"(what is left in int8 is not a weighted layer)")
    return runner, record


def _with_producers(layers: List[str], producers: Dict[str, List[str]]) -> List[str]:
    out: List[str] = []
    for name in layers:
        for layer in (name, *producers.get(name, ())):
            if layer not in out:
                out.append(layer)
    return out


def step_record(k: int, verdict: Dict[str, Any], ms: float, fp32_ms: float) -> Dict[str, Any]:
    """One row of a fallback's record: layers in float, the gate's verdict, batch-1 latency beside fp32's."""
    return {"float_layers": k, "test_score": round(verdict["test_score"], 5),
            "accuracy_drop": round(verdict["accuracy_drop"], 5), "passed": bool(verdict["passed"]),
            "p50_ms": round(ms, 3), "fp32_p50_ms": round(fp32_ms, 3)}


def fallback_summary(record: Dict[str, Any]) -> str:
    """One line for the report and the refusal message: what the fallback did and what it cost."""
    first, last = record["steps"][0], record["steps"][-1]
    cost = (f"{last['p50_ms']:.2f} ms against {first['p50_ms']:.2f} ms fully int8 and {last['fp32_p50_ms']:.2f} ms "
            f"fp32 at batch 1")
    return (f"accuracy fallback: {len(record['float_layers'])} of {record['ranked_layers']} layers in float, test "
            f"{100 * first['test_score']:.2f}% -> {100 * last['test_score']:.2f}%, {cost}; {record['reason']}")
