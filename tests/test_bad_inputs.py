"""Every bad input gets a clear answer before the long work starts.

Each case runs the real CLI and asserts: the exit code (2 bad input), a message that names the problem, no
Python traceback, and nothing already built lost (the store's sealed entries are all still there and verify).
Read-only folders are real: a read-only bind mount in a private mount namespace (``unshare``), since root
ignores permission bits; those cases skip where the machine cannot make one.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from tests.conftest import stage_statuses
from tests.hostile import build_args, check_answer, folder, recipe, sealed, text_file
from vfm_toolchain.cli import app
from vfm_toolchain.store import ArtifactStore

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def one_class_train(env) -> List[str]:
    train = folder(env, "train")
    first = sorted(Path(env.task["train"]).iterdir())[0]
    shutil.copytree(first, train / first.name)
    return build_args(env, recipe(env, **{"data.train": str(train), "data.val": None, "data.test": str(train)}))


def empty_class_folder(env) -> List[str]:
    train = folder(env, "train")
    shutil.copytree(env.task["train"], train, dirs_exist_ok=True)
    (train / "zz_empty").mkdir()
    return build_args(env, recipe(env, **{"data.train": str(train)}))


def wrong_shape_student(env) -> List[str]:
    import timm

    path = env.root / "other_student.safetensors"
    save_file(timm.create_model("mobilevitv2_075", num_classes=3).state_dict(), str(path))
    return build_args(env, recipe(env, **{"student.weights": str(path)}))


def unsafe_teacher(env) -> List[str]:
    import datetime

    path = env.root / "unsafe.pth"
    torch.save({"when": datetime.datetime(2026, 1, 1)}, path)  # needs code to unpickle
    return build_args(env, recipe(env, **{"teacher.weights": str(path)}))


def not_a_state_dict(env) -> List[str]:
    path = env.root / "list.pth"
    torch.save([1, 2, 3], path)
    return build_args(env, recipe(env, **{"teacher.weights": str(path)}))


def out_is_a_file(env) -> List[str]:
    f = env.root / "out_file"
    f.write_text("I am a file")
    return ["build", recipe(env), "--store", str(env.store), "--out", str(f)]


def store_is_a_file(env) -> List[str]:
    f = env.root / "store_file"
    f.write_text("I am a file")
    return ["build", recipe(env), "--store", str(f), "--out", str(folder(env, "out"))]


def bundle_to_a_file(env) -> List[str]:
    f = env.root / "bundle_file"
    f.write_text("I am a file")
    return ["bench", str(env.out), "--bundle", str(f)]


def results_file(env, text: str) -> List[str]:
    env.n += 1
    f = env.root / f"results_{env.n}.json"
    f.write_text(text)
    return ["report", str(env.out), "--device-results", str(f)]


# (id, argv builder, exit code, a regex the message must match)
CASES: List[tuple] = [
    ("recipe missing", lambda e: build_args(e, str(e.root / "nope.yaml")), 2, r"recipe .*nope.yaml' does not exist"),
    ("recipe not yaml", lambda e: build_args(e, text_file(e, "data: [unclosed")), 2, r"is not valid YAML"),
    ("recipe a list", lambda e: build_args(e, text_file(e, "- a\n- b\n")), 2, r"must be a mapping of sections"),
    ("unknown section", lambda e: build_args(e, text_file(e, "data: {source: synthetic}\nstudnet: {}\n")), 2,
     r"unknown key 'studnet'.*Did you mean 'student'"),
    ("unknown nested key", lambda e: build_args(e, recipe(e, **{"student.nmae": "x"})), 2,
     r"unknown key 'student.nmae'.*Did you mean 'name'"),
    ("--set unclosed list", lambda e: build_args(e, recipe(e), "--set", "export.formats=[onnx"), 2,
     r"--set export.formats=\[onnx: the value is not valid YAML"),
    ("--set without =", lambda e: build_args(e, recipe(e), "--set", "student.name"), 2, r"--set expects KEY=VALUE"),
    ("--set unknown key", lambda e: build_args(e, recipe(e), "--set", "studnet.name=x"), 2,
     r"unknown key 'studnet'.*Did you mean 'student'"),
    ("--only unknown stage", lambda e: build_args(e, recipe(e), "--only", "teacher.finetun"), 2,
     r"--only: unknown stage 'teacher.finetun'.*Did you mean 'teacher.finetune'"),
    ("teacher.epochs 0", lambda e: build_args(e, recipe(e, **{"teacher.epochs": 0})), 2, r"teacher.epochs is 0"),
    ("distill.epochs 0", lambda e: build_args(e, recipe(e, **{"distill.epochs": 0})), 2, r"distill.epochs is 0"),
    ("batch size 0", lambda e: build_args(e, recipe(e, **{"distill.batch_size": 0})), 2,
     r"'distill.batch_size': Input should be greater than or equal to 1"),
    ("image size a word", lambda e: build_args(e, recipe(e, **{"student.image_size": "big"})), 2,
     r"'student.image_size': .*an image size is one side .* or \[height, width\].*got 'big'"),
    ("val_fraction above 1", lambda e: build_args(e, recipe(e, **{"data.val_fraction": 1.5})), 2,
     r"'data.val_fraction': Input should be less than 1"),
    ("unknown student", lambda e: build_args(e, recipe(e, **{"student.name": "fastvit_s21"})), 2,
     r"Did you mean 'fastvit_s12'"),
    ("unknown teacher family", lambda e: build_args(e, recipe(e, **{"teacher.name": "hf:dinov2"})), 2,
     r"unknown teacher"),
    ("unknown adapter", lambda e: build_args(e, recipe(e, **{"teacher.adapter": {"name": "lorra"}})), 2,
     r"Did you mean 'lora'"),
    ("unknown adapter option", lambda e: build_args(e, recipe(e, **{"teacher.adapter": {"name": "lora", "rank": 4}})),
     2, r"unknown key 'teacher.adapter.rank'"),
    ("unknown strategy", lambda e: build_args(e, recipe(e, **{"curate.strategy": "best_match"})), 2,
     r"Did you mean 'best_matches'"),
    ("unknown format", lambda e: build_args(e, recipe(e, **{"export.formats": ["onx"]})), 2,
     r"unknown export format 'onx'.*Did you mean 'onnx'"),
    ("unknown runtime", lambda e: build_args(e, recipe(e, **{"bench.runtimes": ["onnxrt"]})), 2,
     r"Did you mean 'onnxruntime'"),
    ("train folder missing", lambda e: build_args(e, recipe(e, **{"data.train": str(e.root / "gone")})), 2,
     r"data.train '.*gone' is not a folder"),
    ("pool missing", lambda e: build_args(e, recipe(e, **{"data.pools": [str(e.root / "nopool")]})), 2,
     r"data.pools\[0\] '.*nopool' does not exist"),
    ("train with one class", one_class_train, 2, r"has 1 class folder.*at least 2"),
    ("empty class folder", empty_class_folder, 2, r"class folder '.*zz_empty' has no images"),
    ("labeled_per_class above images", lambda e: build_args(e, recipe(e, **{"data.labeled_per_class": 50})), 2,
     r"data.labeled_per_class is 50 but 3 of 3 train classes have fewer images.*Lower it to at most 6"),
    ("test classes differ", lambda e: build_args(e, recipe(e, **{"data.test": e.task["pools"][0]})), 2,
     r"test classes differ from train classes"),
    ("teacher weights missing", lambda e: build_args(e, recipe(e, **{"teacher.weights": str(e.root / "t.pth")})), 2,
     r"teacher.weights '.*t.pth' is not a file"),
    ("student weights missing", lambda e: build_args(e, recipe(e, **{"student.weights": str(e.root / "s.pth")})), 2,
     r"student.weights '.*s.pth' is not a file"),
    ("student checkpoint of another size", wrong_shape_student, 2,
     r"does not fit student 'mobilevitv2_050': \d+ tensors have another shape"),
    ("unsafe teacher pickle", unsafe_teacher, 2, r"is not a safe format: it needs arbitrary code"),
    ("teacher file not a state_dict", not_a_state_dict, 2, r"does not hold a state_dict of tensors"),
    ("--out is a file", out_is_a_file, 2, r"--out '.*out_file' is a file"),
    ("--store is a file", store_is_a_file, 2, r"--store '.*store_file' is a file, not a folder"),
    ("bench --bundle is a file", bundle_to_a_file, 2, r"--bundle '.*bundle_file' is a file"),
    ("bench on a non-build folder", lambda e: ["bench", str(folder(e, "x")), "--bundle", str(e.root / "b")], 2,
     r"is not a build output folder \(no build.json\)"),
    ("device results missing", lambda e: ["report", str(e.out), "--device-results", str(e.root / "r.json")], 2,
     r"--device-results '.*r.json' does not exist"),
    ("device results not JSON", lambda e: results_file(e, "{not json"), 2, r"is not valid JSON"),
    ("device results wrong shape", lambda e: results_file(e, json.dumps([1, 2])), 2,
     r"is not a results file written by a bundle's run_bench.py"),
    ("device misspelt", lambda e: build_args(e, recipe(e, device="gpu")), 2, r"'device': String should match pattern"),
    ("a GPU that is not there", lambda e: build_args(e, recipe(e, device="cuda:99")), 2,
     r"device 'cuda:99'.*(no CUDA device|CUDA device\(s\))"),
    ("segmentation size not /8", lambda e: build_args(e, recipe(e, **{"data.task": "segmentation",
                                                                     "student.image_size": 30})), 2,
     r"must be a multiple of 8"),
]


@pytest.mark.parametrize("name,make_args,code,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_clear_answer(env, name: str, make_args: Callable, code: int, pattern: str):
    res = runner.invoke(app, make_args(env))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    check_answer(res.exit_code, res.output, code, pattern)
    assert sealed(env.store) == env.sealed  # nothing built was lost or replaced
    assert not any(ArtifactStore(env.store).verify(s, k) for s, k in env.sealed)


def test_there_are_at_least_30_bad_inputs():
    assert len(CASES) + len(READ_ONLY_CASES) >= 30


# ---------------------------------------------------------------------------------------------------
# read-only folders: a real read-only mount in a private namespace


@pytest.fixture(scope="module")
def read_only_mount(tmp_path_factory):
    probe = tmp_path_factory.mktemp("ro_probe")
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: cannot make a read-only mount for these cases")
    res = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -o bind,ro "$1" "$1" && ! touch "$1/x" 2>/dev/null',
                          "sh", str(probe)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"this machine cannot make a read-only bind mount in a user namespace: {res.stderr.strip()}")


# the CLI in one Python inside the namespace, case after case (a process each spent 10 s importing torch again)
READ_ONLY_DRIVER = """
import json, sys
from typer.testing import CliRunner
from vfm_toolchain.cli import app
cases, answers = json.loads(sys.argv[1]), {}
for name, argv in cases.items():
    res = CliRunner().invoke(app, argv)  # its output holds stdout and stderr
    answers[name] = [res.exit_code, res.output]
with open(sys.argv[2], "w") as f:
    json.dump(answers, f)
"""


def run_with_read_only(folders: List[Path], cases: Dict[str, List[str]], answers: Path) -> Dict[str, list]:
    """The CLI with ``folders`` mounted read-only (only for this process): ``cases`` (name -> argv), each's exit
    code and output, in ``answers``, a file outside those folders."""
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do mount -o bind,ro "$1" "$1" || exit 97; shift; n=$((n-1)); done; ' \
             'exec "$@"'
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(len(folders)), *map(str, folders),
                          sys.executable, "-c", READ_ONLY_DRIVER, json.dumps(cases), str(answers)],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(answers.read_text())


def _ro_out(env):
    out = folder(env, "ro_out")
    return out, ["build", recipe(env), "--store", str(env.store), "--out", str(out)]


def _ro_parent(env):
    parent = folder(env, "ro_parent")
    return parent, ["build", recipe(env), "--store", str(env.store), "--out", str(parent / "out")]


def _ro_store_must_run(env):
    store = folder(env, "ro_store")
    shutil.copytree(env.store, store, dirs_exist_ok=True)
    # a new finetune setting: the cached stages before it are served, student.finetune must run
    return store, ["build", recipe(env, **{"finetune.epochs": 2}), "--store", str(store), "--out",
                   str(folder(env, "out"))]


READ_ONLY_CASES = [
    ("--out read-only", _ro_out, 2, r"the output folder '.*ro_out_\d+' is not writable"),
    ("--out under a read-only parent", _ro_parent, 2, r"cannot create the output folder .*read-only file system"),
    ("read-only store, a stage must run", _ro_store_must_run, 2,
     r"stage 'student.finetune' failed: student.finetune is not built in the artifact store .* which is read-only"),
]


def test_read_only_folders_get_a_clear_answer_and_a_read_only_store_serves_what_it_has(env, read_only_mount):
    """Each case above gets its one clear answer; a read-only store that holds every stage serves them all."""
    made = {name: make(env) for name, make, _, _ in READ_ONLY_CASES}
    store, out = folder(env, "ro_full_store"), folder(env, "out")
    shutil.copytree(env.store, store, dirs_exist_ok=True)
    made["serves"] = (store, ["build", recipe(env), "--store", str(store), "--out", str(out)])
    answers = run_with_read_only([ro for ro, _ in made.values()], {k: argv for k, (_, argv) in made.items()},
                                 env.root / "read_only_answers.json")
    for name, _, code, pattern in READ_ONLY_CASES:
        check_answer(*answers[name], code, pattern)
    assert sealed(env.store) == env.sealed
    served, output = answers["serves"]
    assert served == 0, output[-3000:]
    record = json.loads((out / "build.json").read_text())
    assert set(stage_statuses(record).values()) == {"cached"}
    assert "read-only" in output
