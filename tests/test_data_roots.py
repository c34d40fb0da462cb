"""Data stays where the recipe says (issue 64): every path a data file names stays inside the folder the recipe
names for it, or data.roots, and every file a stage reads is in its key.

The refusals are checked on every reader (COCO file_name, YOLO and segmentation symlinks, ImageFolder symlinks,
pool lists, precomputed pools' paths.txt, the study's oracle), and through the real CLI with an audit hook that
records every file opened: no reader opens the outside file, not even to say that it is not an image.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from tests.conftest import tiny_recipe
from vfm_toolchain.cli import app
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.detection import parse_detection_split, scan_detection_split
from vfm_toolchain.data.images import scan_image_folder
from vfm_toolchain.data.pools import list_pool_source
from vfm_toolchain.data.segmentation import list_segmentation_pairs
from vfm_toolchain.oracle import MaskFolder
from vfm_toolchain.plugins import load_plugins
from vfm_toolchain.recipe import load_recipe, recipe_from_dict
from vfm_toolchain.runner import environment, stage_key
from vfm_toolchain.stage import STAGES

runner = CliRunner()

# every file opened while the hook records: audit hooks cannot be removed, so one hook per process, off by default
_OPENED: List[str] = []
_RECORDING = [False]


def _audit(event: str, args) -> None:
    if _RECORDING[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


if not getattr(sys, "_vfm_roots_audit", False):
    sys.addaudithook(_audit)
    sys._vfm_roots_audit = True


class opened:
    """The files opened inside the block (``with opened() as files: ...``)."""

    def __enter__(self) -> List[str]:
        _OPENED.clear()
        _RECORDING[0] = True
        return _OPENED

    def __exit__(self, *exc) -> None:
        _RECORDING[0] = False


def _image(path: Path, colour=(90, 120, 150), size=(24, 20)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture
def outside(tmp_path) -> Path:
    """A real image and a text file outside every data folder: what a hostile data file points at."""
    _image(tmp_path / "outside" / "secret.png", (200, 10, 10))
    (tmp_path / "outside" / "passwd").write_text("root:x:0:0\n")
    return tmp_path / "outside"


def _coco(root: Path, names: List[str], make=True) -> Path:
    for name in names:
        if make and not name.startswith(("/", "..")) and "/../" not in name:
            _image(root / "images" / name)
    data = {"images": [{"id": i + 1, "file_name": n, "width": 24, "height": 20} for i, n in enumerate(names)],
            "annotations": [{"id": i + 1, "image_id": i + 1, "category_id": 1, "bbox": [2, 2, 10, 10], "iscrowd": 0}
                            for i in range(len(names))],
            "categories": [{"id": 1, "name": "fish"}, {"id": 2, "name": "shark"}]}
    root.mkdir(parents=True, exist_ok=True)
    (root / "annotations.json").write_text(json.dumps(data))
    return root


def _touches(files: List[str], outside: Path) -> List[str]:
    bad = (str(outside), "/etc/passwd", "/etc/hostname")
    return [f for f in files if f.startswith(bad) or os.path.realpath(f).startswith(bad)]


# ---------------------------------------------------------------------------------------------------
# COCO file_name


@pytest.mark.parametrize("name", ["../../../../../../../../etc/passwd", "/etc/hostname", "../../outside/secret.png",
                                  "sub/../../../outside/secret.png", "../../outside/no_such_file.png"])
def test_a_coco_file_name_outside_the_images_folder_is_refused_unopened(tmp_path, outside, name):
    split = _coco(tmp_path / "train", ["a.png", name])
    with opened() as files, pytest.raises(ToolchainError) as err:
        parse_detection_split(split, "train")
    msg = str(err.value)
    assert f"'{split / 'annotations.json'}' names 1 path outside '{split / 'images'}'" in msg
    assert f"image id 2: '{name}'" in msg and "Nothing was opened" in msg and "data.roots" in msg
    assert not _touches(files, outside), files


def test_the_refusal_reads_the_same_whether_the_outside_file_exists_or_not(tmp_path, outside):
    """An error that differed would tell a third party's annotation file which files exist on the machine."""
    answers = []
    for name in ("../../outside/secret.png", "../../outside/secret.pnx"):
        split = _coco(tmp_path / name[-3:] / "train", ["a.png", name])
        with pytest.raises(ToolchainError) as err:
            parse_detection_split(split, "train")
        answers.append(str(err.value).replace(str(split), "SPLIT").replace(name, "NAME"))
    assert answers[0] == answers[1]


def test_a_symlinked_subfolder_of_images_cannot_lead_outside(tmp_path, outside):
    split = _coco(tmp_path / "train", ["a.png"])
    os.symlink(outside, split / "images" / "more")
    _coco(split, ["a.png", "more/secret.png"], make=False)
    with opened() as files, pytest.raises(ToolchainError, match=r"image id 2: 'more/secret.png'"):
        parse_detection_split(split, "train")
    assert not _touches(files, outside)


def test_coco_subfolders_inside_images_and_paths_under_data_roots_are_read(tmp_path, outside):
    split = _coco(tmp_path / "train", ["a.png", "cam1/b.png", "cam2/deep/c.png"])
    assert len(scan_detection_split(split, "train").records) == 3
    _coco(split, ["a.png", "../../outside/secret.png"], make=False)
    records = scan_detection_split(split, "train", data_roots=[str(outside)]).records
    assert sorted(Path(r["path"]).name for r in records) == ["a.png", "secret.png"]


# ---------------------------------------------------------------------------------------------------
# symlinks in split folders: YOLO, segmentation, ImageFolder; pool lists and paths.txt; the oracle


def _yolo(root: Path) -> Path:
    _image(root / "images" / "a.png")
    (root / "labels").mkdir(parents=True)
    (root / "labels" / "a.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (root / "classes.txt").write_text("fish\nshark\n")
    return root


def test_yolo_images_and_labels_that_link_outside_are_refused(tmp_path, outside):
    split = _yolo(tmp_path / "yolo")
    os.symlink(outside / "secret.png", split / "images" / "b.png")
    with opened() as files, pytest.raises(ToolchainError, match=r"holds 1 symlink that leads outside .*b.png: '"):
        parse_detection_split(split, "train")
    assert not _touches(files, outside)
    (split / "images" / "b.png").unlink()
    (outside / "b.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    os.symlink(outside / "b.txt", split / "labels" / "a.txt.tmp")
    os.replace(split / "labels" / "a.txt.tmp", split / "labels" / "a.txt")
    with pytest.raises(ToolchainError, match=r"'.*labels' holds 1 symlink .*a.txt: '.*outside/b.txt'"):
        parse_detection_split(split, "train")
    assert parse_detection_split(split, "train", data_roots=[str(outside)]).entries


def test_segmentation_masks_that_link_outside_are_refused(tmp_path, outside):
    root = tmp_path / "seg"
    _image(root / "images" / "a.png")
    (root / "masks").mkdir()
    Image.new("L", (24, 20)).save(outside / "a.png")
    os.symlink(outside / "a.png", root / "masks" / "a.png")
    with opened() as files, pytest.raises(ToolchainError, match=r"'.*masks' holds 1 symlink that leads outside"):
        list_segmentation_pairs(root, "train")
    assert not _touches(files, outside)
    assert len(list_segmentation_pairs(root, "train", data_roots=[str(outside)])[0]) == 1


def test_a_split_whose_images_folder_links_outside_is_refused(tmp_path, outside):
    """``images -> /datasets/x``: every image under it lies outside the split folder, symlinks or not."""
    root = tmp_path / "seg"
    (root / "masks").mkdir(parents=True)
    Image.new("L", (24, 20)).save(root / "masks" / "secret.png")
    os.symlink(outside, root / "images")
    with opened() as files, pytest.raises(ToolchainError, match=r"'.*seg' holds 1 symlink that leads outside .*images"):
        list_segmentation_pairs(root, "train")
    assert not _touches(files, outside)
    assert len(list_segmentation_pairs(root, "train", data_roots=[str(outside)])[0]) == 1
    split = _coco(tmp_path / "coco", [])  # annotations.json alone
    os.symlink(outside, split / "images")
    _coco(split, ["secret.png"], make=False)
    with pytest.raises(ToolchainError, match=r"'.*coco' holds 1 symlink that leads outside"):
        parse_detection_split(split, "train")
    assert len(parse_detection_split(split, "train", data_roots=[str(outside)]).entries) == 1


def test_the_fingerprint_opens_nothing_outside_and_follows_symlinked_folders_inside(tmp_path, outside):
    from vfm_toolchain.fingerprint import fingerprint_paths

    root = tmp_path / "data"
    _image(root / "cat" / "a.png")
    os.symlink(outside / "secret.png", root / "cat" / "s.png")  # outside: counted by where it points
    os.symlink(tmp_path / "nowhere.png", root / "cat" / "gone.png")  # leads nowhere: no crash
    _image(tmp_path / "shared" / "b.png")
    os.symlink(tmp_path / "shared", root / "dog")  # a folder inside data.roots: walked
    os.symlink(root, root / "cat" / "loop")  # a loop: walked once
    memo = tmp_path / "memo.sqlite"
    with opened() as files:
        first = fingerprint_paths([str(root)], memo, data_roots=[str(tmp_path / "shared")])
    assert not _touches(files, outside)
    _image(tmp_path / "shared" / "b.png", (1, 2, 3))
    assert fingerprint_paths([str(root)], memo, data_roots=[str(tmp_path / "shared")]) != first


def test_imagefolder_images_that_link_outside_are_refused_and_links_inside_are_read(tmp_path, outside):
    root = tmp_path / "train"
    _image(root / "cat" / "a.png")
    _image(root / "dog" / "b.png")
    os.symlink(root / "cat" / "a.png", root / "dog" / "same_as_a.png")  # inside: fine
    assert len(scan_image_folder(root, "train").samples) == 3
    os.symlink(outside / "secret.png", root / "dog" / "c.png")
    with opened() as files, pytest.raises(ToolchainError, match=r"'.*train' holds 1 symlink that leads outside .*dog/c.png"):
        scan_image_folder(root, "train")
    assert not _touches(files, outside)
    assert len(scan_image_folder(root, "train", data_roots=[str(outside)]).samples) == 4


def test_a_pool_list_names_only_files_inside_its_folder_or_data_roots(tmp_path, outside):
    pool = tmp_path / "pool"
    _image(pool / "a.png")
    (pool / "list.txt").write_text(f"# pool\na.png\n../outside/secret.png\n{outside / 'passwd'}\n")
    with opened() as files, pytest.raises(ToolchainError) as err:
        list_pool_source(str(pool / "list.txt"))
    assert "names 2 paths outside" in str(err.value)
    assert "line 3: '../outside/secret.png'; line 4: " in str(err.value)
    assert not _touches(files, outside)
    assert len(list_pool_source(str(pool / "list.txt"), [str(outside)])) == 3


def test_a_precomputed_pools_paths_stay_inside(tmp_path, outside):
    pool = tmp_path / "emb"
    _image(pool / "a.png")
    (pool / "paths.txt").write_text("a.png\n/etc/passwd\n")
    np.save(pool / "000.npy", np.zeros((2, 4), np.float32))
    with pytest.raises(ToolchainError, match=r"paths.txt' names 1 path outside .*line 2: '/etc/passwd'"):
        list_pool_source(str(pool))


def test_a_pool_folder_symlink_outside_is_refused(tmp_path, outside):
    pool = tmp_path / "pool"
    _image(pool / "a.png")
    os.symlink(outside / "secret.png", pool / "b.png")
    with pytest.raises(ToolchainError, match=r"'.*pool' holds 1 symlink .*b.png"):
        list_pool_source(str(pool))


def test_the_oracles_masks_stay_inside(tmp_path, outside):
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    Image.new("L", (24, 20)).save(outside / "m.png")
    os.symlink(outside / "m.png", oracle / "x.png")
    with pytest.raises(ToolchainError, match=r"'.*oracle' holds 1 symlink"):
        MaskFolder(str(oracle))
    MaskFolder(str(oracle), [str(outside)])


def test_data_roots_resolve_against_the_recipe_folder_and_stay_out_of_the_key(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    plain = load_recipe(tmp_path / "r.yaml")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({**raw, "data": {**raw["data"], "roots": ["images"]}}))
    rooted = load_recipe(tmp_path / "r.yaml")
    assert rooted.data.roots == [str(tmp_path / "images")]
    load_plugins()
    prepare = STAGES.get("data.prepare")()
    assert prepare.config(plain) == prepare.config(rooted)  # where files may come from, not which are read


# ---------------------------------------------------------------------------------------------------
# through the CLI: refused before the first stage, and no file outside opened by preflight nor data.prepare


def _hostile_recipes(tiny_task, tmp, outside) -> dict:
    """One recipe per data file format, each naming the outside image (and /etc/passwd where a name can)."""
    det = tmp / "det"
    for split in ("train", "val", "test"):
        _coco(det / split, ["a.png", "b.png", "../../../outside/secret.png", "/etc/passwd"])
    yolo = tmp / "yolo"
    for split in ("train", "val", "test"):
        _yolo(yolo / split)
        os.symlink(outside / "secret.png", yolo / split / "images" / "s.png")
    seg = tmp / "seg"
    for split in ("train", "val", "test"):
        (seg / split / "masks").mkdir(parents=True)
        for n in ("a", "b"):
            _image(seg / split / "images" / f"{n}.png")
            Image.new("L", (24, 20)).save(seg / split / "masks" / f"{n}.png")
        os.symlink(outside / "secret.png", seg / split / "images" / "s.png")
        (seg / split / "classes.txt").write_text("background\nfish\n")
    cls = tmp / "cls"
    for split in ("train", "val", "test"):
        for c in ("cat", "dog"):
            _image(cls / split / c / "a.png")
    os.symlink(outside / "secret.png", cls / "test" / "dog" / "s.png")
    pool = tmp / "pool"
    _image(pool / "a.png")
    (pool / "list.txt").write_text("a.png\n../outside/secret.png\n/etc/passwd\n")
    det_base = {"data.task": "detection", "teacher.name": "torchvision:mobilenet_v2", "teacher.image_size": 64,
                "student.name": "fastvit_t8", "student.image_size": 64, "data.pools": [str(pool)]}
    splits = lambda root: {"data.train": str(root / "train"), "data.val": str(root / "val"),
                           "data.test": str(root / "test")}
    return {
        "coco": tiny_recipe(tiny_task, **det_base, **splits(det)),
        "yolo": tiny_recipe(tiny_task, **det_base, **splits(yolo)),
        "segmentation": tiny_recipe(tiny_task, **{"data.task": "segmentation", **splits(seg),
                                                  "data.pools": [str(pool)]}),
        "imagefolder": tiny_recipe(tiny_task, **splits(cls)),
        "pool list": tiny_recipe(tiny_task, **{"data.pools": [str(pool / "list.txt")]}),
    }


def test_no_reader_opens_a_path_outside_its_roots(tiny_task, tmp_path, outside):
    """Each format's hostile data through ``build --only data.prepare``: refused before the first stage (exit 2),
    and no file outside opened; then data.prepare itself, called past the recipe checks, refuses as well."""
    from vfm_toolchain.stage import StageContext
    import logging

    for fmt, raw in _hostile_recipes(tiny_task, tmp_path, outside).items():
        path = tmp_path / f"{fmt.replace(' ', '_')}.yaml"
        path.write_text(yaml.safe_dump(raw))
        store = tmp_path / f"store_{path.stem}"
        with opened() as files:
            res = runner.invoke(app, ["build", str(path), "--store", str(store), "--out", str(tmp_path / "out"),
                                      "--only", "data.prepare"])
        assert res.exit_code == 2, (fmt, res.output)
        assert "outside" in res.output and "data.roots" in res.output and "Traceback" not in res.output, res.output
        assert "[1/" not in res.output, f"{fmt}: a stage started before the refusal"
        assert not _touches(files, outside), (fmt, _touches(files, outside))
        recipe = recipe_from_dict(raw)
        prepare = STAGES.get("data.prepare")()
        with opened() as files, pytest.raises(ToolchainError, match="outside"):
            prepare.config(recipe)
            work = tmp_path / f"work_{path.stem}"
            work.mkdir()
            prepare.run(StageContext(recipe=recipe, workdir=work, inputs={}, log=logging.getLogger("t")))
        assert not _touches(files, outside), (fmt, _touches(files, outside))


# ---------------------------------------------------------------------------------------------------
# every file a stage reads is in its key


def _key(recipe, stage: str = "data.prepare") -> str:
    load_plugins()  # the stages register with their areas
    return stage_key(STAGES.get(stage)(), recipe, {}, environment())


def _edit_one_byte(path: Path) -> None:
    """One byte changed, the file still of its kind: a box's x in a COCO file, a letter's case in a list, else the
    last byte of an image (its decoder may refuse it; the key must change either way)."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".json":
        i = data.index(b'"bbox": [') + len(b'"bbox": [')  # the first box's x, a single digit here
        data[i] = ord("3") if data[i] != ord("3") else ord("4")
    elif path.suffix == ".txt":
        i = next(i for i, b in enumerate(data) if chr(b).isalpha())
        data[i] ^= 0x20
    else:
        data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_one_changed_byte_of_any_input_changes_the_key(tiny_task, tmp_path, outside):
    """An image, a mask, an annotation file, a pool list, an image a list names, an image a COCO file names under
    data.roots and a local checkpoint: each edited by one byte changes the key of the stage that reads it."""
    from safetensors.torch import save_file
    import torch

    seg = tmp_path / "seg"
    for split in ("train", "test"):
        for n in ("a", "b"):
            _image(seg / split / "images" / f"{n}.png")
            (seg / split / "masks").mkdir(parents=True, exist_ok=True)
            Image.new("L", (24, 20)).save(seg / split / "masks" / f"{n}.png")
    (seg / "train" / "classes.txt").write_text("background\nfish\n")
    pool = tmp_path / "pool"
    _image(pool / "a.png")
    _image(tmp_path / "listed" / "b.png")
    (pool / "list.txt").write_text("a.png\n../listed/b.png\n")
    det = tmp_path / "det"
    for split in ("train", "test"):
        _coco(det / split, ["a.png", "../../../outside/secret.png"])
    weights = tmp_path / "teacher.safetensors"
    save_file({"w": torch.zeros(4)}, str(weights))

    roots = [str(outside), str(tmp_path / "listed")]
    def task(kind: str, root: Path, pools: List[str], **more) -> object:
        return recipe_from_dict(tiny_recipe(tiny_task, **{"data.task": kind, "data.train": str(root / "train"),
                                                          "data.val": None, "data.test": str(root / "test"),
                                                          "data.pools": pools, "data.roots": roots, **more}))

    seg_recipe = task("segmentation", seg, [str(pool / "list.txt")])
    det_recipe = task("detection", det, [str(pool)], **{"teacher.weights": str(weights)})
    edits = [(seg_recipe, "data.prepare", seg / "train" / "images" / "a.png"),
             (seg_recipe, "data.prepare", seg / "test" / "masks" / "b.png"),
             (seg_recipe, "data.prepare", pool / "list.txt"),
             (seg_recipe, "data.prepare", tmp_path / "listed" / "b.png"),
             (det_recipe, "data.prepare", det / "test" / "annotations.json"),
             (det_recipe, "data.prepare", outside / "secret.png"),
             (det_recipe, "teacher.finetune", weights)]
    for recipe, stage, path in edits:
        before = _key(recipe, stage)
        assert _key(recipe, stage) == before  # the key is stable when nothing changed
        _edit_one_byte(path)
        assert _key(recipe, stage) != before, f"editing {path.relative_to(tmp_path)} left {stage}'s key unchanged"


def test_an_edited_listed_pool_image_reruns_data_prepare(tiny_task, tmp_path):
    """The rule end to end: the same build reuses data.prepare, and after one byte of an image that the pool list
    names (outside the list's folder, under data.roots) changes, runs it again."""
    pool = tmp_path / "lists"
    pool.mkdir()
    images = Path(tiny_task["pools"][0])
    (pool / "pool.txt").write_text("".join(f"{p}\n" for p in sorted(images.glob("*.png"))[:6]))
    first = sorted(images.glob("*.png"))[0]
    listed = tmp_path / "copy" / first.name
    listed.parent.mkdir()
    listed.write_bytes(first.read_bytes())
    (pool / "pool.txt").write_text(pool.joinpath("pool.txt").read_text() + f"{listed}\n")
    raw = tiny_recipe(tiny_task, **{"data.pools": [str(pool / "pool.txt")],
                                    "data.roots": [str(images), str(listed.parent)]})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    argv = ["build", str(path), "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
            "--only", "data.prepare"]
    statuses = []
    for edit in (False, False, True):
        if edit:
            _edit_one_byte(listed)
        res = runner.invoke(app, argv)
        assert res.exit_code == 0, res.output
        record = json.loads((tmp_path / "out" / "build.json").read_text())
        statuses.append(record["stages"][0]["status"])
        assert "no report.md this build (report skipped: not requested (--only))" in res.output
    assert statuses == ["ran", "cached", "ran"]
