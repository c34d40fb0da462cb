"""LiteRT: a ``.tflite`` file run by the LiteRT interpreter (``ai_edge_litert``) with its default XNNPACK CPU
delegate and the given thread count, the CPU path an Android app takes.  Files are converted at batch 1; a larger
batch runs one image after another.  A full-integer file takes and gives int8 tensors: the runner quantizes the
float input and dequantizes the output with the file's own scale and zero point, as an app does."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, artifact, described, per_image
from .layers import RUNS, WARMUP, conv_macs, layer_row, layer_table, matmul_macs, nms_row, precision_of, timed_calls
from .nms import with_nms

ENTRIES = {"litert": {"runs": "litert", "devices": "cpu (xnnpack)", "from_record": ("runtime_nms",)}}


def load(path, threads=None, runtime_nms=None):
    """``runtime_nms``: a detector's candidates file is finished by the shared NMS (nms.py) with these settings."""
    run, _ = _runner(path, threads, runtime_nms)
    return described(run, f"xnnpack ({threads or 'default'} threads)", threads)


def _runner(path, threads=None, runtime_nms=None):
    """``(run, interpreter)``."""
    path = artifact(path, "litert")
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError as why:
        raise Unavailable(f"ai-edge-litert is not installed ({why}); pip install ai-edge-litert") from None
    interpreter = Interpreter(model_path=str(path), num_threads=int(threads) if threads else None)
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()

    def call(x: np.ndarray) -> np.ndarray:
        interpreter.set_tensor(inp["index"], _to(x, inp))
        interpreter.invoke()
        return _from(interpreter.get_tensor(out["index"]), out)

    run = per_image(call)
    return (with_nms(run, runtime_nms) if runtime_nms else run), interpreter


UNTIMED = ("the LiteRT Python interpreter (ai-edge-litert) exposes no op profiler; LiteRT's benchmark_model "
           "(what android_bench.sh runs) times each op with --enable_op_profiling=true")


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, runtime_nms=None):
    """The layer table (base.py) from the interpreter's graph after its default XNNPACK delegate took what it
    supports: each op of the file, ``delegated`` when a ``DELEGATE`` node replaced it and ``where`` ``tflite
    builtin`` when it runs in LiteRT's own kernels, with its precision from its operand types and MACs from its
    tensor shapes.  Untimed: the interpreter's profiler is not exposed to Python (:data:`UNTIMED`)."""
    run, interpreter = _runner(path, threads, runtime_nms)
    one = np.ascontiguousarray(x[:1], dtype=np.float32)
    calls = timed_calls(lambda: run(one), warmup, runs)
    ops = interpreter._get_ops_details()  # every node: the file's ops, then the DELEGATE nodes that replaced some
    shapes = {t["index"]: list(t["shape"]) for t in interpreter.get_tensor_details()}
    taken = _delegated(ops)
    rows = []
    for op in ops:
        if op["op_name"] == "DELEGATE":
            continue
        types = [np.dtype(t).name for t in op["operand_types"][:1] + op["result_types"][:1]]
        name = f"{op['op_name']} {op['index']}"
        precision = "mixed" if op["op_name"] in ("QUANTIZE", "DEQUANTIZE") else precision_of(types)
        delegated = op["index"] in taken
        rows.append(layer_row(name, op["op_name"], "XNNPACK" if delegated else "tflite builtin", delegated, precision,
                              macs=_op_macs(op, shapes),
                              note=None if delegated else "the XNNPACK delegate did not take it (an op or types it "
                                                          "does not support): LiteRT's own kernel runs it"))
    extra = nms_row(run, runs)
    rows += [extra] if extra else []
    return layer_table("litert", f"xnnpack ({threads or 'default'} threads)", threads, "XNNPACK", rows, 1, calls,
                       UNTIMED)


def _delegated(ops):
    """Indices of the ops a ``DELEGATE`` node replaced: walking back from each delegate's outputs through the ops
    that produce them, up to the delegate's inputs (a delegated partition is closed between the two)."""
    producer = {int(t): op for op in ops if op["op_name"] != "DELEGATE" for t in op["outputs"]}
    taken = set()
    for d in (op for op in ops if op["op_name"] == "DELEGATE"):
        stop, todo = {int(t) for t in d["inputs"]}, [int(t) for t in d["outputs"]]
        while todo:
            t = todo.pop()
            op = producer.get(t)
            if t in stop or op is None or op["index"] in taken:
                continue
            taken.add(op["index"])
            todo += [int(i) for i in op["inputs"] if i >= 0]
    return taken


def _op_macs(op, shapes):
    ins = [shapes.get(int(i)) if i >= 0 else None for i in op["inputs"]]
    out = shapes.get(int(op["outputs"][0])) if len(op["outputs"]) else None
    kind = op["op_name"]
    if kind == "CONV_2D" and len(ins) > 1:  # weight [Cout, kh, kw, Cin / groups]
        return conv_macs(out, ins[1])
    if kind == "DEPTHWISE_CONV_2D" and len(ins) > 1 and ins[1]:  # weight [1, kh, kw, Cout]
        return conv_macs(out, [1, *ins[1][1:3]])
    if kind == "FULLY_CONNECTED" and len(ins) > 1 and ins[1] and out:  # weight [N, K]
        return int(np.prod(out, dtype=np.int64) * ins[1][-1])
    if kind == "BATCH_MATMUL" and ins:
        return matmul_macs(ins[0], out)
    return None


def _to(x: np.ndarray, detail) -> np.ndarray:
    """Float input into the tensor's type: quantized with its (scale, zero point) when it is an integer tensor."""
    if not np.issubdtype(detail["dtype"], np.integer):
        return x.astype(detail["dtype"])
    scale, zero = detail["quantization"]
    info = np.iinfo(detail["dtype"])
    return np.clip(np.round(x / scale) + zero, info.min, info.max).astype(detail["dtype"])


def _from(y: np.ndarray, detail) -> np.ndarray:
    if not np.issubdtype(detail["dtype"], np.integer):
        return y.astype(np.float32)  # a copy: the interpreter reuses its buffer
    scale, zero = detail["quantization"]
    return (y.astype(np.float32) - zero) * scale
