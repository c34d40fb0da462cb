"""Flip-averaged teacher outputs (students/teacher_flip.py): what "mapped back" means for image logits,
per-pixel logits and a detector's levels, on small real models."""
import pytest
import torch

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.recipe import AdapterConfig, recipe_from_dict
from vfm_toolchain.students.teacher_flip import FlipAveraged, flip_averaged, mirror_back
from vfm_toolchain.teachers.detection import create_detection_teacher

HW = (64, 128)


def test_image_logits_average_the_view_and_its_mirror():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 5))
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(flip_averaged(net)(x), (net(x) + net(x.flip(-1))) / 2)
        assert not torch.allclose(net(x), net(x.flip(-1)))  # the network is not mirror-symmetric itself


def test_per_pixel_logits_are_flipped_back_before_the_mean():
    """A map that is the input's own first channel: its mirror's map flipped back is the map itself, so the mean
    is the map; a mean without the flip back would be the map averaged with its mirror image."""
    x = torch.randn(1, 3, 4, 6)
    first = lambda t: t[:, :1]  # noqa: E731  (B, 1, h, w) "logits"
    assert torch.equal(flip_averaged(first)(x), x[:, :1])


def test_detector_boxes_of_the_mirror_mapped_back_are_the_mirrored_boxes():
    """For the levels of a real detector on any image, decoding ``mirror_back(levels)`` gives, location for
    location, the mirror images of the boxes decoded from ``levels`` at the mirrored location, with the same scores:
    flipping the maps and swapping left / right distances is the exact mirror of every box."""
    torch.manual_seed(0)
    det = create_detection_teacher("timm:resnet10t", "none", HW, 3, AdapterConfig(name="full"), neck_channels=16,
                                   head_convs=1).eval()
    with torch.no_grad():
        levels = det.forward_levels(torch.randn(1, 3, *HW))
        boxes, scores = det.boxes_and_scores(levels)
        m_boxes, m_scores = det.boxes_and_scores(mirror_back(levels))
    w = HW[1]
    start = 0
    for cls in levels["cls"]:  # per level: location (y, x) of the mirror is location (y, width - 1 - x)
        h, lw = cls.shape[-2:]
        idx = torch.arange(h * lw).view(h, lw).flip(-1).reshape(-1) + start
        b, mb = boxes[0, idx], m_boxes[0, start:start + h * lw]
        mirrored = torch.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], dim=1)
        assert torch.allclose(mb, mirrored, atol=1e-4)
        assert torch.allclose(m_scores[0, :, start:start + h * lw], scores[0, :, idx])
        start += h * lw
    assert not torch.allclose(boxes, m_boxes)  # the check above compared different boxes


def test_a_flip_averaged_detector_is_exactly_mirror_equivariant_and_decodes():
    torch.manual_seed(1)
    det = create_detection_teacher("timm:resnet10t", "none", HW, 3, AdapterConfig(name="full"), neck_channels=16,
                                   head_convs=1).eval()
    avg = FlipAveraged(det)
    x = torch.randn(2, 3, *HW)
    with torch.no_grad():
        a, b = avg.forward_levels(x), mirror_back(avg.forward_levels(x.flip(-1)))
        for k in a:
            for u, v in zip(a[k], b[k]):
                assert torch.allclose(u, v, atol=1e-5)
        assert avg.forward_dense(x).shape == det.forward_dense(x).shape
        assert not torch.allclose(avg.forward_dense(x), det.forward_dense(x))
        assert len(avg.decode(avg.forward_levels(x))) == 2


def test_other_outputs_and_task_agnostic_distillation_are_refused():
    with pytest.raises(ValueError, match="image logits"):
        mirror_back(torch.zeros(2, 3, 4))
    with pytest.raises(ToolchainError, match="a mirror does not map back"):
        recipe_from_dict({"data": {"train": "t", "test": "t"}, "teacher": {"name": "timm:resnet10t"},
                          "distill": {"mode": "task_agnostic", "teacher_flip": True}})


def test_the_classification_distill_stage_teaches_the_averaged_logits(hostile_env, tmp_path):
    """The wiring of ``distill.teacher_flip`` for classification: the function the stage caches targets with is
    the mean of the finetuned teacher's logits on the images and on their mirrors (the shared tiny build's
    teacher, a ViT with LoRA)."""
    import logging

    from tests.hostile import BASE
    from tests.conftest import tiny_recipe
    from vfm_toolchain.stage import StageContext, StageOutput
    from vfm_toolchain.students.distill import StudentDistill

    folder = next(hostile_env.out.glob("**/stages/teacher.finetune")).resolve()
    raw = tiny_recipe(hostile_env.task, **{**BASE, "distill.teacher_flip": True})
    ctx = StageContext(recipe=recipe_from_dict(raw), workdir=tmp_path, log=logging.getLogger("test"),
                       inputs={"teacher.finetune": StageOutput("teacher.finetune", "k", folder, {"model": "model"})})
    _, teacher, fn, pp = StudentDistill._teacher(ctx, None)
    torch.manual_seed(0)
    x = torch.randn(2, 3, *pp.hw)
    with torch.no_grad():
        plain, mirrored = teacher(x), teacher(x.flip(-1))
        assert not torch.allclose(plain, mirrored)
        assert torch.allclose(fn(x), (plain + mirrored) / 2, atol=1e-6)
