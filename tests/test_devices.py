"""The one device policy (toolchain/devices.py): its decisions, and that no stage picks a device by itself.
The GPU path itself runs only where CUDA is (the ``gpu`` marker); here those tests skip with the reason."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from toolchain import devices
from toolchain.errors import ToolchainError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` CUDA devices (only the policy's decisions are tested, nothing runs)."""
    def make(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return make


@pytest.mark.parametrize("spec,n,local,expected", [
    ("auto", 0, "0", "cpu"), ("auto", 2, "0", "cuda:0"), ("auto", 2, "1", "cuda:1"), ("cpu", 2, "0", "cpu"),
    ("cuda", 2, "1", "cuda:1"), ("cuda:1", 2, "0", "cuda:1"),
])
def test_the_policy_decides(gpus, monkeypatch, spec, n, local, expected):
    gpus(n)
    monkeypatch.setenv("LOCAL_RANK", local)
    assert str(devices.resolve(spec)) == expected


@pytest.mark.parametrize("spec,n,message", [
    ("cuda", 0, "no CUDA device that PyTorch can use"), ("cuda:0", 0, "no CUDA device"),
    ("cuda:2", 2, "has 2 CUDA device"), ("gpu", 1, "not one of auto, cpu, cuda, cuda:N"),
])
def test_impossible_devices_are_refused_with_the_reason(gpus, spec, n, message):
    gpus(n)
    with pytest.raises(ToolchainError, match=message):
        devices.resolve(spec)


def test_autocast_and_pinned_memory_only_on_cuda():
    with devices.use("cpu") as policy:
        assert not policy.cuda and devices.loader_kwargs() == {"pin_memory": False}
        assert not torch.is_autocast_enabled()
        with devices.inference_autocast(), devices.training_autocast(True):
            assert not torch.is_autocast_enabled("cuda")
    assert devices.EXPORT_DEVICE.type == "cpu"


def test_on_device_puts_the_model_back():
    model = torch.nn.Linear(2, 2)
    with devices.use("cpu"):
        with devices.on_device(model) as device:
            assert device.type == "cpu" and next(model.parameters()).device.type == "cpu"
    assert next(model.parameters()).device.type == "cpu"


# Where CUDA may be named: the policy itself, process-group setup, and TensorRT (CUDA-only by nature).
ALLOWED = {"toolchain/devices.py", "toolchain/distributed.py", "export/formats/tensorrt_format.py"}
DEVICE_CHOICE = re.compile(r"\.cuda\(|torch\.device\(\s*[\"']cuda|autocast\(\s*[\"']cuda|device\s*=\s*[\"']cuda|"
                           r"torch\.cuda\.is_available\(\)")


def test_no_stage_picks_a_device_by_itself():
    """What a reviewer checks by reading: every network runs where toolchain/devices.py says."""
    offenders = []
    for area in ("toolchain", "teachers", "students", "export", "bench"):
        for path in sorted((REPO / area).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel in ALLOWED:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if DEVICE_CHOICE.search(code):
                    offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "device chosen outside toolchain/devices.py:\n" + "\n".join(offenders)


@pytest.mark.gpu
def test_a_tiny_build_on_cuda(tiny_task, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `pytest -m gpu` in the Docker image (README, GPU / Docker)")
    from tests.conftest import tiny_recipe
    from toolchain.recipe import recipe_from_dict
    from toolchain.runner import build

    raw = tiny_recipe(tiny_task, device="cuda", **{"bench.runtimes": ["pytorch", "onnxruntime"]})
    record = build(recipe_from_dict(raw), tmp_path / "out", tmp_path / "store")
    assert all(s["status"] == "ran" for s in record["stages"])
    assert any(r["runtime"] == "pytorch" and (r.get("provider") or "").startswith("cuda") for r in record["bench"])
