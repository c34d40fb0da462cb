"""Device bundles: a build's deployable artifacts with a runner that measures them where they will run,
and the merge of the device's results back into the build report.

``write_bundle`` copies the artifacts whose format declares ``bundle=True`` (export/formats/base.py),
``bundle.json`` (artifacts with the runtime family that loads each, input size, bench settings),
``run_bench.py`` and ``measure.py`` (the same measurement code the build uses).  ``merge_device_results`` adds the device's rows to ``build.json``
and an "On-device latency" section to ``report.md``.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

from bench.measure import latency_cell
from export.convert import artifact_files
from export.formats import FORMATS
from toolchain.errors import ToolchainError
from toolchain.store import atomic_write_bytes, atomic_write_json

__all__ = ["write_bundle", "merge_device_results", "bundle_kinds"]

_HERE = Path(__file__).resolve().parent


def bundle_kinds() -> list:
    """The formats that travel in a device bundle, as their files declare."""
    return [f for f in FORMATS.list() if FORMATS.meta(f)["bundle"] and FORMATS.meta(f)["runtime"]]


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ToolchainError(f"{what} '{path}' does not exist") from None
    except IsADirectoryError:
        raise ToolchainError(f"{what} '{path}' is a folder; give the JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolchainError(f"{what} '{path}' cannot be read: {exc}") from None
    except ValueError as exc:
        raise ToolchainError(f"{what} '{path}' is not valid JSON ({exc})") from None


def _record(build_dir: Path) -> Dict[str, Any]:
    f = Path(build_dir) / "build.json"
    if not f.is_file():
        raise ToolchainError(f"'{build_dir}' is not a build output folder (no build.json); pass the --out of a build")
    record = _read_json(f, "build record")
    if not isinstance(record, dict):
        raise ToolchainError(f"'{f}' is not a build record; pass the --out of a build")
    return record


# A phone has no Python: each runtime's own benchmark binary, pushed with the files over adb (android_bench.sh)
_PHONE_BENCH = {
    "executorch": 'cd {dir} && ./executor_runner -model_path {file} -num_executions "$RUNS" -cpu_threads "$THREADS"',
    "litert": '{dir}/benchmark_model --graph={dir}/{file} --num_threads="$THREADS" --num_runs="$RUNS" '
              '--warmup_runs=5 --use_xnnpack=true',
}


def android_script(entries: List[Dict[str, Any]]) -> str:
    """A POSIX shell script that times the bundle's ``.pte`` and ``.tflite`` files on an attached Android phone."""
    lines = ["#!/bin/sh",
             "# Times this bundle's ExecuTorch (.pte) and LiteRT (.tflite) files on an Android phone attached over",
             "# adb, with each runtime's own benchmark binary for arm64-v8a placed beside this script:",
             "#   executor_runner  ExecuTorch's runner with XNNPACK, built from the ExecuTorch repository for Android",
             "#                    (-DEXECUTORCH_BUILD_XNNPACK=ON; ExecuTorch docs, 'Building from source')",
             "#   benchmark_model  LiteRT's benchmark tool (the android_aarch64_benchmark_model prebuilt, renamed)",
             "# Not verified by the toolchain: no phone was attached where this bundle was written.",
             "#   THREADS=4 RUNS=50 ./android_bench.sh 2>&1 | tee android_results.txt",
             "set -eu", 'cd "$(dirname "$0")"', 'THREADS="${THREADS:-4}"', 'RUNS="${RUNS:-50}"',
             "DIR=/data/local/tmp/vfm_bench", 'adb shell mkdir -p "$DIR"',
             'for tool in executor_runner benchmark_model; do',
             '  if [ -f "$tool" ]; then adb push "$tool" "$DIR/" && adb shell chmod +x "$DIR/$tool"; fi',
             'done']
    for e in entries:
        name = Path(e["file"]).name
        command = _PHONE_BENCH[e["runtime"]].format(dir="$DIR", file=name)
        lines += [f'echo "== {e["label"]} ({name})"', f'adb push "{e["file"]}" "$DIR/{name}"',
                  f'adb shell "{command}"']
    return "\n".join(lines) + "\n"


def write_bundle(build_dir: Path, out: Path) -> Path:
    """Write the bundle folder ``out`` for the build in ``build_dir``; returns ``out``."""
    build_dir, out = Path(build_dir), Path(out)
    record = _record(build_dir)
    resolved = build_dir / "recipe.resolved.yaml"
    import yaml

    recipe = yaml.safe_load(resolved.read_text()) if resolved.is_file() else {}
    bench_cfg = recipe.get("bench", {})
    kinds = bundle_kinds()
    arts = [a for a in record.get("artifacts", []) if a.get("status") == "ok" and a["kind"] in kinds]
    if not arts:
        raise ToolchainError(f"build '{build_dir}' has no artifact a device can run ({', '.join(kinds)}); add "
                             f"onnx to export.formats and rebuild")
    measured = {r["artifact"].split(" ")[0]: r for r in record.get("bench", [])}  # model -> one bench row
    if out.exists() and not out.is_dir():
        raise ToolchainError(f"--bundle '{out}' is a file; give a folder for the bundle (it is created when missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolchainError(f"cannot create the bundle folder '{out}': {exc.strerror}") from None
    entries = []
    for a in arts:
        src = build_dir / a["path"]
        name = f"{a['model']}_{a['kind']}{''.join(src.suffixes) if src.is_file() else src.suffix}"
        files = artifact_files(src)
        if len(files) > 1:  # ONNX external data, an IR's .bin keep their names: a folder of their own
            (out / f"{a['model']}_{a['kind']}").mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copy2(f, out / f"{a['model']}_{a['kind']}" / f.name)
            name = f"{a['model']}_{a['kind']}/{src.name}"
        elif src.is_dir():
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(src, out / name)
        else:
            shutil.copy2(src, out / name)
        row = measured.get(a["model"], {})
        size = a.get("image_size") or row.get("image_size") or recipe.get(a["model"], {}).get("image_size")
        if not size:
            raise ToolchainError(f"cannot tell the input size of {a['model']} {a['kind']}; rebuild the export stage")
        entries.append({"label": f"{a['model']} {a['kind']}", "model": a["model"], "kind": a["kind"], "file": name,
                        "runtime": FORMATS.meta(a["kind"])["runtime"],
                        "bytes": a["bytes"], "sha256": a["sha256"], "image_size": size,
                        "params": row.get("params"), "macs": row.get("macs")})
    phone = [e for e in entries if e["runtime"] in _PHONE_BENCH]
    if phone:
        (out / "android_bench.sh").write_text(android_script(phone))
        (out / "android_bench.sh").chmod(0o755)
    shutil.copy2(_HERE / "measure.py", out / "measure.py")
    shutil.copy2(_HERE / "bundle_runner.py", out / "run_bench.py")
    atomic_write_json(out / "bundle.json", {
        "name": record.get("name"), "artifacts": entries,
        "bench": {"warmup": bench_cfg.get("warmup", 5), "iters": bench_cfg.get("iters", 30),
                  "batch_sizes": bench_cfg.get("batch_sizes", [1, 8])}})
    readme = (f"# Device bundle: {record.get('name')}\n\n"
              "On the device (Python 3 with numpy and its runtime: onnxruntime, coremltools on macOS, executorch, "
              "ai-edge-litert or openvino):\n\n"
              "    python run_bench.py                 # writes results.json\n\n"
              "On an Android phone (no Python there), with adb and the two benchmark binaries the script names:\n\n"
              "    ./android_bench.sh                  # ExecuTorch .pte and LiteRT .tflite files, when bundled\n\n"
              "ONNX runs through onnxruntime's best provider there (TensorRT or CUDA with onnxruntime-gpu on a "
              "Jetson). TensorRT engines are not bundled: an engine only loads on the GPU model and TensorRT "
              "version that built it, so build it on the device or use the TensorRT execution provider.\n\n"
              "Back on the build machine:\n\n"
              "    toolchain report BUILD_OUT --device-results results.json --device-name my-device\n")
    atomic_write_bytes(out / "README.md", readme.encode())
    return out


def merge_device_results(build_dir: Path, results: Path, device_name: str) -> Dict[str, Any]:
    """Add a device's ``results.json`` to ``build.json`` (``device_bench``) and to ``report.md``."""
    build_dir = Path(build_dir)
    record = _record(build_dir)
    res = _read_json(Path(results), "--device-results")
    if not isinstance(res, dict) or "bench" not in res or "device" not in res:
        raise ToolchainError(f"'{results}' is not a results file written by a bundle's run_bench.py")
    record.setdefault("device_bench", {})[device_name] = res
    atomic_write_json(build_dir / "build.json", record)
    report = build_dir / "report.md"
    text = report.read_text() if report.is_file() else f"# Build report: {record.get('name')}\n"
    marker = f"## On-device latency: {device_name}"
    if marker in text:  # replace an earlier merge of the same device
        head, _, tail = text.partition(marker)
        nxt = tail.find("\n## ")
        text = head + (tail[nxt + 1:] if nxt >= 0 else "")
    d = res["device"]
    L = ["", marker, "", f"{d.get('system')} {d.get('machine')} ({d.get('processor') or 'cpu'}), Python "
         f"{d.get('python')}, measured {res.get('measured_at')} with the bundle's run_bench.py.", "",
         "| artifact | runtime / provider | batch | p50 ms | p90 ms | p99 ms | images/s |", "|---|---|---|---|---|---|---|"]
    for r in res["bench"]:
        L.append(f"| {r['artifact']} | {r['runtime']} / {r.get('provider')} | {r['batch']} | {latency_cell(r)} | "
                 f"{latency_cell(r, 'p90_ms')} | {latency_cell(r, 'p99_ms')} | "
                 f"{'' if r.get('unstable') else format(r['throughput_ips'], '.1f')} |")
    for s in res.get("skipped", []):
        L.append(f"\nnot measured: {s['artifact']} ({s['reason']})")
    atomic_write_bytes(report, (text.rstrip("\n") + "\n" + "\n".join(L) + "\n").encode())
    return record
