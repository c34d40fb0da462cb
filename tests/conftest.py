"""Tiny fixtures: a generated shapes task at 32 px, a tiny ViT teacher, a small student; seconds each."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# `make test` runs the suite in pytest-xdist workers (Makefile): each worker, and every build or probe it starts
# (they inherit OMP_NUM_THREADS), gets its share of the cores, at least one thread.  Two processes that each spin
# two OpenMP threads on two cores slow each other many times over; one thread each runs both near full speed.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 2) // WORKERS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
# xdist hands each worker the controller's terminal width as COLUMNS, which the toolchain's console honours as the
# user's choice (80 on CI); without it a captured console is 160 wide, as on a CI page, and table cells stay whole
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
# onnxslim's own setting (builds and probes inherit it too): one pass of its rewrites per ONNX export instead of
# repeating them, up to 10 times, until the graph stops changing: 0.5 s of CPU instead of 1.9 s per export of the
# tiny student, the largest part of a tiny build's export stage (docs/development.md has the command).  The tests
# check that the slimmed file runs and matches PyTorch, which one pass exercises; how small the graph gets is
# onnxslim's concern.
os.environ.setdefault("ONNXSLIM_MAX_ITER", "1")

import torch  # noqa: E402  (after OMP_NUM_THREADS, which sizes its thread pool)

from vfm_toolchain.data.synthetic import generate_task  # noqa: E402

torch.set_num_threads(THREADS)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _cpu_outside_builds():
    """What a test calls directly (fit, TeacherLoss, an embedding) runs on the CPU, where its exact-math
    assertions hold on any machine: outside a build the policy's default is CUDA in bfloat16 autocast where
    there is a GPU.  A build still follows its recipe's device (auto: CUDA there), and the gpu-marked tests ask
    for CUDA themselves."""
    from vfm_toolchain import devices

    with devices.use("cpu"):
        yield
    torch.set_num_threads(THREADS)  # a build sets its recipe's threads in this process; the next test gets its share


@pytest.fixture(scope="session", autouse=True)
def _own_default_store(tmp_path_factory):
    """Nothing a test runs touches the user's store or the data-fingerprint memo beside it."""
    old = os.environ.get("VFM_TOOLCHAIN_CACHE")
    os.environ["VFM_TOOLCHAIN_CACHE"] = str(tmp_path_factory.mktemp("default_store"))
    yield
    if old is None:
        os.environ.pop("VFM_TOOLCHAIN_CACHE", None)
    else:
        os.environ["VFM_TOOLCHAIN_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("task")
    return generate_task(out, classes=3, labeled_per_class=6, val_per_class=3, test_per_class=4, pool_size=40,
                         distractor_size=10, image_size=32, seed=0)


def curate_manifest(out: Path) -> list:
    """A build's transfer set as (file name, query, distance to 3 places): what two curations that should agree
    are compared by."""
    import csv

    with open(out / "stages" / "teacher.curate" / "manifest.csv") as fh:
        return [(Path(r["path"]).name, r["query"], round(float(r["distance"]), 3)) for r in csv.DictReader(fh)]


def stage_statuses(record: dict) -> dict:
    """Stage -> status of a build record, without the stages a recipe that does not ask for them skips:
    ``student.select`` (a named student) and ``student.qat`` (no ``student_qat`` in ``export.models``)."""
    return {s["name"]: s["status"] for s in record["stages"]
            if not (s["name"] in ("student.select", "student.qat") and s["status"] == "skipped")}


def tiny_recipe(task: dict, **overrides) -> dict:
    """A complete recipe dict that builds end to end in well under a minute on 2 cores."""
    r = {
        "name": "tiny", "seed": 0, "threads": THREADS,
        "data": {"source": "folders", "train": task["train"], "val": task["val"], "test": task["test"],
                 "pools": task["pools"]},
        "teacher": {"name": "timm:vit_tiny_patch16_224", "weights": "none", "image_size": 32,
                    "adapter": {"name": "lora", "r": 4, "alpha": 8}, "epochs": 2, "batch_size": 8},
        "curate": {"strategy": "query_balanced_image", "budget": 24, "batch_size": 16},
        "student": {"name": "mobilevitv2_050", "image_size": 32},
        "distill": {"epochs": 2, "batch_size": 8, "views": 2},
        "finetune": {"epochs": 1, "batch_size": 8},
        "baseline": {"epochs": 1},
        "export": {"formats": ["onnx"], "parity_images": 4},
        "bench": {"runtimes": ["pytorch", "onnxruntime"], "batch_sizes": [1, 2], "warmup": 1, "iters": 2,
                  "threads": THREADS, "memory": False},
    }
    for key, value in overrides.items():
        node = r
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return r


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "store"


def shared_data_or_skip() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not present at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def hostile_env(tiny_task, tmp_path_factory, worker_id):
    """A finished tiny build (tests/hostile.py) shared by every hostile-use test file; none may change it.  Under
    pytest-xdist the first worker to ask builds it in the folder the workers' temporary folders share, and each
    works on a copy of its store and output folder (a tiny build is 20 s of a worker, a copy under a second)."""
    from filelock import FileLock

    from tests.hostile import make_env

    if worker_id == "master":  # not under xdist
        return make_env(tiny_task, tmp_path_factory.mktemp("hostile"))
    shared = tmp_path_factory.getbasetemp().parent / "hostile"
    with FileLock(f"{shared}.lock"):
        return make_env(tiny_task, shared, tmp_path_factory.mktemp("hostile_scratch"))


@pytest.fixture
def env(hostile_env):
    """What the hostile-use test files call ``hostile_env`` (a file may define an ``env`` of its own)."""
    return hostile_env


# What each test costs, for a suite bound by 2 cores: VFM_TEST_CPU_LOG=FILE adds a JSON line per test (setup,
# call and teardown together) with its CPU seconds in the worker ("self") and in the subprocesses it waited for
# ("children"), and its wall seconds.  `--durations` gives wall time only, which a neighbour on the other core
# inflates.  tests/slowest.py turns the log into tests/slowest.txt.
if os.environ.get("VFM_TEST_CPU_LOG"):
    import json
    import resource
    import time

    def _cpu():
        own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        (own0, waited0), t0 = _cpu(), time.perf_counter()
        yield
        (own1, waited1), t1 = _cpu(), time.perf_counter()
        with open(os.environ["VFM_TEST_CPU_LOG"], "a") as f:
            f.write(json.dumps({"id": item.nodeid, "self": round(own1 - own0, 2),
                                "children": round(waited1 - waited0, 2), "wall": round(t1 - t0, 2)}) + "\n")


def pytest_collection_modifyitems(config, items):
    """The files that hold the slowest tests first, in tests/slowest.txt's order, each file's tests in their own
    order (a module's fixtures are made once only while its tests run together); the rest keep theirs.  A worker
    that starts a one-minute test when the others have nothing left keeps one core busy and the other idle to the
    end.  Every worker sorts the same way, as pytest-xdist needs."""
    rank: dict = {}
    for node in Path(__file__).with_name("slowest.txt").read_text().split():
        rank.setdefault(node.split("::")[0], len(rank))
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: a file keeps its order
