"""Device bundles: a build's deployable artifacts with a runner that measures them where they will run,
and the merge of the device's results back into the build report (their latency, accuracy and layer tables).

``write_bundle`` copies the artifacts whose format declares ``bundle=True`` (export/formats/base.py),
``bundle.json`` (artifacts with the runtime family that loads each, input size, bench settings),
``run_bench.py`` and ``runtimes/`` (the build's runtime layer, byte for byte: the loaders and measurement code
that checked and timed the artifacts here).  ``merge_device_results`` adds the device's rows to ``build.json``
and an "On-device latency" section to ``report.md``, once ``read_results`` has checked the results file whole (schema,
finite positive latencies, scores in [0, 1]) and every artifact it measured is this build's, by name and sha256.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from vfm_toolchain.bench import layer_report
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes, atomic_write_json
from vfm_toolchain.export.convert import artifact_files
from vfm_toolchain.export.formats import FORMATS
from vfm_toolchain.export.runtimes import options_for, runtime_files
from vfm_toolchain.export.runtimes.measure import latency_cell
from vfm_toolchain.tasks import TASKS, task_of

__all__ = ["write_bundle", "merge_device_results", "read_results", "RESULT_KINDS", "bundle_kinds", "prepare_out",
           "copy_artifact", "finish_bundle"]

_HERE = Path(__file__).resolve().parent
_SOURCE_STAGE = {"student": "student.finetune", "teacher": "teacher.finetune"}  # the stage an exported model came from


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


def prepare_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ToolchainError(f"--bundle '{out}' is a file; give a folder for the bundle (it is created when missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolchainError(f"cannot create the bundle folder '{out}': {exc.strerror}") from None


def copy_artifact(src: Path, out: Path, stem: str) -> str:
    """Copy an artifact (and the files it needs beside it) into the bundle; its path there."""
    name = f"{stem}{''.join(src.suffixes) if src.is_file() else src.suffix}"
    files = artifact_files(src)
    if len(files) > 1:  # ONNX external data, an IR's .bin keep their names: a folder of their own
        (out / stem).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, out / stem / f.name)
        return f"{stem}/{src.name}"
    if src.is_dir():
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(src, out / name)
    else:
        shutil.copy2(src, out / name)
    return name


def copy_runtime_layer(folder: Path) -> None:
    """The build's runtime files, byte for byte (run_bench.py loads and times with them), as a package of their own:
    its ``__init__.py`` is the one file written here, and says so."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for f in runtime_files():
        shutil.copy2(f, folder / f.name)
    (folder / "__init__.py").write_text('"""The build\'s runtime layer (export/runtimes), copied verbatim; run_bench.py '
                                        'loads each *_runtime.py here."""\n')


def finish_bundle(out: Path, name: str, entries: List[Dict[str, Any]], bench_cfg: Dict[str, Any],
                   about: str, kind: str) -> Path:
    """The runner, its measurement code, the Android script, ``bundle.json`` and the README; ``kind`` (one of
    ``RESULT_KINDS``) travels into the device's results, so they go back only where they belong."""
    phone = [e for e in entries if e["runtime"] in _PHONE_BENCH]
    if phone:
        (out / "android_bench.sh").write_text(android_script(phone))
        (out / "android_bench.sh").chmod(0o755)
    copy_runtime_layer(out / "runtimes")
    shutil.copy2(_HERE / "bundle_runner.py", out / "run_bench.py")
    atomic_write_json(out / "bundle.json", {
        "name": name, "kind": kind, "artifacts": entries,
        "bench": {"warmup": bench_cfg.get("warmup", 5), "iters": bench_cfg.get("iters", 30),
                  "batch_sizes": bench_cfg.get("batch_sizes", [1, 8])}})
    readme = (f"# Device bundle: {name}\n\n{about}\n\n"
              "On the device (Python 3 with numpy and its runtime: onnxruntime, coremltools on macOS, executorch, "
              "ai-edge-litert, openvino or ncnn):\n\n"
              "    python run_bench.py                 # writes results.json\n\n"
              "On an Android phone (no Python there), with adb and the two benchmark binaries the script names:\n\n"
              "    ./android_bench.sh                  # ExecuTorch .pte and LiteRT .tflite files, when bundled\n\n"
              "ONNX runs through onnxruntime's best provider there (TensorRT or CUDA with onnxruntime-gpu on a "
              "Jetson). TensorRT engines are not bundled: an engine only loads on the GPU model and TensorRT "
              "version that built it, so build it on the device or use the TensorRT execution provider.\n")
    atomic_write_bytes(out / "README.md", readme.encode())
    return out


def write_bundle(build_dir: Path, out: Path, test_images: int = 200) -> Path:
    """Write the bundle folder ``out`` for the build in ``build_dir``; returns ``out``.

    ``test_images`` labeled test images (at each model's input size) travel along, so the device scores every
    artifact where it runs; each artifact is scored here on the same slice too, wherever its runtime runs here."""
    build_dir, out = Path(build_dir), Path(out)
    record = _record(build_dir)
    resolved = build_dir / "recipe.resolved.yaml"
    import yaml

    recipe = yaml.safe_load(resolved.read_text()) if resolved.is_file() else {}
    kinds = bundle_kinds()
    arts = [a for a in record.get("artifacts", []) if a.get("status") == "ok" and a["kind"] in kinds]
    if not arts:
        raise ToolchainError(f"build '{build_dir}' has no artifact a device can run ({', '.join(kinds)}); add "
                             f"onnx to export.formats and rebuild")
    measured = {r["artifact"].split(" ")[0]: r for r in record.get("bench", [])}  # model -> one bench row
    prepare_out(out)
    entries, slices = [], {}
    for a in arts:
        name = copy_artifact(build_dir / a["path"], out, f"{a['model']}_{a['kind']}")
        row = measured.get(a["model"], {})
        size = a.get("image_size") or row.get("image_size") or recipe.get(a["model"], {}).get("image_size")
        if not size:
            raise ToolchainError(f"cannot tell the input size of {a['model']} {a['kind']}; rebuild the export stage")
        entry = {"label": f"{a['model']} {a['kind']}", "model": a["model"], "kind": a["kind"], "file": name,
                 "runtime": FORMATS.meta(a["kind"])["runtime"],
                 "runtime_options": options_for(FORMATS.meta(a["kind"])["runtime"], a),
                 "bytes": a["bytes"], "sha256": a["sha256"], "image_size": size,
                 "params": row.get("params"), "macs": row.get("macs"),
                 "build_test_score": a["test_score"] if a.get("test_score") is not None
                 else _test_score(build_dir, a["model"])}
        if test_images > 0:
            if a["model"] not in slices:
                slices[a["model"]] = write_test_slice(build_dir, a["model"], out, test_images)
            entry["test_slice"] = slices[a["model"]]
        entries.append(entry)
    for e in entries:  # the same slice scored here, beside what the device will report
        if e.get("test_slice"):
            e.update(score_here(out, e))
    about = ("The build's deployable artifacts, with a labeled test slice: run_bench.py reports each artifact's "
             "latency and its top-1 / mIoU / mAP50 on the slice where it runs. Back on the build machine:\n\n"
             "    toolchain report BUILD_OUT --device-results results.json --device-name my-device")
    return finish_bundle(out, record.get("name"), entries, recipe.get("bench", {}), about, "build")


def _test_score(build_dir: Path, model: str) -> Optional[float]:
    """The build's test top-1 / mIoU of the model an fp32 artifact was exported from."""
    f = Path(build_dir) / "stages" / _SOURCE_STAGE[model] / "result.json"
    try:
        metrics = json.loads(f.read_text()).get("metrics", {})
    except (OSError, ValueError):
        return None
    return next((v for k, v in metrics.items() if k.startswith("test_")), None)


def write_test_slice(build_dir: Path, model: str, out: Path, n: int) -> Optional[Dict[str, Any]]:
    """``test_<model>.npz``: the first ``n`` test images at the model's input size (uint8, as the build's eval
    transform resizes them) with their targets as the task writes them (``Task.test_slice``); None without a test
    split."""
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.prepare import load_index
    from vfm_toolchain.stage import StageOutput

    prep = Path(build_dir) / "stages" / "data.prepare"
    source = Path(build_dir) / "stages" / _SOURCE_STAGE[model] / "model"
    if not prep.is_dir() or not source.is_dir():
        return None
    index = load_index(StageOutput("data.prepare", "", prep.resolve(), {}))
    spec = json.loads((source / "spec.json").read_text())
    items = index["test"][:n]
    if not items:
        return None
    task = task_of(index)
    f = f"test_{model}.npz"
    task.test_slice(items, Preprocess.from_dict(spec["preprocess"]), len(index["classes"]), out / f)
    return {"file": f, "task": task.name, "images": len(items), "metric": task.metric}


def score_here(out: Path, entry: Dict[str, Any]) -> Dict[str, Any]:
    """The artifact scored on its test slice on this machine, with the bundle's own runner code."""
    from vfm_toolchain.bench import bundle_runner

    try:
        run = bundle_runner.loaders()[entry["runtime"]](out / entry["file"], None, **entry.get("runtime_options", {}))
        return {"local_score": bundle_runner.score(run, out / entry["test_slice"]["file"])}
    except Exception as exc:  # a runtime this machine lacks (Core ML off macOS): said, not fatal
        return {"local_score": None, "local_reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}


# --------------------------------------------------------------------------------------------------------------
# A device's results.json, checked whole before anything uses it: a hand-edited, truncated or misplaced file must
# be refused with what is wrong, never merged as figures a person would trust (nor end in a traceback).

# The kinds of bundle (finish_bundle's ``kind``, copied into the results by run_bench.py): how to write one, what
# it is called, and where its results go back
RESULT_KINDS = {"build": "toolchain bench BUILD_OUT --bundle DIR",
                "candidates": "toolchain candidates RECIPE --bundle DIR"}
_KIND_NAME = {"build": "a build's bundle", "candidates": "a candidates bundle"}
_KIND_USE = {"build": "toolchain report BUILD_OUT --device-results results.json",
             "candidates": "toolchain build RECIPE --set student.target=results.json"}
_FIX = "Give the results.json run_bench.py wrote, unedited, or run it again on the device"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


# One rule per kind of value run_bench.py writes: (test, what is allowed).  Both kinds of results (a build's
# bundle, a candidates bundle) go through these, so a latency or a score means the same in both.
LATENCY = (lambda v: _finite(v) and v > 0, "a finite number of milliseconds above 0")
RATE = (lambda v: _finite(v) and v > 0, "a finite number of images per second above 0")
SCORE = (lambda v: _finite(v) and 0 <= v <= 1, "a finite fraction from 0 to 1")
MAYBE_SCORE = (lambda v: v is None or SCORE[0](v), "null or a finite fraction from 0 to 1")
TEXT = (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
COUNT = (_whole, "a whole number from 1")
SIZE = (lambda v: _whole(v) or (isinstance(v, list) and len(v) == 2 and all(map(_whole, v))),
        "one side in pixels or [height, width]")
# a task's main metric (toolchain/tasks/): what its test slice is scored by
METRIC = (lambda v: v in {TASKS.get(t).metric for t in TASKS.list()},
          "the main metric of a task (" + ", ".join(TASKS.get(t).metric for t in TASKS.list()) + ")")



def _layer_table_ok(t: Any) -> bool:
    """A runtime's layer table as run_bench.py writes it (export/runtimes/base.py): its rows with a name, a type, a
    precision, and times and MACs that are null or finite and not negative."""
    if not isinstance(t, dict) or not isinstance(t.get("rows"), list) or not isinstance(t.get("timed"), bool):
        return False
    if not (t.get("total_ms") is None or (_finite(t["total_ms"]) and t["total_ms"] >= 0)):
        return False
    for r in t["rows"]:
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) for k in ("name", "type", "precision")):
            return False
        if r.get("delegated") not in (True, False, None):
            return False
        if not all(r.get(k) is None or (_finite(r[k]) and r[k] >= 0) for k in ("ms", "macs")):
            return False
    return True


TABLE = (_layer_table_ok, "a layer table (export/runtimes/base.py: rows with name, type, precision, delegated, and "
                          "ms and macs null or not negative)")

# The entries of each list run_bench.py writes (bundle_runner.measure_one / main): field -> (rule, required)
_SECTIONS = {
    "bench": ("a list of rows, one per (artifact, batch)", {
        "artifact": (TEXT, True), "model": (TEXT, True), "runtime": (TEXT, True), "batch": (COUNT, True),
        "image_size": (SIZE, True), "p50_ms": (LATENCY, True), "p90_ms": (LATENCY, True), "p99_ms": (LATENCY, True),
        "throughput_ips": (RATE, True)}),
    "accuracy": ("a list of scores, one per artifact", {
        "artifact": (TEXT, True), "metric": (METRIC, True), "images": (COUNT, True), "score": (SCORE, True),
        "here": (MAYBE_SCORE, False), "build_test_score": (MAYBE_SCORE, False)}),
    "skipped": ("a list of the artifacts not measured, with the reason", {
        "artifact": (TEXT, True), "reason": (TEXT, True)}),
    "layers": ("a list of layer tables, one per artifact, each with its table or the reason it has none", {
        "artifact": (TEXT, True), "runtime": (TEXT, True), "table": (TABLE, False), "reason": (TEXT, False)}),
}
_OPTIONAL_SECTIONS = ("accuracy", "skipped", "layers")  # absent: none (results of a run_bench.py before them)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type(v: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(v), type(v).__name__)


def _where(section: str, i: int, entry: Dict[str, Any]) -> str:
    """``bench[2] (student onnx, batch 8)``: the entry as a person finds it in the file."""
    name = entry.get("artifact")
    if not isinstance(name, str):
        return f"{section}[{i}]"
    batch = f", batch {_show(entry['batch'])}" if section == "bench" and "batch" in entry else ""
    return f"{section}[{i}] ({name}{batch})"


def _check_fields(entry: Dict[str, Any], fields: Dict[str, tuple], where: str, prefix: str) -> None:
    """Every field of ``entry`` against its rule; the first one wrong raises, naming entry, field and value."""
    for field, ((ok, allowed), required) in fields.items():
        if field not in entry:
            if required:
                raise ToolchainError(f"{prefix}: {where} has no {field}; it must be {allowed}. {_FIX}")
            continue
        if not ok(entry[field]):
            raise ToolchainError(f"{prefix}: {where}: {field} is {_show(entry[field])}; it must be {allowed}. {_FIX}")


def _check_section(res: Dict[str, Any], section: str, prefix: str) -> None:
    what, fields = _SECTIONS[section]
    entries = res.get(section, [] if section in _OPTIONAL_SECTIONS else None)
    if not isinstance(entries, list):
        raise ToolchainError(f"{prefix}: '{section}' is {_json_type(entries)}; it must be {what}. {_FIX}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ToolchainError(f"{prefix}: {section}[{i}] is {_show(entry)}; each entry must be an object. "
                                 f"{_FIX}")
        _check_fields(entry, fields, _where(section, i, entry), prefix)
        if section == "layers" and "table" not in entry and "reason" not in entry:
            raise ToolchainError(f"{prefix}: {_where(section, i, entry)} has neither a table nor a reason. {_FIX}")


def _check_kind(res: Dict[str, Any], prefix: str, kind: str) -> None:
    """The results are of the kind of bundle the caller needs (and record which files they measured)."""
    got = res.get("kind")
    if got == kind:
        return
    again = f"write one with `{RESULT_KINDS[kind]}`, run it on the device, and give its results.json"
    if got in RESULT_KINDS:
        raise ToolchainError(f"{prefix} is the results of {_KIND_NAME[got]}, not of {_KIND_NAME[kind]}: {again} "
                             f"(these results go to `{_KIND_USE[got]}`)")
    if "kind" not in res or "artifacts" not in res:
        raise ToolchainError(f"{prefix} was written by an older run_bench.py, which did not record which bundle and "
                             f"which artifact files it measured: {again}")
    raise ToolchainError(f"{prefix}: kind is {_show(got)}; it must be '{kind}' ({_KIND_NAME[kind]}): {again}")


def _check_artifacts(res: Dict[str, Any], prefix: str) -> None:
    """``artifacts`` maps each label the bundle shipped to its sha256, and every entry names one of them."""
    shipped = res.get("artifacts")
    if not isinstance(shipped, dict) or not shipped:
        raise ToolchainError(f"{prefix}: 'artifacts' is {_show(shipped)}; it must map each artifact the bundle "
                             f"shipped to its sha256, as run_bench.py copies it from bundle.json. {_FIX}")
    for label, sha in shipped.items():
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ToolchainError(f"{prefix}: 'artifacts': {_show(label)} has sha256 {_show(sha)}; each must be the "
                                 f"artifact's sha256 (64 hex digits) from bundle.json. {_FIX}")
    for section in _SECTIONS:
        for i, entry in enumerate(res.get(section, [])):
            if entry["artifact"] not in shipped:
                raise ToolchainError(f"{prefix}: {section}[{i}]: artifact is {_show(entry['artifact'])}, not one of "
                                     f"the artifacts the results list: {', '.join(sorted(shipped))}. {_FIX}")


def read_results(path: Path, what: str, kind: str) -> Dict[str, Any]:
    """A device's ``results.json`` (a bundle's run_bench.py) of a ``kind`` bundle (``RESULT_KINDS``), checked
    whole: its schema, that every entry names an artifact the bundle shipped, finite positive latencies and
    scores in [0, 1].  ``what`` names the file in errors (the option or recipe field it came from)."""
    res = _read_json(Path(path), what)
    prefix = f"{what} '{path}'"
    if not isinstance(res, dict) or "bench" not in res or "device" not in res:
        raise ToolchainError(f"{prefix} is not a results file written by a bundle's run_bench.py (an object with "
                             f"bench, device, kind and artifacts): write one with `{RESULT_KINDS[kind]}` and "
                             f"run_bench.py on the device")
    _check_kind(res, prefix, kind)
    if not isinstance(res["device"], dict):
        raise ToolchainError(f"{prefix}: 'device' is {_show(res['device'])}; it must be an object describing the "
                             f"device (system, machine, processor, python). {_FIX}")
    for section in _SECTIONS:
        _check_section(res, section, prefix)
    _check_artifacts(res, prefix)
    return res


def _check_this_build(res: Dict[str, Any], record: Dict[str, Any], build_dir: Path, prefix: str) -> None:
    """Every artifact the results measured is one this build made, by the bundle's label and by sha256."""
    made = {f"{a.get('model')} {a.get('kind')}": a.get("sha256") for a in record.get("artifacts", [])
            if a.get("status") == "ok"}
    bundle_again = (f"`toolchain bench {build_dir} --bundle DIR`, run_bench.py on the device, then merge its "
                    f"results.json")
    for label, sha in res["artifacts"].items():
        if label not in made:
            raise ToolchainError(f"{prefix} has results for '{label}', which the build in '{build_dir}' did not make "
                                 f"(this build's artifacts: {', '.join(sorted(made)) or 'none'}); give the results of "
                                 f"this build's own bundle: {bundle_again}")
        if sha != made[label]:
            raise ToolchainError(f"{prefix}: '{label}' was measured with sha256 {sha[:12]}..., but this build's "
                                 f"'{label}' has sha256 {str(made[label])[:12]}...: these are the results of another "
                                 f"build (or of an earlier build into this folder). Bundle this build: {bundle_again}")


def merge_device_results(build_dir: Path, results: Path, device_name: str) -> Dict[str, Any]:
    """Add a device's ``results.json`` to ``build.json`` (``device_bench``) and to ``report.md``.  The results
    are checked whole first (``read_results``, then against this build's artifacts): on any error nothing is
    written."""
    build_dir = Path(build_dir)
    record = _record(build_dir)
    res = read_results(Path(results), "--device-results", "build")
    _check_this_build(res, record, build_dir, f"--device-results '{results}'")
    record.setdefault("device_bench", {})[device_name] = res
    report = build_dir / "report.md"
    text = report.read_text() if report.is_file() else f"# Build report: {record.get('name')}\n"
    text = _device_section(text, res, device_name, _device_layers(res, record, build_dir))
    # written through the top-level links (an output folder shows its current build through them), so the
    # merge lands in that build's own files and the links stay
    atomic_write_json((build_dir / "build.json").resolve(), record)
    atomic_write_bytes(report.resolve(), text.encode())
    return record


def _device_layers(res: Dict[str, Any], record: Dict[str, Any], build_dir: Path) -> List[Dict[str, Any]]:
    """The device's layer tables as the report shows them (bench/layer_report.py), each fallen-back row with why,
    read against the artifact's export record in this build (the file itself where the build still has it)."""
    arts = {f"{a.get('model')} {a.get('kind')}": a for a in record.get("artifacts", [])}
    macs = {r["artifact"]: r.get("macs") for r in res["bench"]}
    out = []
    for e in res.get("layers", []):
        entry = {"artifact": e["artifact"], "runtime": e["runtime"]}
        if "table" in e:
            a = arts.get(e["artifact"], {})
            table = layer_report.annotate(e["table"], a, build_dir / a["path"] if a.get("path") else None)
            entry["summary"] = layer_report.summarize(table, macs.get(e["artifact"]))
        else:
            entry["reason"] = e["reason"]
        out.append(entry)
    return out


def _device_section(text: str, res: Dict[str, Any], device_name: str, layers: List[Dict[str, Any]] = ()) -> str:
    """``text`` (a report) with the device's section, replacing an earlier merge of the same device."""
    marker = f"## On-device latency: {device_name}"
    if marker in text:
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
    if res.get("accuracy"):
        L += ["", "Accuracy on the bundle's labeled test slice, on the device and here (same images, same scoring; "
              "masks and boxes at the input size), beside the build's full test score:", "",
              "| artifact | metric | images | on the device | here | build test |", "|---|---|---|---|---|---|"]
        fmt = lambda v: "-" if v is None else f"{100 * v:.2f}%"
        for a in res["accuracy"]:
            L.append(f"| {a['artifact']} | {a['metric']} | {a['images']} | {fmt(a['score'])} | {fmt(a.get('here'))} | "
                     f"{fmt(a.get('build_test_score'))} |")
    for s in res.get("skipped", []):
        L.append(f"\nnot measured: {s['artifact']} ({s['reason']})")
    if layers:  # the device's own layer tables, in the build's form ("Where the time goes")
        L += ["", f"### Where the time goes on {device_name}", ""]
        L += layer_report.section_lines(layers, f"{device_name} ({d.get('machine')})",
                                        f"build.json device_bench.{device_name}.layers")
    return text.rstrip("\n") + "\n" + "\n".join(L) + "\n"
