"""Core ML: an ``.mlpackage`` predicted through coremltools on macOS, fed what an app feeds it: an RGB image when the
model takes one (the export bakes the normalisation in; rounding to 0-255 costs about 1e-2 of parity), one image
per prediction, with the compute units asked for (the Neural Engine included with ``ALL``).  Returns the class
scores in the model's class order (from the metadata the export wrote), or a detector's final rows (its pipeline's
NMS outputs turned into ``[K, 7]``, :func:`detection_rows`).  Elsewhere it is unavailable."""
from __future__ import annotations

import json
import platform

import numpy as np

from .base import Unavailable, artifact, described
from .layers import RUNS, WARMUP, layer_row, layer_table, timed_calls

# the export record's compute_units (what the recipe exported for) is passed to load wherever it runs
ENTRIES = {"coreml": {"runs": "coreml", "devices": "macOS (cpu, gpu, neural engine)", "from_record": ["compute_units"]}}


def load(path, threads=None, compute_units: str = "ALL"):
    path = artifact(path, "coreml")
    if platform.system() != "Darwin":  # said before importing coremltools, which takes 10-25 s on a small machine
        raise Unavailable("Core ML prediction needs macOS")
    try:
        import coremltools as ct
    except ImportError as why:
        raise Unavailable(f"coremltools is not installed ({why}); pip install coremltools") from None
    model = ct.models.MLModel(str(path), compute_units=getattr(ct.ComputeUnit, compute_units))
    md = dict(model.user_defined_metadata)
    image = model.get_spec().description.input[0].type.WhichOneof("Type") == "imageType"
    pp = json.loads(md["preprocess"]) if image else None
    classes = json.loads(md["classes"]) if md.get("class_labels") == "true" else None

    nms = json.loads(md["nms"]) if "nms" in md else None  # a detector: a pipeline ending in Core ML's NMS model

    def one(x: np.ndarray) -> np.ndarray:
        feed = x
        if pp is not None:  # back to the 0-255 RGB image the app would pass
            from PIL import Image

            pix = (x[0] * np.asarray(pp["std"])[:, None, None] + np.asarray(pp["mean"])[:, None, None]) * 255.0
            feed = Image.fromarray(np.clip(pix.transpose(1, 2, 0).round(), 0, 255).astype(np.uint8))
        if nms is not None:
            out = model.predict({"input": feed, "iouThreshold": float(nms["iou"]),
                                 "confidenceThreshold": float(nms["score_thresh"])})
            return detection_rows(out["confidence"], out["coordinates"], x.shape[-2:], int(nms["max_det"]))
        out = model.predict({"input": feed})
        if classes:
            return np.asarray([[out["classLabel_probs"][c] for c in classes]], dtype=np.float32)
        return np.asarray(next(iter(out.values())), dtype=np.float32)

    def run(x: np.ndarray) -> np.ndarray:
        if nms is not None:  # rows of every image, each with its batch index
            rows = [one(x[i:i + 1]) for i in range(len(x))]
            for i, r in enumerate(rows):
                r[:, 0] = i
            return np.concatenate(rows) if rows else np.zeros((0, 7), np.float32)
        return np.concatenate([one(x[i:i + 1]) for i in range(len(x))])

    return described(run, f"coreml ({compute_units} compute units, {md.get('precision', 'fp32')})", threads)


def detection_rows(confidence, coordinates, hw, max_det: int) -> np.ndarray:
    """Core ML's NMS outputs (class scores [K, C]; x centre, y centre, width, height relative to the input [K, 4]) as
    the rows every detection artifact returns, ``(0, x1, y1, x2, y2, score, class)`` in input pixels, best first, at
    most ``max_det``.  Its NMS keeps each box under its best class only, where the graphs' NMS may also keep a box
    of a second class at the same place: the export judges a Core ML detector by its test mAP, not box by box."""
    conf = np.asarray(confidence, dtype=np.float32).reshape(-1, max(1, np.asarray(confidence).shape[-1]))
    xywh = np.asarray(coordinates, dtype=np.float32).reshape(-1, 4)
    h, w = float(hw[0]), float(hw[1])
    score, cls = conf.max(axis=1), conf.argmax(axis=1)
    x1, y1 = (xywh[:, 0] - xywh[:, 2] / 2) * w, (xywh[:, 1] - xywh[:, 3] / 2) * h
    x2, y2 = (xywh[:, 0] + xywh[:, 2] / 2) * w, (xywh[:, 1] + xywh[:, 3] / 2) * h
    rows = np.stack([np.zeros_like(score), x1, y1, x2, y2, score, cls.astype(np.float32)], axis=1)
    return rows[np.argsort(-score, kind="stable")][:max_det].astype(np.float32)


UNTIMED = ("Core ML reports no per-layer times to Python; MLComputePlan gives each operation's planned compute unit "
           "and its estimated share of the model's cost (in each row's note), and Xcode's Core ML performance "
           "report times layers on the device")
_DEVICE = {"MLCPUComputeDevice": "CPU", "MLGPUComputeDevice": "GPU", "MLNeuralEngineComputeDevice": "Neural Engine"}


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, compute_units: str = "ALL"):
    """The layer table (base.py) from the compute plan (coremltools ``MLComputePlan``, macOS 14.4+): every operation
    of the ML program's main function with the compute unit Core ML plans to run it on; ``delegated`` is "off the
    CPU" when the compute units allow the GPU or the Neural Engine.  Untimed (:data:`UNTIMED`)."""
    path = artifact(path, "coreml")
    if platform.system() != "Darwin":
        raise Unavailable("Core ML's compute plan needs macOS")
    run = load(path, threads, compute_units)
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    calls = timed_calls(lambda: run(np.ascontiguousarray(x[:1], dtype=np.float32)), warmup, runs)
    compiled = ct.models.MLModel(str(path), compute_units=getattr(ct.ComputeUnit, compute_units))
    plan = MLComputePlan.load_from_path(compiled.get_compiled_model_path(),
                                        compute_units=getattr(ct.ComputeUnit, compute_units))
    program = plan.model_structure.program
    if program is None:
        raise Unavailable(f"{path} is not an ML program: its compute plan has no operations to list")
    offloads = compute_units != "CPU_ONLY"
    rows = []
    for op in program.functions["main"].block.operations:
        if op.operator_name in ("const",):
            continue
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        cost = plan.get_estimated_cost_for_mlprogram_operation(op)
        where = _DEVICE.get(type(usage.preferred_compute_device).__name__, "?") if usage else "?"
        supported = sorted(_DEVICE.get(type(d).__name__, "?") for d in usage.supported_compute_devices) if usage else []
        name = op.outputs[0].name if op.outputs else op.operator_name
        note = (f"estimated {cost.weight:.1%} of the model's cost" if cost else "no cost estimate") + \
            (f"; could run on {', '.join(supported)}" if supported else "")
        rows.append(layer_row(name, op.operator_name, where, (where != "CPU") if offloads and usage else None,
                              _op_precision(op), note=note))
    return layer_table("coreml", f"coreml ({compute_units} compute units)", threads, compute_units, rows, 1, calls,
                       UNTIMED)


def _op_precision(op) -> str:
    """An operation's precision from its output's type as the model structure prints it (``fp16``, ``fp32``)."""
    text = repr(op.outputs[0].type).lower() if op.outputs else ""
    for word, precision in (("float16", "fp16"), ("fp16", "fp16"), ("float32", "fp32"), ("fp32", "fp32"),
                            ("int8", "int8")):
        if word in text:
            return precision
    return "unknown"
