"""The accuracy-aware int8 fallback (export/fallback.py, issue 39): the layer ranking finds a deliberately fragile
layer, and each int8 format that misses the gate puts it back in float first and then passes.

The fragile model computes exactly what a plain one does, but its first convolution writes one channel 500 times
larger (ReLU commutes with the scale) and the second convolution divides it back: the second convolution's input,
quantized with one scale per tensor, then keeps almost nothing of the seven small channels."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from torch import nn

from vfm_toolchain.export.fallback import fall_back, fallback_summary, layer_sensitivity
from vfm_toolchain.export.formats.base import export_format
from vfm_toolchain.export.formats.onnx_quantized_format import ELEMENTWISE
from vfm_toolchain.students.qat import weighted_layers


class Fragile(nn.Module):
    def __init__(self, outlier: float = 500.0):
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.conv1.weight[0] *= outlier
            self.conv1.bias[0] = self.conv1.bias[0].abs() * outlier
            self.conv2.weight[:, 0] /= outlier

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def _images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 16, 16)).astype(np.float32)


class OutputGate:
    """A gate with the build's interface over a score any model has: 1 - the relative squared error of the
    artifact's outputs against the fp32 model's on fixed images (1.0 for fp32 itself)."""

    def __init__(self, model, max_drop: float = 0.02):
        self.model, self.max_drop = model.eval(), max_drop
        self.items = _images(16, seed=1)

    def score(self, runner, items) -> float:
        x = np.stack(list(items))
        with torch.no_grad():
            ref = self.model(torch.from_numpy(x)).numpy()
        got = np.concatenate([np.asarray(runner(x[i:i + 1])) for i in range(len(x))])
        return float(1 - min(1.0, ((got - ref) ** 2).sum() / (ref ** 2).sum()))

    def __call__(self, runner):
        score = self.score(runner, self.items)
        return {"test_score": score, "fp32_test_score": 1.0, "accuracy_drop": 1.0 - score,
                "passed": 1.0 - score <= self.max_drop}


def test_sensitivity_ranks_the_fragile_layer_first():
    model = Fragile().eval()
    ranked = layer_sensitivity(model, _images(8))
    assert [n for n, _ in ranked][0] == "conv2"
    assert ranked[0][1] > 10 * ranked[1][1]  # not a near tie: the outlier channel makes conv2's input coarse
    # the same model without the outlier has no such layer: the ranking measures the model, not the position
    plain = dict(layer_sensitivity(Fragile(outlier=1.0).eval(), _images(8)))
    assert plain["conv2"] < ranked[0][1] / 10
    assert weighted_layers(model) == ["conv1", "conv2", "fc"]


def test_fall_back_stops_at_the_first_passing_step_and_records_every_step():
    calls = []

    def make(layers):
        calls.append(list(layers))
        return lambda x: len(layers)  # a "runner" whose score is how many layers are in float

    def judge(runner):
        k = runner(None)
        score = 0.5 + 0.2 * k
        return {"test_score": score, "fp32_test_score": 1.0, "accuracy_drop": 1.0 - score, "passed": k >= 2}

    ranked = [("a", 3.0), ("b", 2.0), ("c", 1.0), ("d", 0.5), ("e", 0.1)]
    slow = lambda x: sum(range(20000))  # the fp32 counterpart: slower than the fake int8 runners
    runner, record = fall_back("fmt", ranked, make, judge, (lambda x: 0, judge(lambda x: 0)), slow,
                               np.zeros((1, 3, 4, 4), np.float32))
    assert calls == [["a"], ["a", "b"]]  # 1, then 2 layers; stops once the gate passes
    assert record["passed"] and record["float_layers"] == ["a", "b"]
    assert [s["float_layers"] for s in record["steps"]] == [0, 1, 2]
    assert [s["passed"] for s in record["steps"]] == [False, False, True]
    assert "2 of 5 layers in float" in fallback_summary(record)


def test_fall_back_stops_when_int8_no_longer_pays():
    judge = lambda r: {"test_score": 0.5, "fp32_test_score": 1.0, "accuracy_drop": 0.5, "passed": False}
    slow, fp32 = (lambda x: sum(range(200000))), (lambda x: sum(range(20000)))
    made = []
    _, record = fall_back("fmt", [("a", 1.0), ("b", 0.5)], lambda layers: made.append(layers) or slow, judge,
                          (lambda x: 0, judge(None)), fp32, np.zeros((1, 3, 4, 4), np.float32))
    assert made == [["a"]] and not record["passed"]  # slower than fp32 after one layer: not worth a second
    assert record["speed_decides"] and "no faster than fp32" in record["reason"]


def test_fall_back_goes_on_where_int8_never_paid_here():
    # plain int8 already no faster than fp32 on this machine (a phone's format on x86, a small input): its speed
    # here says nothing about the target's, so only the gate stops the search
    judge = lambda r: {"test_score": 0.5, "fp32_test_score": 1.0, "accuracy_drop": 0.5, "passed": False}
    slow = lambda x: sum(range(200000))
    made = []
    _, record = fall_back("fmt", [("a", 1.0), ("b", 0.5), ("c", 0.1)], lambda layers: made.append(layers) or slow,
                          judge, (slow, judge(None)), lambda x: 0, np.zeros((1, 3, 4, 4), np.float32))
    assert made == [["a"], ["a", "b"], ["a", "b", "c"]] and not record["passed"]
    assert not record["speed_decides"] and "every one of the 3 layers" in record["reason"]


def test_onnx_int8_falls_back_to_float_for_the_fragile_layer(tmp_path):
    pytest.importorskip("onnxruntime")
    model = Fragile().eval()
    gate = OutputGate(model)
    res = export_format("onnx_int8", model, torch.from_numpy(_images(2)), tmp_path,
                        {"layout": "qdq", "fp32_slow_layers": False}, calibration=_images(16), judge=gate)
    record = res.meta["fallback"]
    assert not record["steps"][0]["passed"], "plain int8 should miss the gate on the fragile model"
    assert record["passed"] and res.accuracy["passed"]
    # ONNX Runtime's first step leaves every op without weights in fp32; not enough here, the fragile layer comes next
    assert record["float_layers"][:2] == [ELEMENTWISE, "conv2"] and not record["steps"][1]["passed"]
    assert gate(res.runner)["passed"]  # the artifact on disk is the repaired one
    off = export_format("onnx_int8", model, torch.from_numpy(_images(2)), tmp_path / "off",
                        {"layout": "qdq", "fp32_slow_layers": False, "fallback": False}, calibration=_images(16),
                        judge=gate)
    assert "fallback" not in off.meta and not gate(off.runner)["passed"]  # refused by the stage, untouched


@pytest.mark.edge
@pytest.mark.parametrize("fmt", ["executorch_int8", "tflite_int8", "openvino_int8"])
def test_edge_int8_falls_back_to_float_for_the_fragile_layer(tmp_path, fmt):
    needs = {"executorch_int8": "executorch", "tflite_int8": "ai_edge_quantizer", "openvino_int8": "nncf"}[fmt]
    if importlib.util.find_spec(needs) is None:
        pytest.skip(f"{fmt} needs {needs} (pip install 'vfm-toolchain[edge]')")
    model = Fragile().eval()
    gate = OutputGate(model)
    # openvino_int8 also keeps in float the layers int8 makes slower, from timings: off, so only accuracy decides
    options = {"tflite_int8": {"float_output": False}, "openvino_int8": {"fp32_slow_layers": False}}.get(fmt, {})
    res = export_format(fmt, model, torch.from_numpy(_images(1)), tmp_path, options, calibration=_images(16),
                        judge=gate)
    record = res.meta["fallback"]
    assert not record["steps"][0]["passed"], f"plain {fmt} should miss the gate on the fragile model"
    assert record["passed"] and res.accuracy["passed"], fallback_summary(record)
    if fmt != "openvino_int8":  # NNCF ranks on its own; ours puts the fragile layer back first
        assert record["float_layers"][0] == "conv2"
    assert gate(res.runner)["passed"]


class TwoBranches(nn.Module):
    """Two convs, then the root's own decoding-like op: a concatenation of a large-range and a [0, 1] output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.a(x) * 100, self.b(x).sigmoid()], dim=1)


@pytest.mark.edge
def test_executorch_int8_quantizes_the_named_modules_and_nothing_outside():
    # XNNPACKQuantizer.set_module_name alone annotated no conv (their weights carry no module stack) and its
    # concatenation annotator ignored the filter: the root's concat got one int8 grid for both ranges
    if importlib.util.find_spec("executorch") is None:
        pytest.skip("executorch_int8 needs executorch (pip install 'vfm-toolchain[edge]')")
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import get_symmetric_quantization_config

    from vfm_toolchain.export.formats.executorch_format import _scoped_quantizer

    graph = torch.export.export(TwoBranches().eval(), (torch.randn(1, 3, 8, 8),)).module()
    _scoped_quantizer(["a"], get_symmetric_quantization_config(is_per_channel=True)).annotate(graph)
    annotated = {(n.target.__name__, next(reversed(n.meta.get("nn_module_stack", {"": ("",)}).values()))[0])
                 for n in graph.graph.nodes if n.op == "call_function" and "quantization_annotation" in n.meta}
    assert ("conv2d.default", "a") in annotated, annotated
    assert not any(name in ("b", "") for _, name in annotated), f"quantized outside 'a': {annotated}"


def test_report_row_says_what_the_fallback_did():
    from vfm_toolchain.export.convert import _artifact_row

    record = {"ranked_layers": 3, "float_layers": ["conv2", "conv1"], "fp32_p50_ms": 1.0, "passed": True,
              "reason": "passed with the 1 most sensitive of 3 layers in float",
              "steps": [{"float_layers": 0, "test_score": 0.90, "accuracy_drop": 0.05, "passed": False,
                         "p50_ms": 0.5, "fp32_p50_ms": 1.0},
                        {"float_layers": 1, "test_score": 0.95, "accuracy_drop": 0.0, "passed": True,
                         "p50_ms": 0.6, "fp32_p50_ms": 1.0}]}
    row = _artifact_row({"status": "ok", "model": "student", "kind": "onnx_int8", "path": "a/model.int8.onnx",
                         "bytes": 1e6, "parity_max_abs_diff": 0.1, "precision": "int8", "fallback": record})
    assert "2 of 3 layers in float, test 90.00% -> 95.00%" in row and "0.60 ms against 0.50 ms" in row


# ---------------------------------------------------------------------------------------------------
# quantization-aware training against a teacher's cached outputs (students/qat.py)


class _Views(torch.utils.data.Dataset):
    """The (student input, image, view) items TransferViews gives distillation, over fixed arrays."""

    def __init__(self, x: np.ndarray):
        self.x = torch.from_numpy(x)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], i, 0

    def set_epoch(self, epoch):
        pass


def _kl(teacher, runner, x: np.ndarray) -> float:
    """Mean KL(teacher || artifact) of the class distributions: what task-oriented distillation minimises."""
    with torch.no_grad():
        t = torch.log_softmax(teacher(torch.from_numpy(x)), -1)
    a = torch.log_softmax(torch.from_numpy(np.concatenate([np.asarray(runner(x[i:i + 1])) for i in range(len(x))])),
                          -1)
    return float((t.exp() * (t - a)).sum(-1).mean())


@pytest.mark.parametrize("target", ["teacher", "student"])
def test_qat_against_the_teacher_gives_int8_not_below_ptq(tmp_path, target):
    """The fragile model's own fp32 outputs are the teacher's cached rows (``teacher``), or come from a frozen copy
    of it on each batch (``student``, export.qat.target): QAT trains a copy with fake-quantized weights and inputs to
    match them, and ONNX Runtime's int8 of the result is closer to the fp32 model, on images neither saw, than plain
    PTQ of the model (measured here: about 8x smaller KL)."""
    pytest.importorskip("onnxruntime")
    import copy
    import logging

    from vfm_toolchain.recipe import QATConfig
    from vfm_toolchain.students.objectives import TaskOriented
    from vfm_toolchain.students.qat import quantization_aware

    teacher = Fragile().eval()
    images = _images(64, seed=3)
    with torch.no_grad():
        cache = teacher(torch.from_numpy(images)).numpy()[:, None]  # (images, views, classes)
    student = copy.deepcopy(teacher)
    reference = copy.deepcopy(teacher) if target == "student" else None
    trained = quantization_aware(student, TaskOriented(student, temperature=1.0), _Views(images),
                                 None if reference is not None else cache, QATConfig(epochs=8, batch_size=16),
                                 tmp_path, logging.getLogger("qat"), 0, reference)
    assert not any(hasattr(m, "parametrizations") for m in trained.modules())  # plain modules again
    w = trained.conv2.weight.detach()
    scale = w.abs().flatten(1).amax(1).view(-1, 1, 1, 1) / 127
    assert torch.allclose(w / scale, (w / scale).round(), atol=1e-3)  # weights on their int8 grid

    opts = {"layout": "qdq", "fp32_slow_layers": False, "fallback": False}
    ptq = export_format("onnx_int8", teacher, torch.from_numpy(images[:2]), tmp_path / "ptq", opts,
                        calibration=images[:32])
    qat = export_format("onnx_int8", trained, torch.from_numpy(images[:2]), tmp_path / "qat", opts,
                        calibration=images[:32])
    held_out = _images(32, seed=9)
    assert _kl(teacher, qat.runner, held_out) < _kl(teacher, ptq.runner, held_out)


def test_qat_needs_task_oriented_distillation_its_target_and_an_int8_format(tiny_task):
    from tests.conftest import tiny_recipe
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.export import check_qat
    from vfm_toolchain.recipe import recipe_from_dict

    qat = {"export.models": ["student", "student_qat"], "export.formats": ["onnx", "onnx_int8"],
           "export.qat.target": "teacher"}
    check_qat(recipe_from_dict(tiny_recipe(tiny_task, **qat)))
    for change, says in [({"distill.mode": "task_agnostic"}, "task_agnostic"),
                         ({"distill.teacher_outputs": "online"}, "online"),
                         ({"distill.teacher_outputs": "online", "export.qat.target": "nobody"}, "target"),
                         ({"export.formats": ["onnx"]}, "no int8 format"),
                         ({"export.qat.epochs": 0}, "epochs is 0")]:
        with pytest.raises(ToolchainError, match=says):
            check_qat(recipe_from_dict(tiny_recipe(tiny_task, **{**qat, **change})))
    # the fp32 student as the target needs no cached teacher outputs
    check_qat(recipe_from_dict(tiny_recipe(tiny_task, **{**qat, "distill.teacher_outputs": "online",
                                                         "export.qat.target": "student"})))
