"""The Python API (toolchain/api.py): docs/api.md's example runs as written, and each call does what it says."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import timm
import torch

from tests.conftest import THREADS, tiny_recipe
from vfm_toolchain import api
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.failures import StageFailed

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_documented_example_runs(tmp_path, monkeypatch, capsys):
    """Run as a script from the checkout's root, in this process (a process of its own would spend seconds
    importing torch, timm and PEFT again first)."""
    text = (REPO / "docs" / "api.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert 'out="runs/api_example"' in code
    code = code.replace('out="runs/api_example"', f'out={str(tmp_path / "out")!r}')
    # the quickstart's `threads: 2` beside another pytest-xdist worker would oversubscribe the cores
    code = code.replace("overrides={", f'overrides={{"threads": {THREADS}, ', 1)
    monkeypatch.chdir(REPO)
    exec(compile(code, "docs/api.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert printed.startswith("complete {") and "ONNX Runtime, batch 1: p50" in printed
    assert str(tmp_path / "out") in printed and "report.md" in printed


def test_overrides_as_a_dict_or_strings_give_the_same_recipe(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task)
    a = api.load(raw, {"student.name": "fastvit_t8", "export.formats": ["onnx", "onnx_int8"],
                       "export.options.onnx_int8.layout": "qdq"})
    b = api.load(raw, ["student.name=fastvit_t8", "export.formats=[onnx, onnx_int8]",
                       "export.options.onnx_int8.layout=qdq"])
    assert a == b and a.student.name == "fastvit_t8" and a.export.options["onnx_int8"]["layout"] == "qdq"
    with pytest.raises(ToolchainError, match="unknown key 'student.nmae'"):
        api.load(raw, {"student.nmae": "x"})
    with pytest.raises(ToolchainError, match="not one string"):
        api.load(raw, "student.name=x")


def test_build_returns_its_artifacts_and_a_failure_raises_with_its_record(hostile_env, tmp_path):
    env = hostile_env
    store = tmp_path / "store"  # the failed build below leaves its working folder: not in the shared store
    shutil.copytree(env.store, store)
    result = api.build(env.raw, out=tmp_path / "out", store=store)
    assert result.status == "complete" and set(s["status"] for s in result.stages) <= {"cached", "skipped"}
    onnx = result.artifact("student", "onnx")
    assert onnx.path.is_file() and onnx.parity is not None and onnx.parity < 1e-4
    assert result.report.is_file() and result.metrics["student_distilled_top1"] is not None
    with pytest.raises(ToolchainError, match=r"has no student tensorrt artifact \(it made: student onnx\)"):
        result.artifact("student", "tensorrt")
    with pytest.raises(StageFailed) as info:
        api.build(env.raw, {"export.parity_atol": 1e-30}, out=tmp_path / "out", store=store)
    assert info.value.stage == "export.convert" and "this build's record" in info.value.where


def test_export_checks_a_model_and_time_artifact_times_it(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", pretrained=False, num_classes=3).eval()
    made = api.export(model, "onnx", torch.rand(2, 3, 32, 32), tmp_path / "onnx")
    assert made.path.is_file() and made.parity is not None and made.parity < 1e-4 and len(made.sha256) == 64
    latency = api.time_artifact(made.path, "onnxruntime", image_size=32, iters=3, warmup=1)
    assert latency["p50_ms"] > 0
    with pytest.raises(ToolchainError, match="unknown export format 'onx'"):
        api.export(model, "onx", torch.rand(1, 3, 32, 32), tmp_path / "x")
    with pytest.raises(ToolchainError, match="does not exist"):
        api.time_artifact(tmp_path / "nope.onnx", "onnxruntime", image_size=32)
