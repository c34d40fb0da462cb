"""``toolchain init`` (toolchain/init.py) on small folders of every layout, on broken ones, and a build from a recipe
it wrote."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import THREADS, stage_statuses
from vfm_toolchain import api
from vfm_toolchain.cli import app
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.init import input_size, survey
from vfm_toolchain.plugins import load_plugins
from vfm_toolchain.recipe import SyntheticData, load_recipe
from vfm_toolchain.tasks import TASKS

REPO = Path(__file__).resolve().parents[1]
SMALL = SyntheticData(classes=3, labeled_per_class=6, val_per_class=3, test_per_class=4, pool_size=12,
                      distractor_size=0, image_size=32)


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    """No hub round trip per test: the teacher init picks here is the packaged MobileNetV2."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Each task's generated data written as a person's folder: train/, val/, test/ and pool/."""
    load_plugins()
    root = tmp_path_factory.mktemp("layouts")
    return {name: (TASKS.get(name)().generate(root / name, SMALL), root / name) for name in TASKS.list()}


def test_every_starter_is_its_shipped_recipe():
    """init starts from each task's shipped real-data recipe: the values it copies are that recipe's."""
    load_plugins()
    for name in TASKS.list():
        st = TASKS.get(name).starter
        shipped = yaml.safe_load((REPO / "recipes" / st["recipe"]).read_text())
        assert shipped["data"].get("task", "classification") == name, st["recipe"]
        for section in ("teacher", "student", "distill", "finetune", "baseline", "export"):
            for key, value in st.get(section, {}).items():
                assert shipped[section][key] == value, f"{st['recipe']} {section}.{key}"


@pytest.mark.parametrize("task", ["classification", "segmentation", "detection", "multilabel"])
def test_init_reads_each_layout_and_writes_a_recipe_that_loads(folders, task, tmp_path):
    generated, root = folders[task]
    result = api.init(root, out=tmp_path / "mine.yaml", target="cpu")
    assert result.task == task and result.splits is None
    recipe = load_recipe(result.recipe)
    assert recipe.data.task == task and recipe.target == "cpu"
    assert Path(recipe.data.train) == Path(generated["train"]).resolve()
    assert Path(recipe.data.test) == Path(generated["test"]).resolve()
    assert [Path(p) for p in recipe.data.pools] == [(root / "pool").resolve()]
    assert "onnx" in recipe.export.formats
    assert len(result.text.splitlines()) <= 32
    assert any(f"classes ({len(generated['classes'])})" in line for line in result.found)
    assert any("12 unlabeled" in line for line in result.found)


def test_a_coco_folder_is_detection_unless_tags_are_asked_for(folders, tmp_path):
    _, root = folders["detection"]
    assert survey(root).task == "detection"
    assert survey(root, task="multilabel").task == "multilabel"
    with pytest.raises(ToolchainError, match="not in the segmentation layout"):
        survey(root, task="segmentation")


def test_a_folder_without_splits_gets_a_proposed_test_split(folders, tmp_path):
    """One labeled ImageFolder: init links a fifth of each class into test, and names the source as a data root
    so the build accepts the links."""
    generated, _ = folders["classification"]
    result = api.init(generated["train"], out=tmp_path / "flat.yaml")
    split = tmp_path / "flat-splits"
    assert result.splits == split.resolve()
    test = sorted(p.relative_to(split / "test").as_posix() for p in (split / "test").rglob("*.png"))
    train = sorted(p.relative_to(split / "train").as_posix() for p in (split / "train").rglob("*.png"))
    assert len(test) == 3 and {t.split("/")[0] for t in test} == {"circle", "square", "triangle"}
    assert len(train) == 15 and not set(test) & set(train)
    assert all((split / "test" / t).is_symlink() for t in test)
    recipe = load_recipe(result.recipe)
    assert [Path(r) for r in recipe.data.roots] == [Path(generated["train"]).resolve()]
    assert any("no unlabeled images" in p["what"] for p in result.problems)


def test_a_yolo_folder_is_read(folders, tmp_path):
    """The COCO task rewritten as YOLO txt (labels/<name>.txt, classes.txt): the same images and classes."""
    generated, _ = folders["detection"]
    root = tmp_path / "yolo"
    for split in ("train", "val", "test"):
        coco = json.loads((Path(generated[split]) / "annotations.json").read_text())
        (root / split / "labels").mkdir(parents=True)
        shutil.copytree(Path(generated[split]) / "images", root / split / "images")
        names = [c["name"] for c in coco["categories"]]
        (root / split / "classes.txt").write_text("\n".join(names) + "\n")
        for im in coco["images"]:
            rows = [a for a in coco["annotations"] if a["image_id"] == im["id"]]
            lines = [f"{a['category_id'] - 1} {(a['bbox'][0] + a['bbox'][2] / 2) / im['width']:.6f} "
                     f"{(a['bbox'][1] + a['bbox'][3] / 2) / im['height']:.6f} {a['bbox'][2] / im['width']:.6f} "
                     f"{a['bbox'][3] / im['height']:.6f}" for a in rows]
            (root / split / "labels" / f"{Path(im['file_name']).stem}.txt").write_text("\n".join(lines))
    shutil.copytree(Path(generated["pools"][0]), root / "unlabeled")
    found = survey(root)
    assert (found.task, found.layout) == ("detection", "YOLO txt")
    assert found.images["train"] == survey(Path(generated["train"]).parent).images["train"]


def test_each_problem_is_named_once_with_its_fix(folders, tmp_path):
    """A class with two images, an unreadable image and a mask with an id that names no class."""
    generated, _ = folders["classification"]
    root = tmp_path / "few"
    for split in ("train", "val", "test"):
        shutil.copytree(generated[split], root / split)
    shutil.copytree(generated["pools"][0], root / "unlabeled")
    for extra in sorted((root / "train" / "square").iterdir())[2:]:
        extra.unlink()
    (root / "train" / "circle" / "broken.png").write_bytes(b"not an image")
    found = survey(root)
    lines = [p.what for p in found.problems]
    assert sum("'square' has 2 labeled images" in w for w in lines) == 1, lines
    assert sum("cannot be used" in w and "broken.png" in w for w in lines) == 1, lines
    assert len(lines) == 2, lines
    assert all(p.fix for p in found.problems)

    seg, _ = folders["segmentation"]
    root = tmp_path / "seg"
    for split in ("train", "val", "test"):
        shutil.copytree(seg[split], root / split)
    mask = sorted((root / "train" / "masks").iterdir())[0]
    Image.fromarray(np.full((32, 32), 9, np.uint8)).save(mask)  # 4 classes: ids 0..3
    found = survey(root)
    bad = [p.what for p in found.problems if "cannot be used" in p.what]
    assert len(bad) == 1 and "class id 9" in bad[0] and "4 classes" in bad[0], found.problems


def test_a_folder_of_nothing_and_an_existing_recipe_are_refused(tmp_path, folders):
    (tmp_path / "empty" / "stuff").mkdir(parents=True)
    with pytest.raises(ToolchainError, match="holds no layout a task reads"):
        survey(tmp_path / "empty")
    with pytest.raises(ToolchainError, match="is not a folder"):
        survey(tmp_path / "missing")
    (tmp_path / "taken.yaml").write_text("name: mine\n")
    with pytest.raises(ToolchainError, match="does not overwrite"):
        api.init(folders["classification"][1], out=tmp_path / "taken.yaml")
    assert (tmp_path / "taken.yaml").read_text() == "name: mine\n"
    with pytest.raises(ToolchainError, match="unknown target 'phone'"):
        api.init(folders["classification"][1], out=tmp_path / "new.yaml", target="phone")


def test_input_sizes_follow_the_images():
    assert input_size((32, 32), 224) == 64  # never below 64
    assert input_size((500, 480), 224) == 224
    assert input_size((320, 240), 256) == [192, 256]  # height, width at the photos' 4:3
    assert input_size((480, 640), 320) == [320, 256]


def test_targets_choose_formats():
    cpu, _ = api.target_formats("cpu")
    assert cpu[0] == "onnx" and "onnx_int8" in cpu
    nvidia, left_out = api.target_formats("nvidia")
    assert nvidia.index("onnx") < min(nvidia.index(f) for f in nvidia if f != "onnx")
    assert all(why for _, why in left_out)


def test_the_command_prints_what_it_found(folders, tmp_path):
    _, root = folders["multilabel"]
    res = CliRunner().invoke(app, ["init", str(root), "--out", str(tmp_path / "tags.yaml"), "--target", "x86"])
    assert res.exit_code == 0, res.output
    assert "task: multilabel" in res.output and "next: toolchain build" in res.output
    res = CliRunner().invoke(app, ["init", str(tmp_path / "nowhere")])
    assert res.exit_code != 0 and "is not a folder" in res.output


@pytest.mark.parametrize("teacher, size", [(None, 64), ("timm:vit_small_patch14_dinov2.lvd142m", 224)])
def test_a_detection_recipe_puts_teacher_and_student_at_one_size(folders, teacher, size, tmp_path):
    """Detection distils per grid location, so init writes one input for both, a multiple of 32 and of a ViT's
    patch (DINOv2's 14: 224), which the recipe's checks then accept."""
    from vfm_toolchain.stage import RECIPE_CHECKS

    _, root = folders["detection"]
    recipe = load_recipe(api.init(root, out=tmp_path / "mine.yaml", teacher=teacher).recipe)
    assert recipe.teacher.image_size == recipe.student.image_size == size
    for check in RECIPE_CHECKS:
        check(recipe)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["classification", "detection"])
def test_a_recipe_init_wrote_builds(folders, task, tmp_path):
    """The recipe as written, with only its schedules shortened for the test, builds end to end (detection: with the
    BatchNorm head, which distillation, finetuning and the export's fold must all build alike)."""
    _, root = folders[task]
    result = api.init(root, out=tmp_path / "mine.yaml")
    short = {"threads": THREADS, "teacher.epochs": 1, "distill.epochs": 1, "finetune.epochs": 1,
             "baseline.epochs": 1, "bench.iters": 2, "bench.warmup": 1, "bench.memory": False,
             **({"student.head_norm": "batch"} if task == "detection" else {})}
    built = api.build(result.recipe, overrides=short, out=tmp_path / "run")
    statuses = stage_statuses(json.loads((tmp_path / "run" / "build.json").read_text()))
    assert set(statuses.values()) == {"ran"}, statuses
    assert built.artifact("student", "onnx").path.is_file()
