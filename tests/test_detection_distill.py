"""Detection's transfer set and distillation (issue 38): object-crop queries balanced over classes, the dense
distillation loss, cached teacher targets, pseudo boxes, and the curate and distill stages on a tiny set
(a ResNet-10t teacher and a FastViT-T8 student at 64x128)."""
import json
import logging

import numpy as np
import pytest
import torch

from vfm_toolchain.blocks.detection import Detector
from vfm_toolchain.checkpoint import load_model, save_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.synthetic_detection import generate_detection_task
from vfm_toolchain.prepare import PrepareData, load_index
from vfm_toolchain.recipe import AdapterConfig, recipe_from_dict
from vfm_toolchain.stage import ReportContext, StageContext, StageOutput
from vfm_toolchain.students.detection import build_student_detector
from vfm_toolchain.students.detection_distill import (PSEUDO_MAX, DenseDetection, NeckImitation,
                                                      choose_pseudo_threshold, dense_detection_loss, flat_neck,
                                                      neck_width)
from vfm_toolchain.students.distill import StudentDistill
from vfm_toolchain.students.objectives import OBJECTIVES
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.teachers.curate import TeacherCurate
from vfm_toolchain.teachers.detection import create_detection_teacher, detection_teacher_spec
from vfm_toolchain.teachers.object_queries import MIN_CROP, crop_region, object_queries, query_weights
from vfm_toolchain.teachers.strategies import select_transfer_set

HW = (64, 128)
LOG = logging.getLogger("test")


def _teacher(seed: int = 0) -> Detector:
    torch.manual_seed(seed)
    return create_detection_teacher("timm:resnet10t", "none", HW, 3, AdapterConfig(name="full"), neck_channels=32,
                                    head_convs=1).eval()


@pytest.fixture(scope="module")
def student() -> Detector:
    torch.manual_seed(0)
    return build_student_detector("fastvit_t8", 3).eval()


# ---------------------------------------------------------------------------------------------------
# object-crop queries


def test_crop_keeps_the_encoders_aspect_with_context_and_stays_inside_the_image():
    # a tall box at the right edge, a square encoder: the crop widens to square, moves left inside the image
    x1, y1, x2, y2 = crop_region([180, 20, 200, 80], 200, 100, aspect=1.0, context=0.1)
    assert (x2 - x1) == pytest.approx(y2 - y1, abs=1) and 0 <= x1 and x2 <= 200 and 0 <= y1 and y2 <= 100
    assert x1 <= 180 - 2 and y1 <= 20 - 6 + 1 and y2 >= 80 + 6 - 1  # 10% context on each side, at least
    # a 2 px box still gets a crop with something in it; a box wider than the image is clipped to it
    tiny = crop_region([50, 50, 52, 52], 200, 100, aspect=0.5, context=0.1)
    assert tiny[2] - tiny[0] >= MIN_CROP and tiny[3] - tiny[1] >= MIN_CROP / 2
    assert crop_region([0, 0, 200, 100], 200, 100, aspect=1.0, context=0.5) == (0, 0, 200, 100)


def test_object_queries_give_every_class_an_equal_share_of_the_budget():
    """Hand-made records: class 0 has 12 objects, class 1 one, class 2 three.  Each class's objects share an
    equal part of the crops' budget, and the weighted query-balanced selection gives each class about that
    many transfer images, however many objects it has."""
    records = [{"path": f"{i}.png", "width": 100, "height": 100, "boxes": [[0, 0, 10, 10]] * n, "labels": labels}
               for i, (n, labels) in enumerate([(4, [0, 0, 0, 0]), (4, [0, 0, 0, 0]), (4, [0, 0, 0, 0]),
                                                (2, [1, 2]), (2, [2, 2])])]
    objects = object_queries(records)
    labels = [q.label for q in objects]
    assert len(objects) == 16 and labels.count(0) == 12 and labels.count(1) == 1
    w = query_weights(len(records), labels, object_share=0.6)
    assert w.sum() == pytest.approx(1.0) and w[:5] == pytest.approx([0.08] * 5)
    for c in range(3):  # each class's objects together: 0.6 / 3
        assert w[5:][np.array(labels) == c].sum() == pytest.approx(0.2)
    assert query_weights(0, labels, 1.0).sum() == pytest.approx(1.0)
    assert query_weights(5, [], 0.0) == pytest.approx([0.2] * 5)

    # embeddings: each object query sits in its own region of the pool; whole images far from all of them
    rng = np.random.default_rng(0)
    q_obj = rng.normal(size=(16, 16)) * 10
    q_img = rng.normal(size=(5, 16)) * 10
    pool = np.concatenate([q + rng.normal(size=(40, 16)) * 0.3 for q in np.concatenate([q_img, q_obj])])
    queries = np.concatenate([q_img, q_obj]).astype(np.float32)
    sel = select_transfer_set("query_balanced_image", queries, pool.astype(np.float32), 300, 0, weights=w)
    by_query = np.bincount(sel.queries, minlength=21)
    per_class = [by_query[5:][np.array(labels) == c].sum() for c in range(3)]
    assert len(set(sel.indices.tolist())) == 300
    assert all(abs(n - 0.2 * 300) <= 6 for n in per_class), per_class  # 60 each, not 12:1:3
    assert abs(by_query[:5].sum() - 0.4 * 300) <= 6
    # equal weights: exactly the unweighted rule
    plain = select_transfer_set("query_balanced_image", queries, pool.astype(np.float32), 300, 0)
    same = select_transfer_set("query_balanced_image", queries, pool.astype(np.float32), 300, 0,
                               weights=np.ones(21))
    assert np.array_equal(plain.indices, same.indices)


# ---------------------------------------------------------------------------------------------------
# the dense loss, targets and pseudo boxes


def test_dense_loss_is_zero_when_the_student_reads_as_the_teacher_and_grows_when_not(student):
    x = torch.randn(2, 3, *HW)
    obj = DenseDetection(student, HW)
    with torch.no_grad():
        own = obj.target(student.forward_dense(x))             # the student as its own teacher, via fp16
        flat = student.flatten(student.forward_levels(x))
        same = dense_detection_loss(flat, obj.split(own)[0], 3)
        other = dense_detection_loss(flat, obj.split(obj.target(_teacher(1).forward_dense(x)))[0], 3)
    assert own.dtype == torch.float16 and own.shape == (2, obj.locations * 8)
    assert same["total"].item() < 1e-3
    assert other["total"].item() > 100 * max(same["total"].item(), 1e-5)
    assert other["box"].item() > 0 and other["cls"].item() > 0  # the random teacher is confident somewhere


def _raw_with_objects(model: Detector, boxes, scores, batch=1):
    """Raw forward_dense rows with confident locations at the given boxes: at the stride-8 location nearest each
    box centre, class logit and quality logit giving ``score``, distances reaching the box."""
    c = model.num_classes
    points = torch.cat([torch.stack(torch.meshgrid((torch.arange(HW[0] // s) + 0.5) * s,
                                                   (torch.arange(HW[1] // s) + 0.5) * s, indexing="ij")[::-1],
                                    -1).reshape(-1, 2) for s in model.strides])
    raw = torch.full((batch, len(points), c + 5), -9.0)
    raw[..., c:c + 4] = 4.0
    for (x1, y1, x2, y2), (label, score) in zip(boxes, scores):
        n = int(((points - torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2])) ** 2).sum(1).argmin())
        px, py = points[n].tolist()
        logit = float(torch.logit(torch.tensor(score)))  # sqrt(p * q) = score when p = q = score
        raw[:, n, label], raw[:, n, c + 4] = logit, logit
        raw[:, n, c:c + 4] = torch.tensor([px - x1, py - y1, x2 - px, y2 - py])
    return raw


def test_pseudo_boxes_are_the_teachers_detections_above_the_threshold(student):
    boxes = [[10, 10, 40, 50], [60, 8, 100, 40], [90, 30, 120, 60]]
    raw = _raw_with_objects(student, boxes, [(0, 0.9), (2, 0.7), (1, 0.3)], batch=2)
    obj = DenseDetection(student, HW, "both", pseudo_threshold=0.5)
    target = obj.target(raw)
    assert target.dtype == torch.float16 and target.shape == (2, obj.locations * 8 + PSEUDO_MAX * 6)
    dense, pseudo = obj.split(target)
    assert dense.shape == (2, obj.locations, 8)
    for p in pseudo:
        assert (p["scores"] > 0.5).all() and len(p["scores"]) == 2  # the 0.3 box is not a label
        assert sorted(p["labels"].tolist()) == [0, 2]
        got = {int(l): b.tolist() for l, b in zip(p["labels"], p["boxes"])}
        assert got[0] == pytest.approx(boxes[0], abs=0.1) and got[2] == pytest.approx(boxes[1], abs=0.1)
    assert torch.isfinite(obj(torch.randn(2, 3, *HW), target))  # the detector's own loss on them
    student.eval()
    with pytest.raises(ValueError, match="threshold"):
        DenseDetection(student, HW, "both")


class _Oracle(torch.nn.Module):
    """A teacher that answers each val image's own boxes at score 0.9 and one wrong box at 0.3."""

    def __init__(self, records):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.records, self.seen = records, 0

    def forward_levels(self, x):
        return {"cls": [x[:, :1]], "box": [x[:, :1]], "quality": [x[:, :1]]}

    def decode(self, out, score_thresh, nms_iou, max_det):
        dets = []
        for _ in range(out["cls"][0].shape[0]):
            r = self.records[self.seen]
            self.seen += 1
            sx, sy = HW[1] / r["width"], HW[0] / r["height"]
            boxes = torch.tensor(r["boxes"]).reshape(-1, 4) * torch.tensor([sx, sy, sx, sy])
            dets.append({"boxes": torch.cat([boxes, torch.tensor([[1.0, 1.0, 9.0, 9.0]])]),
                         "scores": torch.tensor([0.9] * len(boxes) + [0.3]),
                         "labels": torch.tensor(r["labels"] + [0], dtype=torch.long)})
        return dets


def test_pseudo_threshold_is_chosen_on_val_by_f1(tiny):
    from vfm_toolchain.data.images import Preprocess

    val = tiny["index"]["val"]
    choice = choose_pseudo_threshold(_Oracle(val), val, Preprocess(HW))
    assert 0.3 < choice["threshold"] <= 0.9 and choice["f1"] == 1.0 and choice["recall"] == 1.0
    assert choice["val_boxes"] == sum(len(r["boxes"]) for r in val)
    assert choose_pseudo_threshold(_teacher(), [], Preprocess(HW))["threshold"] == 0.5


@pytest.mark.parametrize("name", [n for n in OBJECTIVES.list() if OBJECTIVES.meta(n).get("task") == "detection"])
def test_each_detection_objective_learns_its_target(name, student):
    torch.manual_seed(0)
    x = torch.randn(2, 3, *HW)
    teacher = _teacher(1)
    with torch.no_grad():
        raw = teacher.forward_dense(x) if name == "detection_dense" else flat_neck(teacher, x)
    obj = DenseDetection(student, HW) if name == "detection_dense" else \
        NeckImitation(student, neck_width(teacher), HW)
    target = obj.target(raw)
    opt = torch.optim.Adam(obj.parameters(), lr=1e-4)
    first = obj(x, target).item()
    for _ in range(3):
        loss = obj(x, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert obj(x, target).item() < first
    student.eval()


# ---------------------------------------------------------------------------------------------------
# the stages on a tiny task


def _recipe(paths, **distill):
    return recipe_from_dict({"seed": 0, "data": {"task": "detection", "train": paths["train"], "val": paths["val"],
                                                 "test": paths["test"], "pools": paths["pools"]},
                             "teacher": {"name": "timm:resnet10t", "weights": "none", "image_size": list(HW)},
                             "curate": {"budget": 8, "batch_size": 8, "object_share": 0.5},
                             "student": {"name": "fastvit_t8", "image_size": list(HW)},
                             "distill": {"epochs": 1, "batch_size": 4, "views": 2, "teacher_batch_size": 8,
                                         **distill}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A prepared tiny detection task and a saved (untrained) detection teacher, as their stages leave them."""
    root = tmp_path_factory.mktemp("det")
    paths = generate_detection_task(root / "task", classes=3, labeled_per_class=2, val_per_class=1,
                                    test_per_class=1, pool_size=12, distractor_size=4, image_size=64, seed=0)
    recipe = _recipe(paths)
    ctx = StageContext(recipe=recipe, workdir=root / "prepare", inputs={}, log=LOG)
    prepare = StageOutput("data.prepare", "k", root / "prepare", PrepareData().run(ctx))
    teacher = _teacher()
    save_model(root / "teacher" / "model", teacher,
               detection_teacher_spec("timm:resnet10t", list(HW), paths["classes"], AdapterConfig(name="full"),
                                      teacher.backbone.preprocess, neck_channels=32, head_convs=1))
    finetune = StageOutput("teacher.finetune", "k", root / "teacher", {"model": "model"})
    return {"root": root, "paths": paths, "prepare": prepare, "teacher": finetune, "index": load_index(prepare)}


def _curate(tiny, recipe, folder):
    ctx = StageContext(recipe=recipe, workdir=tiny["root"] / folder,
                       inputs={"data.prepare": tiny["prepare"], "teacher.finetune": tiny["teacher"]}, log=LOG)
    stage = TeacherCurate()
    return StageOutput("teacher.curate", "k", ctx.workdir, stage.run(ctx)), stage


@pytest.fixture(scope="module")
def curated(tiny):
    return _curate(tiny, _recipe(tiny["paths"]), "curate")


def test_curate_queries_images_and_object_crops_and_reports_them_per_class(tiny, curated):
    out, stage = curated
    recipe = _recipe(tiny["paths"])
    q = out.result["stats"]["queries"]
    train = tiny["index"]["train"]
    assert q["images"] == len(train) and q["objects"] == sum(len(r["boxes"]) for r in train)
    assert set(q["per_class"]) == set(tiny["paths"]["classes"])
    assert sum(v["object_queries"] for v in q["per_class"].values()) == q["objects"]
    assert all(v["share"] == pytest.approx(0.5 / 3, abs=1e-3) for v in q["per_class"].values())
    assert q["selected_by_images"] + sum(v["selected"] for v in q["per_class"].values()) == 8
    assert out.result["stats"]["selected"] == 8 and "removed" in out.result["stats"]
    with open(out.path("manifest.csv")) as fh:
        assert "#box" in fh.read()  # crops are named by their image and box
    section = stage.report(out, ReportContext(recipe=recipe, inputs={}))
    text = "\n".join(section.lines)
    assert "object queries" in text and all(f"| {c} |" in text for c in tiny["paths"]["classes"])


def test_a_saved_detection_teacher_embeds_images_and_crops_for_curate_encoder_teacher(tiny):
    """curate.encoder: teacher reads the finetuned detector: its backbone still pools a global embedding."""
    from vfm_toolchain.teachers.curate import embed_images
    from vfm_toolchain.teachers.object_queries import ObjectCrops

    recipe = _recipe(tiny["paths"])
    recipe.curate.encoder = "teacher"
    ctx = StageContext(recipe=recipe, workdir=tiny["root"], inputs={"teacher.finetune": tiny["teacher"]}, log=LOG)
    encoder = TeacherCurate()._encoder(ctx)
    assert isinstance(encoder, Detector)
    pp, train = encoder.backbone.preprocess, tiny["index"]["train"]
    images = embed_images(encoder, [r["path"] for r in train], pp, 4)
    crops = embed_images(encoder, ObjectCrops(train, object_queries(train), pp, 0.15), pp, 4)
    assert images.shape == (len(train), 512) and crops.shape == (sum(len(r["boxes"]) for r in train), 512)
    assert np.allclose(np.linalg.norm(crops, axis=1), 1, atol=1e-4)


def test_curate_and_distill_keys_of_other_tasks_do_not_see_the_detection_options(tiny):
    cls = recipe_from_dict({"data": {"source": "synthetic"}})
    assert "object_share" not in TeacherCurate().config(cls)["curate"]
    assert "detection_targets" not in StudentDistill().config(cls)["distill"]
    det = _recipe(tiny["paths"])
    assert "object_share" in TeacherCurate().config(det)["curate"]
    assert StudentDistill().config(det)["distill"]["detection_targets"] == "dense"
    # set on another task's recipe they would be ignored: refused when the recipe loads, naming their task
    for section, field, value in (("distill", "detection_targets", "both"), ("curate", "object_share", 0.2),
                                  ("export", "detection", {"iou": 0.5}), ("student", "head_norm", "batch")):
        with pytest.raises(ToolchainError, match=rf"{section}.{field}: detection only; data.task classification "
                                                 rf"does not read it: remove it, or set data.task: detection"):
            recipe_from_dict({"data": {"source": "synthetic"}, section: {field: value}})


def test_a_batchnorm_head_reaches_every_student_the_build_makes_and_their_keys(tiny):
    """student.head_norm: batch is in the student's key (at its default it is not, so stores made before it keep
    their keys), and the distilled, finetuned, labels-only and candidate students all take it."""
    from vfm_toolchain.blocks.detection import LevelNormTower, SharedTower
    from vfm_toolchain.checkpoint import MODEL_FAMILIES
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.students.models import create_student

    plain = _recipe(tiny["paths"])
    assert "head_norm" not in plain.student.arch_dump() and plain.student.form() == {}
    batch = _recipe(tiny["paths"])
    batch.student.head_norm = "batch"
    assert batch.student.arch_dump()["head_norm"] == "batch"
    assert StudentDistill().config(batch) != StudentDistill().config(plain)
    model = create_student(batch.student.name, 3, "none", "detection", **batch.student.form())
    assert isinstance(model.head.box_tower, LevelNormTower)
    spec = student_task("detection").spec(batch.student.name, list("abc"), Preprocess((64, 64)),
                                          **batch.student.form())
    assert isinstance(MODEL_FAMILIES.get(spec["family"])(spec).head.cls_tower, LevelNormTower)
    assert isinstance(create_student(plain.student.name, 3, "none", "detection").head.cls_tower, SharedTower)


def test_detection_distill_refuses_different_teacher_and_student_sizes(tiny):
    recipe = _recipe(tiny["paths"])
    student_task("detection").check(recipe)  # equal sizes pass
    recipe.student.image_size = (64, 96)
    with pytest.raises(ToolchainError, match="one input size"):
        student_task("detection").check(recipe)
    recipe = _recipe(tiny["paths"], mode="task_agnostic", feature_loss="contrastive")
    with pytest.raises(ToolchainError, match="per location"):
        student_task("detection").check(recipe)


def test_neck_imitation_over_a_recipe_with_pseudo_boxes_names_the_overrides_that_fix_it(tiny):
    recipe = _recipe(tiny["paths"], mode="task_agnostic", detection_targets="both")
    with pytest.raises(ToolchainError, match=r"--set distill.detection_targets=dense "
                                             r"--set distill.pseudo_threshold=null"):
        student_task("detection").check(recipe)
    recipe.distill.detection_targets = "dense"
    student_task("detection").check(recipe)


def test_distill_stage_caches_fp16_targets_reuses_them_and_saves_a_student_that_loads(tiny, curated):
    recipe = _recipe(tiny["paths"])
    curate = curated[0]
    inputs = {"data.prepare": tiny["prepare"], "teacher.finetune": tiny["teacher"], "teacher.curate": curate}
    workdir = tiny["root"] / "distill"
    workdir.mkdir()
    ctx = StageContext(recipe=recipe, workdir=workdir, inputs=inputs, log=LOG)
    result = StudentDistill().run(ctx)
    assert result["objective"] == "detection_dense" and result["detection_targets"] == "dense"
    assert {"test_map50", "test_map", "val_map50", "val_map", "test_per_class_ap"} <= set(result["metrics"])
    assert all(0 <= result["metrics"][k] <= 1 for k in ("test_map50", "test_map", "val_map50", "val_map"))
    assert set(result["metrics"]["test_per_class_ap"]) == set(tiny["paths"]["classes"])
    cache = workdir / "teacher_targets.npy"
    arr = np.load(cache, mmap_mode="r")
    assert arr.dtype == np.float16 and arr.shape[:2] == (8, 2)

    # the cached rows are the teacher's targets for those views, to fp16
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.students.distill import TransferViews
    from vfm_toolchain.teachers.curate import transfer_paths

    teacher = load_model(tiny["teacher"].path("model"))
    views = TransferViews(transfer_paths(curate, tiny["prepare"]), 2, 0, teacher.backbone.preprocess,
                          Preprocess(HW))
    student = build_student_detector("fastvit_t8", 3)
    with torch.no_grad():
        expected = DenseDetection(student, HW).target(teacher.forward_dense(views.teacher_input(3, 1)[None]))
    assert np.allclose(np.asarray(arr[3, 1], dtype=np.float32), expected[0].float().numpy(), atol=2e-3, rtol=2e-3)

    # a rerun in the same folder (a resumed stage) reads the cache instead of running the teacher again
    stamp = cache.stat().st_mtime_ns
    again = StudentDistill().run(ctx)
    assert cache.stat().st_mtime_ns == stamp and again["metrics"] == result["metrics"]

    model = load_model(workdir / "model")
    spec = json.loads((workdir / "model" / "spec.json").read_text())
    assert isinstance(model, Detector) and spec["family"] == "detection_student" and spec["name"] == "fastvit_t8"
    with torch.no_grad():
        det = model.decode(model.forward_levels(torch.zeros(1, 3, *HW)))
    assert len(det) == 1 and det[0]["boxes"].shape[1] == 4

    section = StudentDistill().report(StageOutput("student.distill", "k", workdir, result),
                                      ReportContext(recipe=recipe, inputs={}))
    assert section.scores[0].key == "student_after_distill_map50"
    assert "dense targets" in section.summary[0]


def test_labeled_images_join_the_transfer_set_through_the_teacher(tiny, curated):
    """distill.labeled_images: the labeled training images get teacher targets beside the transfer set (their labels
    are not read there); off, the stage's key is the one stores made before the option existed."""
    from vfm_toolchain.prepare import load_index, sample_paths

    off, on = _recipe(tiny["paths"]), _recipe(tiny["paths"], labeled_images=True)
    assert "labeled_images" not in StudentDistill().config(off)["distill"]
    assert StudentDistill().config(on)["distill"]["labeled_images"] is True
    inputs = {"data.prepare": tiny["prepare"], "teacher.finetune": tiny["teacher"], "teacher.curate": curated[0]}
    workdir = tiny["root"] / "distill_labeled"
    workdir.mkdir()
    StudentDistill().run(StageContext(recipe=on, workdir=workdir, inputs=inputs, log=LOG))
    labeled = len(set(sample_paths(load_index(tiny["prepare"])["train"])))
    assert np.load(workdir / "teacher_targets.npy", mmap_mode="r").shape[:2] == (8 + labeled, 2)
