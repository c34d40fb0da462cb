"""Peak memory of one (artifact, runtime) in a fresh process.

Within one process, memory a runtime frees goes back to the allocator, not to the OS, so the next
artifact's resident-size growth reads near zero; a fresh process per artifact is the only honest
reading.  The bench stage runs this module once per candidate:

    python -m bench.memory_probe --runtime onnxruntime --artifact model.onnx --size 256 --batches 1 8
    python -m bench.memory_probe --runtime onnxruntime --artifact model.onnx --size 192 256 --batches 1  # h w
    python -m bench.memory_probe --runtime pytorch --artifact STAGE/model --fold --size 256 --batches 1
    python -m bench.memory_probe --runtime pytorch --artifact STAGE/model --size 320 --batches 1 \
        --detection 0.05 0.6 100      # a detector, timed with its NMS (score threshold, IoU, max detections)

and reads one JSON line: ``{"1": bytes, "8": bytes}``, the resident memory added over the process
before the model was loaded, libraries already imported (weights, workspace, activations at that batch).

``probe_memory`` runs this file by its path, not as ``-m vfm_toolchain.bench.memory_probe``: the package would import
every bench stage, and through them PyTorch and timm, about 8 s of each probe's start on 2 cores.  An artifact of a
runtime the layer's own files declare (ONNX Runtime, OpenVINO, LiteRT, ...) is then loaded as a device bundle
loads it, with NumPy and its runtime library alone; PyTorch models and runtimes registered from elsewhere take the
toolchain's registry.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["probe_memory"]

LAYER = Path(__file__).resolve().parents[1] / "export" / "runtimes"  # the repository's and the wheel's layout alike


def probe_memory(runtime: str, artifact: Path, size: Tuple[int, int], batches: List[int], threads: Optional[int] = None,
                 fold: bool = False, iters: int = 3, timeout: float = 600,
                 detection: Optional[Dict[str, Any]] = None) -> Dict[int, Optional[int]]:
    """Run the probe in a child process; a failure there leaves the rows without memory, never the bench.
    ``detection``: a PyTorch detector's NMS settings (``score_thresh``, ``iou``, ``max_det``), which it is
    wrapped with as the bench times it."""
    cmd = [sys.executable, "-c", f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')",
           "--runtime", runtime, "--artifact", str(artifact),
           "--size", *map(str, size), "--iters", str(iters), "--batches", *map(str, batches)]
    cmd += ["--fold"] if fold else []
    if detection:
        cmd += ["--detection", *(str(detection[k]) for k in ("score_thresh", "iou", "max_det"))]
    cmd += ["--threads", str(threads)] if threads else []
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root)
        peaks = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        peaks = {}
    return {b: peaks.get(str(b)) for b in batches}


def _layer_loader(runtime: str):
    """``load`` of the runtime layer's file that declares ``runtime``, imported as package ``runtimes`` the way a
    device bundle imports its copy (export/runtimes/__init__.py, which pulls in the toolchain, never runs); None for
    PyTorch (it loads the toolchain's models) and for names no file here declares."""
    package = types.ModuleType("runtimes")
    package.__path__ = [str(LAYER)]
    sys.modules.setdefault("runtimes", package)
    from runtimes.base import entry_loader, runtime_modules

    for module in runtime_modules(LAYER, "runtimes"):
        entry = module.ENTRIES.get(runtime)
        if entry is not None:
            return None if entry.get("build_device") else entry_loader(module, runtime)
    return None


def _load(runtime: str, artifact: str, fold: bool, threads: Optional[int], detection: Optional[List[float]] = None):
    from vfm_toolchain.export.runtimes import RUNTIMES

    if runtime != "pytorch":
        return RUNTIMES.get(runtime)(artifact, threads)
    import torch
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.core.sizes import image_hw
    from vfm_toolchain.students.fold import deployable, fold_model, ships_wrapped

    model = load_model(Path(artifact))
    if fold:
        spec = json.loads((Path(artifact) / "spec.json").read_text())
        model, _ = fold_model(model, spec, torch.zeros(1, 3, *image_hw(spec["preprocess"]["size"])))
    if ships_wrapped(model):  # a detector: the bench times it with its NMS, as it ships
        if detection is None:
            raise SystemExit(f"{artifact} is a detector: give its NMS settings with --detection SCORE IOU MAX_DET")
        model = deployable(model, {"score_thresh": detection[0], "iou": detection[1], "max_det": int(detection[2])})
    return RUNTIMES.get("pytorch")(model, threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--size", type=int, nargs="+", required=True, help="one side, or height width")
    ap.add_argument("--batches", type=int, nargs="+", required=True)
    ap.add_argument("--fold", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--detection", type=float, nargs=3, default=None, metavar=("SCORE", "IOU", "MAX_DET"),
                    help="a PyTorch detector: the NMS it is timed with")
    args = ap.parse_args()
    if len(args.size) > 2:
        ap.error(f"--size takes one side or height width, not {len(args.size)} numbers")
    hw = (args.size[0], args.size[0]) if len(args.size) == 1 else tuple(args.size)
    layer = _layer_loader(args.runtime)
    # libraries are imported before the baseline: their code is not this model's memory
    if layer is None:
        import torch  # noqa: F401
        from vfm_toolchain.export.runtimes import RUNTIMES  # noqa: F401
        from vfm_toolchain.plugins import load_plugins

        load_plugins()
    if args.runtime.startswith("onnxruntime"):
        import onnxruntime  # noqa: F401
    from runtimes.measure import PeakMemory, resident_bytes  # the layer's file: as light as the bundle's

    before = resident_bytes()
    if layer is not None:
        run = layer(args.artifact, args.threads)
    else:
        run = _load(args.runtime, args.artifact, args.fold, args.threads, args.detection)
    peaks = {}
    for bs in sorted(args.batches):
        x = np.random.default_rng(0).standard_normal((bs, 3, *hw)).astype(np.float32)
        mem = PeakMemory().start(base=before)
        for _ in range(args.iters):
            run(x)
        peaks[str(bs)] = mem.peak_bytes()
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
