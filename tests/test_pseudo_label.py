"""pseudo-label's files on hand-made teacher predictions: the kept labels read back by our own data readers, every
image in the Label Studio and CVAT files, the unsure ones listed for review (students/pseudo_label.py)."""
from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from vfm_toolchain.data.segmentation import mask_polygons
from vfm_toolchain.students.pseudo_label import _Writer

CLASSES = ["road", "sky", "tree"]  # sorted, as an ImageFolder lists its classes


def _images(tmp_path, n, size=(40, 30)):
    folder = tmp_path / "pool"
    folder.mkdir()
    paths = []
    for k in range(n):
        p = folder / f"{k:03d}.png"
        Image.new("RGB", size, (k * 40, 90, 20)).save(p)
        paths.append(str(p))
    return paths


def _rows(path):
    return list(csv.DictReader(open(path)))


def _cvat(out):
    root = ET.parse(out / "cvat" / "annotations.xml").getroot()
    assert root.find("version").text == "1.1" and [x.text for x in root.iter("name")][1:] == CLASSES
    return root.findall("image")


def test_mask_polygons_outline_each_region_in_pixel_corners():
    mask = np.zeros((20, 30), dtype=np.int64)
    mask[2:8, 3:13] = 1  # a 10 x 6 block
    mask[12:18, 20:26] = 1
    mask[0, 0] = 1  # one pixel: under min_area
    polys = mask_polygons(mask, 1)
    assert len(polys) == 2
    boxes = sorted((p[:, 0].min(), p[:, 1].min(), p[:, 0].max(), p[:, 1].max()) for p in polys)
    assert boxes[0] == pytest.approx((3, 2, 13, 8), abs=0.51) and boxes[1] == pytest.approx((20, 12, 26, 18), abs=0.51)


def test_classification_labels_read_back_as_an_image_folder(tmp_path):
    from vfm_toolchain.data.images import scan_image_folder

    paths = _images(tmp_path, 4)
    out = tmp_path / "out"
    w = _Writer(out, "classification", CLASSES, 0.6, copy=False, teacher="teacher t")
    for k, (label, conf) in enumerate([(0, 0.9), (1, 0.7), (1, 0.3), (2, 0.95)]):
        w.add(k, paths[k], (30, 40), {"label": label, "confidence": conf, "summary": CLASSES[label]})
    summary = w.finish()
    assert summary == {"images": 4, "kept": 3, "review": 1, "threshold": 0.6}
    scan = scan_image_folder(out / "imagefolder", "pseudo-labels", data_roots=[str(tmp_path)])  # links to them
    assert scan.classes == CLASSES and sorted((p.split("/")[-1], y) for p, y in scan.samples) == [
        ("000.png", 0), ("001.png", 1), ("003.png", 2)]
    assert [r["file"] for r in _rows(out / "review.csv")] == ["002.png"]
    tasks = json.loads((out / "label_studio" / "tasks.json").read_text())
    assert len(tasks) == 4 and tasks[2]["predictions"][0]["result"][0]["value"] == {"choices": ["sky"]}
    assert tasks[2]["data"]["image"] == "/data/local-files/?d=images/002.png" and (out / "images" / "002.png").is_file()
    assert '<Choices name="label" toName="image">' in (out / "label_studio" / "config.xml").read_text()
    assert [im.find("tag").get("label") for im in _cvat(out)] == ["road", "sky", "sky", "tree"]


def test_segmentation_masks_read_back_and_unsure_pixels_are_ignored(tmp_path):
    from vfm_toolchain.data.segmentation import IGNORE_INDEX, read_classes, scan_segmentation_folder

    paths = _images(tmp_path, 2)
    out = tmp_path / "out"
    mask = np.zeros((30, 40), dtype=np.int64)
    mask[10:, :] = 2
    conf = np.full((30, 40), 0.9, dtype=np.float32)
    conf[:, :5] = 0.2  # a strip the teacher is unsure of
    w = _Writer(out, "segmentation", CLASSES, 0.5, copy=True, teacher="teacher t")
    w.add(0, paths[0], (30, 40), {"mask": mask, "pixel_confidence": conf, "confidence": float(conf.mean()),
                                  "summary": "sky road"})
    w.add(1, paths[1], (30, 40), {"mask": mask, "pixel_confidence": conf * 0.3, "confidence": 0.24,
                                  "summary": "sky road"})
    assert w.finish()["kept"] == 1
    assert read_classes(out / "segmentation") == CLASSES
    pairs, skipped = scan_segmentation_folder(out / "segmentation", "pseudo-labels", len(CLASSES))
    assert len(pairs) == 1 and not skipped and not (out / "segmentation" / "images" / "000.png").is_symlink()
    written = np.asarray(Image.open(pairs[0][1]))
    assert (written[:, :5] == IGNORE_INDEX).all() and (written[:10, 5:] == 0).all() and (written[10:, 5:] == 2).all()
    result = json.loads((out / "label_studio" / "tasks.json").read_text())[0]["predictions"][0]["result"]
    assert {r["value"]["polygonlabels"][0] for r in result} == {"road", "tree"}
    assert all(0 <= x <= 100 and 0 <= y <= 100 for r in result for x, y in r["value"]["points"])
    assert len(_cvat(out)[0].findall("polygon")) == 2


def test_detection_boxes_read_back_as_coco_and_a_doubtful_box_sends_the_image_to_review(tmp_path):
    from vfm_toolchain.data.detection import scan_detection_split

    paths = _images(tmp_path, 2)
    out = tmp_path / "out"
    w = _Writer(out, "detection", CLASSES, 0.5, copy=False, teacher="teacher t")
    boxes = np.array([[2.0, 3.0, 20.0, 25.0], [25.0, 5.0, 38.0, 28.0]], dtype=np.float32)
    w.add(0, paths[0], (30, 40), {"boxes": boxes, "scores": np.array([0.9, 0.6]), "labels": np.array([1, 2]),
                                  "confidence": 0.6, "doubtful": False, "summary": "2 boxes"})
    w.add(1, paths[1], (30, 40), {"boxes": boxes, "scores": np.array([0.9, 0.3]), "labels": np.array([1, 2]),
                                  "confidence": 0.9, "doubtful": True, "summary": "1 box"})
    assert w.finish()["review"] == 1
    split = scan_detection_split(out / "coco", "pseudo-labels", data_roots=[str(tmp_path)])
    assert split.classes == CLASSES and len(split.records) == 1
    np.testing.assert_allclose(split.records[0]["boxes"], boxes, atol=1e-4)
    assert list(split.records[0]["labels"]) == [1, 2]
    coco = json.loads((out / "coco" / "annotations.json").read_text())
    assert [a["score"] for a in coco["annotations"]] == pytest.approx([0.9, 0.6])
    second = json.loads((out / "label_studio" / "tasks.json").read_text())[1]["predictions"][0]["result"]
    assert [r["value"]["rectanglelabels"] for r in second] == [["sky"], ["tree"]]  # the doubtful box shown too
    assert second[0]["value"]["x"] == pytest.approx(5.0) and second[0]["value"]["height"] == pytest.approx(220 / 3)
    box = _cvat(out)[1].findall("box")[0]
    assert (box.get("label"), float(box.get("xbr"))) == ("sky", 20.0)


def test_placing_a_file_over_an_earlier_link_replaces_the_link_and_never_writes_through_it(tmp_path):
    """store.place_file (pseudo-label's images, the study's grown label folders, label-next's folder): a copy onto
    a link left by an earlier run must not overwrite the original image the link names."""
    from vfm_toolchain.core.files import place_file

    a, b, dst = tmp_path / "a.jpg", tmp_path / "b.jpg", tmp_path / "out" / "x.jpg"
    a.write_bytes(b"original a")
    b.write_bytes(b"new b")
    place_file(a, dst)
    assert dst.is_symlink() and dst.read_bytes() == b"original a"
    place_file(b, dst, copy=True)
    assert a.read_bytes() == b"original a"  # the original is untouched
    assert not dst.is_symlink() and dst.read_bytes() == b"new b"
    place_file(a, dst)  # and a link over an earlier copy
    assert dst.is_symlink() and dst.resolve() == a.resolve()
