"""Detection end to end: the shipped quickstart recipe, shrunk by overrides to seconds, builds through every stage
(the procedural task, a detection teacher, curation with object crops, dense distillation, finetune, baseline, ONNX
with NMS inside and box-level parity, latency, report), and a cached rebuild runs nothing again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from vfm_toolchain.recipe import load_recipe
from vfm_toolchain.runner import build

from conftest import THREADS, stage_statuses

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TINY = ["data.synthetic.classes=2", "data.synthetic.labeled_per_class=4", "data.synthetic.val_per_class=3",
        "data.synthetic.test_per_class=4", "data.synthetic.pool_size=40", "data.synthetic.distractor_size=8",
        "data.synthetic.image_size=64", "teacher.name=timm:resnet10t", "teacher.weights=none",
        "teacher.image_size=64", "teacher.epochs=2", "teacher.batch_size=8", "curate.budget=20",
        f"threads={THREADS}", "student.image_size=64", "distill.epochs=1", "distill.batch_size=8", "finetune.epochs=1",
        "finetune.batch_size=8", "baseline.epochs=1", "export.parity_images=4", "bench.iters=2", "bench.warmup=1",
        "bench.memory=false"]


def test_the_detection_quickstart_builds_end_to_end_and_caches(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "quickstart_detection.yaml", TINY)
    record = build(recipe, tmp_path / "out", tmp_path / "store")
    assert record["status"] == "complete"
    assert set(stage_statuses(record).values()) <= {"ran", "skipped"}
    metrics = record["metrics"]
    for key in ("teacher_map50", "student_distilled_map50", "student_baseline_map50"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    (onnx,) = [a for a in record["artifacts"] if a["kind"] == "onnx"]
    assert onnx["status"] == "ok" and onnx["parity"] == "detections"
    assert onnx["test_map50"] == pytest.approx(onnx["pytorch_test_map50"], abs=0.003)  # the 0.3 points
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| test mAP50 |" in report and "PyTorch detections matched" in report
    # the sheet: test images with the ground truth and the three detectors' boxes, drawn from the saved models
    assert "## Test images" in report and "![test images with boxes](detections.png)" in report
    assert (tmp_path / "out" / "detections.png").stat().st_size > 10_000
    assert any(r["artifact"] == "student onnx" for r in record["bench"])
    again = build(recipe, tmp_path / "out", tmp_path / "store")
    assert set(stage_statuses(again).values()) <= {"cached", "skipped"}
    assert json.loads((tmp_path / "out" / "build.json").read_text())["metrics"] == metrics
    # after the build, from its store: which pool images to label next (box-level scores), and the teacher's
    # boxes for review, the kept ones a COCO split our reader takes
    from vfm_toolchain import api
    from vfm_toolchain.data.detection import scan_detection_split

    pool = json.loads((tmp_path / "out" / "stages" / "data.prepare" / "result.json").read_text())["counts"]["pool"]
    chosen = api.label_next(recipe, 5, out=tmp_path / "next", store=tmp_path / "store")
    assert chosen["chosen"] == 5 and chosen["scored"] == pool
    summary = api.pseudo_label(recipe, out=tmp_path / "pseudo", store=tmp_path / "store", threshold=0.3)
    assert summary["kept"] + summary["review"] == pool
    if summary["kept"]:
        split = scan_detection_split(tmp_path / "pseudo" / "coco", "pseudo-labels", data_roots=summary["data_roots"])
        assert len(split.records) == summary["kept"] and split.classes == record_classes(tmp_path)


def record_classes(tmp_path):
    return json.loads((tmp_path / "out" / "stages" / "data.prepare" / "result.json").read_text())["classes"]


def test_a_detection_study_reports_map50_per_method_and_refuses_a_method_it_cannot_take(tmp_path):
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.study import run_study

    recipe = load_recipe(ROOT / "recipes" / "quickstart_detection.yaml",
                         TINY + ["study.budgets=[2]", "study.seeds=[0]", "study.methods=[label_only, task_oriented]"])
    got = run_study(recipe, tmp_path / "study", tmp_path / "store")
    assert {r["method"] for r in got["rows"]} == {"label_only", "task_oriented"}
    assert all(r["metric"] == "map50" and 0.0 <= r["test"] <= 1.0 for r in got["rows"])
    assert "mAP50" in (tmp_path / "study" / "study.md").read_text()
    bad = load_recipe(ROOT / "recipes" / "quickstart_detection.yaml",
                      TINY + ["study.budgets=[2]", "study.methods=[label_only, task_agnostic_contrastive]"])
    with pytest.raises(ToolchainError, match="study method task_agnostic_contrastive"):
        run_study(bad, tmp_path / "bad", tmp_path / "store")
    assert not (tmp_path / "bad" / "builds").exists()  # refused before label_only's build


def test_student_auto_times_the_detectors_with_their_nms(tmp_path):
    from vfm_toolchain.bench.select import build_candidate
    from vfm_toolchain.blocks.detection import DetectorWithNMS

    folded, counts = build_candidate("fastvit_t8", 2, "detection", 64, {"score_thresh": 0.0, "iou": 0.5,
                                                                         "max_det": 7})
    assert isinstance(folded, DetectorWithNMS) and counts["macs"] > 0  # what the artifact holds is what is timed
    import torch

    rows = folded(torch.randn(1, 3, 64, 64))
    assert rows.shape == (7, 7)  # (batch, x1, y1, x2, y2, score, class): NMS inside, max_det kept

    candidates = ["fastvit_t8", "mobilevitv2_050"]
    recipe = load_recipe(ROOT / "recipes" / "quickstart_detection.yaml",
                         TINY + ["student.name=auto", f"student.candidates=[{', '.join(candidates)}]",
                                 "student.budget_ms=10000", "student.target=pytorch"])
    record = build(recipe, tmp_path / "out", tmp_path / "store", only=["student.select"])  # the stage takes the task
    assert record["status"] == "complete"
    select = json.loads((tmp_path / "out" / "stages" / "student.select" / "result.json").read_text())
    rows = {c["name"]: c for c in select["candidates"]}
    assert all(rows[n]["status"] == "ok" and rows[n]["p50_ms"] > 0 for n in candidates), rows
    assert select["chosen"] == max(candidates, key=lambda n: rows[n]["macs"])  # the rule: most MACs in budget
