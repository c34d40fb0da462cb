"""Students: the transfer objectives, cached vs online teaching, head-only finetuning and the
learning-rate sweep."""
import json

import pytest
import torch

from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.students.distill import TransferViews
from vfm_toolchain.students.models import create_student, student_preprocess
from vfm_toolchain.students.objectives import OBJECTIVES, student_map_size
from vfm_toolchain.teachers.backbones import create_backbone

from conftest import curate_manifest, tiny_recipe


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory):
    """One store for the builds here: they share the teacher and the transfer set."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def student():
    torch.manual_seed(0)
    return create_student("mobilevitv2_050", 3)


# detection's objectives take a detector (tests/test_detection_distill.py runs them)
@pytest.mark.parametrize("name", [n for n in OBJECTIVES.list() if OBJECTIVES.meta(n).get("task") != "detection"])
def test_each_objective_learns_its_target(name, student):
    """A few steps on one fixed batch lower the loss: gradients reach the student and the projections."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 32, 32)
    s_map = student_map_size(student, (32, 32))
    features = {"global_contrastive": torch.randn(6, 40), "global_regression": torch.randn(6, 40),
                "patch_regression": torch.randn(6, 40, 3, 3)}
    raw = features.get(name, torch.randn(6, 3) * 3)  # the others read a finetuned teacher's logits
    assert name in features or OBJECTIVES.meta(name)["teacher"] == "finetuned"
    obj = OBJECTIVES.get(name)(student, temperature=4.0, teacher_dim=raw.shape[1], student_map=s_map)
    target = obj.target(raw)
    assert target.dtype == torch.float16  # every cached target is half precision
    if name == "patch_regression":  # the teacher grid is resized to the student's map
        assert target.shape == (6, 40, *s_map[1:])
    opt = torch.optim.Adam(obj.parameters(), lr=3e-3)
    obj.train()
    first = obj(x, target).item()
    for _ in range(15):
        loss = obj(x, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert obj(x, target).item() < first


def test_contrastive_memory_adds_negatives_but_never_the_same_image(student):
    """Earlier batches' teacher features become negatives; entries of images in the batch are left out, so
    a batch whose images are all in memory scores as if the memory were empty."""
    torch.manual_seed(0)
    obj = OBJECTIVES.get("global_contrastive")(student, teacher_dim=16, negatives=8).eval()
    plain = OBJECTIVES.get("global_contrastive")(student, teacher_dim=16, negatives=0).eval()
    plain.load_state_dict({k: v for k, v in obj.state_dict().items() if not k.startswith("memory")}, strict=False)
    x, t = torch.randn(4, 3, 32, 32), torch.randn(4, 16).half()
    with torch.no_grad():
        assert torch.allclose(obj(x, t, torch.arange(4)), plain(x, t, torch.arange(4)))  # memory empty
        assert obj.memory_index.tolist()[:4] == [0, 1, 2, 3]
        same = obj(x, t, torch.arange(4))              # the memory holds exactly these images: all masked
        assert torch.allclose(same, plain(x, t, torch.arange(4)))
        other = obj(x, t, torch.arange(4) + 10)        # the same features under other indices: negatives now
        assert other > plain(x, t, torch.arange(4)) + 1e-3
    assert obj.memory_index.tolist() == [10, 11, 12, 13, 0, 1, 2, 3]  # a ring: the oldest entries go first


def test_student_augmentation_moves_no_pixel_and_replays_per_epoch(tiny_task):
    """Photometric ops only: a pixel-wise constant image stays constant; the draw is fixed by (seed,
    epoch, image), so a resumed epoch sees the same augmented input, and the next epoch another."""
    from pathlib import Path

    from vfm_toolchain.data.augment import photometric_augment

    import pickle

    aug = pickle.loads(pickle.dumps(photometric_augment(ops=3, magnitude=15)))  # as DataLoader workers get it
    flat = torch.full((3, 16, 16), 120, dtype=torch.uint8)
    for seed in range(20):
        torch.manual_seed(seed)
        out = aug(flat)
        assert out.shape == flat.shape and (out == out[:, :1, :1]).all()
    paths = sorted(str(p) for p in Path(tiny_task["pools"][0]).glob("*.png"))[:2]
    spp = student_preprocess(32)
    views = TransferViews(paths, 2, 0, spp, spp, student_augment=photometric_augment(2, 9, 0.5))
    plain = TransferViews(paths, 2, 0, spp, spp)
    drawn = []
    for epoch in (0, 0, 1):
        views.set_epoch(epoch)
        views.choice[:] = 0  # the same cached view every time
        drawn.append(views[0][0])
    plain.choice[:] = 0
    assert torch.equal(drawn[0], drawn[1]) and not torch.equal(drawn[0], drawn[2])
    assert not torch.equal(drawn[0], plain[0][0])


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


@pytest.mark.parametrize("mode,features,loss,teaching,objective", [
    ("task_agnostic", "global", "auto", "cached", "global_contrastive"),
    ("task_agnostic", "global", "smooth_l1", "cached", "global_regression"),
    ("task_agnostic", "patch", "auto", "online", "patch_regression"),
    ("task_oriented", "global", "auto", "online", "task_oriented")])
def test_transfer_modes_build(tiny_task, tmp_path, shared_store, mode, features, loss, teaching, objective):
    raw = tiny_recipe(tiny_task, **{"distill.mode": mode, "distill.features": features, "distill.feature_loss": loss,
                                    "distill.teacher_outputs": teaching, "export.formats": [], "bench.runtimes": []})
    build(recipe_from_dict(raw), tmp_path / "o", shared_store, only=["student.finetune"])
    res = json.loads((tmp_path / "o" / "stages" / "student.distill" / "result.json").read_text())
    assert res["objective"] == objective
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
    from vfm_toolchain.data.images import scan_image_folder
    from vfm_toolchain.probe import _L2_GRID, classifier_inputs, linear_probe

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
    from vfm_toolchain.checkpoint import load_model

    # keep_best off: the finetuned head ships whatever val says, so the test sees what head-only training changed
    raw = tiny_recipe(tiny_task, **{"finetune.head_only": True, "finetune.lr_sweep": [1e-4, 3e-2],
                                    "finetune.keep_best": False,
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
    """teacher finetune, curation, distillation and finetune as DDP over 2 CPU processes: the build finishes, rank
    0 alone writes the outputs, every stage says it ran on 2 processes, and each rank embedded its own shards of
    the pool.  Then the same curation in one process, on the same store (so the same teacher), selects the same
    images: the shard size differs (8 vs 7), which changes the curation key but not what it selects.  One torchrun
    for both checks: each of its three processes starts torch afresh."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    raw = tiny_recipe(tiny_task, **{"export.formats": [], "bench.runtimes": [], "teacher.epochs": 1,
                                    "distill.epochs": 1, "curate.shard_size": 8})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "vfm_toolchain.cli", "build", str(tmp_path / "r.yaml"), "--only", "student.finetune", "--out",
           str(tmp_path / "o"), "--store", str(tmp_path / "s")]
    p = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "o" / "argv.json").read_text())["world"] == 2
    for stage in ("teacher.finetune", "teacher.curate", "student.distill", "student.finetune"):
        done = json.loads((tmp_path / "o" / "stages" / stage / "DONE").read_text())
        assert done["world"] == 2
        assert json.loads((tmp_path / "o" / "stages" / stage / "result.json").read_text())  # rank 0's result
    shards = tmp_path / "o" / "stages" / "teacher.curate" / "pool_embeddings"
    computed = [json.loads((shards / f"rank_{r}.json").read_text())["computed"] for r in (0, 1)]
    assert computed[0] and computed[1] and not set(computed[0]) & set(computed[1])  # each rank its own shards

    torch.set_num_threads(1)  # as each rank: the same sums, so the same near-ties (conftest restores it)
    build(recipe_from_dict({**raw, "curate": {**raw["curate"], "shard_size": 7}}), tmp_path / "one", tmp_path / "s",
          only=["teacher.curate"])
    assert json.loads((tmp_path / "one" / "stages" / "teacher.finetune" / "DONE").read_text())["world"] == 2
    assert curate_manifest(tmp_path / "one") == curate_manifest(tmp_path / "o")
