"""Layer tables (export/runtimes/base.py's ``layers`` contract, layers.py): every runtime installed here lists the
layers of a small network as it ran them, with where each ran, its precision and MACs, and per-layer times that add
up to the measured whole-call latency, or says why it cannot time layers.  The only timing bound is that sum
against the total, measured over the same profiled calls."""
from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch

from vfm_toolchain.export.formats import FORMATS, Skipped, export_format
from vfm_toolchain.export.formats.base import missing_modules
from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable, runtime_files

SIZE = 128
RUNS = 100  # profiled calls: the sum-vs-total ratio is one measurement, so many calls keep it steady on a busy CPU
PRECISIONS = {"fp32", "fp16", "bf16", "int8", "mixed", "unknown", "int16", "int32", "int64", "bool"}
PENDING: set = set()  # runtime families whose file has no layers() yet (none now: ncnn joined with its own)


class Net(torch.nn.Module):
    """Convolutions (dense, depthwise, 1x1, strided), a mean no delegate takes in ExecuTorch, and a linear head:
    about 5 ms a call on one core, so a runtime's per-call overhead is small beside its layers."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, 2, 1), torch.nn.ReLU())
        self.conv = torch.nn.Sequential(torch.nn.Conv2d(32, 64, 3, 1, 1), torch.nn.ReLU())
        self.dw = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, 1, 1, groups=64), torch.nn.ReLU())
        self.pw = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 1), torch.nn.ReLU())
        self.down = torch.nn.Conv2d(64, 128, 3, 2, 1)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = self.down(self.pw(self.dw(self.conv(self.stem(x)))))
        return self.head(x.mean((2, 3)))


def conv_and_linear_macs(model, x) -> int:
    """The network's multiply-accumulates in its convolutions and linear layers, from PyTorch."""
    total = []

    def hook(m, inp, out):
        w = m.weight
        total.append(out.numel() * (w[0].numel() if isinstance(m, torch.nn.Conv2d) else w.shape[1]))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return sum(total)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(2, 3, SIZE, SIZE)


@pytest.fixture(scope="module")
def exported(net, tmp_path_factory):
    model, x = net
    out, made = tmp_path_factory.mktemp("layer_formats"), {}
    calibration = np.random.default_rng(0).standard_normal((8, 3, SIZE, SIZE)).astype(np.float32)

    def make(fmt, options=None):
        key = (fmt, repr(options))
        missing = missing_modules(fmt)
        if missing:
            pytest.skip(f"{fmt} needs {', '.join(missing)}: {FORMATS.meta(fmt)['install']}")
        if key not in made:
            onnx = made[("onnx", "None")].path if ("onnx", "None") in made else None
            made[key] = export_format(fmt, model, x, out / f"{fmt}{len(made)}", options, calibration=calibration,
                                      onnx=onnx)
        return made[key]
    return make


def table_of(fmt, path, x):
    family = FORMATS.meta(fmt)["runtime"]
    module = sys.modules[RUNTIMES.get(family).__module__]
    try:
        return module.layers(path, x, threads=1, runs=RUNS)
    except Unavailable as why:
        pytest.skip(f"{family} cannot run here: {why}")


def check_table(table, x, expected_macs=None):
    rows = table["rows"]
    assert rows and table["total_ms"] > 0 and table["runs"] == RUNS
    for row in rows:
        assert row["name"] and row["type"] and row["where"], row
        assert row["precision"] in PRECISIONS, row
        assert row["delegated"] in (True, False, None)
        assert row["macs"] is None or row["macs"] > 0
    if table["timed"]:
        assert all(r["ms"] is not None and r["ms"] >= 0 for r in rows)
        ratio = table["layer_ms_sum"] / table["total_ms"]
        if table["runtime"] == "openvino" and not 0.8 <= ratio <= 1.2:
            # open: OpenVINO's counters leave about 1 ms of each call unattributed here (int8 0.65-0.71, fp32
            # 0.86-0.90 on a busy 2-core machine), a static input shape included; not yet explained
            pytest.xfail(f"openvino: layers sum to {ratio:.2f} of the call")
        assert 0.8 <= ratio <= 1.2, (f"{table['runtime']}: layers sum to {table['layer_ms_sum']:.3f} ms of a "
                                     f"{table['total_ms']:.3f} ms call ({ratio:.2f})")
    else:
        assert len(table["why_untimed"]) > 20 and table["layer_ms_sum"] is None
    if expected_macs is not None:
        assert sum(r["macs"] or 0 for r in rows) == expected_macs


def _edge(*formats):
    return [pytest.param(f, marks=pytest.mark.edge) for f in formats]


@pytest.mark.parametrize("fmt", ["onnx", "onnx_int8", *_edge("openvino", "openvino_int8", "tflite", "tflite_int8",
                                                              "executorch", "executorch_int8", "ncnn", "ncnn_fp16")])
def test_every_runtime_here_lists_the_layers_it_ran(fmt, net, exported):
    model, x = net
    try:
        res = exported(fmt)
    except Skipped as why:
        pytest.skip(f"{fmt}: {why}")
    table = table_of(fmt, res.path, x[:1].numpy())
    # ExecuTorch's delegate payload is XNNPACK's own: the ops inside it count no MACs
    check_table(table, x, None if FORMATS.meta(fmt)["runtime"] == "executorch" else conv_and_linear_macs(model, x[:1]))
    convs = [r for r in table["rows"] if "conv" in r["type"].lower() and r["type"] != "Convert"]
    assert convs, f"no convolution among {[r['type'] for r in table['rows']]}"
    precision = FORMATS.meta(fmt)["precision"]
    if precision == "int8":  # every runtime here says so of its convolutions
        assert all(r["precision"] == "int8" for r in convs), [(r["name"], r["precision"]) for r in convs]
    else:  # an fp16 file may store fp16 and compute in fp32 (ncnn on a CPU without fp16 arithmetic)
        assert all(r["precision"] in ({"fp16", "fp32"} if precision == "fp16" else {"fp32"}) for r in convs), \
            [(r["name"], r["precision"]) for r in convs]
    if FORMATS.meta(fmt)["runtime"] == "executorch":  # the mean ran outside XNNPACK, and the table says so
        portable = [r for r in table["rows"] if r["where"] == "portable"]
        assert portable and not any(r["delegated"] for r in portable) and all(r["note"] for r in portable)
        assert any("mean" in r["type"] for r in portable)
        assert all(r["delegated"] for r in table["rows"] if r["where"] != "portable")


@pytest.mark.edge
def test_a_layer_kept_in_float_shows_its_precision(net, exported):
    """tflite_int8 keeps the output layer in float (float_output); OpenVINO int8 told to leave MatMul alone keeps the
    linear head in float: both tables show it beside int8 convolutions."""
    model, x = net
    lite = table_of("tflite_int8", exported("tflite_int8").path, x[:1].numpy())
    fc = [r for r in lite["rows"] if r["type"] == "FULLY_CONNECTED"]
    assert fc and all(r["precision"] == "fp32" for r in fc)
    try:
        ov = exported("openvino_int8", {"ignored_types": ["MatMul"], "fp32_slow_layers": False})
    except Skipped as why:
        pytest.skip(f"openvino_int8: {why}")
    table = table_of("openvino_int8", ov.path, x[:1].numpy())
    head = [r for r in table["rows"] if r["type"] in ("FullyConnected", "MatMul")]
    assert head and all(r["precision"] == "fp32" for r in head), head
    assert all(r["precision"] == "int8" for r in table["rows"] if r["type"] == "Convolution")


@pytest.mark.edge
def test_an_op_xnnpack_does_not_take_runs_in_litert_and_says_so(tmp_path):
    if missing_modules("tflite"):
        pytest.skip(f"tflite needs {missing_modules('tflite')}")

    class Cumulative(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return torch.cumsum(self.conv(x), dim=1).mean((2, 3))

    torch.manual_seed(0)
    x = torch.randn(1, 3, 16, 16)
    res = export_format("tflite", Cumulative().eval(), x, tmp_path)
    table = table_of("tflite", res.path, x.numpy())
    off = [r for r in table["rows"] if not r["delegated"]]
    assert [r["type"] for r in off] == ["CUMSUM"] and off[0]["where"] == "tflite builtin" and off[0]["note"]
    assert next(r for r in table["rows"] if r["type"] == "CONV_2D")["delegated"]


def test_int8_onnx_kernels_are_int8_and_macs_survive_prepacking(net, exported):
    """ONNX Runtime prepacks int8 weights (the profiler no longer shows them): MACs then come from the graph."""
    model, x = net
    table = table_of("onnx_int8", exported("onnx_int8").path, x[:1].numpy())
    qconv = [r for r in table["rows"] if r["type"] in ("QLinearConv", "ConvInteger")]
    assert qconv and all(r["precision"] == "int8" and r["macs"] for r in qconv)


@pytest.mark.parametrize("family", ["tensorrt", "coreml"])
def test_runtimes_this_machine_lacks_skip_with_the_reason(family, tmp_path, net):
    module = sys.modules[RUNTIMES.get(family).__module__]
    fake = tmp_path / ("model.mlpackage" if family == "coreml" else "model.engine")
    fake.write_bytes(b"")
    try:
        module.layers(fake, net[1][:1].numpy(), threads=1)
    except Unavailable as why:
        assert len(str(why)) > 10
        pytest.skip(f"{family} layer tables cannot be made here: {why}")
    except Exception:  # the runtime is here (a GPU machine, macOS) and refuses the empty file, as it must
        return
    pytest.fail(f"{family} made a layer table of an empty file")


def test_every_artifact_runtime_has_a_layer_table_and_the_bundle_carries_its_helpers(tmp_path, monkeypatch):
    files = {f.name for f in runtime_files()}
    assert "layers.py" in files
    families = {RUNTIMES.meta(n)["runs"] for n in RUNTIMES.list()} - {None} - PENDING
    for family in families:
        module = sys.modules[RUNTIMES.get(family).__module__]
        assert callable(getattr(module, "layers", None)), f"{module.__file__} has no layers()"
    # a device bundle's copy imports as a package of its own, with nothing from the toolchain
    from vfm_toolchain.bench.bundle import copy_runtime_layer
    from vfm_toolchain.export.runtimes.base import runtime_modules

    copy_runtime_layer(tmp_path / "runtimes")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {k: v for k, v in sys.modules.items() if k == "runtimes" or k.startswith("runtimes.")}
    try:
        modules = runtime_modules(tmp_path / "runtimes", "runtimes")
        assert {m.__name__ for m in modules if hasattr(m, "layers")} >= {f"runtimes.{sys.modules[RUNTIMES.get(f).__module__].__name__.rsplit('.', 1)[1]}" for f in families}
        assert all("vfm_toolchain" not in (getattr(v, "__name__", "")) for v in vars(sys.modules["runtimes.layers"]).values())
    finally:
        for k in [k for k in sys.modules if k == "runtimes" or k.startswith("runtimes.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    shutil.rmtree(tmp_path / "runtimes")
