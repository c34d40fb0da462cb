"""Device-side latency runner, copied into a bundle as ``run_bench.py`` beside ``measure.py`` and the
artifacts.  It needs Python, NumPy and the target's runtime only (onnxruntime on a Raspberry Pi or Jetson,
coremltools on a Mac, executorch / ai-edge-litert / openvino on an ARM or x86 Linux board), never this
toolchain, and writes the same rows as the build's ``bench.latency``, plus each artifact's top-1 / mIoU on the bundle's
labeled test slice (``test_<model>.npz``) where the build bundled one.  Phones have no Python: the bundle's
``android_bench.sh`` times the ``.pte`` and ``.tflite`` files there with each runtime's own benchmark binary.

    python run_bench.py                       # every artifact this device can run, bundle.json's settings
    python run_bench.py --iters 100 --out my_device.json

Each artifact is measured in a process of its own, so its peak memory is its own.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if __package__:  # imported as bench.bundle_runner: the toolchain scores a bundle's test slice here
    from .measure import PeakMemory, measure_stable, resident_bytes
else:  # run as the bundle's run_bench.py, beside the bundle's copy of bench/measure.py
    sys.path.insert(0, str(HERE))
    from measure import PeakMemory, measure_stable, resident_bytes  # noqa: E402


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
    """Feeds Core ML what an app would: an RGB image when the model takes one (the export bakes the
    normalisation in), one image per prediction; returns the class scores in the model's class order."""
    import coremltools as ct
    from PIL import Image

    if platform.system() != "Darwin":
        raise RuntimeError("Core ML prediction needs macOS")
    model = ct.models.MLModel(str(path), compute_units=ct.ComputeUnit.ALL)
    md = dict(model.user_defined_metadata)
    image = model.get_spec().description.input[0].type.WhichOneof("Type") == "imageType"
    pp = json.loads(md["preprocess"]) if image else None
    classes = json.loads(md["classes"]) if md.get("class_labels") == "true" else None

    def one(x):
        if pp is not None:
            pix = (x[0] * np.asarray(pp["std"])[:, None, None] + np.asarray(pp["mean"])[:, None, None]) * 255.0
            x = Image.fromarray(np.clip(pix.transpose(1, 2, 0).round(), 0, 255).astype(np.uint8))
        out = model.predict({"input": x})
        if classes:
            return np.asarray([[out["classLabel_probs"][c] for c in classes]], dtype=np.float32)
        return np.asarray(next(iter(out.values())), dtype=np.float32)

    def run(x):
        return np.concatenate([one(x[i:i + 1]) for i in range(len(x))])

    run.provider = f"coreml (ALL compute units, {md.get('precision', 'fp32')})"
    return run


def _one_by_one(call):
    """Programs exported at batch 1 (ExecuTorch, LiteRT): a batch runs one image after another."""
    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return np.concatenate([call(x[i:i + 1]) for i in range(len(x))])
    return run


def load_executorch(path: Path, threads):
    import torch
    from executorch.runtime import Runtime

    if threads:
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(int(threads))
    method = Runtime.get().load_program(str(path)).load_method("forward")
    run = _one_by_one(lambda x: method.execute([torch.from_numpy(x)])[0].numpy())
    run.provider = "executorch xnnpack"
    return run


def load_litert(path: Path, threads):
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path), num_threads=threads)
    interpreter.allocate_tensors()
    (inp,), (out,) = interpreter.get_input_details(), interpreter.get_output_details()

    def call(x):
        if np.issubdtype(inp["dtype"], np.integer):  # a full-integer file: quantize in, dequantize out
            (scale, zero), info = inp["quantization"], np.iinfo(inp["dtype"])
            x = np.clip(np.round(x / scale) + zero, info.min, info.max).astype(inp["dtype"])
        interpreter.set_tensor(inp["index"], x)
        interpreter.invoke()
        y = interpreter.get_tensor(out["index"])
        if np.issubdtype(out["dtype"], np.integer):
            scale, zero = out["quantization"]
            return (y.astype(np.float32) - zero) * scale
        return y.copy()

    run = _one_by_one(call)
    run.provider = "litert xnnpack"
    return run


def load_openvino(path: Path, threads):
    import openvino as ov

    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    request = ov.Core().compile_model(str(path), "CPU", config).create_infer_request()

    def run(x):
        return np.array(request.infer([np.ascontiguousarray(x, dtype=np.float32)])[0])

    run.provider = "openvino CPU"
    return run


# one loader per runtime family; bundle.json names each artifact's family (its format's declaration), so a new
# format of a known family needs nothing here
LOADERS = {"onnxruntime": load_onnxruntime, "coreml": load_coreml, "executorch": load_executorch,
           "litert": load_litert, "openvino": load_openvino}


def score(run, slice_path, batch=8):
    """Top-1 (labels) or mIoU (masks at the input size) of ``run`` on a bundle's labeled test slice."""
    data = np.load(str(slice_path))
    images, labels = data["images"], data["labels"]
    mean, std = data["mean"][:, None, None], data["std"][:, None, None]
    n_classes = int(data["num_classes"])
    hits, cm = 0, np.zeros((n_classes, n_classes), dtype=np.int64)
    for i in range(0, len(images), batch):
        x = ((images[i:i + batch].transpose(0, 3, 1, 2).astype(np.float32) / 255.0) - mean) / std
        out = np.asarray(run(np.ascontiguousarray(x, dtype=np.float32)))
        if labels.ndim == 1:
            hits += int((out.argmax(1) == labels[i:i + batch]).sum())
            continue
        pred, target = out.argmax(1).ravel(), labels[i:i + batch].astype(np.int64).ravel()
        valid = target != 255  # the ignore id
        cm += np.bincount(target[valid] * n_classes + pred[valid], minlength=n_classes ** 2).reshape(n_classes, -1)
    if labels.ndim == 1:
        return hits / max(1, len(images))
    tp = np.diag(cm).astype(np.float64)
    union = cm.sum(0) + cm.sum(1) - tp
    return float((tp[union > 0] / union[union > 0]).mean()) if (union > 0).any() else float("nan")


def measure_one(art, warmup, iters, batches, threads):
    """Rows for one artifact, run in a process of its own (see main): memory a runtime frees stays with
    the process's allocator, so artifacts measured after it in one process would read too little."""
    runtime = art.get("runtime")
    loader = LOADERS.get(runtime)
    if loader is None:
        return {"skipped": {"artifact": art["label"], "reason": f"this run_bench.py has no loader for runtime "
                                                                f"'{runtime}' ({art['kind']})"}}
    before = resident_bytes()
    try:
        run = loader(HERE / art["file"], threads)
    except Exception as exc:  # the runtime is missing or cannot load this artifact on this device
        return {"skipped": {"artifact": art["label"], "reason": f"{type(exc).__name__}: {exc}"}}
    rows = []
    for bs in sorted(batches):
        size = art["image_size"]  # one side, or [height, width]
        h, w = (size, size) if isinstance(size, int) else size
        x = np.random.default_rng(0).standard_normal((bs, 3, h, w)).astype(np.float32)
        mem = PeakMemory().start(base=before)
        stats = measure_stable(run, x, warmup, iters)
        rows.append({"artifact": art["label"], "model": art["model"], "runtime": runtime, "batch": bs,
                     "image_size": size, "params": art.get("params"), "macs": art.get("macs"),
                     "bytes": art["bytes"], "peak_memory_bytes": mem.peak_bytes(),
                     "provider": getattr(run, "provider", None), **stats})
    got = {"rows": rows}
    slice_ = art.get("test_slice")
    if slice_:  # accuracy where it runs: an fp16 / int8 artifact's loss measured on the device itself
        got["accuracy"] = {"artifact": art["label"], "metric": slice_["metric"], "images": slice_["images"],
                           "score": score(run, HERE / slice_["file"]), "here": art.get("local_score"),
                           "build_test_score": art.get("build_test_score")}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "results.json"))
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child: one artifact, JSON out
    args = ap.parse_args()
    bundle = json.loads((HERE / "bundle.json").read_text())
    cfg = bundle["bench"]
    warmup = cfg["warmup"] if args.warmup is None else args.warmup
    iters = cfg["iters"] if args.iters is None else args.iters
    batches = args.batch_sizes or cfg["batch_sizes"]
    if args.one is not None:
        print(json.dumps(measure_one(bundle["artifacts"][args.one], warmup, iters, batches, args.threads)))
        return
    rows, skipped, accuracy = [], [], []
    for i, art in enumerate(bundle["artifacts"]):
        cmd = [sys.executable, str(HERE / "run_bench.py"), "--one", str(i), "--warmup", str(warmup), "--iters",
               str(iters), "--batch-sizes", *map(str, batches)] + (["--threads", str(args.threads)] if args.threads
                                                                   else [])
        child = subprocess.run(cmd, capture_output=True, text=True)
        if child.returncode != 0:
            skipped.append({"artifact": art["label"], "reason": f"runner failed: {child.stderr.strip()[-500:]}"})
            continue
        got = json.loads(child.stdout.strip().splitlines()[-1])
        if "skipped" in got:
            skipped.append(got["skipped"])
            continue
        if got.get("accuracy"):
            accuracy.append(got["accuracy"])
            print(f"{art['label']:<28} {got['accuracy']['metric']} {got['accuracy']['score']:.4f} on "
                  f"{got['accuracy']['images']} test images")
        for r in got["rows"]:
            rows.append(r)
            print(f"{r['artifact']:<28} {r['runtime']:<12} batch {r['batch']:3d}  p50 {r['p50_ms']:.2f} ms"
                  + (f"  UNSTABLE ({r['unstable']})" if r.get("unstable") else ""))
    device = {"machine": platform.machine(), "system": platform.system(), "release": platform.release(),
              "processor": platform.processor(), "python": platform.python_version(), "node": platform.node()}
    # which bundle and which files were measured (kind, each artifact's sha256): the build machine refuses
    # results of another build, of a candidates bundle where a build's is expected, and the other way round
    result = {"bundle": bundle["name"], "kind": bundle.get("kind"),
              "artifacts": {a["label"]: a["sha256"] for a in bundle["artifacts"]}, "device": device,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "bench": rows, "accuracy": accuracy,
              "skipped": skipped}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
