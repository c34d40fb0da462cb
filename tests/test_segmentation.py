"""Segmentation end to end at tiny size: data, mIoU, students at output stride 8, per-pixel distillation."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.segmentation import IGNORE_INDEX, scan_segmentation_folder
from vfm_toolchain.data.synthetic import generate_segmentation_task
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.segmetrics import confusion_matrix, mean_iou
from vfm_toolchain.students.models import create_student
from conftest import stage_statuses, THREADS


def test_mean_iou_on_a_hand_example():
    target = torch.tensor([[0, 0, 1, 1], [0, 0, 1, IGNORE_INDEX]])
    pred = torch.tensor([[0, 1, 1, 1], [0, 0, 2, 2]])
    cm = confusion_matrix(pred, target, 3)
    # class 0: TP 3, FN 1 -> 3/4; class 1: TP 2, FP 1, FN 1 -> 2/4; class 2: TP 0, FP 1 -> 0; ignored pixel left out
    assert cm.sum() == 7
    assert mean_iou(cm) == pytest.approx((3 / 4 + 2 / 4 + 0) / 3)
    cm4 = confusion_matrix(pred, target, 4)  # a class absent from target and prediction does not count
    assert mean_iou(cm4) == pytest.approx(mean_iou(cm))


@pytest.mark.parametrize("name", ["mobilevitv2_050", "fastvit_t8"])
def test_students_reach_output_stride_8_with_a_deeplab_head(name):
    m = create_student(name, 5, task="segmentation").eval()
    x = torch.randn(1, 3, 64, 64)
    assert m.forward_features(x).shape[-2:] == (8, 8)
    assert m(x).shape == (1, 5, 64, 64)


def test_masks_that_do_not_fit_are_skipped(tmp_path):
    t = generate_segmentation_task(tmp_path / "t", 2, 3, 1, 1, 2, 0, 32, 0)
    Image.fromarray(np.full((8, 8), 1, np.uint8)).save(f"{t['train']}/masks/00000.png")   # wrong size
    Image.fromarray(np.full((32, 32), 9, np.uint8)).save(f"{t['train']}/masks/00001.png")  # id beyond the classes
    pairs, bad = scan_segmentation_folder(t["train"], "train", 3)
    assert len(pairs) == 1 and len(bad) == 2
    with pytest.raises(ToolchainError, match="images/ and masks/"):
        scan_segmentation_folder(tmp_path, "train", 3)


def test_segmentation_builds_end_to_end(tmp_path):
    raw = {"name": "seg", "seed": 0, "threads": THREADS,
           "data": {"source": "synthetic", "task": "segmentation",
                    "synthetic": {"classes": 2, "labeled_per_class": 8, "val_per_class": 3, "test_per_class": 3,
                                  "pool_size": 24, "distractor_size": 0, "image_size": 32}},
           # 2:3 frames (height, width) on both models: nothing squashes them to squares
           "teacher": {"name": "timm:vit_tiny_patch16_224", "weights": "none", "image_size": [32, 48],
                       "adapter": {"name": "lora", "r": 4, "alpha": 8}, "epochs": 2, "batch_size": 4},
           "curate": {"strategy": "query_balanced_image", "budget": 16},
           "student": {"name": "mobilevitv2_050", "image_size": [32, 48]},
           "distill": {"epochs": 2, "batch_size": 8, "views": 2},
           "finetune": {"epochs": 1, "batch_size": 4}, "baseline": {"epochs": 1},
           "export": {"formats": ["onnx"], "parity_images": 2},
           "bench": {"runtimes": ["onnxruntime"], "batch_sizes": [1], "warmup": 1, "iters": 2}}
    record = build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s")
    assert list(stage_statuses(record).values()) == ["ran"] * 9
    stages = tmp_path / "o" / "stages"
    distill = json.loads((stages / "student.distill" / "result.json").read_text())
    assert 0 <= distill["metrics"]["test_miou"] <= 1
    targets = np.load(stages / "student.distill" / "teacher_targets.npy", mmap_mode="r")
    # per view, the teacher's logits at its own output stride 8, in half precision: 64x less than at the
    # student's 32x48 px (which the cache held before), upsampled inside the loss
    assert targets.shape == (16, 2, 3, 4, 6) and targets.dtype == np.float16
    assert targets.nbytes * 32 <= 16 * 2 * 3 * 32 * 48 * 2
    assert distill["teacher_cache_mb"] == pytest.approx(targets.nbytes / 2 ** 20, abs=0.01)
    for key in ("teacher_miou", "student_baseline_miou", "student_distilled_miou"):
        assert 0 <= record["metrics"][key] <= 1
    assert "mIoU" in (tmp_path / "o" / "report.md").read_text()
    onnx = [a for a in record["artifacts"] if a["kind"] == "onnx"][0]
    assert onnx["status"] == "ok" and onnx["parity_max_abs_diff"] < 1e-3 and onnx["image_size"] == [32, 48]
    # after the build, from its store: which pool images to label next, and the teacher's masks for review
    from vfm_toolchain import api
    from vfm_toolchain.data.segmentation import read_classes, scan_segmentation_folder

    chosen = api.label_next(raw, 4, out=tmp_path / "next", store=tmp_path / "s")
    assert chosen["chosen"] == 4 and chosen["scored"] == 24
    # the class balance counts every class the teacher shows in an image, on the 16 labeled images as on the pool
    assert list(chosen["showing"]) == ["background", "circle", "square"]
    assert all(0 <= labeled <= 16 and 0 <= picked <= 4 for labeled, picked in chosen["showing"].values())
    summary = api.pseudo_label(raw, out=tmp_path / "pseudo", store=tmp_path / "s", threshold=0.3)
    assert summary["kept"] + summary["review"] == 24
    if summary["kept"]:
        folder = tmp_path / "pseudo" / "segmentation"
        assert read_classes(folder) == ["background", "circle", "square"]
        pairs, skipped = scan_segmentation_folder(folder, "pseudo-labels", 3, summary["data_roots"])
        assert len(pairs) == summary["kept"] and not skipped


def test_segmentation_student_size_must_be_a_multiple_of_8():
    with pytest.raises(ToolchainError, match="multiple of 8"):
        recipe_from_dict({"data": {"source": "synthetic", "task": "segmentation"},
                          "student": {"name": "fastvit_t8", "image_size": 60}})
    with pytest.raises(ToolchainError, match=r"on each side, e.g. \[64, 56\]"):
        recipe_from_dict({"data": {"source": "synthetic", "task": "segmentation"},
                          "student": {"name": "fastvit_t8", "image_size": [64, 58]}})


def test_miou_is_scored_at_each_masks_own_resolution(tmp_path):
    """A 1-pixel-wide structure in a 48x64 mask vanishes if the mask is squashed to the model's 8 px; scored at
    the mask's own resolution it counts, and a model that misses it is charged for it."""
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.training import miou

    (tmp_path / "images").mkdir()
    (tmp_path / "masks").mkdir()
    Image.fromarray(np.full((48, 64, 3), 128, np.uint8)).save(tmp_path / "images" / "a.png")
    mask = np.zeros((48, 64), np.uint8)
    mask[:, 11] = 1                      # the thin structure: 48 of 3072 pixels
    Image.fromarray(mask).save(tmp_path / "masks" / "a.png")

    class AllZero(torch.nn.Module):       # predicts class 0 everywhere, at the model's 8 x 8
        def forward(self, x):
            return torch.stack([torch.ones_like(x[:, 0]), torch.zeros_like(x[:, 0])], 1)

    items = [(str(tmp_path / "images" / "a.png"), str(tmp_path / "masks" / "a.png"))]
    score = miou(AllZero(), items, Preprocess(8), 2)
    assert score == pytest.approx((3072 - 48) / 3072 / 2)  # class 0: IoU 3024/3072; class 1: 0
