"""Device-side latency runner, copied into a bundle as ``run_bench.py`` beside ``measure.py`` and the
artifacts.  It needs Python, NumPy and the target's runtime only (onnxruntime on a Raspberry Pi or Jetson,
coremltools on a Mac), never this toolchain, and writes the same rows as the build's ``bench.latency``.

    python run_bench.py                       # every artifact this device can run, bundle.json's settings
    python run_bench.py --iters 100 --out my_device.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import measure_latency  # noqa: E402  (the bundle's copy of bench/measure.py)


def load_onnxruntime(path: Path, threads):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    wanted = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CoreMLExecutionProvider", "CPUExecutionProvider")
    providers = [p for p in wanted if p in ort.get_available_providers()]
    session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    name = session.get_inputs()[0].name

    def run(x):
        return session.run(None, {name: x})[0]

    run.provider = session.get_providers()[0]
    return run


def load_coreml(path: Path, threads):
    import coremltools as ct

    if platform.system() != "Darwin":
        raise RuntimeError("Core ML prediction needs macOS")
    model = ct.models.MLModel(str(path), compute_units=ct.ComputeUnit.ALL)

    def run(x):
        return model.predict({"input": x})

    run.provider = "coreml (ALL compute units)"
    return run


LOADERS = {"onnx": ("onnxruntime", load_onnxruntime), "onnx_fp16": ("onnxruntime", load_onnxruntime),
           "onnx_int8": ("onnxruntime", load_onnxruntime), "coreml": ("coremltools", load_coreml)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    bundle = json.loads((HERE / "bundle.json").read_text())
    cfg = bundle["bench"]
    warmup = cfg["warmup"] if args.warmup is None else args.warmup
    iters = cfg["iters"] if args.iters is None else args.iters
    batches = args.batch_sizes or cfg["batch_sizes"]
    rows, skipped = [], []
    for art in bundle["artifacts"]:
        runtime, loader = LOADERS.get(art["kind"], (None, None))
        if loader is None:
            skipped.append({"artifact": art["label"], "reason": f"no runner for {art['kind']}"})
            continue
        try:
            run = loader(HERE / art["file"], args.threads)
        except Exception as exc:  # the runtime is missing or cannot load this artifact on this device
            skipped.append({"artifact": art["label"], "reason": f"{type(exc).__name__}: {exc}"})
            continue
        for bs in batches:
            size = art["image_size"]
            x = np.random.default_rng(0).standard_normal((bs, 3, size, size)).astype(np.float32)
            stats = measure_latency(run, x, warmup, iters)
            rows.append({"artifact": art["label"], "model": art["model"], "runtime": runtime, "batch": bs,
                         "image_size": size, "params": art.get("params"), "bytes": art["bytes"],
                         "provider": getattr(run, "provider", None), **stats})
            print(f"{art['label']:<28} {runtime:<12} batch {bs:3d}  p50 {stats['p50_ms']:.2f} ms")
    device = {"machine": platform.machine(), "system": platform.system(), "release": platform.release(),
              "processor": platform.processor(), "python": platform.python_version(), "node": platform.node()}
    result = {"bundle": bundle["name"], "device": device, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "bench": rows, "skipped": skipped}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
