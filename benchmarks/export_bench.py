"""Fold-and-export benchmark (issues 6, 15): for each student, side by side in one run at batch 1: PyTorch eager
before and after folding, then every on-device format this machine can run through the runtime a device uses
(ONNX Runtime, ExecuTorch XNNPACK, LiteRT XNNPACK, OpenVINO; fp32 and int8, calibrated on the same images; NCNN
fp32 and fp16);
plus MACs, peak memory of the ONNX artifacts (fresh process) and the Core ML conversion time and package size.

Latency is measured round-robin (a few iterations of each candidate in turn, repeated), so drift in a
noisy machine's speed hits every candidate alike; the table gives the median over all rounds.  Weights
are random (speed does not depend on them; ImageNet weights cannot be downloaded here).

    python -m benchmarks.export_bench --students mobilevitv2_100 fastvit_s12 --size 256

With ``--detection CLASSES`` each student is timed as the detector a detection build ships (students/detection.py:
the FPN neck, the FCOS head and the NMS in the graph, whose score threshold here lets no location of random weights
through), once per ``--head-norm`` (GroupNorm, FCOS's, or a BatchNorm per level, which folds away), at
``--size H W``:

    python -m benchmarks.export_bench --students fastvit_t8 --detection 7 --head-norm group batch --size 256 320 \
        --formats onnx openvino_int8

Int8 speed depends on the CPU (x86 without VNNI has no fast int8 dot product; phones' ARM cores do), so the
table says which int8 artifact is fastest here relative to ONNX Runtime fp32, not on a phone.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from vfm_toolchain.blocks.detection import HEAD_NORMS
from vfm_toolchain.export.runtimes.measure import round_robin


# random weights score every detector location about 0.07 (the class prior 0.01, quality 0.5): above the build's 0.05
RANDOM_SCORE_THRESH = 0.5
# (column, format, options, runtime): each format timed through the runtime a device would use, on the CPU
FORMAT_ROWS = [("ORT fp32", "onnx", {"opset": 17, "slim": True}, "onnxruntime_cpu"),
               ("ORT int8", "onnx_int8", {"per_channel": True}, "onnxruntime_cpu"),
               ("ExecuTorch fp32", "executorch", {}, "executorch"),
               ("ExecuTorch int8", "executorch_int8", {}, "executorch"),
               ("LiteRT fp32", "tflite", {}, "litert"),
               ("LiteRT int8", "tflite_int8", {}, "litert"),
               ("OpenVINO fp32", "openvino", {}, "openvino"),
               ("OpenVINO int8", "openvino_int8", {}, "openvino"),
               ("NCNN fp32", "ncnn", {}, "ncnn"),
               ("NCNN fp16", "ncnn_fp16", {}, "ncnn")]


def bench_student(name: str, size: Tuple[int, int], work: Path, rounds: int, coreml: bool, formats: List[str],
                  detection: int = 0, head_norm: str = "group") -> Dict[str, Any]:
    """One student's row; ``size`` (h, w); ``detection``: its detector with this many classes (0: the classifier)."""
    import timm

    from vfm_toolchain.bench.latency import count_macs
    from vfm_toolchain.bench.memory_probe import probe_memory
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.export.runtimes import RUNTIMES, options_for
    from vfm_toolchain.students.detection import build_student_detector
    from vfm_toolchain.students.fold import deployable, fold_model
    from vfm_toolchain.export.convert import artifact_digest
    from vfm_toolchain.export.formats import ExportInputs, Skipped, export_chain, export_format
    from vfm_toolchain.export.formats.base import missing_modules

    torch.manual_seed(0)
    label = f"{name} ({head_norm} head)" if detection else name
    if detection:
        model = build_student_detector(name, detection, head_norm=head_norm).eval()
    else:
        model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = torch.rand(8, 3, *size)
    folded, records = fold_model(model, {"family": "student"}, x[:2])
    macs = count_macs(folded, size)
    # a detector with its NMS, as its artifacts hold it, at a score threshold no location of random weights reaches:
    # at the build's 0.05 every location (about 0.07) would enter the NMS, a worst case no trained detector meets
    model, folded = (deployable(m, {"score_thresh": RANDOM_SCORE_THRESH}) for m in (model, folded))
    out = work / label.replace(" ", "_")
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((32, 3, *size)).astype(np.float32)
    threads = torch.get_num_threads()
    cands = {"eager (unfolded)": RUNTIMES.get("pytorch")(model, threads),
             "eager (folded)": RUNTIMES.get("pytorch")(folded, threads)}
    made, skipped, seconds, sizes = {}, {}, {}, {}
    rows = []
    for column, fmt, options, runtime in FORMAT_ROWS:
        missing = missing_modules(fmt)
        if fmt not in formats or missing:
            skipped[column] = "not asked for (--formats)" if fmt not in formats else f"needs {', '.join(missing)}"
        else:
            rows.append((column, fmt, options, runtime))
    # the export chain the build uses, a format at a time: int8 from the fp32 ONNX (the shared inputs carry it),
    # calibrated on the same images; a converter that refuses this student (pnnx on MobileViT-V2's unfold) is a cell
    inputs = ExportInputs(calibration=calib)
    for column, fmt, options, runtime in rows:
        print(f"{label}: exporting {fmt} ...", flush=True)
        t0 = time.time()
        try:
            (_, res), = export_chain([fmt], folded, x, out, {fmt: options}, inputs)
        except ToolchainError as why:
            skipped[column] = str(why).splitlines()[0]
            continue
        if isinstance(res, Skipped):
            skipped[column] = str(res)
            continue
        made[fmt], seconds[column] = res, round(time.time() - t0, 1)
        sizes[column] = artifact_digest(res.path)["bytes"]
        cands[column] = RUNTIMES.get(runtime)(res.path, threads, **options_for(runtime, res.meta))
    p50 = round_robin(cands, x[:1].numpy(), rounds=rounds, per_round=5, warmup=5)
    row: Dict[str, Any] = {"student": label, "image_size": list(size),
                           "params": sum(p.numel() for p in model.parameters()), "macs": macs, "p50_ms": p50,
                           "threads": threads,
                           "folds": [r["pass"] for r in records if "skipped" not in r],
                           "max_fold_deviation": max((r.get("max_abs_diff", 0.0) for r in records), default=0.0),
                           "export_seconds": seconds, "bytes": sizes, "skipped": skipped,
                           "ort_int8_layout": made["onnx_int8"].meta.get("layout_reason") if "onnx_int8" in made
                           else None,
                           "peak_memory_bytes": {k: probe_memory("onnxruntime_cpu", made[f].path, size, [1])[1]
                                                 for k, f in (("fp32", "onnx"), ("int8", "onnx_int8")) if f in made}}
    if coreml and not detection:  # the classifier's Core ML conversion (a detector's is the build's, with its NMS)
        pp = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
              "size": size[0] if size[0] == size[1] else list(size)}
        for precision in ("fp16", "fp32"):
            try:
                res = export_format("coreml", folded, x, out / f"coreml_{precision}",
                                    {"precision": precision, "image_input": True}, preprocess=pp,
                                    classes=[str(i) for i in range(10)])
                row[f"coreml_{precision}"] = {"seconds": res.meta["seconds"],
                                              "bytes": artifact_digest(res.path)["bytes"]}
            except Skipped as why:
                row[f"coreml_{precision}"] = {"skipped": str(why)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--students", nargs="+", default=["mobilevitv2_100", "fastvit_s12"])
    ap.add_argument("--size", type=int, nargs="+", default=[256], help="one side, or height and width")
    ap.add_argument("--detection", type=int, default=0, metavar="CLASSES",
                    help="time each student as a detector with this many classes (NMS included); 0: the classifier")
    ap.add_argument("--head-norm", nargs="+", default=["group"], choices=list(HEAD_NORMS),
                    help="--detection: the head's normalisation, a row each")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-coreml", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--formats", nargs="+", default=[f for _, f, *_ in FORMAT_ROWS],
                    choices=[f for _, f, *_ in FORMAT_ROWS], help="only these formats (default: all)")
    args = ap.parse_args()
    if len(args.size) > 2:
        ap.error(f"--size takes one side or a height and a width, got {len(args.size)} numbers")
    size = (args.size[0], args.size[-1])
    if args.head_norm != ["group"] and not args.detection:
        ap.error("--head-norm is the detector's head: give --detection CLASSES too")
    if "onnx" not in args.formats and len(args.formats) > 0:
        args.formats = ["onnx", *args.formats]  # the int8 ONNX and the memory probe start from the fp32 ONNX
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="export_bench_") as work:  # the artifacts matter for their numbers only
        norms = args.head_norm if args.detection else ["group"]
        rows = [bench_student(s, size, Path(work), args.rounds, not args.no_coreml, args.formats, args.detection,
                              norm) for s in args.students for norm in norms]
    print(f"\nbatch 1, {size[0]}x{size[1]} px (h x w), {torch.get_num_threads()} threads, p50 over {args.rounds} "
          f"round-robin rounds, 5 calls each\n")
    columns = ["eager (unfolded)", "eager (folded)"] + [c for c, *_ in FORMAT_ROWS]
    print("| student | params | MACs | " + " | ".join(columns) + " | fastest int8 vs ORT fp32 |")
    print("|---|---|---|" + "---|" * (len(columns) + 1))
    for r in rows:
        t = r["p50_ms"]
        cells = [f"{t[c]:.1f} ms" if c in t else f"n/a ({r['skipped'].get(c, 'not run')})" for c in columns]
        int8 = {c: t[c] for c in t if c.endswith("int8")}
        best = min(int8, key=int8.get) if int8 else None
        ratio = f"{best}: {t['ORT fp32'] / t[best]:.2f}x" if best and "ORT fp32" in t else "n/a"
        print(f"| {r['student']} | {r['params'] / 1e6:.2f}M | {r['macs'] / 1e9:.2f}G | " + " | ".join(cells) +
              f" | {ratio} |")
    print("\n| student | fold passes (max deviation) | export seconds | artifact MB | ORT peak memory fp32 / int8 | "
          "Core ML fp16: conversion, size | Core ML fp32: conversion, size |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = r["peak_memory_bytes"]
        cm = [f"{c['seconds']:.0f} s, {c['bytes'] / 1e6:.1f} MB" if "seconds" in c else c.get("skipped", "")
              for c in (r.get("coreml_fp16", {}), r.get("coreml_fp32", {}))]
        mems = " / ".join(f"{mem[k] / 1e6:.0f} MB" if mem.get(k) else "n/a" for k in ("fp32", "int8"))
        secs = ", ".join(f"{k} {v:.0f}" for k, v in r["export_seconds"].items())
        mb = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in r["bytes"].items())
        print(f"| {r['student']} | {', '.join(r['folds'])} ({r['max_fold_deviation']:.1e}) | {secs} | {mb} | {mems} | "
              f"{cm[0]} | {cm[1]} |")
    for r in rows:
        print(f"\n{r['student']}: ORT int8 layout: {r['ort_int8_layout']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
