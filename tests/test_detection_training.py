"""The training side of detection: fit_detector, the teacher.finetune, student.finetune and student.baseline
stages for data.task detection, and the input-size rules checked before the first stage.

Tiny: the procedural detection task at 64 px, a ResNet-10t teacher and a FastViT-T8 student from random
weights, one or two epochs each; what is checked is that every path does its real work and records what it
should, not that a detector gets good in seconds (the loss test trains one image set long enough to see it fall).
"""
from __future__ import annotations

import json
import logging
import math
import subprocess
import sys

import pytest
import torch

from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.prepare import PrepareData, load_index
from vfm_toolchain.recipe import FinetuneConfig, recipe_from_dict
from vfm_toolchain.stage import STAGES, ReportContext, StageContext, StageOutput
from vfm_toolchain.training import evaluate, fit_detector, metric_name

LOG = logging.getLogger("test")
TEACHER = {"name": "timm:resnet10t", "weights": "none", "image_size": [64, 96], "adapter": {"name": "full"},
           "epochs": 2, "batch_size": 4, "lr": 2e-3, "lp_ft": True, "probe_epochs": 1}
STUDENT = {"name": "fastvit_t8", "image_size": [64, 128]}


def _recipe(**sections):
    raw = {"name": "det", "seed": 0,
           "data": {"source": "synthetic", "task": "detection",
                    "synthetic": {"classes": 2, "labeled_per_class": 4, "val_per_class": 2, "test_per_class": 2,
                                  "pool_size": 4, "distractor_size": 0, "image_size": 64}},
           "teacher": TEACHER, "student": STUDENT,
           "finetune": {"epochs": 1, "batch_size": 4, "lr": 1e-3}, "baseline": {"epochs": 1}}
    raw.update(sections)
    return recipe_from_dict(raw)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """data.prepare of the procedural detection task: (its stage output, the loaded index)."""
    workdir = tmp_path_factory.mktemp("det_prepare")
    result = PrepareData().run(StageContext(recipe=_recipe(), workdir=workdir, inputs={}, log=LOG))
    out = StageOutput("data.prepare", "k", workdir, result)
    return out, load_index(out)


def test_detection_is_taken_by_the_training_stages_and_its_metric_is_map50():
    from vfm_toolchain.plugins import load_plugins

    load_plugins()  # every area's stages registered
    assert metric_name("detection") == "map50"
    assert metric_name("segmentation") == "miou" and metric_name("classification") == "top1"
    for name in ("teacher.finetune", "student.finetune", "student.baseline"):
        takes = STAGES.get(name).tasks
        assert takes is None or "detection" in takes  # None: every registered task


def test_fit_detector_lowers_the_loss_and_reports_val_map50(prepared, tmp_path):
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.recipe import AdapterConfig
    from vfm_toolchain.teachers.detection import create_detection_teacher

    _, index = prepared
    torch.manual_seed(0)
    # a narrow neck and one conv per tower: the loop is what is tested, in seconds
    model = create_detection_teacher("timm:resnet10t", "none", (64, 96), 2, AdapterConfig(name="full"),
                                     neck_channels=32, head_convs=1)
    pp = Preprocess((64, 96))
    cfg = FinetuneConfig(epochs=10, lr=5e-3, batch_size=3, weight_decay=0.0)
    history = fit_detector(model, [{"params": list(model.parameters()), "lr": cfg.lr}], index["train"], pp, cfg,
                           tmp_path / "state.pt", LOG, 0, "det", val_records=index["val"], classes=index["classes"])
    losses = [row["loss"] for row in history]
    assert len(history) == 10 and sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    # val scores at fit_classifier's cadence: every other epoch of 10
    assert [("val_map50" in row and "val_map" in row) for row in history] == [False, True] * 5
    assert 0 <= history[-1]["val_map50"] <= 1 and history[-1]["val_map"] <= history[-1]["val_map50"]
    # the same number through the generic evaluate, by class names or by class count
    assert evaluate(model, index["val"], pp, "detection", classes=index["classes"]) == \
        pytest.approx(history[-1]["val_map50"])
    assert evaluate(model, index["val"], pp, "detection", 2) == pytest.approx(history[-1]["val_map50"])
    with pytest.raises(ValueError, match="need the classes"):
        evaluate(model, index["val"], pp, "detection")
    with pytest.raises(ToolchainError, match="3 class names .* for a detector of 2 classes"):
        fit_detector(model, [{"params": list(model.parameters()), "lr": cfg.lr}], index["train"], pp, cfg,
                     tmp_path / "other.pt", LOG, 0, "det", classes=["a", "b", "c"])


def test_teacher_stage_trains_a_detector_that_loads_in_a_fresh_process(prepared, tmp_path):
    from vfm_toolchain.teachers.finetune import TeacherFinetune

    prep, index = prepared
    recipe = _recipe()
    workdir = tmp_path / "teacher"
    result = TeacherFinetune().run(StageContext(recipe=recipe, workdir=workdir, inputs={"data.prepare": prep},
                                                log=LOG))
    assert result["task"] == "detection" and result["adapter"] == "full"
    m = result["metrics"]
    assert next(k for k in m if k.startswith("test_")) == "test_map50"  # the main metric first (toolchain study)
    for split in ("val", "test"):
        assert 0 <= m[f"{split}_map"] <= m[f"{split}_map50"] <= 1
        assert set(m[f"{split}_per_class_ap"]) == set(index["classes"])
    lp = result["lp_ft"]  # the probe trained neck and head on the frozen backbone; the better on val was kept
    assert lp["probe"] == {"epochs": 1} and lp["kept"] in ("probe", "finetuned")
    assert {"probe_val_map50", "finetuned_val_map50"} <= set(lp)
    assert len(result["history"]) == 2 and "val_map50" in result["history"][-1]
    spec = json.loads((workdir / "model" / "spec.json").read_text())
    assert spec["family"] == "detection_teacher" and spec["classes"] == index["classes"]

    # the report: mAP50 in the accuracy table, mAP and per-class AP in its own section and in build.json
    out = StageOutput("teacher.finetune", "k", workdir, json.loads(json.dumps(result)))
    section = TeacherFinetune().report(out, ReportContext(recipe, {"data.prepare": prep, "teacher.finetune": out}))
    assert section.scores[0].key == "teacher_map50" and section.scores[0].value == m["test_map50"]
    assert section.record["metrics"]["teacher_map"] == m["test_map"]
    assert set(section.record["per_class_ap"]["teacher"]) == set(index["classes"])
    assert "| test |" in "\n".join(section.lines) and "mAP@[.5:.95]" in section.lines[0]

    # a build whose teacher.finetune is cached never imports the code that built it: the family must be known
    code = ("import sys, torch; from vfm_toolchain.plugins import load_plugins; load_plugins(); "
            "from vfm_toolchain.checkpoint import load_model; m = load_model(sys.argv[1]); "
            "out = m.forward_levels(torch.zeros(1, 3, 64, 96)); print(type(m).__name__, len(out['cls']))")
    run = subprocess.run([sys.executable, "-c", code, str(workdir / "model")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["Detector", "3"]


def test_student_finetune_and_baseline_train_the_student_detector(prepared, tmp_path):
    from vfm_toolchain.students.detection import build_student_detector, detection_student_spec
    from vfm_toolchain.students.finetune import StudentBaseline, StudentFinetune
    from vfm_toolchain.students.models import create_student, student_preprocess

    prep, index = prepared
    torch.manual_seed(0)
    # what student.distill hands on: a saved student detector (here untrained)
    distilled = build_student_detector("fastvit_t8", 2)
    save_model(tmp_path / "distill" / "model", distilled,
               detection_student_spec("fastvit_t8", index["classes"], student_preprocess((64, 128))))
    distill_out = StageOutput("student.distill", "k", tmp_path / "distill", {"mode": "task_oriented"})
    recipe = _recipe(finetune={"epochs": 1, "batch_size": 4, "lr_sweep": [1e-4, 3e-3], "head_only": True},
                     baseline={"epochs": 1, "lr": 1e-3})
    inputs = {"data.prepare": prep, "student.distill": distill_out}
    fin = StudentFinetune().run(StageContext(recipe=recipe, workdir=tmp_path / "fin", inputs=inputs, log=LOG))
    assert fin["task"] == "detection" and fin["head_start"] == "distilled" and fin["head_only"]
    assert [r["lr"] for r in fin["sweep"]] == [1e-4, 3e-3]
    assert fin["lr"] == max(fin["sweep"], key=lambda r: r["val_map50"])["lr"]  # kept on val mAP50
    assert fin["metrics"]["val_map50"] == pytest.approx(max(r["val_map50"] for r in fin["sweep"]))
    assert {"test_map50", "test_map", "val_map", "test_per_class_ap"} <= set(fin["metrics"])
    tuned = load_model(tmp_path / "fin" / "model")
    assert json.loads((tmp_path / "fin" / "model" / "spec.json").read_text())["family"] == "detection_student"
    before, after = distilled.state_dict(), tuned.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(not k.startswith("backbone.") for k in changed)  # head-only: the body is untouched

    base = StudentBaseline().run(StageContext(recipe=recipe, workdir=tmp_path / "base", inputs={"data.prepare": prep},
                                              log=LOG))
    assert base["task"] == "detection" and not base["head_only"] and base["sweep"] is None and base["lr"] == 1e-3
    assert 0 <= base["metrics"]["test_map"] <= base["metrics"]["test_map50"] <= 1
    assert type(create_student("fastvit_t8", 2, task="detection")).__name__ == "Detector"

    # the report: both rows in mAP50, and the teacher's help in mAP50 points
    outs = {"data.prepare": prep, "student.finetune": StageOutput("student.finetune", "k", tmp_path / "fin", fin),
            "student.baseline": StageOutput("student.baseline", "k", tmp_path / "base", base)}
    build = ReportContext(recipe, outs)
    fsec = StudentFinetune().report(outs["student.finetune"], build)
    bsec = StudentBaseline().report(outs["student.baseline"], build)
    assert [s.key for s in fsec.scores + bsec.scores] == ["student_distilled_map50", "student_baseline_map50"]
    assert "val mAP50" in fsec.summary[0] and fsec.record["metrics"]["student_distilled_map"] == fin["metrics"]["test_map"]
    if not any(math.isnan(v) for v in (fin["metrics"]["test_map50"], base["metrics"]["test_map50"])):
        assert "test mAP50" in bsec.findings[0] and " points)." in bsec.findings[0]


def test_gramian_heads_and_probe_head_start_are_refused_for_detection():
    from vfm_toolchain.students import _check_task_student

    with pytest.raises(ToolchainError, match="gramian.heads: 0 for data.task detection"):
        _check_task_student(_recipe(student={**STUDENT, "gramian": {"heads": 2}}))
    with pytest.raises(ToolchainError, match="head_start 'probe' fits a linear classifier.*use 'keep' or 'auto'"):
        _check_task_student(_recipe(finetune={"epochs": 1, "head_start": "probe"}))


def test_detection_input_sizes_are_checked_before_the_first_stage():
    from vfm_toolchain.students import _check_task_student
    from vfm_toolchain.teachers import _check_names as check_teacher

    with pytest.raises(ToolchainError, match=r"student.image_size 100 must be a multiple of 32 .*nearest valid: "
                                             r"student.image_size 96 or 128"):
        _recipe(student={**STUDENT, "image_size": 100})
    with pytest.raises(ToolchainError, match=r"teacher.image_size \[64, 100\] must be a multiple of 32 .*"
                                             r"\[64, 96\] or \[64, 128\]"):
        _recipe(teacher={**TEACHER, "image_size": [64, 100]})
    # MobileViT-V2's detector needs 64; FastViT's takes 32
    with pytest.raises(ToolchainError, match=r"student.image_size 96 is not a multiple of 64 .*mobilevitv2_050.*"
                                             r"nearest valid: student.image_size 64 or 128"):
        _check_task_student(_recipe(student={"name": "mobilevitv2_050", "image_size": 96}))
    _check_task_student(_recipe(student={"name": "fastvit_t8", "image_size": 96}, teacher={**TEACHER, "image_size": 96}))
    with pytest.raises(ToolchainError, match=r"2 of the student.name: auto candidates.*mobilevitv2_050, "
                                             r"mobilevitv2_075.*student.candidates without them"):
        _check_task_student(_recipe(student={"name": "auto", "image_size": 96, "budget_ms": 5, "candidates":
                                                  ["fastvit_t8", "mobilevitv2_050", "mobilevitv2_075"]}))
    # the teacher's own size when none is given, and a ViT's patch: DINOv2 (518 px, patch 14) needs 224's
    dino = {**TEACHER, "name": "timm:vit_small_patch14_dinov2", "adapter": {"name": "lora"}, "lp_ft": False}
    with pytest.raises(ToolchainError, match=r"own input size 518 \(teacher.image_size is not set\) is not a "
                                             r"multiple of 224.*patch size 14.*teacher.image_size 448 or 672"):
        check_teacher(_recipe(teacher={**dino, "image_size": None}))
    with pytest.raises(ToolchainError, match=r"teacher.image_size 256 is not a multiple of 224"):
        check_teacher(_recipe(teacher={**dino, "image_size": 256}))
    check_teacher(_recipe(teacher={**dino, "image_size": 224}))
    check_teacher(_recipe())
    # other tasks keep their own rules
    recipe_from_dict({"data": {"source": "synthetic"}, "student": {"name": "mobilevitv2_050", "image_size": 100}})
