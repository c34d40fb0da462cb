"""ONNX Runtime, one provider policy for the build and the device: ``onnxruntime`` takes the best execution
provider that starts (TensorRT, CUDA, Core ML, then the CPU) and says which one ran and what failed before it;
``onnxruntime_cpu`` / ``_cuda`` / ``_tensorrt`` / ``_coreml`` pin one, so a recipe can time the same ONNX file
under each side by side, and the export stage's parity and accuracy checks pin the CPU.  A pinned provider this
machine lacks, or one that does not start, is reported as unavailable, never replaced by another one silently
(ONNX Runtime itself falls back to the CPU without saying so)."""
from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np

from .base import Unavailable, artifact, described
from .layers import RUNS, WARMUP, conv_macs, layer_row, layer_table, matmul_macs, precision_of, timed_calls, \
    transposed_conv_macs

PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider", "CPUExecutionProvider")
_PINNED = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
           "coreml": "CoreMLExecutionProvider"}

_WHERE = {"CUDAExecutionProvider": "onnxruntime-gpu on an NVIDIA GPU has it",
          "TensorrtExecutionProvider": "onnxruntime-gpu with TensorRT installed has it",
          "CoreMLExecutionProvider": "onnxruntime on macOS has it"}

ENTRIES = {"onnxruntime": {"runs": "onnxruntime", "devices": "the best provider present"},
           **{f"onnxruntime_{short}": {"runs": "onnxruntime", "devices": short, "options": {"providers": [provider]}}
              for short, provider in _PINNED.items()}}


def _start(ort, path, opts, chain):
    """A session whose first provider is ``chain[0]``; ONNX Runtime's own silent fallback is an error here."""
    session = ort.InferenceSession(str(path), sess_options=opts, providers=chain)
    if session.get_providers()[0] != chain[0]:
        raise Unavailable(f"it fell back to {session.get_providers()[0]}")
    return session


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _session(path, threads=None, providers=None, profile_prefix=None):
    """``(session, fell_back)`` by the provider policy of :func:`load`; ``profile_prefix``: with the profiler on."""
    path = artifact(path, "onnxruntime")
    try:
        import onnxruntime as ort
    except ImportError as why:
        raise Unavailable(f"onnxruntime is not installed ({why}); pip install onnxruntime "
                          f"(onnxruntime-gpu on a CUDA machine)") from None

    opts = ort.SessionOptions()
    # its threads stop spinning when a call returns: left spinning, they took a core from whatever ran next (the
    # Aquarium detector's OpenVINO int8 timed round-robin beside it: 12.2 ms against 9.0; docs/results.md)
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    if threads:
        opts.intra_op_num_threads = int(threads)
    if profile_prefix:
        opts.enable_profiling, opts.profile_file_prefix = True, str(profile_prefix)
    available = ort.get_available_providers()
    if providers:
        missing = [p for p in providers if p not in available]
        if missing:
            raise Unavailable(f"onnxruntime {ort.__version__} here has {available}, not {missing} "
                              f"({'; '.join(_WHERE.get(p, p) for p in missing)})")
        candidates = [list(providers)]
    else:
        candidates = [[p] for p in PREFERENCE if p in available]
    fell_back, session = [], None
    for chain in candidates:
        if "CPUExecutionProvider" not in chain:
            chain = [*chain, "CPUExecutionProvider"]  # nodes a GPU provider lacks still run
        try:
            session = _start(ort, path, opts, chain)
            break
        except Exception as exc:  # the providers' own error types differ; each is reported, then the next tried
            fell_back.append(f"{chain[0]}: {_first_line(exc)}")
    if session is None:
        raise Unavailable(f"onnxruntime could not start {'; '.join(fell_back)}")
    return session, fell_back


def load(path, threads=None, providers=None):
    """``providers=None``: the best provider that starts, in :data:`PREFERENCE` order (a TensorRT engine build can
    fail on an op or a shape where CUDA runs fine); ``run.fell_back`` lists what failed before it and why.  A
    pinned provider that fails is :class:`Unavailable`."""
    session, fell_back = _session(path, threads, providers)
    name = session.get_inputs()[0].name

    def run(x: np.ndarray) -> np.ndarray:
        return session.run(None, {name: x})[0]

    run.fell_back = fell_back
    return described(run, session.get_providers()[0], threads)


# integer kernels (QOperator files, and QDQ files once ONNX Runtime fuses a DequantizeLinear -> op -> QuantizeLinear)
_CONVERSIONS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, providers=None):
    """The layer table (base.py) from ONNX Runtime's profiler: every node kernel that ran in the profiled calls,
    the execution provider it was assigned to, its mean time, and its MACs from the shapes the profiler recorded
    (the shapes of the node that ran, after ONNX Runtime's fusions: a ``Conv`` it moved to its blocked layout is
    named after its output plus ``_nchwc``, a fused activation is part of its convolution)."""
    with tempfile.TemporaryDirectory() as tmp:
        session, fell_back = _session(path, threads, providers, profile_prefix=os.path.join(tmp, "profile"))
        feed = {session.get_inputs()[0].name: np.ascontiguousarray(x, dtype=np.float32)}
        calls = timed_calls(lambda: session.run(None, feed), warmup, runs)
        with open(session.end_profiling()) as fh:
            events = json.load(fh)
    backend = session.get_providers()[0]
    model_runs = [e["ts"] for e in events if e.get("name") == "model_run"]
    start = sorted(model_runs)[-runs] if len(model_runs) >= runs else 0  # the warmup's runs are in the file too
    rows, index = [], {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time") or e["ts"] < start:
            continue
        name = e["name"][:-len("_kernel_time")]
        if name not in index:
            index[name] = len(rows)
            rows.append(_node_row(name, e.get("args", {}), backend))
        rows[index[name]]["ms"] += e["dur"] / 1e3 / runs
    graph = _graph_macs(path, len(x))
    for row in rows:
        if row["macs"] is None:
            row["macs"] = _graph_lookup(graph, row["name"])
        if not row["delegated"] and row["note"] is None:
            row["note"] = f"{backend} did not take it; ONNX Runtime assigned it to {row['where']}"
    run_ms = [e["dur"] / 1e3 for e in events if e.get("name") == "model_run" and e["ts"] >= start]
    between = float(np.mean(run_ms)) - sum(r["ms"] for r in rows) if run_ms else 0.0
    if between > 0:  # a row of its own (runtimes/base.py): at small inputs, a fifth of the run
        rows.append(layer_row("(between kernels)", "Executor", backend, None, "unknown", between,
                              note="ONNX Runtime's own time in each run outside its kernels (the profiler's model_run "
                                   "less its node kernels): scheduling, allocations, thread handoffs"))
    return layer_table("onnxruntime", backend, threads, backend, rows, len(x), calls)


def _graph_lookup(graph, name):
    """A profiled node's MACs from the graph's: by its name without the profiler's ``_token_<n>``, or as the
    quantizer named it (``<name>_quant``), or by the output a blocked-layout node is named after."""
    base = re.sub(r"_token_\d+$", "", name)
    for key in (base, base + "_quant", re.sub(r"_quant$", "", base), re.sub(r"_nchwc$", "", base)):
        if key in graph:
            return graph[key]
    return None


def _graph_macs(path, batch):
    """``{node name or first output: MACs}`` of the graph's convolutions and matrix products by ONNX shape
    inference, for the nodes whose weights the profiler no longer shows (prepacked int8 kernels); ``{}`` where the
    ``onnx`` package is not installed (a device: the profiler's shapes are all there is)."""
    try:
        import onnx
    except ImportError:
        return {}
    try:
        model = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    except Exception:  # a file shape inference cannot follow: the profiler's shapes are all there is
        return {}
    g = model.graph
    shapes = {t.name: list(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (batch if i == 0 else -1)
                           for i, d in enumerate(dims)]
    found = {}
    for node in g.node:
        ins, out = [shapes.get(i) for i in node.input], shapes.get(node.output[0]) if node.output else None
        macs = _macs(node.op_type, ins, out)
        if macs is not None:
            found[node.name] = found[node.output[0]] = macs
    return found


def _macs(op, ins, out):
    """MACs of a convolution or matrix product from its operand shapes (graph or profiler), else ``None``."""
    weight = {"Conv": 1, "FusedConv": 1, "NchwcConv": 1, "ConvInteger": 1, "QLinearConv": 3}.get(op)
    if weight is not None:
        return conv_macs(out, ins[weight]) if len(ins) > weight else None
    if op == "ConvTranspose":
        return transposed_conv_macs(ins[0], ins[1]) if len(ins) > 1 else None
    if op in ("MatMul", "FusedMatMul", "Gemm", "FusedGemm", "QGemm", "MatMulInteger", "QLinearMatMul",
              "MatMulIntegerToFloat", "DynamicQuantizeMatMul"):
        return matmul_macs(ins[0], out) if ins else None
    return None


def _shapes(entries):
    """The profiler's ``[{"float": [1, 3, 32, 32]}, ...]`` as ``([types], [shapes])``."""
    pairs = [next(iter(e.items())) if e else (None, None) for e in entries or []]
    return [t for t, _ in pairs], [s for _, s in pairs]


def _node_row(name, args, backend):
    op, provider = args.get("op_name", "?"), args.get("provider", "?")
    types, ins = _shapes(args.get("input_type_shape"))
    _, outs = _shapes(args.get("output_type_shape"))
    out = outs[0] if outs else None
    if op.startswith("QLinear") or "Integer" in op or op in ("QGemm", "QAttention"):
        precision = "int8"
    elif op in _CONVERSIONS:
        precision = "mixed"
    else:
        precision = precision_of(types[:1])
    # a prepacked int8 weight is not among the profiler's shapes (QLinearConv's fourth input then is its scale)
    macs = None if op == "QLinearConv" and len(ins) < 9 else _macs(op, ins, out)
    row = layer_row(name, op, provider, provider == backend, precision, 0.0, macs)
    if provider != "CPUExecutionProvider" and provider.endswith("ExecutionProvider") and op.endswith("Kernel"):
        row["note"] = "a subgraph compiled by the provider: its own layers are inside it"
    return row
