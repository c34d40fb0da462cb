"""Students: the transfer objectives, cached vs online teaching, head-only finetuning and the
learning-rate sweep."""
import json

import numpy as np
import pytest
import torch

from students.distill import TransferViews
from students.models import create_student, student_preprocess
from students.objectives import OBJECTIVES, student_map_size
from teachers.backbones import create_backbone
from toolchain.recipe import recipe_from_dict
from toolchain.runner import build

from conftest import tiny_recipe


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One store for the builds here: they share the teacher and the transfer set."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def student():
    torch.manual_seed(0)
    return create_student("mobilevitv2_050", 3)


@pytest.mark.parametrize("name", OBJECTIVES.list())
def test_each_objective_learns_its_target(name, student):
    """A few steps on one fixed batch lower the loss: gradients reach the student and the projections."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, 32)
    s_map = student_map_size(student, 32)
    raw = {"task_oriented": torch.randn(6, 3) * 3, "global_contrastive": torch.randn(6, 40),
           "patch_cosine": torch.randn(6, 40, 3, 3)}[name]
    obj = OBJECTIVES.get(name)(student, temperature=4.0, teacher_dim=raw.shape[1], student_map=s_map)
    target = obj.target(raw)
    if name == "patch_cosine":  # the teacher grid is resized to the student's map and cached in fp16
        assert target.shape == (6, 40, *s_map[1:]) and target.dtype == torch.float16
    opt = torch.optim.Adam(obj.parameters(), lr=3e-3)
    obj.train()
    first = obj(x, target).item()
    for _ in range(15):
        loss = obj(x, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert obj(x, target).item() < first


def test_openclip_style_projection_only_on_the_student(student):
    obj = OBJECTIVES.get("global_contrastive")(student, teacher_dim=24, teacher_projection=False)
    assert isinstance(obj.teacher_proj, torch.nn.Identity) and obj.student_proj.out_features == 24


def test_online_views_are_the_cached_views_a_teacher_would_see(tiny_task):
    from pathlib import Path

    paths = sorted(str(p) for p in Path(tiny_task["pools"][0]).glob("*.png"))[:4]
    tpp, spp = create_backbone("timm:vit_tiny_patch16_224", "none", 32).preprocess, student_preprocess(32)
    online = TransferViews(paths, 2, 0, tpp, spp, online=True)
    online.set_epoch(0)
    xs, xt, i, v = online[1]
    assert v >= 1 and torch.allclose(xt, online.teacher_input(1, v))
    online.set_epoch(1)
    assert online[1][3] != v  # a fresh view each epoch


def test_patch_features_of_each_library():
    for name, side in (("timm:vit_tiny_patch16_224", 4), ("torchvision:mobilenet_v2", 2), ("open_clip:ViT-B-32", 2)):
        b = create_backbone(name, "none", 64)
        grid = b.forward_patches(torch.zeros(1, 3, 64, 64))  # 64 px / patch 16 = 4; stride 32 = 2
        assert grid.ndim == 4 and grid.shape[2] == grid.shape[3] == side


@pytest.mark.parametrize("mode,features,teaching", [("task_agnostic", "global", "cached"),
                                                    ("task_agnostic", "patch", "online"),
                                                    ("task_oriented", "global", "online")])
def test_transfer_modes_build(tiny_task, tmp_path, shared_store, mode, features, teaching):
    raw = tiny_recipe(tiny_task, **{"distill.mode": mode, "distill.features": features,
                                    "distill.teacher_outputs": teaching, "export.formats": [], "bench.runtimes": []})
    build(recipe_from_dict(raw), tmp_path / "o", shared_store, only=["student.finetune"])
    res = json.loads((tmp_path / "o" / "stages" / "student.distill" / "result.json").read_text())
    expected = {"task_oriented": "task_oriented", "global": "global_contrastive", "patch": "patch_cosine"}
    assert res["objective"] == expected[mode if mode == "task_oriented" else features]
    assert res["teacher_outputs"].startswith(teaching)
    assert (res["metrics"]["test_top1"] is None) == (mode == "task_agnostic")  # no trained head yet
    fin = json.loads((tmp_path / "o" / "stages" / "student.finetune" / "result.json").read_text())
    assert 0 <= fin["metrics"]["test_top1"] <= 1
    # feature distillation leaves the head untrained: the finetune starts from a linear probe
    assert fin["head_start"] == ("probe" if mode == "task_agnostic" else "distilled")
    assert (fin["probe"] is not None) == (mode == "task_agnostic")


def test_linear_probe_fits_the_classifier_on_the_frozen_features(tiny_task):
    """The probe is fitted on standardised features and folded back into the Linear: the model's own
    predictions reach the probe's train accuracy, the body is untouched, and they beat the random head."""
    from toolchain.data import scan_image_folder
    from students.probe import _L2_GRID, classifier_inputs, linear_probe

    torch.manual_seed(0)
    model = create_student("mobilevitv2_050", 3)
    pp = student_preprocess(32)
    train = scan_image_folder(tiny_task["train"], "train").samples
    body = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("head")}
    x, y = classifier_inputs(model, train, pp)
    before = float((model.get_classifier()(x).argmax(1) == y).float().mean())
    res = linear_probe(model, train, scan_image_folder(tiny_task["val"], "val").samples, pp, 3)
    after = float((model.get_classifier()(x).argmax(1) == y).float().mean())
    assert after == pytest.approx(res["train_top1"]) and after > before and res["l2"] in _L2_GRID
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in body.items())


def test_head_only_finetune_and_lr_sweep_keep_the_best_on_val(tiny_task, tmp_path, shared_store):
    from toolchain.checkpoint import load_model

    raw = tiny_recipe(tiny_task, **{"finetune.head_only": True, "finetune.lr_sweep": [1e-4, 3e-2],
                                    "finetune.epochs": 2, "export.formats": [], "bench.runtimes": []})
    build(recipe_from_dict(raw), tmp_path / "o", shared_store, only=["student.finetune"])
    stages = tmp_path / "o" / "stages"
    res = json.loads((stages / "student.finetune" / "result.json").read_text())
    assert [r["lr"] for r in res["sweep"]] == [1e-4, 3e-2] and res["head_only"]
    assert res["lr"] == max(res["sweep"], key=lambda r: r["val_top1"])["lr"]
    assert res["metrics"]["val_top1"] == max(r["val_top1"] for r in res["sweep"])
    distilled, tuned = load_model(stages / "student.distill" / "model"), load_model(stages / "student.finetune" / "model")
    head = tuned.default_cfg.get("classifier", "head")
    changed = {k for k, v in tuned.state_dict().items() if not torch.equal(v, distilled.state_dict()[k])}
    assert changed and all(k.startswith(head) for k in changed)  # body (BatchNorm statistics too) untouched


def test_training_stages_under_torchrun_with_two_gloo_processes(tiny_task, tmp_path):
    """teacher finetune, curation, distillation and finetune as DDP over 2 CPU processes: the build
    finishes, rank 0 alone writes the outputs, and every stage says it ran on 2 processes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    raw = tiny_recipe(tiny_task, **{"export.formats": [], "bench.runtimes": [], "teacher.epochs": 1,
                                    "distill.epochs": 1})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "toolchain.cli", "build", str(tmp_path / "r.yaml"), "--only", "student.finetune", "--out",
           str(tmp_path / "o"), "--store", str(tmp_path / "s")]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    for stage in ("teacher.finetune", "teacher.curate", "student.distill", "student.finetune"):
        done = json.loads((tmp_path / "o" / "stages" / stage / "DONE").read_text())
        assert done["world"] == 2
        assert json.loads((tmp_path / "o" / "stages" / stage / "result.json").read_text())  # rank 0's result
