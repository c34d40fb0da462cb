"""Fold-and-export benchmark (issue 6): for each student, side by side in one run at batch 1: PyTorch eager
before folding, after folding, ONNX Runtime fp32 and int8; plus MACs, peak memory of each ONNX artifact
(fresh process) and the Core ML conversion time and package size.

Latency is measured round-robin (a few iterations of each candidate in turn, repeated), so drift in a
noisy machine's speed hits every candidate alike; the table gives the median over all rounds.  Weights
are random (speed does not depend on them; ImageNet weights cannot be downloaded here).

    python -m bench.export_bench --students mobilevitv2_100 fastvit_s12 --size 256
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch


def _round_robin(candidates: Dict[str, Callable[[np.ndarray], Any]], x: np.ndarray, rounds: int, per_round: int,
                 warmup: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {k: [] for k in candidates}
    for run in candidates.values():
        for _ in range(warmup):
            run(x)
    for _ in range(rounds):
        for name, run in candidates.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                run(x)
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def bench_student(name: str, size: int, work: Path, rounds: int, coreml: bool) -> Dict[str, Any]:
    import timm

    from bench.latency import count_macs
    from bench.memory_probe import probe_memory
    from bench.runtimes import RUNTIMES
    from export.fold import fold_model
    from export.formats import Skipped, export_format

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = torch.rand(8, 3, size, size)
    folded, records = fold_model(model, {"family": "student"}, x[:2])
    out = work / name
    onnx = export_format("onnx", folded, x, out / "onnx", {"opset": 17, "slim": True})
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((32, 3, size, size)).astype(np.float32)
    int8 = export_format("onnx_int8", folded, x, out / "int8", {"per_channel": True}, onnx=onnx.path,
                         calibration=calib)
    cands = {"eager (unfolded)": RUNTIMES.get("pytorch")(model), "eager (folded)": RUNTIMES.get("pytorch")(folded),
             "onnxruntime fp32": RUNTIMES.get("onnxruntime_cpu")(onnx.path),
             "onnxruntime int8": RUNTIMES.get("onnxruntime_cpu")(int8.path)}
    p50 = _round_robin(cands, x[:1].numpy(), rounds=rounds, per_round=5, warmup=5)
    row: Dict[str, Any] = {"student": name, "image_size": size, "params": sum(p.numel() for p in model.parameters()),
                           "macs": count_macs(folded, size), "p50_ms": p50,
                           "folds": [r["pass"] for r in records if "skipped" not in r],
                           "max_fold_deviation": max((r.get("max_abs_diff", 0.0) for r in records), default=0.0),
                           "onnx_bytes": onnx.path.stat().st_size, "int8_bytes": int8.path.stat().st_size,
                           "peak_memory_bytes": {k: probe_memory("onnxruntime_cpu", p, size, [1])[1]
                                                 for k, p in (("fp32", onnx.path), ("int8", int8.path))}}
    if coreml:
        from export.convert import artifact_digest

        pp = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "size": size}
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
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-coreml", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    work = Path(tempfile.mkdtemp(prefix="export_bench_"))
    rows = [bench_student(s, args.size, work, args.rounds, not args.no_coreml) for s in args.students]
    print(f"batch 1, {args.size} px, {torch.get_num_threads()} threads, p50 over {args.rounds} round-robin rounds\n")
    print("| student | params | MACs | eager unfolded | eager folded | ORT fp32 | ORT int8 | folded / unfolded | "
          "ORT fp32 vs unfolded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["p50_ms"]
        print(f"| {r['student']} | {r['params'] / 1e6:.2f}M | {r['macs'] / 1e9:.2f}G | {t['eager (unfolded)']:.1f} ms | "
              f"{t['eager (folded)']:.1f} ms | {t['onnxruntime fp32']:.1f} ms | {t['onnxruntime int8']:.1f} ms | "
              f"{t['eager (unfolded)'] / t['eager (folded)']:.2f}x | "
              f"{t['eager (unfolded)'] / t['onnxruntime fp32']:.2f}x faster |")
    print("\n| student | fold passes (max deviation) | ONNX fp32 / int8 size | ORT peak memory fp32 / int8 | "
          "Core ML fp16: conversion, size | Core ML fp32: conversion, size |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mem = r["peak_memory_bytes"]
        cm = [f"{c['seconds']:.0f} s, {c['bytes'] / 1e6:.1f} MB" if "seconds" in c else c.get("skipped", "")
              for c in (r.get("coreml_fp16", {}), r.get("coreml_fp32", {}))]
        mems = " / ".join(f"{mem[k] / 1e6:.0f} MB" if mem[k] else "n/a" for k in ("fp32", "int8"))
        print(f"| {r['student']} | {', '.join(r['folds'])} ({r['max_fold_deviation']:.1e}) | "
              f"{r['onnx_bytes'] / 1e6:.1f} / {r['int8_bytes'] / 1e6:.1f} MB | {mems} | {cm[0]} | {cm[1]} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
