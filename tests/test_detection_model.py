"""The FCOS detector (blocks/detection.py, teachers/detection.py, students/detection.py) on hand-made cases and tiny backbones:
assignment, loss, decoding, every backbone family, a few training steps, fold passes and NMS inside ONNX."""
import json
import math

import pytest
import torch
from torchvision.ops import box_iou

from vfm_toolchain.blocks.detection import (Detector, DetectorWithNMS, fcos_assign, level_points, select_detections,
                                            size_ranges)
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.students.detection import build_student_detector
from vfm_toolchain.teachers.detection import create_detection_teacher

HW = (64, 96)  # non-square, every side a multiple of 32


@pytest.fixture(scope="module")
def tiny() -> Detector:
    torch.manual_seed(0)
    return create_detection_teacher("timm:resnet10t", "none", HW, 3, AdapterConfig(name="full"), neck_channels=32,
                                    head_convs=1).eval()


def _levels(h, w, strides=(8, 16, 32)):
    pts = [level_points(h // s, w // s, s) for s in strides]
    st = torch.cat([torch.full((len(p),), float(s)) for p, s in zip(pts, strides)])
    ranges = torch.tensor(size_ranges(3))[torch.cat([torch.full((len(p),), i) for i, p in enumerate(pts)])]
    return torch.cat(pts), st, ranges


def _at(points, strides, stride, xy_set):
    """Indices of the locations of one level whose centres are in ``xy_set``."""
    return sorted(i for i, (p, s) in enumerate(zip(points.tolist(), strides.tolist()))
                  if s == stride and tuple(p) in xy_set)


def test_fcos_assignment_on_a_hand_made_case():
    points, strides, ranges = _levels(128, 192)
    boxes = torch.tensor([[10., 10., 50., 40.],     # A: 40 x 30, reach < 64 -> stride 8
                          [0., 0., 60., 60.],       # B: contains A's centre region too, but is larger
                          [40., 20., 180., 120.]])  # C: reach 76..92 at its centre -> stride 16
    labels = torch.tensor([1, 0, 2])
    got, assigned, ctr = fcos_assign(points, strides, ranges, boxes, labels, radius=1.5)
    # A at stride 8: centre (30, 25), region 1.5 * 8 = 12 around it clipped to A: x in (18, 42), y in (13, 37);
    # the stride-8 centres are 4 + 8k, so x and y each in {20, 28, 36}
    a = _at(points, strides, 8, {(x, y) for x in (20., 28., 36.) for y in (20., 28., 36.)})
    # B's region (18, 42)^2 holds the same nine centres with reach <= 40 (in range): the smaller A wins them all
    # C at stride 16: centre (110, 70), region 24: x in (86, 134), y in (46, 94) -> {88, 104, 120} x {56, 72, 88},
    # largest distance 76..92, inside [64, 128]; at stride 8 its reach is > 64, at stride 32 < 128: nothing there
    c = _at(points, strides, 16, {(x, y) for x in (88., 104., 120.) for y in (56., 72., 88.)})
    assert len(a) == 9 and len(c) == 9
    assert (got >= 0).nonzero().flatten().tolist() == sorted(a + c)
    assert set(got[a].tolist()) == {1} and set(got[c].tolist()) == {2} and 0 not in got.tolist()
    assert torch.equal(assigned[a], boxes[0].expand(9, 4)) and torch.equal(assigned[c], boxes[2].expand(9, 4))
    # centerness at (28, 28) in A: l, t, r, b = 18, 18, 22, 12
    i = _at(points, strides, 8, {(28., 28.)})[0]
    assert ctr[i].item() == pytest.approx(math.sqrt(18 / 22 * 12 / 18), abs=1e-6)
    # a location outside every box, and one inside C but outside its centre region, are background
    for xy, s in (((4., 124.), 8), ((40., 24.), 16)):
        j = _at(points, strides, s, {xy})[0]
        assert got[j] == -1 and ctr[j] == 0
    empty, _, _ = fcos_assign(points, strides, ranges, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert (empty == -1).all()


def _outputs_from_flat(model: Detector, cls, box, quality, hw=HW):
    """Per-level output dict from rows over all locations (the inverse of Detector.flatten)."""
    out, start = {"cls": [], "box": [], "quality": []}, 0
    for s in model.strides:
        h, w = hw[0] // s, hw[1] // s
        sl = slice(start, start + h * w)
        for key, t in (("cls", cls), ("box", box), ("quality", quality[..., None])):
            out[key].append(t[:, sl].transpose(1, 2).reshape(t.shape[0], t.shape[2], h, w))
        start += h * w
    return out


def _perfect(model: Detector, targets, wrong_class=None):
    """Outputs that predict the targets exactly: logit +10 for the assigned class (or ``wrong_class``) at
    positives and -10 elsewhere, the assigned box's distances, the centerness as quality."""
    n = sum((HW[0] // s) * (HW[1] // s) for s in model.strides)
    flat = model.flatten(_outputs_from_flat(model, torch.zeros(1, n, 3), torch.ones(1, n, 4), torch.zeros(1, n)))
    labels, boxes, ctr = model.assign(flat, targets)
    pos = labels[0] >= 0
    cls = torch.full((1, n, 3), -10.0)
    cls[0, pos, labels[0, pos] if wrong_class is None else wrong_class] = 10.0
    pts = flat["points"]
    ltrb = torch.cat([pts - boxes[0, :, :2], boxes[0, :, 2:] - pts], dim=1)
    box = torch.where(pos[:, None], ltrb, torch.full_like(ltrb, 4.0))[None]
    quality = torch.logit(ctr.clamp(1e-4, 1 - 1e-4))
    return _outputs_from_flat(model, cls, box, quality), int(pos.sum())


def test_loss_on_a_hand_made_case(tiny):
    targets = [{"boxes": torch.tensor([[10., 10., 50., 40.]]), "labels": torch.tensor([1])}]
    perfect, num_pos = _perfect(tiny, targets)
    assert num_pos == 9
    good = tiny.loss(perfect, targets)
    assert good["box"].item() < 1e-5 and good["cls"].item() < 1e-3
    assert good["total"].item() == pytest.approx((good["cls"] + good["box"] + good["quality"]).item())
    wrong, _ = _perfect(tiny, targets, wrong_class=2)
    bad = tiny.loss(wrong, targets)
    assert bad["box"].item() < 1e-5 and bad["cls"].item() > good["cls"].item() + 1.0
    assert bad["total"].item() > good["total"].item() + 1.0
    shifted = {k: list(v) for k, v in perfect.items()}
    shifted["box"] = [b + 6.0 for b in perfect["box"]]  # every box 6 px too large on each side
    assert tiny.loss(shifted, targets)["box"].item() > 0.1
    # an image without objects: the class loss alone, every term finite
    none = tiny.loss(perfect, [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)}])
    assert all(torch.isfinite(v) for v in none.values()) and none["box"].item() == 0
    with pytest.raises(ToolchainError, match="outside 0..2"):
        tiny.loss(perfect, [{"boxes": torch.tensor([[1., 1., 9., 9.]]), "labels": torch.tensor([3])}])
    with pytest.raises(ToolchainError, match="2 targets for a batch of 1"):
        tiny.loss(perfect, targets * 2)


def test_decode_and_nms_remove_a_duplicate_box(tiny):
    n = sum((HW[0] // s) * (HW[1] // s) for s in tiny.strides)
    pts = tiny.flatten(_outputs_from_flat(tiny, torch.zeros(1, n, 3), torch.ones(1, n, 4), torch.zeros(1, n)))["points"]
    cls, box, quality = torch.full((1, n, 3), -20.0), torch.full((1, n, 4), 2.0), torch.full((1, n), 20.0)
    i, j, k = 25, 26, 60  # two neighbours at stride 8 (x 12 and 20 on row 2), and one far away
    target = torch.tensor([8., 10., 40., 36.])
    for loc, label, logit in ((i, 1, 3.0), (j, 1, 2.0), (j, 2, 1.0), (k, 0, 0.5)):
        cls[0, loc, label] = logit
        box[0, loc] = torch.cat([pts[loc] - target[:2], target[2:] - pts[loc]])
    box[0, k] = torch.tensor([4., 4., 4., 4.])
    det = tiny.decode(_outputs_from_flat(tiny, cls, box, quality), score_thresh=0.3, nms_iou=0.5)[0]
    # i and j predict the same class-1 box: j's is suppressed; j's class-2 score is another class and stays
    assert det["labels"].tolist() == [1, 2, 0]
    assert torch.allclose(det["scores"], torch.sigmoid(torch.tensor([3.0, 1.0, 0.5])).sqrt(), atol=1e-6)
    assert torch.allclose(det["boxes"][0], target) and torch.allclose(det["boxes"][1], target)
    only_one = tiny.decode(_outputs_from_flat(tiny, cls, box, quality), score_thresh=0.3, nms_iou=0.5, max_det=1)[0]
    assert only_one["labels"].tolist() == [1]


@pytest.fixture(scope="module")
def tiny_open_clip_resnet(tmp_path_factory):
    """open_clip's ModifiedResNet (the RN50 family's tower: stem, layer1..4, attention pool) at a test's size, as a
    model config open_clip reads like its own: ``open_clip:tiny-RN``."""
    import open_clip

    folder = tmp_path_factory.mktemp("open_clip_configs")
    (folder / "tiny-RN.json").write_text(json.dumps({
        "embed_dim": 32, "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "patch_size": None},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 1, "layers": 1}}))
    open_clip.add_model_config(folder)
    return "open_clip:tiny-RN"


@pytest.mark.parametrize("kind,name,hw", [("teacher", "timm:resnet10t", HW),
                                          ("teacher", "timm:vit_tiny_patch16_224", HW),
                                          ("teacher", "torchvision:mobilenet_v2", HW),
                                          ("teacher", "open_clip:ViT-B-32", HW),  # patch 32: two deconvs to 8
                                          ("teacher", "open_clip:tiny-RN", (64, 64)),  # ModifiedResNet: square
                                          ("student", "mobilevitv2_050", (64, 128)),  # MobileViT-V2: sides x 64
                                          ("student", "fastvit_t8", HW)])
def test_detector_builds_on_every_backbone_family(kind, name, hw, tiny_open_clip_resnet):
    """Maps at input / 8, / 16, / 32 on a non-square input, and a loss that trains the right weights: LoRA
    (wrapping the backbone as the classification teacher does), neck and head; the model rebuilds from its spec."""
    from vfm_toolchain.checkpoint import MODEL_FAMILIES
    from vfm_toolchain.data.images import Preprocess

    torch.manual_seed(0)
    if kind == "teacher":
        from vfm_toolchain.teachers.detection import detection_teacher_spec

        cfg = AdapterConfig(name="lora", r=2, alpha=4)
        model = create_detection_teacher(name, "none", hw, 3, cfg, neck_channels=32, head_convs=1)
        spec = detection_teacher_spec(name, list(hw), list("abc"), cfg, Preprocess(hw), 32, 1)  # as JSON keeps it
    else:
        from vfm_toolchain.students.detection import detection_student_spec

        model = build_student_detector(name, 3, neck_channels=32, head_convs=1)
        spec = detection_student_spec(name, list("abc"), Preprocess(hw), 32, 1)
    x = torch.randn(2, 3, *hw)
    out = model.train()(x)
    for key, ch in (("cls", 3), ("box", 4), ("quality", 1)):
        assert [tuple(o.shape) for o in out[key]] == [(2, ch, hw[0] // s, hw[1] // s) for s in (8, 16, 32)]
    targets = [{"boxes": torch.tensor([[4., 6., 40., 50.]]), "labels": torch.tensor([2])},
               {"boxes": torch.tensor([[30., 8., 60., 30.], [0., 0., 64., 64.]]), "labels": torch.tensor([0, 1])}]
    model.loss(out, targets)["total"].backward()
    assert model.head.cls_logits.weight.grad.abs().sum() > 0 and model.neck.lateral[0].weight.grad is not None
    if kind == "teacher":
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
        assert not any(p.requires_grad for n, p in model.backbone.named_parameters() if "lora_" not in n)
        assert model.backbone(x).ndim == 2  # the pooled embedding curation reads is still there
    rebuilt = MODEL_FAMILIES.get(spec["family"])(spec).eval()
    rebuilt.load_state_dict(model.state_dict())
    with torch.no_grad():
        a, b = model.eval().forward_dense(x), rebuilt.forward_dense(x)
    assert a.shape == (2, sum((hw[0] // s) * (hw[1] // s) for s in (8, 16, 32)), 3 + 5) and (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("stride,grid,image", [(16, (4, 6), (64, 96)),     # ViT-B/16: ViTDet's own case
                                               (14, (16, 32), (224, 448)),  # DINOv2's patch 14: resized to 16
                                               (32, (2, 3), (64, 96)),      # OpenCLIP ViT-B/32
                                               (8, (8, 12), (64, 96))])     # a patch-8 ViT: pooled twice
def test_simple_feature_pyramid_reaches_8_16_32_from_any_patch(stride, grid, image):
    from vfm_toolchain.blocks.detection import SimpleFeaturePyramid

    pyramid = SimpleFeaturePyramid(64, stride)
    maps = pyramid(torch.randn(2, 64, *grid), image)
    assert [tuple(m.shape[-2:]) for m in maps] == [(image[0] // s, image[1] // s) for s in (8, 16, 32)]
    assert [m.shape[1] for m in maps] == pyramid.channels


def test_a_few_steps_on_a_toy_batch_reduce_the_loss():
    torch.manual_seed(0)
    model = create_detection_teacher("timm:resnet10t", "none", HW, 2, AdapterConfig(name="full"), neck_channels=32,
                                     head_convs=1).train()
    x = torch.randn(2, 3, *HW)
    targets = [{"boxes": torch.tensor([[8., 8., 40., 56.]]), "labels": torch.tensor([0])},
               {"boxes": torch.tensor([[40., 10., 90., 40.]]), "labels": torch.tensor([1])}]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(15):
        loss = model.loss(model(x), targets)["total"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_dense_outputs_are_the_teachers_per_location_targets(tiny):
    x = torch.randn(2, 3, *HW)
    with torch.no_grad():
        out = tiny(x)
        dense = tiny.dense_outputs(out)
    n = sum((HW[0] // s) * (HW[1] // s) for s in tiny.strides)
    assert dense["cls_prob"].shape == (2, n, 3) and dense["box"].shape == (2, n, 4) and dense["quality"].shape == (2, n)
    assert dense["points"].shape == (n, 2) and dense["strides"].tolist().count(32.0) == 2 * 3
    assert 0 < dense["cls_prob"].min() and dense["cls_prob"].max() < 1 and (dense["box"] > 0).all()
    # the last row is the bottom-right location of the stride-32 level
    assert dense["points"][-1].tolist() == [96 - 16, 64 - 16]
    assert torch.allclose(dense["cls_prob"][:, -1], out["cls"][-1][:, :, -1, -1].sigmoid())


def test_sizes_and_adapters_a_detector_refuses():
    model = build_student_detector("mobilevitv2_050", 2, neck_channels=16, head_convs=1)
    with pytest.raises(ToolchainError, match="multiples of 32 .64 for MobileViT-V2"):
        model(torch.randn(1, 3, 64, 96))  # 96 / 32 = 3: MobileViT-V2 pads the odd grid to 4
    with pytest.raises(ToolchainError, match="pooled embedding"):
        create_detection_teacher("timm:resnet10t", "none", HW, 2, AdapterConfig(name="llu"))
    with pytest.raises(ToolchainError, match="unknown student"):
        build_student_detector("no_such_student", 2)


def test_fastvit_reparameterization_folds_inside_the_detector():
    """The export floor's fold passes (reparameterize, BatchNorm fusion) find FastViT's blocks inside the detector
    and keep every location's outputs."""
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.students.detection import detection_student_spec
    from vfm_toolchain.students.fold import fold_model

    torch.manual_seed(0)
    model = build_student_detector("fastvit_t8", 3, neck_channels=16, head_convs=1).train()
    with torch.no_grad():  # BatchNorm statistics that are not the identity, so fusing them means something
        model(torch.randn(4, 3, *HW))
    model.eval().dense_output = True
    spec = detection_student_spec("fastvit_t8", list("abc"), Preprocess(HW), 16, 1)
    folded, records = fold_model(model, spec, torch.randn(2, 3, *HW))
    by_pass = {r["pass"]: r for r in records}
    assert by_pass["reparameterize"]["params_after"] < by_pass["reparameterize"]["params_before"]
    assert all(r["max_abs_diff"] < 1e-4 for r in records), records
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())


def test_a_batchnorm_head_keeps_each_levels_statistics_and_folds_into_a_tower_per_level():
    """head_norm batch: the levels share the towers' convolutions and each trains a BatchNorm of its own; the
    export floor's level_batchnorm pass gives every level its own conv + ReLU tower with no normalisation left,
    the same outputs at every location, and the spec rebuilds the network before folding."""
    from vfm_toolchain.blocks.detection import LevelNormTower, LevelTowers
    from vfm_toolchain.checkpoint import MODEL_FAMILIES
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.students.detection import detection_student_spec
    from vfm_toolchain.students.fold import fold_model

    torch.manual_seed(0)
    model = build_student_detector("timm:resnet10t", 3, neck_channels=16, head_convs=2, head_norm="batch").train()
    tower = model.head.cls_tower
    assert isinstance(tower, LevelNormTower) and len(tower.convs) == 2 and len(tower.norms) == 3
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, *HW) * 2)
    means = [norms[0].running_mean for norms in tower.norms]
    assert not torch.allclose(means[0], means[2]), "each level keeps statistics of its own"
    spec = detection_student_spec("timm:resnet10t", list("abc"), Preprocess(HW), 16, 2, "batch")
    rebuilt = MODEL_FAMILIES.get(spec["family"])(spec)
    rebuilt.load_state_dict(model.state_dict())
    model.eval().dense_output = True
    x = torch.randn(2, 3, *HW)
    folded, records = fold_model(model, spec, x)
    assert next(r for r in records if r["pass"] == "level_batchnorm")["max_abs_diff"] < 1e-4
    assert isinstance(folded.head.cls_tower, LevelTowers) and isinstance(folded.head.box_tower, LevelTowers)
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm)) for m in folded.head.modules())
    with torch.no_grad():
        assert (folded.forward_dense(x) - rebuilt.eval().forward_dense(x)).abs().max() < 1e-4
    with pytest.raises(ToolchainError, match="head norm 'layer': use one of group, batch"):
        build_student_detector("timm:resnet10t", 3, neck_channels=16, head_norm="layer")


def test_teacher_lora_merges_into_plain_weights():
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.teachers.detection import detection_teacher_spec
    from vfm_toolchain.teachers.model import fold_teacher

    torch.manual_seed(0)
    cfg = AdapterConfig(name="lora", r=2, alpha=4)
    model = create_detection_teacher("timm:resnet10t", "none", HW, 2, cfg, neck_channels=16, head_convs=1).eval()
    x = torch.randn(2, 3, *HW)
    with torch.no_grad():
        for n, p in model.named_parameters():  # B != 0: the adapter changes the outputs, so merging means something
            if "lora_B" in n:
                p.normal_(std=0.05)
        adapted = model.forward_dense(x)
        merged = fold_teacher(model, detection_teacher_spec("timm:resnet10t", HW, list("ab"), cfg, Preprocess(HW)))
        assert (merged.forward_dense(x) - adapted).abs().max() < 1e-4
    assert not [n for n, _ in merged.named_modules() if "lora_" in n]


def test_imagenet_mobilenet_v2_is_the_teachers_backbone():
    """The one real pretrained backbone here (``../shared/data/weights``) loads under the detection head, and
    its stride 8 / 16 / 32 maps are the ``.features`` stages MobileNetV2 has there."""
    from tests.conftest import shared_data_or_skip

    path = shared_data_or_skip() / "weights" / "mobilenet_v2-b0353104.pth"
    model = create_detection_teacher("torchvision:mobilenet_v2", str(path), (96, 128), 7, AdapterConfig(name="lora"))
    state = torch.load(path, map_location="cpu", weights_only=True)
    net = model.backbone.model.model  # inside PEFT's LoRA wrapper
    assert torch.equal(net.features[0][0].weight, state["features.0.0.weight"])
    assert model.reader.indices == (6, 13, 18) and model.neck.lateral[2].in_channels == 1280


def _match(ref: torch.Tensor, got: torch.Tensor):
    """Every reference detection has one in ``got`` of the same image and class with IoU > 0.99."""
    assert ref.shape == got.shape, (ref.shape, got.shape)
    for img in ref[:, 0].unique():
        for cls in ref[ref[:, 0] == img][:, 6].unique():
            a = ref[(ref[:, 0] == img) & (ref[:, 6] == cls)]
            b = got[(got[:, 0] == img) & (got[:, 6] == cls)]
            assert len(a) == len(b)
            iou = box_iou(a[:, 1:5], b[:, 1:5])
            best, at = iou.max(1)
            assert (best > 0.99).all() and len(set(at.tolist())) == len(a)
            assert (a[:, 5] - b[at, 5]).abs().max() < 1e-4


def test_nms_inside_the_onnx_graph_matches_pytorch(tmp_path):
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    model = create_detection_teacher("timm:resnet10t", "none", HW, 4, AdapterConfig(name="full"), neck_channels=16,
                                     head_convs=1).eval()
    with torch.no_grad():  # spread the scores apart, so that many boxes pass and NMS has work to do
        model.head.cls_logits.weight.normal_(std=0.5)
        model.head.quality.weight.normal_(std=0.5)
    wrapped = DetectorWithNMS(model, score_thresh=0.3, iou=0.5, max_det=20).eval()
    x = torch.randn(2, 3, *HW)
    path = tmp_path / "det.onnx"
    torch.onnx.export(wrapped, (x,), str(path), opset_version=17, input_names=["input"], output_names=["detections"],
                      dynamic_axes={"input": {0: "batch"}, "detections": {0: "detections"}}, dynamo=False)
    graph = onnx.load(str(path)).graph
    assert [n.op_type for n in graph.node].count("NonMaxSuppression") == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (x, torch.randn(3, 3, *HW)):  # the batch stays free
        with torch.no_grad():
            ref = wrapped(batch)
        got = torch.from_numpy(session.run(None, {"input": batch.numpy()})[0])
        assert ref.shape[1] == 7 and len(ref) > len(batch)  # something to compare
        _match(ref, got)
        assert torch.bincount(ref[:, 0].long()).max() <= 20
    # the eager path is select_detections, which decode runs too
    with torch.no_grad():
        per_image = model.decode(model(x), 0.3, 0.5, 20)
        flat = select_detections(*model.boxes_and_scores(model(x)), 0.3, 0.5, 20)
    assert sum(len(d["boxes"]) for d in per_image) == len(flat)


def test_an_open_clip_resnet_tower_refuses_a_non_square_size_with_the_fix(tiny_open_clip_resnet):
    """Its attention pool (the pooled embedding curation reads) has a fixed square grid: said before building."""
    with pytest.raises(ToolchainError, match=r"ResNet tower.*64x96 is not square.*image_size: 96"):
        create_detection_teacher(tiny_open_clip_resnet, "none", (64, 96), 3, AdapterConfig(name="lora", r=2, alpha=4))
