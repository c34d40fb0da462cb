"""The runtime layer's contract (export/runtimes/base.py), for every registered runtime, table-driven as NNCF's
cross-framework template tests are: it loads an artifact of its family (exported the way a build does), runs a
batch to the model's numbers, reports what ran it and with how many threads, and refuses a missing file with an
error that names it.  A runtime this machine cannot run says why, and its case skips with that reason.  A new runtime
joins by registering; one test registers one from a single new file."""
from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

from vfm_toolchain.export.formats import FORMATS, Skipped, export_format
from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable, register_runtime_file, runtime_files
from vfm_toolchain.export.runtimes import onnxruntime_runtime

# families whose converters load native code that must stay out of the main test process (Makefile, `-m edge`)
EDGE_FAMILIES = {"executorch", "litert", "openvino", "ncnn"}


def _cases():
    return [pytest.param(n, marks=pytest.mark.edge) if RUNTIMES.meta(n)["runs"] in EDGE_FAMILIES else n
            for n in RUNTIMES.list()]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()


def _artifact(name, model, x, folder):
    """The fp32 format of the runtime's family, made through the export chain; the model itself for PyTorch."""
    family = RUNTIMES.meta(name)["runs"]
    if family is None:
        return model
    fmt = next(f for f in FORMATS.list() if FORMATS.meta(f)["runtime"] == family
               and FORMATS.meta(f)["precision"] not in ("fp16", "int8"))
    missing = [m for m in FORMATS.meta(fmt)["requires"] if __import__("importlib").util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{name}: its format {fmt} needs {missing}")
    try:
        return export_format(fmt, model, x, folder / fmt).path
    except Skipped as why:
        pytest.skip(f"{name}: its format {fmt} cannot be made on this machine: {why}")


@pytest.mark.parametrize("name", _cases())
def test_runtime_loads_runs_a_batch_and_reports_provider_and_threads(name, model, tmp_path):
    x = torch.randn(3, 3, 16, 16)
    artifact = _artifact(name, model, x, tmp_path)
    try:
        run = RUNTIMES.get(name)(artifact, 1)
    except Unavailable as why:
        assert len(str(why)) > 10, "an unavailable runtime says why"
        pytest.skip(f"{name} cannot run on this machine: {why}")
    out = np.asarray(run(x.numpy()))
    with torch.no_grad():
        assert out.shape == (3, 4) and np.abs(out - model(x).numpy()).max() < 1e-4
    assert isinstance(run.provider, str) and run.provider, "what executed the artifact"
    assert run.threads in (1, None), f"asked for 1 thread, reports {run.threads}"


@pytest.mark.parametrize("name", [n for n in RUNTIMES.list() if RUNTIMES.meta(n)["runs"] is not None])
def test_runtime_refuses_a_missing_file_naming_it(name, tmp_path):
    """Before its library is even imported: the same error on a machine that lacks the runtime."""
    missing = tmp_path / "gone" / "model.bin"
    with pytest.raises(FileNotFoundError, match="no artifact at .*gone"):
        RUNTIMES.get(name)(missing, 1)


def test_every_registered_runtime_has_its_file_in_the_layer():
    files = {f.name for f in runtime_files()}
    for name in RUNTIMES.list():
        assert RUNTIMES.meta(name)["file"].name in files
    assert {"base.py", "measure.py"} <= files


def test_pinned_onnxruntime_provider_never_falls_back_silently(model, tmp_path):
    import onnxruntime as ort

    path = export_format("onnx", model, torch.randn(1, 3, 16, 16), tmp_path).path
    run = RUNTIMES.get("onnxruntime_cpu")(path, 2)
    assert run.provider == "CPUExecutionProvider" and run.threads == 2 and run.fell_back == []
    session, _ = onnxruntime_runtime._session(path, 2)  # no spinning after a call: it slows what is timed next
    assert session.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(Unavailable, match="not \\['CUDAExecutionProvider'\\]"):
            RUNTIMES.get("onnxruntime_cuda")(path, 1)


class _FakeOrt:
    """ONNX Runtime as a GPU machine shows it: TensorRT fails to build its engine, CUDA starts."""

    __version__ = "fake"

    def __init__(self, failing):
        self.failing, self.tried = failing, []

    class SessionOptions:
        intra_op_num_threads = 0

        def add_session_config_entry(self, key, value):
            pass

    def get_available_providers(self):
        return ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]

    def InferenceSession(self, path, sess_options=None, providers=()):
        self.tried.append(providers[0])
        if providers[0] in self.failing:
            raise RuntimeError(f"{providers[0]} failed: engine build error")
        session = type("S", (), {})()
        session.get_providers = lambda: list(providers)
        session.get_inputs = lambda: [type("I", (), {"name": "x"})()]
        session.run = lambda out, feeds: [feeds["x"] * 2]
        return session


@pytest.mark.parametrize("failing,expected", [
    ({"TensorrtExecutionProvider"}, "CUDAExecutionProvider"),
    ({"TensorrtExecutionProvider", "CUDAExecutionProvider"}, "CPUExecutionProvider"),
    (set(), "TensorrtExecutionProvider"),
])
def test_best_provider_falls_through_tensorrt_cuda_cpu_and_says_which_ran(monkeypatch, failing, expected, tmp_path):
    fake = _FakeOrt(failing)
    monkeypatch.setitem(sys.modules, "onnxruntime", fake)
    path = tmp_path / "model.onnx"
    path.write_bytes(b"")  # the fake session never reads it
    run = RUNTIMES.get("onnxruntime")(path, 1)
    assert run.provider == expected and run(np.ones(2)).tolist() == [2, 2]
    order = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert fake.tried == order[:order.index(expected) + 1]
    assert [f.split(":")[0] for f in run.fell_back] == order[:order.index(expected)]
    if failing:  # a pinned provider never falls through
        with pytest.raises(Unavailable, match="TensorrtExecutionProvider failed"):
            RUNTIMES.get("onnxruntime_tensorrt")(path, 1)



NEW_RUNTIME = '''
    """ONNX Runtime with graph optimisations off: a second runtime of the onnxruntime family, in one file."""
    from __future__ import annotations

    from .base import Unavailable, artifact, described

    ENTRIES = {"onnxruntime_noopt": {"runs": "onnxruntime", "devices": "cpu, graph optimisation off"}}


    def load(path, threads=None):
        path = artifact(path, "onnxruntime_noopt")
        try:
            import onnxruntime as ort
        except ImportError as why:
            raise Unavailable(str(why)) from None
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        return described(lambda x: session.run(None, {name: x})[0], "CPUExecutionProvider, unoptimised", threads)
'''


@pytest.fixture
def new_runtime_file(tmp_path):
    path = tmp_path / "plugin" / "noopt_runtime.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(NEW_RUNTIME))
    yield path
    RUNTIMES._entries.pop("onnxruntime_noopt", None)  # the registry is process-wide: leave it as it was
    sys.modules.pop("vfm_toolchain.export.runtimes.noopt_runtime", None)


def test_a_new_runtime_is_one_file(new_runtime_file, model, tmp_path):
    """Registered from one file, it is a name recipes accept, times the family's artifacts as bench.latency does,
    and travels into device bundles with the rest of the layer."""
    from vfm_toolchain.bench.bundle import copy_runtime_layer
    from vfm_toolchain.bench.latency import timed_runtimes
    from vfm_toolchain.export.runtimes.measure import measure_latency

    assert register_runtime_file(new_runtime_file) == ["onnxruntime_noopt"]
    assert timed_runtimes(["onnxruntime_noopt"], []) == ["onnxruntime_noopt"]
    x = torch.randn(2, 3, 16, 16)
    run = RUNTIMES.get("onnxruntime_noopt")(export_format("onnx", model, x, tmp_path / "onnx").path, 1)
    with torch.no_grad():
        assert np.abs(run(x.numpy()) - model(x).numpy()).max() < 1e-4
    assert measure_latency(run, x.numpy(), warmup=1, iters=2)["p50_ms"] > 0
    copy_runtime_layer(tmp_path / "bundle" / "runtimes")
    assert (tmp_path / "bundle" / "runtimes" / "noopt_runtime.py").read_bytes() == new_runtime_file.read_bytes()


def test_a_file_that_is_not_a_runtime_is_refused_with_the_contract(tmp_path):
    bad = tmp_path / "half_runtime.py"
    bad.write_text("def load(path, threads=None):\n    return None\n")
    with pytest.raises(ValueError, match="needs ENTRIES"):
        register_runtime_file(bad)
    sys.modules.pop("vfm_toolchain.export.runtimes.half_runtime", None)


def test_an_onnx_memory_probe_starts_without_the_toolchain_or_torch(tmp_path):
    """The probe loads a layer runtime's artifact as a device bundle does (NumPy and ONNX Runtime alone): none of
    the PyTorch, torchvision and timm imports (about 8 s of each probe on 2 cores), and the memory it reads is the
    runtime's."""
    import json
    import subprocess

    from vfm_toolchain.bench import memory_probe

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    onnx = export_format("onnx", model, torch.randn(1, 3, 16, 24), tmp_path / "onnx", {"opset": 17})
    code = (f"import runpy, sys; runpy.run_path({memory_probe.__file__!r}, run_name='__main__'); "
            f"print(sorted(m for m in ('torch', 'timm', 'vfm_toolchain') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, "--runtime", "onnxruntime", "--artifact", str(onnx.path),
                          "--size", "16", "24", "--batches", "1", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    *_, peaks, imported = out.stdout.strip().splitlines()
    assert imported == "[]" and set(json.loads(peaks)) == {"1", "2"} and all(json.loads(peaks).values())
    # and through probe_memory, as the bench stage calls it
    assert all(v and v > 0 for v in memory_probe.probe_memory("onnxruntime", onnx.path, (16, 24), [1]).values())
