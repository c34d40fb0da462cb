"""``finetune.teacher_weight`` (students/finetune_teacher.py): the finetuned teacher's loss beside the labels while
the distilled student finetunes.  What its loss is, where the teacher's input comes from, which stage keys it enters,
and the wiring of student.finetune on the shared tiny build."""
from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from tests.conftest import tiny_recipe
from tests.hostile import BASE
from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.data import Preprocess
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.recipe import AdapterConfig, recipe_from_dict
from vfm_toolchain.stage import StageContext, StageOutput
from vfm_toolchain.students.finetune import StudentBaseline, StudentFinetune
from vfm_toolchain.students.finetune_teacher import TeacherLoss, teacher_view
from vfm_toolchain.teachers.detection import create_detection_teacher


class _Net(torch.nn.Module):
    """A small classifier with the ``backbone.preprocess`` a TeacherLoss reads."""

    def __init__(self, pp: Preprocess, classes: int = 5):
        super().__init__()
        self.backbone = torch.nn.Module()
        self.backbone.preprocess = pp
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                                        torch.nn.Flatten(), torch.nn.Linear(8, classes))

    def forward(self, x):
        return self.body(x)


def test_the_teachers_view_is_the_same_pixels_in_its_own_normalisation_and_size():
    student = Preprocess((16, 24), mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    teacher = Preprocess((16, 24))  # ImageNet mean / std
    pixels = torch.rand(2, 3, 16, 24)
    norm = lambda p, pp: (p - torch.tensor(pp.mean).view(1, 3, 1, 1)) / torch.tensor(pp.std).view(1, 3, 1, 1)  # noqa
    x = norm(pixels, student)
    assert torch.allclose(teacher_view(x, student, teacher), norm(pixels, teacher), atol=1e-5)
    assert teacher_view(x, student, student) is x  # nothing to do: the batch itself
    assert teacher_view(x, student, Preprocess((32, 48), mean=student.mean, std=student.std)).shape[-2:] == (32, 48)


def test_the_classification_loss_is_zero_for_the_teachers_own_outputs_and_trains_only_the_student():
    torch.manual_seed(0)
    pp = Preprocess(16)
    teacher = _Net(pp)
    loss = TeacherLoss(teacher, "classification", pp, weight=2.0, temperature=4.0)
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        assert loss(x, teacher(x)).item() == pytest.approx(0.0, abs=1e-6)
    student = _Net(pp)
    value = loss(x, student(x))
    assert value.item() > 0
    value.backward()
    assert student.body[-1].weight.grad is not None and student.body[-1].weight.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    half = TeacherLoss(copy.deepcopy(teacher), "classification", pp, weight=1.0, temperature=4.0)
    assert half(x, student(x)).item() == pytest.approx(value.item() / 2, rel=1e-5)  # the weight scales it


def test_the_flip_averaged_teacher_teaches_the_mean_of_the_view_and_its_mirror():
    torch.manual_seed(1)
    pp = Preprocess(16)
    teacher = _Net(pp)
    x = torch.randn(3, 3, 16, 16)
    flipped = TeacherLoss(teacher, "classification", pp, weight=1.0, temperature=1.0, flip=True)
    with torch.no_grad():
        mean = (teacher(x) + teacher(x.flip(-1))) / 2
        assert flipped(x, mean).item() == pytest.approx(0.0, abs=1e-6)
        assert flipped(x, teacher(x)).item() > 1e-6  # the network is not mirror-symmetric itself


def test_the_detection_loss_is_the_dense_loss_against_the_teachers_rows_and_refuses_other_sizes():
    from vfm_toolchain.students.detection_distill import dense_detection_loss, dense_targets

    torch.manual_seed(0)
    hw = (64, 96)
    make = lambda: create_detection_teacher("timm:resnet10t", "none", hw, 3, AdapterConfig(name="full"),  # noqa
                                            neck_channels=16, head_convs=1).eval()
    teacher, student = make(), make()
    pp = teacher.backbone.preprocess
    loss = TeacherLoss(teacher, "detection", pp, weight=1.5, temperature=1.0, flatten=student.flatten,
                       num_classes=3)
    x = torch.randn(2, 3, *hw)
    out = student.forward_levels(x)
    with torch.no_grad():
        expected = dense_detection_loss(student.flatten(out), dense_targets(teacher.forward_dense(x), 3), 3)["total"]
    assert loss(x, out).item() == pytest.approx(1.5 * expected.item(), rel=1e-5)
    # a student that is the teacher scores lower than one that is not
    with torch.no_grad():
        assert loss(x, teacher.forward_levels(x)).item() < loss(x, out).item()
    with pytest.raises(ToolchainError, match="line up only at one size"):
        TeacherLoss(make(), "detection", Preprocess((32, 48)), weight=1.0, temperature=1.0, flatten=student.flatten,
                    num_classes=3)


def test_the_teacher_enters_the_finetune_key_only_when_it_teaches_and_never_the_baselines(tiny_task):
    plain = recipe_from_dict(tiny_recipe(tiny_task))
    taught = recipe_from_dict(tiny_recipe(tiny_task, **{"finetune.teacher_weight": 1.0}))
    stage = StudentFinetune()
    assert "teacher.finetune" not in stage.read_inputs(plain) and "teacher.finetune" in stage.read_inputs(taught)
    # the key of a finetune on the labels alone is what it was before the option existed
    assert "teacher_weight" not in json.dumps(stage.config(plain))
    assert stage.config(taught)["finetune"]["teacher_weight"] == 1.0
    baseline = StudentBaseline()
    assert baseline.config(taught) == baseline.config(plain)  # labels only, whatever finetune says
    assert StudentBaseline._cfg(taught).teacher_weight == 0.0


def test_gramian_heads_and_a_teacher_in_finetuning_are_refused_at_load(tiny_task):
    with pytest.raises(ToolchainError, match="cannot combine with student.gramian heads"):
        recipe_from_dict(tiny_recipe(tiny_task, **{"finetune.teacher_weight": 1.0, "student.gramian.heads": 2}))


def _outputs(env, names):
    outputs = {}
    for name in names:
        folder = (env.out / "stages" / name).resolve()
        outputs[name] = StageOutput(name, "k", folder, json.loads((folder / "result.json").read_text()))
    return outputs


def test_student_finetune_trains_with_the_builds_teacher_beside_the_labels(hostile_env, tmp_path, caplog):
    """The stage on the shared tiny build's outputs: the same start, seed and batches, with and without the
    teacher's loss, give different weights, and the teacher is the build's (its log line says so)."""
    inputs = _outputs(hostile_env, ("data.prepare", "student.distill", "teacher.curate", "teacher.finetune"))
    weights = {}
    for w in (0.0, 1.0):
        recipe = recipe_from_dict(tiny_recipe(hostile_env.task, **{**BASE, "finetune.teacher_weight": w,
                                                                    "finetune.keep_best": False}))
        work = tmp_path / f"w{w:g}"
        work.mkdir()
        ctx = StageContext(recipe=recipe, workdir=work, log=logging.getLogger("test.finetune"),
                           inputs={i: inputs[i] for i in StudentFinetune().read_inputs(recipe)})
        with caplog.at_level(logging.INFO, logger="test.finetune"):
            result = StudentFinetune().run(ctx)
        assert result["metrics"]["test_top1"] == result["metrics"]["test_top1"]
        weights[w] = load_model(work / result["model"]).state_dict()
    assert "the teacher keeps teaching: its KL loss on every labeled batch, times 1" in caplog.text
    assert any(not torch.equal(weights[0.0][k], weights[1.0][k]) for k in weights[0.0]
               if weights[0.0][k].is_floating_point())
