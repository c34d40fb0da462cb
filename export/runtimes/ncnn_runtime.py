"""NCNN: a ``.param`` graph with its ``.bin`` weights beside it (pnnx's output), run on the CPU by ncnn's Python binding
with the given thread count.  ncnn's blobs have no batch axis (the net is converted at batch 1): a batch runs one image
after another, and each output gets its batch axis back.

``precision`` (from the artifact's record) sets ncnn's fp16 options: ``fp32`` turns fp16 storage, packing and
arithmetic (and bf16) off, the network the parity gate checked; ``fp16`` leaves them on, as ncnn's defaults are: fp16
storage and arithmetic where the CPU has fp16 arithmetic (ARMv8.2 ``asimdhp``, most phones since 2018); elsewhere
(x86) ncnn computes in fp32 from the fp16 weights.  ``run.provider`` says which held."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .base import Unavailable, artifact, described, per_image
from .layers import RUNS, WARMUP, layer_row, layer_table, nms_row, timed_calls
from .nms import with_nms

ENTRIES = {"ncnn": {"runs": "ncnn", "devices": "android / linux arm and x86 cpu (ncnn's own kernels; vulkan gpu where "
                                               "built)", "from_record": ("precision", "runtime_nms")}}


def weights_file(param):
    """The ``.bin`` a ``.param`` reads its weights from (same stem, same folder: it must travel with it)."""
    return Path(param).with_suffix(".bin")


def _net(path, threads=None, precision="fp32"):
    """``(ncnn, net, mode)``: the loaded net with ncnn's options for ``precision``, and what its fp16 options do on
    this CPU."""
    path = artifact(path, "ncnn")
    weights = artifact(weights_file(path), "ncnn (its .bin weights beside the .param)")
    if precision not in ("fp32", "fp16"):
        raise ValueError(f"ncnn runs fp32 or fp16 artifacts, not precision {precision!r}")
    try:
        import ncnn
    except ImportError as why:
        raise Unavailable(f"ncnn is not installed ({why}); pip install ncnn") from None
    fp16 = precision == "fp16"
    net = ncnn.Net()
    net.opt.use_vulkan_compute = False
    net.opt.use_fp16_storage = net.opt.use_fp16_packed = net.opt.use_fp16_arithmetic = fp16
    net.opt.use_bf16_storage = net.opt.use_bf16_packed = False
    if threads:
        net.opt.num_threads = int(threads)
    missing = unknown_layers(path)
    if missing:
        raise Unavailable(f"this ncnn ({getattr(ncnn, '__version__', '?')}) has no layer {', '.join(missing)} that "
                          f"{path} uses; install the ncnn that converted it or newer")
    if net.load_param(str(path)) != 0 or net.load_model(str(weights)) != 0:
        raise Unavailable(f"ncnn could not load {path} with its weights {weights.name}")
    if not fp16:
        mode = "fp32"
    elif ncnn.cpu_support_arm_asimdhp():
        mode = "fp16 storage and arithmetic"
    else:
        mode = "fp16 weights, fp32 arithmetic: no fp16 arithmetic on this cpu"
    return ncnn, net, mode


def load(path, threads=None, precision="fp32", runtime_nms=None):
    """``runtime_nms``: a detector's candidates file is finished by the shared NMS (nms.py) with these settings."""
    ncnn, net, mode = _net(path, threads, precision)
    (inp,), (out,) = net.input_names(), net.output_names()

    def call(x: np.ndarray) -> np.ndarray:
        image = np.ascontiguousarray(x[0])  # (C, H, W): kept alive while ncnn reads it
        with net.create_extractor() as ex:
            ex.input(inp, ncnn.Mat(image))
            status, y = ex.extract(out)
            if status != 0:
                raise RuntimeError(f"ncnn failed to compute {out} (status {status})")
            return np.array(y, dtype=np.float32)[None]  # a copy, with its batch axis back

    run = per_image(call)
    return described(with_nms(run, runtime_nms) if runtime_nms else run, f"ncnn cpu ({mode})", threads)


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, precision="fp32", runtime_nms=None):
    """The layer table (base.py).  ncnn's Python binding has no layer profiler (its per-layer timer is the
    ``NCNN_BENCHMARK`` build option, which the wheel is built without), so each profiled call times the layers
    itself: one extractor extracts the layers' outputs in the file's order (pnnx writes it topologically), so that
    each extract computes that one layer from outputs already there, and leaves its output in the layout and type
    the layer wrote.  A row's ``precision`` is that type (fp16 storage writes fp16); its MACs come from the layer's
    weight count in the ``.param`` and its output's shape."""
    path = artifact(path, "ncnn")
    ncnn, net, mode = _net(path, threads, precision)
    params = _layer_params(path)
    steps = [(layer, layer.tops[0]) for layer in net.layers() if layer.type != "Input" and len(layer.tops)]
    (inp,), (out,) = net.input_names(), net.output_names()
    spent, shapes, bits = [0.0] * len(steps), {}, {}

    def profiled(batch: np.ndarray) -> np.ndarray:
        image = np.ascontiguousarray(batch[0], dtype=np.float32)
        with net.create_extractor() as ex:
            ex.input(inp, ncnn.Mat(image))
            for i, (layer, top) in enumerate(steps):
                t0 = time.perf_counter()
                status, y = ex.extract(top, 1)  # 1: as the layer wrote it (packed; fp16 where it stores fp16)
                spent[i] += time.perf_counter() - t0
                if status != 0:
                    raise RuntimeError(f"ncnn failed to compute layer {layer.name} ({layer.type}, status {status})")
                shapes[i], bits[i] = _shape(y), y.elemsize * 8 // max(1, y.elempack)
            status, y = ex.extract(out)
            return np.array(y, dtype=np.float32)[None]

    run = with_nms(profiled, runtime_nms) if runtime_nms else profiled
    one = np.ascontiguousarray(x[:1], dtype=np.float32)
    for _ in range(warmup):
        run(one)
    spent[:] = [0.0] * len(steps)
    calls = timed_calls(lambda: run(one), 0, runs)
    rows = []
    for i, (layer, _) in enumerate(steps):
        stored = {32: "fp32", 16: "fp16", 8: "int8"}.get(bits.get(i), "unknown")
        note = "fp16 storage, fp32 arithmetic: no fp16 arithmetic on this cpu" if stored == "fp16" and \
            not ncnn.cpu_support_arm_asimdhp() else None
        rows.append(layer_row(layer.name, layer.type, "ncnn cpu", True, stored, spent[i] * 1e3 / runs,
                              _layer_macs(layer.type, params.get(layer.name, {}), shapes.get(i)), None, note))
    extra = nms_row(run, runs)
    rows += [extra] if extra else []
    return layer_table("ncnn", f"ncnn cpu ({mode})", threads, "ncnn cpu", rows, 1, calls)


def _shape(m) -> tuple:
    """A blob's logical shape, outermost axis first: ncnn packs ``elempack`` elements of that axis together."""
    dims = {1: (m.w,), 2: (m.h, m.w), 3: (m.c, m.h, m.w), 4: (m.c, m.d, m.h, m.w)}.get(m.dims, ())
    return (dims[0] * m.elempack, *dims[1:]) if dims else ()


def _layer_params(param) -> dict:
    """``{layer name: {key: value text}}`` of a ``.param`` (lines ``type name n_bottom n_top bottoms tops k=v...``)."""
    found = {}
    for line in Path(param).read_text(errors="replace").splitlines()[2:]:
        parts = line.split()
        if len(parts) >= 4:
            found[parts[1]] = dict(p.split("=", 1) for p in parts[4 + int(parts[2]) + int(parts[3]):] if "=" in p)
    return found


# layers whose every output element meets weight_data_size / num_output weights (params 6 and 0)
_WEIGHTED = {"Convolution", "ConvolutionDepthWise", "Convolution1D", "Convolution3D", "ConvolutionDepthWise1D",
             "ConvolutionDepthWise3D", "InnerProduct"}


def _layer_macs(kind, params, shape):
    """Multiply-accumulates of a convolution or fully connected layer (layers.py counts one per weight use);
    ``None`` for other layers (a transposed convolution's count needs its input's shape), and for weights given at
    run time."""
    try:
        num_output, weights = int(params.get("0", 0)), int(params.get("2" if kind == "InnerProduct" else "6", 0))
    except ValueError:
        return None
    if kind not in _WEIGHTED or not shape or num_output <= 0 or weights <= 0:
        return None
    return int(np.prod(shape, dtype=np.int64) * (weights // num_output))


def unknown_layers(param) -> list:
    """The layer types of a ``.param`` that this ncnn has no implementation of (pnnx writes an op it could not map
    under its own name, which ncnn then refuses to load)."""
    import ncnn

    lines = artifact(param, "ncnn").read_text(errors="replace").splitlines()[2:]  # magic, then "<layers> <blobs>"
    types = {line.split()[0] for line in lines if line.strip()}
    return sorted(t for t in types if ncnn.layer_to_index(t) < 0)
