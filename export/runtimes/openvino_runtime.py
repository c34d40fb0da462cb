"""OpenVINO: an IR (``model.xml`` + ``model.bin``) compiled for the CPU with the given thread count, latency
mode and fp32 inference precision (OpenVINO would otherwise run an fp32 IR in bf16 on CPUs with AMX,
which is a different model from the one the parity gate checked).

The IR keeps a free batch axis, and each batch shape a caller feeds is compiled static, once: OpenVINO's advice for
its CPU plugin, where a static shape lets it choose kernels and memory layouts ahead of the call (an int8 FastViT-T8
detector at 256 x 320 ran about a tenth faster so at batch 1)."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, artifact, described
from .layers import RUNS, WARMUP, conv_macs, layer_row, layer_table, matmul_macs, precision_of, timed_calls, \
    transposed_conv_macs

ENTRIES = {"openvino": {"runs": "openvino", "devices": "cpu"}}


def no_telemetry():
    """OpenVINO (on import and on each conversion) and NNCF send usage telemetry from a forked process unless the user
    opted out in ``~/intel/openvino_telemetry``. A build must not phone home, and forking a process that runs JAX,
    XNNPACK and ONNX Runtime threads is unsafe (the child inherits locks held by threads that do not exist in it), so
    the toolchain declines consent for its own calls only, leaving the user's global setting as it is."""
    import contextlib
    from unittest import mock

    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # openvino without its telemetry package sends nothing
        return contextlib.nullcontext()
    return mock.patch.object(OptInChecker, "check", lambda self, *a, **k: ConsentCheckResult.DECLINED)


def import_openvino():
    with no_telemetry():
        import openvino

    return openvino


def _core(device: str):
    try:
        ov = import_openvino()
    except ImportError as why:
        raise Unavailable(f"openvino is not installed ({why}); pip install openvino") from None
    core = ov.Core()
    if device not in core.available_devices:
        raise Unavailable(f"OpenVINO here has {core.available_devices}, not {device}")
    return ov, core


def _compiled(path, shape, threads=None, device: str = "CPU", profile: bool = False):
    """The IR at ``path`` compiled for input ``shape`` (static)."""
    ov, core = _core(device)
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    if profile:
        config["PERF_COUNT"] = True  # ov.properties.enable_profiling: per-node counters after each inference
    model = core.read_model(str(path))
    model.reshape({model.inputs[0]: ov.PartialShape([int(d) for d in shape])})
    return core.compile_model(model, device, config)


def load(path, threads=None, device: str = "CPU"):
    path = artifact(path, "openvino")
    _core(device)  # unavailable here: now, not at the first call
    requests = {}  # input shape -> its infer request: the few shapes a build feeds (a gate's last batch is smaller)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.shape not in requests:
            requests[x.shape] = _compiled(path, x.shape, threads, device).create_infer_request()
        return np.array(requests[x.shape].infer([x])[0])

    return described(run, f"openvino {device}", threads)


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, device: str = "CPU"):
    """The layer table (base.py) from the compiled model: each node of its runtime graph (after the plugin's
    fusions, ``originalLayersNames`` naming the IR layers it stands for) with its layer type, the precision it runs
    in (``runtimePrecision``) and its kernel (``execType``, e.g. ``jit_avx512_I8``), timed by the infer request's
    performance counters summed over the profiled calls."""
    feed = [np.ascontiguousarray(x, dtype=np.float32)]
    compiled = _compiled(artifact(path, "openvino"), feed[0].shape, threads, device, profile=True)
    request = compiled.create_infer_request()
    spent = {}

    def collect():
        for info in request.get_profiling_info():
            if str(info.status).endswith("EXECUTED") and "NOT" not in str(info.status):
                spent[info.node_name] = spent.get(info.node_name, 0.0) + info.real_time.total_seconds() * 1e3
                spent.setdefault(("kernel", info.node_name), info.exec_type)
                spent.setdefault(("type", info.node_name), info.node_type)

    calls = timed_calls(lambda: request.infer(feed), warmup, runs, after=collect)
    rows = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        name, info = op.get_friendly_name(), op.get_rt_info()
        rt = {k: str(info[k].astype(str)) if hasattr(info[k], "astype") else str(info[k]) for k in info}
        kind = rt.get("layerType", op.get_type_name())
        if name not in spent or kind in ("Input", "Parameter", "Output", "Result", "Const"):
            continue
        fused = [n for n in rt.get("originalLayersNames", "").split(",") if n and n != name]
        precision = "mixed" if kind in ("FakeQuantize", "Convert") else precision_of([rt.get("runtimePrecision")])
        row = layer_row(name, kind, f"{device} plugin", True, precision,
                        spent[name] / runs, _node_macs(op, kind, len(x)),
                        spent.get(("kernel", name)) or rt.get("primitiveType"),
                        f"fused with {', '.join(fused[:3])}{' ...' if len(fused) > 3 else ''}" if fused else None)
        rows.append(row)
    named = {r["name"] for r in rows}
    rows += [layer_row(name, spent[("type", name)], f"{device} plugin", True, "unknown", ms / runs,
                       kernel=spent[("kernel", name)]) for name, ms in spent.items()
             if isinstance(name, str) and name not in named]  # counted, but not a node of the runtime model
    return layer_table("openvino", f"openvino {device}", threads, f"{device} plugin", rows, len(x), calls)


def _dims(port, batch):
    """A port's shape with a dynamic batch axis read as ``batch``; ``None`` when another axis is dynamic."""
    shape = port.get_partial_shape()
    dims = [d.get_length() if d.is_static else (batch if i == 0 else -1) for i, d in enumerate(shape)]
    return dims if all(d >= 0 for d in dims) else None


def _node_macs(op, kind, batch):
    ins, out = [_dims(i, batch) for i in op.inputs()], _dims(op.output(0), batch) if op.get_output_size() else None
    if kind == "Convolution" and len(ins) > 1 and ins[1] and out:
        return conv_macs(out, ins[1], grouped=len(ins[1]) == len(out) + 1)
    if kind == "Deconvolution" and len(ins) > 1:
        return transposed_conv_macs(ins[0], ins[1])
    if kind == "FullyConnected" and len(ins) > 1 and ins[1] and out:  # weight [N, K] (possibly split into groups)
        return int(np.prod(out, dtype=np.int64) * np.prod(ins[1], dtype=np.int64) // max(1, out[-1]))
    if kind == "MatMul" and ins:
        return matmul_macs(ins[0], out)
    return None
