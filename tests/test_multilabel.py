"""Multi-label classification, the fourth task (toolchain/tasks/multilabel.py and its teacher and student parts): its
data layouts and their refusals, its metric against hand-computed values, its distillation loss, and the quickstart
built end to end through every stage, label-next, pseudo-label and a device bundle's scoring."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.tags import parse_tag_split, read_tag_classes, scan_tag_split
from vfm_toolchain.recipe import load_recipe
from vfm_toolchain.tasks import task_of
from vfm_toolchain.tasks.multilabel import average_precision, choose_thresholds, f1_scores, macro_ap, multi_hot

from conftest import THREADS, stage_statuses

ROOT = Path(__file__).resolve().parents[1]
AQUARIUM = ROOT.parent / "shared" / "data" / "aquarium"


def _split(root: Path, rows: str, images=("a.png", "b.png", "c.png"), classes: str = "") -> Path:
    (root / "images").mkdir(parents=True)
    for name in images:
        Image.new("RGB", (8, 8), (len(name) * 30, 0, 0)).save(root / "images" / name)
    (root / "tags.csv").write_text("image,tags\n" + rows)
    if classes:
        (root / "classes.txt").write_text(classes)
    return root


def test_a_tags_csv_gives_each_image_its_tags_and_train_decides_the_tag_list(tmp_path):
    train = _split(tmp_path / "train", "a.png,cat;dog\nb.png,\nc.png, dog \n")
    assert read_tag_classes(train) == ["cat", "dog"]  # every tag train's csv uses, sorted
    split = parse_tag_split(train, "train")
    assert [(Path(p).name, t) for p, t in split.samples] == [("a.png", [0, 1]), ("b.png", []), ("c.png", [1])]
    listed = _split(tmp_path / "listed", "a.png,cat\n", classes="dog\ncat\nbird\n")
    assert read_tag_classes(listed) == ["dog", "cat", "bird"]  # classes.txt fixes the order and adds tags
    val = _split(tmp_path / "val", "a.png,bird\n")
    with pytest.raises(ToolchainError, match=r"uses tags that train's tag list does not have: 'bird' \(line 2\)"):
        parse_tag_split(val, "val", ["cat", "dog"])


@pytest.mark.parametrize("rows, message", [
    ("a.png,cat\na.png,dog\n", r"names 'a.png' on lines 2 and 3; give each image one row"),
    ("a.png,cat,dog\n", r"line 2 has 3 cells"),
    ("../../outside.png,cat\n", r"names 1 path outside .*line 2: '../../outside.png'.*data.roots"),
])
def test_a_bad_tags_csv_is_refused_with_what_to_change(tmp_path, rows, message):
    with pytest.raises(ToolchainError, match=message):
        parse_tag_split(_split(tmp_path / "train", rows), "train")


def test_a_split_without_its_header_or_files_says_what_a_split_holds(tmp_path):
    bad = _split(tmp_path / "bad", "")
    (bad / "tags.csv").write_text("file,label\na.png,cat\n")
    with pytest.raises(ToolchainError, match=r"must start with the header 'image,tags'"):
        parse_tag_split(bad, "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ToolchainError, match=r"has neither tags.csv nor annotations.json"):
        parse_tag_split(tmp_path / "empty", "train")


def test_a_corrupt_image_is_skipped_and_counted_and_a_missing_one_named(tmp_path):
    train = _split(tmp_path / "train", "a.png,cat\nb.png,dog\nc.png,cat\nd.png,dog\n")
    (train / "images" / "b.png").write_bytes(b"not an image")
    split = scan_tag_split(train, "train")
    assert [Path(p).name for p, _ in split.samples] == ["a.png", "c.png"]
    assert {Path(p).name for p in split.skipped} == {"b.png", "d.png"}
    assert "does not exist" in split.skipped[str(train / "images" / "d.png")]


def test_a_coco_split_is_a_tagging_set_whose_tags_are_the_boxes_classes(tmp_path):
    root = tmp_path / "train"
    (root / "images").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (20, 20)).save(root / "images" / f"{i}.png")
    coco = {"images": [{"id": i, "file_name": f"{i}.png", "width": 20, "height": 20} for i in range(3)],
            "categories": [{"id": 1, "name": "fish"}, {"id": 2, "name": "shark"}],
            "annotations": [{"id": 1, "image_id": 0, "category_id": 2, "bbox": [1, 1, 5, 5]},
                            {"id": 2, "image_id": 0, "category_id": 2, "bbox": [8, 8, 5, 5]},
                            {"id": 3, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}]}
    (root / "annotations.json").write_text(json.dumps(coco))
    split = scan_tag_split(root, "train")
    assert split.classes == ["fish", "shark"] and split.layout == "coco"
    assert [(Path(p).name, t) for p, t in split.samples] == [("0.png", [1]), ("1.png", [0]), ("2.png", [])]


@pytest.mark.skipif(not AQUARIUM.is_dir(), reason="../shared/data/aquarium is not on this machine")
def test_aquarium_is_a_real_seven_tag_set():
    split = parse_tag_split(AQUARIUM / "train", "train")
    assert len(split.classes) == 7 and len(split.samples) == 81
    assert all(tags for _, tags in split.samples)  # every labeled photo shows an animal
    assert len({t for _, tags in split.samples for t in tags}) == 7


def test_average_precision_is_the_step_wise_definition():
    # positives at ranks 1 and 3 of 4: precision 1/1 and 2/3, each adding half the recall
    assert average_precision(np.array([0.9, 0.8, 0.7, 0.6]), np.array([1, 0, 1, 0])) == pytest.approx(5 / 6)
    # a tie of a positive and a negative at the top counts as one step at precision 1/2
    assert average_precision(np.array([0.5, 0.5]), np.array([1, 0])) == pytest.approx(0.5)
    assert np.isnan(average_precision(np.array([0.3]), np.array([0])))
    probs = np.array([[0.9, 0.1, 0.2], [0.2, 0.8, 0.3]])
    targets = multi_hot([["a", [0]], ["b", [1]]], 3)
    assert macro_ap(probs, targets) == 1.0  # the third tag has no positive: out of the mean


def test_thresholds_are_chosen_on_val_per_tag_and_f1_is_measured_at_them():
    probs = np.array([[0.9, 0.3], [0.35, 0.2], [0.1, 0.1]])
    targets = np.array([[1, 1], [1, 0], [0, 0]], dtype=np.float32)
    chosen = choose_thresholds(probs, targets)
    assert chosen[0] <= 0.35 and 0.2 < chosen[1] <= 0.3  # tag 0 needs both positives; tag 1 just its one
    assert f1_scores(probs, targets, chosen).tolist() == [1.0, 1.0]
    assert f1_scores(probs, targets, [0.95, 0.95]).tolist() == [0.0, 0.0]


def test_tag_distillation_is_least_where_the_student_matches_the_teacher():
    """Each tag's binary cross-entropy against the teacher's probability has its minimum (zero gradient) at the
    teacher's own logits, and pulls a student that differs towards them."""
    from vfm_toolchain.students.objectives import OBJECTIVES

    torch.manual_seed(0)
    student = torch.nn.Linear(4, 3)
    loss = OBJECTIVES.get("tag_distillation")(student, temperature=2.0)
    x = torch.randn(5, 4)
    with torch.no_grad():
        own = student(x)

    def grad(target):
        student.zero_grad()
        loss(x, loss.target(target)).backward()
        return student.bias.grad.clone()

    assert grad(own).abs().max() < 1e-3  # fp16 targets: not exactly zero
    towards = grad(own + 2.0)  # a teacher more sure of every tag: the step raises the student's logits
    assert (towards < -1e-2).all()


def test_the_device_runner_scores_a_tag_slice_as_the_build_does(tmp_path):
    from vfm_toolchain.bench import bundle_runner

    rng = np.random.default_rng(0)
    logits, tags = rng.normal(size=(30, 4)), (rng.random((30, 4)) > 0.6).astype(np.uint8)
    assert bundle_runner.macro_ap(logits, tags) == pytest.approx(macro_ap(1 / (1 + np.exp(-logits)), tags))


TINY = ["data.synthetic.classes=3", "data.synthetic.labeled_per_class=4", "data.synthetic.val_per_class=3",
        "data.synthetic.test_per_class=4", "data.synthetic.pool_size=40", "data.synthetic.distractor_size=8",
        "teacher.name=timm:resnet10t", "teacher.weights=none", "teacher.image_size=64", "teacher.epochs=2",
        "teacher.batch_size=8", "curate.budget=20", f"threads={THREADS}", "student.image_size=64", "distill.epochs=1", "distill.batch_size=8",
        "finetune.epochs=1", "finetune.batch_size=8", "baseline.epochs=1", "export.parity_images=4",
        "bench.iters=2", "bench.warmup=1", "bench.memory=false"]


@pytest.mark.slow
def test_the_multilabel_quickstart_builds_every_stage_then_ranks_and_pseudo_labels_its_pool(tmp_path):
    from vfm_toolchain import api
    from vfm_toolchain.runner import build

    recipe = load_recipe(ROOT / "recipes" / "quickstart_multilabel.yaml",
                         TINY + ["export.formats=[onnx,openvino_int8]"])
    record = build(recipe, tmp_path / "out", tmp_path / "store")
    assert record["status"] == "complete"
    assert set(stage_statuses(record).values()) <= {"ran", "skipped"}
    metrics = record["metrics"]
    for key in ("teacher_macro_map", "student_distilled_macro_map", "student_baseline_macro_map",
                "student_distilled_macro_f1"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    arts = {a["kind"]: a for a in record["artifacts"]}
    assert arts["onnx"]["status"] == "ok" and arts["onnx"]["parity_max_abs_diff"] < 1e-4
    assert arts["openvino_int8"]["metric"] == "macro_map"  # int8: judged by macro mAP against fp32
    assert 0 <= arts["openvino_int8"]["test_score"] <= 1
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| test macro mAP |" in report and "| tag | threshold (chosen on val) | test F1 |" in report
    finetune = json.loads((tmp_path / "out" / "stages" / "student.finetune" / "result.json").read_text())
    assert set(finetune["metrics"]["thresholds"]) == set(finetune["metrics"]["test_f1_per_tag"])

    pool = json.loads((tmp_path / "out" / "stages" / "data.prepare" / "result.json").read_text())["counts"]["pool"]
    chosen = api.label_next(recipe, 4, out=tmp_path / "next", store=tmp_path / "store")
    assert chosen["chosen"] == 4 and chosen["scored"] == pool
    summary = api.pseudo_label(recipe, out=tmp_path / "pseudo", store=tmp_path / "store", threshold=1e-6, copy=True)
    assert summary["kept"] + summary["review"] == pool and summary["kept"] > pool // 2  # nearly every call is kept
    kept = scan_tag_split(tmp_path / "pseudo" / "multilabel", "pseudo-labels")  # the layout the reader takes
    assert len(kept.samples) == summary["kept"] and kept.classes == record_classes(tmp_path)
    config = (tmp_path / "pseudo" / "label_studio" / "config.xml").read_text()
    assert '<Choices name="label" toName="image" choice="multiple">' in config

    # a device bundle's test slice, scored by the runner that runs on the device, agrees with the build
    from vfm_toolchain.bench import bundle_runner
    from vfm_toolchain.export.runtimes import RUNTIMES

    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.prepare import load_index
    from vfm_toolchain.stage import StageOutput

    folder = (tmp_path / "out" / "stages" / "data.prepare").resolve()
    index = load_index(StageOutput("data.prepare", "", folder, json.loads((folder / "result.json").read_text())))
    spec = json.loads((tmp_path / "out" / "stages" / "student.finetune" / "model" / "spec.json").read_text())
    pp = Preprocess.from_dict(spec["preprocess"])
    task_of("multilabel").test_slice(index["test"], pp, 3, tmp_path / "slice.npz")
    run = RUNTIMES.get("onnxruntime")(tmp_path / "out" / "artifacts" / "student" / "model.onnx", 1)
    here = task_of("multilabel").score_artifact(run, index["test"], pp, 3, 8)
    assert bundle_runner.score(run, tmp_path / "slice.npz") == pytest.approx(here, abs=1e-3)


def record_classes(tmp_path):
    return json.loads((tmp_path / "out" / "stages" / "data.prepare" / "result.json").read_text())["classes"]


@pytest.mark.edge
@pytest.mark.slow
def test_the_multilabel_student_exports_to_the_on_device_formats_with_parity(tmp_path):
    from vfm_toolchain.runner import build

    recipe = load_recipe(ROOT / "recipes" / "quickstart_multilabel.yaml",
                         TINY + ["export.formats=[onnx,executorch,tflite,tflite_int8,coreml]"])
    record = build(recipe, tmp_path / "out", tmp_path / "store")
    arts = {a["kind"]: a for a in record["artifacts"]}
    for kind in ("executorch", "tflite"):
        assert arts[kind]["status"] == "ok" and arts[kind]["parity_max_abs_diff"] < 1e-3, arts[kind]
    assert arts["tflite_int8"]["metric"] == "macro_map"
    assert arts["coreml"]["status"] == "ok"  # converted here; its parity needs macOS
