"""Device-side latency runner, copied into a bundle as ``run_bench.py`` beside the artifacts and ``runtimes/``, a
verbatim copy of the build's runtime layer (export/runtimes: the loaders and the timing code that checked and timed
the artifacts here).  It keeps only its command line, timing and scoring, and needs Python, NumPy and the target's
runtime only (onnxruntime on a Raspberry Pi or Jetson, coremltools on a Mac, executorch / ai-edge-litert / openvino
on an ARM or x86 Linux board), never this toolchain.  It writes the same rows as the build's ``bench.latency``, plus
each artifact's top-1 / mIoU / mAP50 on the bundle's labeled test slice (``test_<model>.npz``) where the build bundled
one, and each artifact's layer table at batch 1 (its runtime's ``layers``: where each layer ran, in which precision,
how long it took).  Phones have no Python: the bundle's
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
    from vfm_toolchain.export.runtimes import default_loaders
    from vfm_toolchain.export.runtimes.measure import PeakMemory, measure_stable, resident_bytes
else:  # run as the bundle's run_bench.py, beside the bundle's verbatim copy of export/runtimes/
    sys.path.insert(0, str(HERE))
    from runtimes.measure import PeakMemory, measure_stable, resident_bytes  # noqa: E402


def bundle_loaders(folder: Path):
    """``{family: load}`` from the runtime files a bundle carries (``runtimes/*_runtime.py``, the build's own
    files byte for byte): each family's default entry, the one named after it (export/runtimes/base.py)."""
    from runtimes.base import entry_loader, runtime_modules

    return {name: entry_loader(module, name) for module in runtime_modules(folder, "runtimes")
            for name, entry in module.ENTRIES.items() if entry["runs"] == name}


def loaders():
    return default_loaders() if __package__ else bundle_loaders(HERE / "runtimes")


def layer_functions():
    """``{family: layers}``: each family's default entry's ``layers`` with its options bound (export/runtimes/base.py),
    for the runtime files that have one."""
    if __package__:
        from vfm_toolchain.export.runtimes import RUNTIMES, layers_for

        return {name: layers_for(name) for name in RUNTIMES.list()
                if RUNTIMES.meta(name)["default"] and RUNTIMES.meta(name)["runs"] and RUNTIMES.meta(name)["layers"]}
    import functools

    from runtimes.base import runtime_modules

    return {name: functools.partial(module.layers, **entry.get("options", {}))
            for module in runtime_modules(HERE / "runtimes", "runtimes") for name, entry in module.ENTRIES.items()
            if entry["runs"] == name and callable(getattr(module, "layers", None))}


LAYER_BUDGET_MS, LAYER_RUNS = 2000.0, (10, 50)  # as the build's bench.latency: about 2 s of profiled calls at most


def layer_table(art, threads, rows, iters=LAYER_RUNS[1]):
    """The artifact's layer table at batch 1 as its runtime reports it (``layers``, export/runtimes/base.py), or the
    reason there is none (a runtime file without ``layers``, a runtime that cannot profile here): never a failure."""
    got = {"artifact": art["label"], "runtime": art.get("runtime")}
    fn = layer_functions().get(art.get("runtime"))
    if fn is None:
        got["reason"] = f"this bundle's runtime file for '{art.get('runtime')}' has no layers()"
        return got
    first = min(rows, key=lambda r: r["batch"]) if rows else None
    per_image = first["p50_ms"] / first["batch"] if first else None
    most = max(LAYER_RUNS[0], min(LAYER_RUNS[1], iters))  # as many as the bench times, fewer for a slow model
    runs = most if not per_image else int(max(LAYER_RUNS[0], min(most, LAYER_BUDGET_MS // per_image)))
    size = art["image_size"]
    h, w = (size, size) if isinstance(size, int) else size
    x = np.random.default_rng(0).standard_normal((1, 3, h, w)).astype(np.float32)
    try:
        got["table"] = fn(HERE / art["file"], x, threads, warmup=3, runs=runs, **art.get("runtime_options", {}))
    except Exception as exc:  # Unavailable (the runtime cannot profile here) or a failure: the reason, in one line
        text = str(exc).strip().splitlines()
        got["reason"] = f"{type(exc).__name__}: {text[0][:200] if text else ''}"
    return got


def macro_ap(logits, tags):
    """Mean over the tags with a positive image of the step-wise average precision of their sigmoid (the build's
    toolchain/tasks/multilabel.py, scikit-learn's definition); NaN when no tag has one."""
    aps = []
    for c in range(tags.shape[1]):
        y = tags[:, c] > 0
        if not y.any():
            continue
        order = np.argsort(-logits[:, c], kind="mergesort")  # the sigmoid keeps the logits' order
        s, hit = logits[order, c], y[order]
        last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
        tp = np.cumsum(hit)[last].astype(np.float64)
        aps.append(float(np.sum(np.diff(np.r_[0.0, tp / tp[-1]]) * tp / (last + 1))))
    return float(np.mean(aps)) if aps else float("nan")


def score(run, slice_path, batch=8):
    """Top-1 (labels), macro mAP (a row of 0/1 tags per image), mIoU (masks at the input size) or COCO mAP50 (boxes
    at the input size: a detector's ``[K, 7]`` rows) of ``run`` on a bundle's labeled test slice."""
    data = np.load(str(slice_path))
    mean, std = data["mean"][:, None, None], data["std"][:, None, None]
    n_classes = int(data["num_classes"])
    if "boxes" in data.files:
        return detection_map50(run, data, batch)
    images, labels = data["images"], data["labels"]
    if labels.ndim == 2:
        outs = [np.asarray(run(np.ascontiguousarray(((images[i:i + batch].transpose(0, 3, 1, 2).astype(np.float32)
                                                      / 255.0) - mean) / std, dtype=np.float32)), dtype=np.float64)
                for i in range(0, len(images), batch)]
        return macro_ap(np.concatenate(outs), labels)
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


def _iou(box, boxes):
    """IoU of one xyxy box with each of ``boxes`` (COCO's: areas as width * height)."""
    lt, rb = np.maximum(box[:2], boxes[:, :2]), np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=1)
    area = lambda b: np.clip(b[..., 2] - b[..., 0], 0, None) * np.clip(b[..., 3] - b[..., 1], 0, None)
    union = area(box) + area(boxes) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def coco_ap50(predictions, targets, n_classes, max_det=100, recall_thresholds=None):
    """COCO's AP at IoU 0.5, area "all", ``max_det`` detections per image, averaged over the classes with a box
    in ``targets`` (pycocotools' COCOeval step by step, in NumPy: the build scores with faster_coco_eval, the same
    numbers).  ``predictions``: per image (boxes [k, 4], scores [k], labels [k]); ``targets``: per image (boxes,
    labels), in one coordinate frame.  ``recall_thresholds``: where the precision is sampled, COCO's 101 points
    by default; a slice carries the build evaluator's own (torchmetrics' are float32 values, and a recall landing
    exactly on a point is counted on one side or the other by that last bit).  NaN when no class has a box."""
    rs = np.linspace(0, 1, 101) if recall_thresholds is None else np.asarray(recall_thresholds, dtype=np.float64)
    cut = []
    for boxes, scores, labels in predictions:  # the best max_det of each image, as the build's evaluator keeps
        keep = np.argsort(-scores, kind="mergesort")[:max_det]
        cut.append((boxes[keep], scores[keep], labels[keep]))
    aps = []
    for c in range(n_classes):
        n_gt = sum(int((t_labels == c).sum()) for _, t_labels in targets)
        if n_gt == 0:  # COCO leaves a class with no box out of the mean
            continue
        scores_c, hits_c = [], []
        for (boxes, scores, labels), (t_boxes, t_labels) in zip(cut, targets):
            d = np.flatnonzero(labels == c)
            d = d[np.argsort(-scores[d], kind="mergesort")][:max_det]
            gt = t_boxes[t_labels == c]
            taken = np.zeros(len(gt), dtype=bool)
            for k in d:  # best first: each takes the unmatched box it overlaps most, at IoU 0.5 or more
                hit = False
                if len(gt):
                    iou = np.where(taken, -1.0, _iou(boxes[k], gt))
                    best = int(np.argmax(iou))
                    if iou[best] >= 0.5:
                        taken[best], hit = True, True
                scores_c.append(scores[k])
                hits_c.append(hit)
        if not scores_c:
            aps.append(0.0)
            continue
        order = np.argsort(-np.asarray(scores_c), kind="mergesort")
        tp = np.cumsum(np.asarray(hits_c)[order]).astype(np.float64)
        fp = np.cumsum(~np.asarray(hits_c)[order]).astype(np.float64)
        recall, precision = tp / n_gt, tp / (tp + fp + np.spacing(1))
        precision = np.maximum.accumulate(precision[::-1])[::-1]  # the precision envelope
        at = np.searchsorted(recall, rs, side="left")  # the first detection reaching each recall point
        aps.append(float(np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0).mean()))
    return float(np.mean(aps)) if aps else float("nan")


def detection_map50(run, data, batch=8):
    """mAP50 of a detector's ``run(images) -> [K, 7]`` rows (batch_index, x1, y1, x2, y2, score, class) on a
    detection slice: images and boxes at the input size (IoU does not change under the per-axis resize, so this
    is the mAP50 of the images at their own resolution)."""
    images = data["images"]
    mean, std = data["mean"][:, None, None], data["std"][:, None, None]
    boxes, labels, owner = data["boxes"], data["box_labels"], data["box_image"]
    predictions = []
    for i in range(0, len(images), batch):
        x = ((images[i:i + batch].transpose(0, 3, 1, 2).astype(np.float32) / 255.0) - mean) / std
        rows = np.asarray(run(np.ascontiguousarray(x, dtype=np.float32)), dtype=np.float64).reshape(-1, 7)
        for k in range(len(x)):
            d = rows[rows[:, 0] == k]
            predictions.append((d[:, 1:5], d[:, 5], d[:, 6].astype(np.int64)))
    targets = [(boxes[owner == k].astype(np.float64), labels[owner == k].astype(np.int64)) for k in range(len(images))]
    thresholds = data["recall_thresholds"] if "recall_thresholds" in data.files else None
    return coco_ap50(predictions, targets, int(data["num_classes"]), recall_thresholds=thresholds)


def measure_one(art, warmup, iters, batches, threads):
    """Rows for one artifact, run in a process of its own (see main): memory a runtime frees stays with
    the process's allocator, so artifacts measured after it in one process would read too little."""
    runtime = art.get("runtime")
    loader = loaders().get(runtime)
    if loader is None:
        return {"skipped": {"artifact": art["label"], "reason": f"this bundle carries no runtime file for "
                                                                f"'{runtime}' ({art['kind']})"}}
    before = resident_bytes()
    try:
        run = loader(HERE / art["file"], threads, **art.get("runtime_options", {}))  # from its export record
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
    got = {"rows": rows, "layers": layer_table(art, threads, rows, iters)}
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
    rows, skipped, accuracy, layers = [], [], [], []
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
        if got.get("layers"):
            layers.append(got["layers"])
            t = got["layers"].get("table")
            print(f"{art['label']:<28} layer table: " + (f"{len(t['rows'])} layers" if t else got["layers"]["reason"]))
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
              "skipped": skipped, "layers": layers}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
