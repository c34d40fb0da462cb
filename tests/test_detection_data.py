"""Detection data (data/detection.py, detmetrics.py, synthetic_detection.py and the detection branches of the
recipe, data.prepare and preflight): readers, bad inputs, box transforms, the label budget, the evaluator."""
import json
import logging

import pytest
import torch
from PIL import Image

from tests.conftest import shared_data_or_skip
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.detection import (DetectionDataset, boxes_per_class, check_same_detection_classes,
                                          detection_collate, detection_transform, images_per_class,
                                          parse_detection_split, scan_detection_split, select_labeled)
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.data.synthetic_detection import generate_detection_task
from vfm_toolchain.detmetrics import coco_map, detection_map, to_original
from vfm_toolchain.preflight import check_data
from vfm_toolchain.prepare import PrepareData, load_index
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.stage import StageContext, StageOutput


def _image(path, w, h, colour=(90, 120, 150)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), colour).save(path)


def _coco_split(root, images, annotations, categories=None):
    """``images``: [(id, file_name, w, h)] written as files too; ``annotations``: [(id, image_id, cat, bbox)]."""
    for _, name, w, h in images:
        _image(root / "images" / name, w, h)
    data = {"images": [{"id": i, "file_name": n, "width": w, "height": h} for i, n, w, h in images],
            "annotations": [{"id": a, "image_id": im, "category_id": c, "bbox": b, "iscrowd": 0}
                            for a, im, c, b in annotations],
            "categories": categories or [{"id": 7, "name": "shark"}, {"id": 2, "name": "fish"}]}
    (root / "annotations.json").write_text(json.dumps(data))
    return root


def _patch(root, **changes):
    """Rewrite parts of a split's annotations.json."""
    f = root / "annotations.json"
    data = json.loads(f.read_text())
    data.update(changes)
    f.write_text(json.dumps(data))


@pytest.fixture
def coco(tmp_path):
    return _coco_split(tmp_path / "train", [(1, "a.jpg", 100, 50), (2, "b.png", 64, 64), (3, "empty.png", 32, 48)],
                       [(10, 1, 2, [10, 5, 20, 30]), (11, 1, 7, [50, 0, 25.5, 10]), (12, 2, 7, [0, 0, 64, 64])])


def test_coco_reader_reads_records_at_each_images_own_resolution(coco):
    split = scan_detection_split(coco, "train")
    assert split.format == "coco"
    assert split.classes == ["fish", "shark"]  # categories sorted by id (2, 7), indices 0, 1
    by_name = {r["path"].rsplit("/", 1)[-1]: r for r in split.records}
    assert by_name["a.jpg"] == {"path": str(coco / "images" / "a.jpg"), "width": 100, "height": 50,
                                "boxes": [[10.0, 5.0, 30.0, 35.0], [50.0, 0.0, 75.5, 10.0]], "labels": [0, 1]}
    assert by_name["b.png"]["boxes"] == [[0.0, 0.0, 64.0, 64.0]] and by_name["b.png"]["labels"] == [1]
    assert by_name["empty.png"]["boxes"] == [] and by_name["empty.png"]["labels"] == []  # a negative
    assert split.skipped == {} and split.dropped_boxes == {} and split.clipped == 0


def test_yolo_reader_with_classes_txt_or_data_yaml(tmp_path):
    root = tmp_path / "ds" / "train"
    _image(root / "images" / "x.jpg", 100, 50)
    _image(root / "images" / "negative.jpg", 40, 40)  # no label file: a negative, as in Ultralytics
    (root / "labels").mkdir(parents=True)
    (root / "labels" / "x.txt").write_text("1 0.5 0.5 0.2 0.4\n\n0 0.1 0.2 0.2 0.2\n")
    (tmp_path / "ds" / "classes.txt").write_text("cat\ndog\n")  # above the split, where exports put it
    split = scan_detection_split(root, "train")
    assert split.format == "yolo" and split.classes == ["cat", "dog"]
    x = next(r for r in split.records if r["path"].endswith("x.jpg"))
    assert x["boxes"] == [[40.0, 15.0, 60.0, 35.0], [0.0, 5.0, 20.0, 15.0]] and x["labels"] == [1, 0]
    assert next(r for r in split.records if r["path"].endswith("negative.jpg"))["boxes"] == []
    (tmp_path / "ds" / "classes.txt").unlink()
    (tmp_path / "ds" / "data.yaml").write_text("names: {0: cat, 1: dog}\nnc: 2\n")
    assert scan_detection_split(root, "train").classes == ["cat", "dog"]
    (root / "labels" / "orphan.txt").write_text("0 0.5 0.5 0.1 0.1\n")  # a label file without its image
    assert "no image" in scan_detection_split(root, "train").skipped[str(root / "labels" / "orphan.txt")]


# ---------------------------------------------------------------------------------------------------
# bad inputs: one clear message each, or skipped and counted with the reason


def test_unknown_category_ids_name_the_ids_and_the_categories(coco):
    _patch(coco, annotations=[{"id": 1, "image_id": 1, "category_id": 9, "bbox": [1, 1, 5, 5]},
                              {"id": 2, "image_id": 2, "category_id": 9, "bbox": [1, 1, 5, 5]}])
    with pytest.raises(ToolchainError, match=r"category ids that its categories do not define: category id 9 "
                                             r"\(2 annotations, e\.g\. id 1\).*2: fish, 7: shark"):
        parse_detection_split(coco, "train")


def test_duplicate_image_ids_are_an_error(coco):
    _patch(coco, images=[{"id": 1, "file_name": "a.jpg"}, {"id": 1, "file_name": "b.png"}])
    with pytest.raises(ToolchainError, match=r"repeats the image id 1; each must be unique"):
        parse_detection_split(coco, "train")


def test_annotation_of_an_image_not_listed_is_an_error(coco):
    _patch(coco, annotations=[{"id": 5, "image_id": 99, "category_id": 2, "bbox": [1, 1, 5, 5]}])
    with pytest.raises(ToolchainError, match=r"image ids that its images list does not have: image id 99"):
        parse_detection_split(coco, "train")


def test_malformed_bbox_and_json_are_errors(coco):
    _patch(coco, annotations=[{"id": 5, "image_id": 1, "category_id": 2, "bbox": [1, 1, 5]}])
    with pytest.raises(ToolchainError, match=r"annotation id 5 has bbox \[1, 1, 5\]; a bbox is \[x, y, width, "):
        parse_detection_split(coco, "train")
    (coco / "annotations.json").write_text("{not json")
    with pytest.raises(ToolchainError, match=r"is not valid JSON"):
        parse_detection_split(coco, "train")


def test_boxes_past_the_edge_are_clipped_and_boxes_outside_or_empty_dropped(tmp_path):
    root = _coco_split(tmp_path / "train", [(1, "a.png", 100, 50)], [
        (1, 1, 2, [-0.4, 10, 20.6, 40.6]),  # past two edges by under a pixel (rounding): clipped, not counted
        (2, 1, 2, [90, 40, 30, 30]),        # half outside: clipped to [90, 40, 100, 50]
        (3, 1, 2, [120, 10, 10, 10]),       # entirely outside
        (4, 1, 7, [10, 10, 0, 5]),          # no width
        (5, 1, 7, [99.5, 10, 10, 10]),      # only a half-pixel sliver inside
    ])
    split = scan_detection_split(root, "train")
    rec = split.records[0]
    assert rec["boxes"] == [[0.0, 10.0, 20.2, 50.0], [90.0, 40.0, 100.0, 50.0]] and rec["labels"] == [0, 0]
    assert split.clipped == 1  # only the one moved by more than a pixel
    assert set(split.dropped_boxes) == {"a.png annotation 3", "a.png annotation 4", "a.png annotation 5"}
    assert split.dropped_boxes["a.png annotation 3"].startswith("entirely outside the 100x50 image")
    assert split.dropped_boxes["a.png annotation 4"].startswith("non-positive size (width 0.00")
    assert split.dropped_boxes["a.png annotation 5"].startswith("all but a sliver under a pixel outside")


def test_missing_corrupt_and_mis_sized_images_are_skipped_and_counted(coco):
    (coco / "images" / "b.png").write_bytes(b"\x89PNG not really")
    data = json.loads((coco / "annotations.json").read_text())
    data["images"].append({"id": 4, "file_name": "gone.jpg", "width": 10, "height": 10})
    data["images"][2]["width"] = 33  # empty.png is 32 px wide: its boxes would have been drawn on another size
    (coco / "annotations.json").write_text(json.dumps(data))
    split = scan_detection_split(coco, "train")
    assert [r["path"].rsplit("/", 1)[-1] for r in split.records] == ["a.jpg"]
    assert "does not exist" in split.skipped[str(coco / "images" / "gone.jpg")]
    assert "cannot" in split.skipped[str(coco / "images" / "b.png")] or "not an image" in \
        split.skipped[str(coco / "images" / "b.png")]
    assert "says 33x48 but the file is 32x48" in split.skipped[str(coco / "images" / "empty.png")]


def test_splits_with_different_class_lists_name_both_lists(coco, tmp_path):
    other = _coco_split(tmp_path / "val", [(1, "v.png", 20, 20)], [],
                        categories=[{"id": 1, "name": "fish"}, {"id": 2, "name": "ray"}])
    with pytest.raises(ToolchainError, match=r"val classes \['fish', 'ray'\] differ from train classes "
                                             r"\['fish', 'shark'\]"):
        check_same_detection_classes(parse_detection_split(coco, "train").classes,
                                     parse_detection_split(other, "val").classes, "val")


def test_yolo_lines_that_do_not_parse_say_file_and_line(tmp_path):
    root = tmp_path / "train"
    _image(root / "images" / "x.jpg", 10, 10)
    (root / "labels").mkdir(parents=True)
    (root / "classes.txt").write_text("a\nb\n")
    (root / "labels" / "x.txt").write_text("0 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2\n")
    with pytest.raises(ToolchainError, match=r"x\.txt:2: 4 values; a box line has 5"):
        parse_detection_split(root, "train")
    (root / "labels" / "x.txt").write_text("0 0.5 0.5 0.2 0.2\n5 0.5 0.5 0.2 0.2\n")
    with pytest.raises(ToolchainError, match=r"x\.txt:2 class 5.*allow 0 to 1"):
        parse_detection_split(root, "train")


def test_preflight_refuses_bad_annotations_before_the_first_stage(coco, tmp_path):
    pool = tmp_path / "pool"
    _image(pool / "p.png", 16, 16)
    val = _coco_split(tmp_path / "val", [(1, "v.png", 20, 20)], [],
                      categories=[{"id": 1, "name": "fish"}, {"id": 2, "name": "ray"}])
    recipe = recipe_from_dict({"data": {"task": "detection", "train": str(coco), "val": str(val), "test": str(coco),
                                        "pools": [str(pool)]}})
    with pytest.raises(ToolchainError, match=r"val classes \['fish', 'ray'\] differ"):
        check_data(recipe)
    recipe = recipe_from_dict({"data": {"task": "detection", "train": str(coco), "test": str(coco),
                                        "pools": [str(pool)], "format": "yolo"}})
    with pytest.raises(ToolchainError, match=r"has no labels/ folder, which data.format: yolo reads.*set data.format: "
                                             r"coco or auto"):
        check_data(recipe)


def test_recipe_keeps_detection_fields_to_detection():
    with pytest.raises(ToolchainError, match=r"data.format coco says how detection boxes are written"):
        recipe_from_dict({"data": {"source": "synthetic", "format": "coco"}})
    with pytest.raises(ToolchainError, match=r"finetune.mixup blends the labels of whole images: classification "
                                             r"only; set it to 0 for detection"):
        recipe_from_dict({"data": {"source": "synthetic", "task": "detection"}, "finetune": {"mixup": 0.2}})
    # classification and segmentation keys do not see the detection-only field
    for task in ("classification", "segmentation"):
        cfg = PrepareData().config(recipe_from_dict({"data": {"source": "synthetic", "task": task}}))
        assert "format" not in cfg["data"]
    assert "format" in PrepareData().config(recipe_from_dict({"data": {"source": "synthetic",
                                                                       "task": "detection"}}))["data"]


# ---------------------------------------------------------------------------------------------------
# box transforms and the dataset


def test_boxes_follow_a_flip_and_a_resize_exactly(tmp_path):
    from torchvision import tv_tensors

    pp = Preprocess((64, 80))  # (h, w): non-square, each axis its own factor
    img = tv_tensors.Image(torch.zeros(3, 100, 200, dtype=torch.uint8))  # a 200 x 100 (w x h) image
    boxes = tv_tensors.BoundingBoxes(torch.tensor([[20.0, 10.0, 60.0, 50.0]]), format="XYXY", canvas_size=(100, 200))
    target = {"boxes": boxes, "labels": torch.tensor([3])}
    _, resized = detection_transform(pp, train=False)(img, target)
    torch.testing.assert_close(resized["boxes"].as_subclass(torch.Tensor),  # x * 80/200, y * 64/100
                               torch.tensor([[8.0, 6.4, 24.0, 32.0]]), atol=1e-4, rtol=0)
    out, flipped = detection_transform(pp, train=True, aspect=2.0, flip=1.0, crop=False)(img, target)
    assert out.shape == (3, 64, 80)
    torch.testing.assert_close(flipped["boxes"].as_subclass(torch.Tensor),  # x -> 200 - x, then resized
                               torch.tensor([[56.0, 6.4, 72.0, 32.0]]), atol=1e-4, rtol=0)
    assert flipped["labels"].tolist() == [3]

    # the dataset: boxes in input pixels, the scale factors that map them back, the original size
    _image(tmp_path / "im.png", 200, 100)
    rec = {"path": str(tmp_path / "im.png"), "width": 200, "height": 100, "boxes": [[20.0, 10.0, 60.0, 50.0]],
           "labels": [1]}
    x, t = DetectionDataset([rec], pp, train=False)[0]
    assert x.shape == (3, 64, 80) and type(x) is torch.Tensor
    assert t["scale"] == (0.4, 0.64) and t["orig_size"] == (100, 200) and t["index"] == 0
    torch.testing.assert_close(to_original(t["boxes"], t["scale"], t["orig_size"]), torch.tensor(rec["boxes"]))


def test_training_crops_keep_boxes_inside_and_labels_aligned(tmp_path):
    _image(tmp_path / "im.png", 160, 120)
    rec = {"path": str(tmp_path / "im.png"), "width": 160, "height": 120,
           "boxes": [[0.0, 0.0, 30.0, 30.0], [60.0, 40.0, 120.0, 100.0], [150.0, 110.0, 160.0, 120.0]],
           "labels": [0, 1, 2]}
    ds = DetectionDataset([rec] * 40, Preprocess((48, 64)), train=True, augment="strong", crop=1.0)
    torch.manual_seed(0)
    x, targets = detection_collate([ds[i] for i in range(len(ds))])
    assert x.shape == (40, 3, 48, 64)
    for t in targets:
        b = t["boxes"]
        assert len(b) == len(t["labels"])
        assert (b[:, 0] >= 0).all() and (b[:, 2] <= 64).all() and (b[:, 1] >= 0).all() and (b[:, 3] <= 48).all()
        assert ((b[:, 2] - b[:, 0]) >= 2).all() and ((b[:, 3] - b[:, 1]) >= 2).all()
    assert any(len(t["boxes"]) < 3 for t in targets)  # crops do cut boxes away, with their labels


# ---------------------------------------------------------------------------------------------------
# the label budget


def test_labeled_per_class_is_deterministic_and_covers_every_class():
    def rec(i, labels):
        return {"path": f"/d/{i:03d}.jpg", "width": 10, "height": 10, "boxes": [[0, 0, 5, 5]] * len(labels),
                "labels": labels}

    records = [rec(i, [0, 0]) for i in range(30)] + [rec(30 + i, [1]) for i in range(4)] + \
              [rec(40 + i, [0, 2]) for i in range(6)] + [rec(50 + i, []) for i in range(5)]
    chosen, rest = select_labeled(records, 3, 3, seed=0)
    again, _ = select_labeled(list(reversed(records)), 3, 3, seed=0)  # input order does not matter
    assert chosen == again and len(chosen) + len(rest) == len(records)
    have = images_per_class(chosen, 3)
    assert all(n >= 3 for n in have) and have[1] == 3
    assert all(r["labels"] for r in chosen)  # negatives are never spent from the budget
    assert [r["path"] for r in chosen] == sorted(r["path"] for r in chosen)
    assert select_labeled(records, 3, 3, seed=1)[0] != chosen  # the seed decides which images
    # a class with fewer images than the budget keeps all of them
    assert images_per_class(select_labeled(records, 3, 10, seed=0)[0], 3)[1] == 4


# ---------------------------------------------------------------------------------------------------
# the evaluator


def _p(boxes, scores, labels):
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "scores": torch.tensor(scores),
            "labels": torch.tensor(labels)}


def test_coco_map_on_hand_made_cases():
    targets = [{"boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 40, 40], [50, 50, 70, 70]]),
                "labels": torch.tensor([0, 1, 1])}]
    perfect = coco_map([_p(targets[0]["boxes"].tolist(), [0.9, 0.8, 0.7], [0, 1, 1])], targets, ["a", "b", "c"])
    assert perfect["map"] == pytest.approx(1.0) and perfect["map50"] == pytest.approx(1.0)
    assert perfect["per_class_ap"] == {"a": pytest.approx(1.0), "b": pytest.approx(1.0), "c": None}

    # a: its one box found with IoU 100/160 = 0.625, a hit at IoU thresholds .50, .55, .60 and a miss at the 7
    #    above: AP 3/10, AP50 1.
    # b: one of two boxes found (score 0.8), then a false positive (0.7): precision 1 up to recall 0.5 and none
    #    beyond, so COCO's 101-point interpolation gives 51/101 at every threshold.
    # c: a false positive of a class with no box: no AP (COCO leaves it out of the mean).
    mix = coco_map([_p([[0, 0, 10, 16], [20, 20, 40, 40], [80, 80, 90, 90], [0, 50, 10, 60]],
                       [0.9, 0.8, 0.7, 0.6], [0, 1, 1, 2])], targets, ["a", "b", "c"])
    assert mix["per_class_ap"]["a"] == pytest.approx(0.3)
    assert mix["per_class_ap"]["b"] == pytest.approx(51 / 101)
    assert mix["per_class_ap"]["c"] is None
    assert mix["map"] == pytest.approx((0.3 + 51 / 101) / 2)
    assert mix["map50"] == pytest.approx((1 + 51 / 101) / 2)


def test_detection_map_scores_at_each_images_own_resolution(tmp_path):
    """A perfect detector at a non-square input size scores 1.0 only if its boxes are mapped back per axis."""
    _image(tmp_path / "a.png", 200, 100)
    _image(tmp_path / "b.png", 90, 120)
    records = [{"path": str(tmp_path / "a.png"), "width": 200, "height": 100,
                "boxes": [[20.0, 10.0, 60.0, 50.0], [100.0, 20.0, 190.0, 90.0]], "labels": [0, 1]},
               {"path": str(tmp_path / "b.png"), "width": 90, "height": 120, "boxes": [[5.0, 5.0, 45.0, 60.0]],
                "labels": [1]}]
    pp = Preprocess((64, 96))
    order = iter(range(len(records)))  # the evaluator reads the records in order

    def predict(x):  # what a perfect model answers: each image's boxes at the input's size
        out = []
        for r in (records[next(order)] for _ in range(len(x))):
            to_input = torch.tensor([96 / r["width"], 64 / r["height"]] * 2)
            out.append({"boxes": torch.tensor(r["boxes"]) * to_input, "scores": torch.ones(len(r["boxes"])),
                        "labels": torch.tensor(r["labels"])})
        return out

    result = detection_map(predict, records, pp, ["fish", "shark"], batch_size=2)
    assert result["map"] == pytest.approx(1.0) and result["map50"] == pytest.approx(1.0)
    assert result["per_class_ap"] == {"fish": pytest.approx(1.0), "shark": pytest.approx(1.0)}


# ---------------------------------------------------------------------------------------------------
# the procedural task, through the same reader and data.prepare


def _prepare(recipe, workdir):
    ctx = StageContext(recipe=recipe, workdir=workdir, inputs={}, log=logging.getLogger("test"))
    result = PrepareData().run(ctx)
    return result, load_index(StageOutput("data.prepare", "k", workdir, result))


def test_synthetic_task_is_read_back_by_the_coco_reader_and_prepared(tmp_path):
    paths = generate_detection_task(tmp_path / "syn", classes=3, labeled_per_class=4, val_per_class=2,
                                    test_per_class=2, pool_size=6, distractor_size=3, image_size=64, seed=0)
    train = scan_detection_split(paths["train"], "train")
    assert train.classes == ["circle", "square", "triangle"] and not train.skipped and not train.dropped_boxes
    assert all(n >= 4 for n in images_per_class(train.records, 3))
    assert any(not r["boxes"] for r in train.records)  # negatives too
    assert len(paths["pools"]) == 2 and (tmp_path / "syn" / "pool_annotations.json").is_file()
    again = generate_detection_task(tmp_path / "again", 3, 4, 2, 2, 6, 3, 64, 0)
    assert [r["boxes"] for r in scan_detection_split(again["train"], "train").records] == \
        [r["boxes"] for r in train.records]  # seeded

    recipe = recipe_from_dict({"data": {"source": "synthetic", "task": "detection",
                                        "synthetic": {"classes": 3, "labeled_per_class": 3, "val_per_class": 2,
                                                      "test_per_class": 2, "pool_size": 5, "distractor_size": 2,
                                                      "image_size": 48}}})
    result, index = _prepare(recipe, tmp_path / "stage")
    assert result["task"] == "detection" and result["format"] == "coco"
    assert result["counts"]["pool"] == 7
    assert result["boxes"]["train"] == sum(result["boxes_per_class"]["train"].values())
    stored = json.loads((tmp_path / "stage" / "index.json").read_text())
    assert stored["relative_to_stage"] and not stored["train"][0]["path"].startswith("/")
    rec = index["train"][0]
    assert rec["path"].startswith(str(tmp_path / "stage")) and Image.open(rec["path"]).size == (48, 48)


def test_prepare_applies_the_label_budget_and_makes_the_rest_validation(tmp_path):
    paths = generate_detection_task(tmp_path / "syn", 3, 6, 2, 2, 4, 0, 48, seed=1)
    recipe = recipe_from_dict({"data": {"task": "detection", "train": paths["train"], "test": paths["test"],
                                        "pools": paths["pools"], "labeled_per_class": 2}})
    check_data(recipe)  # preflight passes on a good set
    result, index = _prepare(recipe, tmp_path / "stage")
    assert all(n >= 2 for n in result["images_per_class"]["train"].values())
    assert result["counts"]["train"] + result["counts"]["val"] == len(scan_detection_split(paths["train"],
                                                                                           "train").records)
    assert set(r["path"] for r in index["train"]).isdisjoint(r["path"] for r in index["val"])
    again, _ = _prepare(recipe, tmp_path / "stage2")
    assert again["boxes_per_class"] == result["boxes_per_class"]
    # no budget and no val folder: a seeded fraction of train is held out
    recipe = recipe_from_dict({"data": {"task": "detection", "train": paths["train"], "test": paths["test"],
                                        "pools": paths["pools"], "val_fraction": 0.25}})
    result, index = _prepare(recipe, tmp_path / "stage3")
    assert result["counts"]["val"] == round(0.25 * (result["counts"]["train"] + result["counts"]["val"]))
    assert set(r["path"] for r in index["train"]).isdisjoint(r["path"] for r in index["val"])


# ---------------------------------------------------------------------------------------------------
# the real set


@pytest.mark.shared_data
def test_aquarium_is_read_with_its_documented_counts():
    root = shared_data_or_skip() / "aquarium"
    if not root.is_dir():
        pytest.skip(f"{root} is not present")
    expected = {"train": (81, 673), "val": (40, 324), "test": (160, 1144)}
    classes = ["fish", "jellyfish", "penguin", "puffin", "shark", "starfish", "stingray"]
    for split, (images, boxes) in expected.items():
        s = scan_detection_split(root / split, split)
        assert s.classes == classes
        assert (len(s.records), sum(len(r["boxes"]) for r in s.records)) == (images, boxes)
        assert not s.skipped and not s.dropped_boxes
    train = scan_detection_split(root / "train", "train")
    assert boxes_per_class(train.records, 7) == [155, 258, 105, 67, 32, 29, 27]  # the README's table
    assert images_per_class(train.records, 7) == [18, 15, 15, 15, 15, 15, 15]
