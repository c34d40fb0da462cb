"""teacher.ensemble (teachers/ensemble.py): members from the recipe, the averaged outputs of classifier and
detector ensembles, the saved ensemble, the teacher.finetune stage training and resuming members, and distillation
from the ensemble (a tiny synthetic detection task, ResNet-10t teachers, a FastViT-T8 student at 64x128)."""
import copy
import json
import logging

import numpy as np
import pytest
import torch

from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.prepare import PrepareData
from vfm_toolchain.recipe import AdapterConfig, recipe_from_dict
from vfm_toolchain.stage import RECIPE_CHECKS, ReportContext, StageContext, StageOutput
from vfm_toolchain.students.teacher_flip import FlipAveraged
from vfm_toolchain.synthetic_detection import generate_detection_task
from vfm_toolchain.teachers.detection import create_detection_teacher, detection_teacher_spec
from vfm_toolchain.teachers.ensemble import TeacherEnsemble, ensemble_spec, teacher_members
from vfm_toolchain.teachers.finetune import TeacherFinetune
from vfm_toolchain.teachers.model import create_teacher, teacher_spec

HW = (64, 128)
LOG = logging.getLogger("test")


def _det(seed: int):
    torch.manual_seed(seed)
    return create_detection_teacher("timm:resnet10t", "none", HW, 3, AdapterConfig(name="full"), neck_channels=16,
                                    head_convs=1).eval()


def _recipe(data=None, **teacher):
    data = data or {"train": "t", "test": "t", "pools": ["p"]}
    return recipe_from_dict({"seed": 0, "data": data,
                             "teacher": {"name": "timm:resnet10t", "weights": "none", **teacher}})


def _check(recipe):
    """The ensemble's check, which the build runs before the first stage (registered by the teachers package); the
    recipes here name no real data, so the path checks are left out."""
    import vfm_toolchain.teachers  # noqa: F401  (registers the teacher checks)
    from vfm_toolchain.teachers.ensemble import check_ensemble

    assert check_ensemble in RECIPE_CHECKS
    check_ensemble(recipe)


# ---------------------------------------------------------------------------------------------------
# members from the recipe


def test_members_are_the_teacher_with_each_entrys_keys_and_their_own_seed():
    r = _recipe(augment="strong", lr=2e-3, ensemble=[{"augment": "light"}, {}, {"lr": 1e-3, "seed_offset": 7}])
    members = teacher_members(r)
    assert [(m.seed, m.teacher.augment, m.teacher.lr) for m in members] == [
        (0, "strong", 2e-3), (1, "light", 2e-3), (2, "strong", 2e-3), (7, "strong", 1e-3)]
    # the seeds move with the recipe's (a study's seed N): each seed is an ensemble of its own
    moved = teacher_members(r.model_copy(update={"seed": 10}))
    assert [m.seed for m in moved] == [10, 11, 12, 17]
    same_seed = _recipe(augment="strong", ensemble=[{"augment": "light", "seed_offset": 0}])
    assert [m.seed for m in teacher_members(same_seed.model_copy(update={"seed": 2}))] == [2, 2]
    assert all(m.teacher.ensemble == [] for m in members)
    # a member is exactly the teacher a recipe of its own would train: the same teacher.finetune key
    own = _recipe(augment="light", lr=2e-3).model_copy(update={"seed": 1})
    assert TeacherFinetune().config(members[1]) == TeacherFinetune().config(own)
    # no ensemble: the key of every store made before the option
    assert "ensemble" not in TeacherFinetune().config(_recipe())["teacher"]
    assert "ensemble" in TeacherFinetune().config(r)["teacher"]
    # the key names the seed each member trains at: an offset written out or left to its default is one model
    spelled = _recipe(augment="strong", lr=2e-3, ensemble=[{"augment": "light", "seed_offset": 1}, {"seed_offset": 2},
                                                            {"lr": 1e-3, "seed_offset": 7}])
    assert TeacherFinetune().config(spelled) == TeacherFinetune().config(r)
    assert [e["seed"] for e in TeacherFinetune().config(r)["teacher"]["ensemble"]] == [1, 2, 7]


def test_bad_ensembles_are_refused_before_the_first_stage_with_the_fix():
    with pytest.raises(ToolchainError, match=r"ensemble\[0\] would train the same teacher as the recipe's"):
        _check(_recipe(ensemble=[{"seed_offset": 0}]))
    with pytest.raises(ToolchainError, match=r"ensemble\[1\] would train the same teacher as teacher.ensemble\[0\]"):
        _check(_recipe(ensemble=[{"augment": "strong", "seed_offset": 3}, {"augment": "strong", "seed_offset": 3}]))
    with pytest.raises(ToolchainError, match="Valid keys here: seed_offset, augment"):  # the backbone is the teacher's
        _recipe(ensemble=[{"name": "timm:resnet18"}])
    with pytest.raises(ToolchainError, match=r"teacher.ensemble\[0\].adapter: unknown adapter 'lorx'"):
        _check(_recipe(ensemble=[{"adapter": {"name": "lorx"}}]))
    with pytest.raises(ToolchainError, match="export.models teacher"):
        _check(recipe_from_dict({"data": {"train": "t", "test": "t", "pools": ["p"]},
                                 "export": {"models": ["student", "teacher"]},
                                 "teacher": {"name": "timm:resnet10t", "weights": "none", "ensemble": [{}]}}))
    with pytest.raises(ToolchainError, match="neck features"):
        _check(recipe_from_dict({"data": {"task": "detection", "train": "t", "test": "t", "pools": ["p"]},
                                 "teacher": {"name": "timm:resnet10t", "weights": "none", "image_size": 64,
                                             "ensemble": [{}]},
                                 "student": {"image_size": 64}, "distill": {"mode": "task_agnostic"}}))
    _check(_recipe(ensemble=[{}]))  # a second seed is a valid ensemble


# ---------------------------------------------------------------------------------------------------
# averaged outputs


def test_a_classifier_ensemble_averages_logits_and_has_no_outputs_its_members_lack():
    torch.manual_seed(0)
    members = [create_teacher("timm:resnet10t", "none", 64, 5, AdapterConfig(name="full")).eval() for _ in range(3)]
    ens = TeacherEnsemble(members).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        outs = [m(x) for m in members]
        assert not torch.allclose(outs[0], outs[1])
        assert torch.allclose(ens(x), sum(outs) / 3, atol=1e-6)
    # distillation asks getattr(teacher, "forward_logits", teacher): a classifier's answer is the ensemble itself
    assert getattr(ens, "forward_logits", None) is None and not hasattr(ens, "forward_levels")
    assert ens.backbone is members[0].backbone
    with pytest.raises(ValueError, match="two members"):
        TeacherEnsemble(members[:1])


def test_a_detector_ensemble_averages_levels_decodes_and_flip_averages_on_top(tmp_path):
    a, b = _det(0), _det(1)
    ens = TeacherEnsemble([a, b]).eval()
    x = torch.randn(2, 3, *HW)
    with torch.no_grad():
        la, lb, le = a.forward_levels(x), b.forward_levels(x), ens.forward_levels(x)
        for key in le:
            for u, v, w in zip(la[key], lb[key], le[key]):
                assert not torch.allclose(u, v)
                assert torch.allclose(w, (u + v) / 2, atol=1e-6)
        assert torch.allclose(ens.forward_dense(x), a.dense_rows(le))
        assert len(ens.decode(le)) == 2 and ens.strides == a.strides
        assert torch.allclose(copy.deepcopy(ens).forward_dense(x), ens.forward_dense(x))  # a copy is whole
        flipped = FlipAveraged(ens).forward_dense(x)
        assert flipped.shape == a.forward_dense(x).shape and not torch.allclose(flipped, ens.forward_dense(x))

        specs = [detection_teacher_spec("timm:resnet10t", list(HW), ["a", "b", "c"], AdapterConfig(name="full"),
                                        m.backbone.preprocess, neck_channels=16, head_convs=1) for m in (a, b)]
        save_model(tmp_path / "model", ens, ensemble_spec(specs))
        back = load_model(tmp_path / "model")
        assert isinstance(back, TeacherEnsemble)
        assert torch.allclose(back.forward_dense(x), ens.forward_dense(x), atol=1e-6)
    spec = json.loads((tmp_path / "model" / "spec.json").read_text())
    assert spec["preprocess"] == specs[0]["preprocess"] and spec["classes"] == ["a", "b", "c"]


# ---------------------------------------------------------------------------------------------------
# the stage, and distillation from the ensemble


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("ens")
    paths = generate_detection_task(root / "task", classes=3, labeled_per_class=2, val_per_class=1,
                                    test_per_class=1, pool_size=8, distractor_size=2, image_size=64, seed=0)
    data = {"task": "detection", "train": paths["train"], "val": paths["val"], "test": paths["test"],
            "pools": paths["pools"]}
    recipe = recipe_from_dict({
        "seed": 0, "data": data,
        "teacher": {"name": "timm:resnet10t", "weights": "none", "image_size": list(HW), "epochs": 1,
                    "batch_size": 4, "ensemble": [{"augment": "strong"}]},
        "curate": {"strategy": "random", "budget": 6, "batch_size": 8},
        "student": {"name": "fastvit_t8", "image_size": list(HW)},
        "distill": {"epochs": 1, "batch_size": 4, "views": 1, "teacher_batch_size": 8, "detection_targets": "dense"}})
    prepare = StageOutput("data.prepare", "k", root / "prepare",
                          PrepareData().run(StageContext(recipe=recipe, workdir=root / "prepare", inputs={}, log=LOG)))
    return {"root": root, "recipe": recipe, "prepare": prepare}


def test_the_stage_trains_each_member_saves_the_mean_and_resumes_a_finished_member(task, caplog):
    r, root = task["recipe"], task["root"]
    workdir = root / "teacher"
    workdir.mkdir()
    ctx = StageContext(recipe=r, workdir=workdir, inputs={"data.prepare": task["prepare"]}, log=LOG)
    result = TeacherFinetune().run(ctx)
    members = result["members"]
    assert [m["seed"] for m in members] == [0, 1] and "augment: strong" in members[1]["teacher"]
    assert {"test_map50", "val_map50"} <= set(members[0]["metrics"]) and "test_map50" in result["metrics"]
    for i in (0, 1):  # each member is saved as a teacher of its own
        assert (workdir / "members" / str(i) / "model" / "spec.json").is_file()
    ens = load_model(workdir / "model")
    m0, m1 = (load_model(workdir / "members" / str(i) / "model") for i in (0, 1))
    x = torch.randn(1, 3, *HW)
    with torch.no_grad():
        d0, d1 = m0.forward_dense(x), m1.forward_dense(x)
        assert not torch.allclose(d0, d1)  # two trainings, two teachers
        assert torch.allclose(ens.forward_dense(x), (d0 + d1) / 2, atol=1e-5)

    section = TeacherFinetune().report(StageOutput("teacher.finetune", "k", workdir, result),
                                       ReportContext(recipe=r, inputs={}))
    assert "an ensemble of 2" in section.summary[0] and "augment: strong" in section.summary[0]

    # a build killed after member 0: member 0 is read back, not trained again
    before = (workdir / "members" / "0" / "model" / "weights.safetensors").read_bytes()
    (workdir / "members" / "1" / "result.json").unlink()
    with caplog.at_level(logging.INFO, logger="test"):
        TeacherFinetune().run(ctx)
    assert "teacher member 1 of 2 (the recipe's teacher (seed 0)): trained before, reused" in caplog.text
    assert "teacher member 2 of 2: augment: strong, seed 1" in caplog.text
    assert (workdir / "members" / "0" / "model" / "weights.safetensors").read_bytes() == before
    task["teacher"] = StageOutput("teacher.finetune", "k", workdir, result)


def test_distillation_caches_the_ensembles_averaged_targets(task):
    from vfm_toolchain.data import Preprocess
    from vfm_toolchain.students.detection import build_student_detector
    from vfm_toolchain.students.detection_distill import DenseDetection
    from vfm_toolchain.students.distill import StudentDistill, TransferViews
    from vfm_toolchain.teachers.curate import TeacherCurate, transfer_paths

    if "teacher" not in task:
        pytest.skip("needs the ensemble teacher the stage test trains (run the module, not this test alone)")
    r, root = task["recipe"], task["root"]
    inputs = {"data.prepare": task["prepare"], "teacher.finetune": task["teacher"]}
    curate = StageOutput("teacher.curate", "k", root / "curate",
                         TeacherCurate().run(StageContext(recipe=r, workdir=root / "curate", inputs=inputs, log=LOG)))
    workdir = root / "distill"
    workdir.mkdir()
    StudentDistill().run(StageContext(recipe=r, workdir=workdir, inputs={**inputs, "teacher.curate": curate},
                                      log=LOG))
    ens = load_model(task["teacher"].path("model"))
    first = load_model(task["teacher"].dir / "members" / "0" / "model")
    views = TransferViews(transfer_paths(curate, task["prepare"]), 1, 0, ens.backbone.preprocess, Preprocess(HW))
    objective = DenseDetection(build_student_detector("fastvit_t8", 3), HW)
    x = views.teacher_input(2, 0)[None]
    with torch.no_grad():
        mean = objective.target(ens.forward_dense(x))[0].float().numpy()
        alone = objective.target(first.forward_dense(x))[0].float().numpy()
    row = np.asarray(np.load(workdir / "teacher_targets.npy", mmap_mode="r")[2, 0], dtype=np.float32)
    assert np.abs(mean - alone).max() > 1e-2  # the second member changed the targets, so the check can fail
    assert np.allclose(row, mean, atol=2e-3, rtol=2e-3)


def test_a_build_reuses_the_stores_teacher_as_a_member_instead_of_training_it(task, tmp_path, caplog):
    """Through the runner: a build of the teacher alone, then the recipe with teacher.ensemble in the same store.
    The first member is the teacher the store holds (same key), copied and not trained; the second is trained."""
    from vfm_toolchain.runner import build

    r = task["recipe"]
    alone = r.model_copy(update={"teacher": r.teacher.model_copy(update={"ensemble": []})})
    store = tmp_path / "store"
    only = ["data.prepare", "teacher.finetune"]
    first = build(alone, tmp_path / "alone", store, only=only)
    key = next(s["key"] for s in first["stages"] if s["name"] == "teacher.finetune")
    with caplog.at_level(logging.INFO):
        record = build(r, tmp_path / "ensemble", store, only=only)
    entry = next(s for s in record["stages"] if s["name"] == "teacher.finetune")
    assert entry["status"] == "ran" and entry["key"] != key
    assert f"teacher member 1 of 2 (the recipe's teacher (seed 0)): the store's teacher {key}, reused" in caplog.text
    assert "teacher member 2 of 2: augment: strong, seed 1" in caplog.text
    folder = next((store / "teacher.finetune").glob(f"{entry['key']}*/"))
    result = json.loads((folder / "result.json").read_text())
    assert [m["reused"] for m in result["members"]] == [key, None]
    own = next((store / "teacher.finetune").glob(f"{key}*/"))
    assert (folder / "members/0/model/weights.safetensors").read_bytes() == \
        (own / "model/weights.safetensors").read_bytes()
