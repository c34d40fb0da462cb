"""The one device policy (toolchain/devices.py): its decisions, and that no stage picks a device by itself.
The GPU path itself runs only where CUDA is (the ``gpu`` marker); here those tests skip with the reason."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vfm_toolchain import devices
from vfm_toolchain.core.errors import ToolchainError

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


@pytest.mark.parametrize("spec", ["auto", "cuda"])
def test_more_torchrun_processes_than_gpus_is_refused_with_the_fix(gpus, monkeypatch, spec):
    gpus(1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ToolchainError, match=r"process 1 on this node.*1 CUDA device.*--nproc_per_node 1"):
        devices.resolve(spec)


def test_checkpoints_carry_the_cuda_generator_under_a_cuda_policy(monkeypatch):
    """Dropout and drop-path on a GPU draw from the CUDA generator: an exact resume restores it (faked here; the
    gpu-marked resume test in tests/test_training.py runs it)."""
    from vfm_toolchain.training import rng_state, set_rng_state

    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: torch.tensor([7, device.index], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.append((state.tolist(), device)))
    cuda = devices.DevicePolicy(torch.device("cuda", 1))
    monkeypatch.setattr(devices, "_current", cuda)
    state = rng_state()
    assert state["cuda"].tolist() == [7, 1]
    set_rng_state(state)
    assert restored == [([7, 1], torch.device("cuda", 1))]
    monkeypatch.setattr(devices, "_current", devices.DevicePolicy(torch.device("cpu")))
    assert rng_state()["cuda"] is None
    set_rng_state(state)  # a GPU checkpoint resumed on the CPU: the CPU generator alone
    assert len(restored) == 1


def test_autocast_and_pinned_memory_only_on_cuda():
    with devices.use("cpu") as policy:
        kw = devices.loader_kwargs()
        assert not policy.cuda and not kw["pin_memory"] and kw["num_workers"] == 0
        assert not torch.is_autocast_enabled()
        with devices.inference_autocast(), devices.training_autocast(True):
            assert not torch.is_autocast_enabled("cuda")
    assert devices.EXPORT_DEVICE.type == "cpu"


@pytest.mark.parametrize("workers,cuda,cpus,local_world,expected", [
    ("auto", False, 16, "1", 0),   # CPU: decoding would take cores from compute
    ("auto", True, 16, "1", 8),    # CUDA: capped at 8
    ("auto", True, 16, "4", 3),    # four processes share 16 cores, one core each stays with its GPU driver
    ("auto", True, 1, "1", 0),
    (2, False, 16, "1", 2),        # the recipe's number wins everywhere
    (0, True, 16, "1", 0),
])
def test_loader_workers_follow_the_device(monkeypatch, workers, cuda, cpus, local_world, expected):
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    policy = devices.DevicePolicy(torch.device("cuda", 0) if cuda else torch.device("cpu"), workers)
    assert devices.loader_workers(policy) == expected


@pytest.mark.parametrize("free_gib,peak1_mib,peak8_mib,expected", [
    (70, 600, 1300, 256),   # 100 MiB per image, 500 fixed: 496 fit in 0.7 x 70 GiB, the power of two below
    (70, 100, 100, 1024),   # per-image memory too small to measure: capped at the limit
    (1, 900, 8000, 1),      # not even two images fit: one at a time
    (16, 2000, 2000 + 7 * 300, 32),
])
def test_auto_batch_fits_the_free_gpu_memory(free_gib, peak1_mib, peak8_mib, expected):
    mib = 1 << 20
    got = devices.batch_from_memory(free_gib << 30, peak1_mib * mib, peak8_mib * mib)
    per_image = max((peak8_mib - peak1_mib) / 7, 1 / mib) * mib
    fixed = max(peak1_mib * mib - per_image, 0)
    assert got == expected
    assert got == 1 or fixed + got * per_image <= 0.7 * (free_gib << 30)      # what it picks fits
    assert got in (1, 1024) or fixed + 2 * got * per_image > 0.7 * (free_gib << 30)  # and twice as much would not
    assert got & (got - 1) == 0


def test_batch_size_from_the_recipe_or_auto_on_the_cpu():
    calls = []
    with devices.use("cpu"):
        assert devices.inference_batch_size(48, calls.append) == 48
        assert devices.inference_batch_size("auto", calls.append) == devices.CPU_BATCH
    assert calls == []  # nothing is measured on the CPU


@pytest.mark.gpu
def test_auto_batch_is_measured_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `pytest -m gpu` in the Docker image (docs/development.md, GPU / Docker)")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1))
    with devices.use("cuda") as policy, devices.on_device(model):
        seen = []
        size = devices.inference_batch_size(
            "auto", lambda b: seen.append(b) or model(torch.zeros(b, 3, 224, 224, device=policy.device)))
    assert seen == [1, 8] and 8 <= size <= 1024


def test_the_report_names_the_cpu_and_under_cuda_the_gpu(monkeypatch):
    cpu = devices.describe(2, devices.DevicePolicy(torch.device("cpu")))
    assert cpu.endswith("(2 threads)") and "cuda" not in cpu
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"NVIDIA H200 #{device.index}")
    gpu = devices.describe(2, devices.DevicePolicy(torch.device("cuda", 1)))
    assert gpu == cpu + "; NVIDIA H200 #1 (cuda:1)"


def test_on_device_puts_the_model_back():
    model = torch.nn.Linear(2, 2)
    with devices.use("cpu"):
        with devices.on_device(model) as device:
            assert device.type == "cpu" and next(model.parameters()).device.type == "cpu"
    assert next(model.parameters()).device.type == "cpu"


# Where CUDA may be named: the policy itself, process-group setup, and TensorRT (CUDA-only by nature: its format and
# its runtime file, which runs on devices without the toolchain and so cannot ask the policy).
ALLOWED = {"toolchain/devices.py", "toolchain/distributed.py", "export/formats/tensorrt_format.py",
           "export/runtimes/tensorrt_runtime.py"}
DEVICE_CHOICE = re.compile(r"\.cuda\(|torch\.device\(\s*[\"']cuda|autocast\(\s*[\"']cuda|device\s*=\s*[\"']cuda|"
                           r"torch\.cuda\.is_available\(\)")


def _source_lines(skip=()):
    for area in ("toolchain", "teachers", "students", "export", "bench"):
        for path in sorted((REPO / area).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel not in skip:
                for i, line in enumerate(path.read_text().splitlines(), 1):
                    yield f"{rel}:{i}: {line.strip()}", line.split("#")[0]


def test_no_stage_picks_a_device_by_itself():
    """What a reviewer checks by reading: every network runs where toolchain/devices.py says."""
    offenders = [where for where, code in _source_lines(ALLOWED) if DEVICE_CHOICE.search(code)]
    assert not offenders, "device chosen outside toolchain/devices.py:\n" + "\n".join(offenders)


def test_seeded_augmentation_forks_the_cpu_generator_alone():
    """torch.random.fork_rng() saves every CUDA generator too: in a DataLoader worker forked from a build that
    already uses CUDA that raises "Cannot re-initialize CUDA in forked subprocess" (the distillation's views
    failed so on an H200 while every CPU test passed).  Augmentation runs on the CPU: devices=[]."""
    offenders = [where for where, code in _source_lines() if "fork_rng(" in code and "devices=[]" not in code]
    assert not offenders, "fork_rng without devices=[]:\n" + "\n".join(offenders)


@pytest.mark.gpu
def test_a_tiny_build_on_cuda(tiny_task, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `pytest -m gpu` in the Docker image (docs/development.md, GPU / Docker)")
    from tests.conftest import tiny_recipe
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    raw = tiny_recipe(tiny_task, device="cuda", **{"bench.runtimes": ["pytorch", "onnxruntime"]})
    record = build(recipe_from_dict(raw), tmp_path / "out", tmp_path / "store")
    assert all(s["status"] == "ran" for s in record["stages"] if s["name"] != "student.select")
    assert any(r["runtime"] == "pytorch" and (r.get("provider") or "").startswith("cuda") for r in record["bench"])
