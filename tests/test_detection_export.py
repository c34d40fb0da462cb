"""Detection through export and bench (issue 38): a detector folded, exported to ONNX fp32 with its NMS inside the
graph, its final boxes matched to PyTorch's, its test mAP measured through the artifact's own runner, timed by
bench.latency, scored on a device bundle's slice; the on-device formats (OpenVINO with the NMS in its graph,
ExecuTorch and LiteRT with the runtime layer's NMS) through the same gates; and the recipe check that keeps the
formats not built for detectors out."""
from __future__ import annotations

import importlib.util
import json
import logging

import numpy as np
import pytest
import torch

from vfm_toolchain.checkpoint import save_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_json
from vfm_toolchain.data.detection import scan_detection_split
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.data.synthetic_detection import generate_detection_task
from vfm_toolchain.export.convert import ExportConvert
from vfm_toolchain.export.parity import ParityError, check_detection_parity, match_detections
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.stage import ReportContext, ReportSection, Score, StageContext, StageOutput
from vfm_toolchain.students.detection import build_student_detector, detection_student_spec
from vfm_toolchain.tasks.detection import artifact_scores as detection_scores

NAME = "timm:resnet10t"  # few, plain convolutions: quick on 2 busy cores
HW = (64, 128)  # non-square, both sides multiples of 32
CLASSES = ["circle", "square", "triangle"]
NMS = {"score_thresh": 0.05, "iou": 0.6, "max_det": 100}


def _recipe(**export):
    export = {"options": {"onnx": {"dynamic_size": True}}, **export}
    return recipe_from_dict({
        "name": "det", "data": {"task": "detection", "source": "synthetic"},
        "teacher": {"name": "timm:resnet10t", "weights": "none", "image_size": list(HW)},
        "student": {"name": NAME, "image_size": list(HW)},
        "export": {"formats": ["onnx"], "parity_images": 4, **export},
        "bench": {"runtimes": ["auto"], "batch_sizes": [1], "warmup": 0, "iters": 2, "repeats": 1, "memory": False}})


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """A tiny build's data.prepare and student.finetune outputs: the procedural detection task's test split, and a
    ResNet-10t detector (random weights, its class and quality logits spread so that many boxes pass the threshold
    and NMS has work to do) saved as the finetune stage saves it."""
    root = tmp_path_factory.mktemp("det_export")
    paths = generate_detection_task(root / "task", classes=3, labeled_per_class=1, val_per_class=1, test_per_class=2,
                                    pool_size=0, distractor_size=0, image_size=96, seed=0)
    test = scan_detection_split(paths["test"], "test").records
    (root / "prep").mkdir()
    torch.manual_seed(0)
    model = build_student_detector(NAME, 3, neck_channels=16, head_convs=1).train()
    with torch.no_grad():
        model(torch.randn(4, 3, *HW))  # BatchNorm statistics that are not the identity, so the fold means something
        model.head.cls_logits.weight.normal_(std=0.5)
        model.head.quality.weight.normal_(std=0.5)
    save_model(root / "finetune" / "model", model.eval(),
               detection_student_spec(NAME, CLASSES, Preprocess(HW), 16, 1))
    test = _labels_it_partly_finds(model, test)
    atomic_write_json(root / "prep" / "index.json", {"task": "detection", "classes": CLASSES, "train": test, "val": [],
                                                      "test": test, "pool": [], "pool_roots": []})
    inputs = {"data.prepare": StageOutput("data.prepare", "k", root / "prep", {}),
              "student.finetune": StageOutput("student.finetune", "k", root / "finetune", {})}
    return {"root": root, "test": test, "inputs": inputs}


def _labels_it_partly_finds(model, records):
    """The records with boxes a random detector gets partly right, so its test mAP is neither 0 nor 1 and moves with
    any box or score the artifact changed: each image's labels are some of the model's own detections (its 1st,
    3rd, 6th and 10th, at the image's resolution) and one box it does not find."""
    from vfm_toolchain.blocks.detection import DetectorWithNMS
    from vfm_toolchain.data.detection import DetectionDataset

    ds = DetectionDataset(records, Preprocess(HW), train=False)
    with torch.no_grad():
        det = DetectorWithNMS(model, **NMS).eval()(torch.stack([ds[i][0] for i in range(len(ds))]))
    out = []
    for k, r in enumerate(records):
        d = det[det[:, 0] == k][[0, 2, 5, 9]]
        scale = torch.tensor([HW[1] / r["width"], HW[0] / r["height"]] * 2)
        boxes = (d[:, 1:5] / scale).tolist() + [[1.0, 1.0, 30.0, 20.0]]
        out.append({**r, "boxes": boxes, "labels": d[:, 6].long().tolist() + [k % 3]})
    return out


def _export(build, workdir, recipe=None):
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(recipe=recipe or _recipe(), workdir=workdir, inputs=build["inputs"], log=logging.getLogger("t"))
    return ExportConvert().run(ctx)


@pytest.fixture(scope="module")
def exported(build):
    wd = build["root"] / "export"
    result = json.loads(json.dumps(_export(build, wd)))  # as result.json stores it
    return {**build, "export": StageOutput("export.convert", "k", wd, result)}


def _onnx(exported):
    return next(a for a in exported["export"].result["artifacts"] if a["kind"] == "onnx")


def test_a_detector_folds_exports_with_nms_and_passes_parity(exported):
    import onnx

    a = _onnx(exported)
    assert a["status"] == "ok" and a["parity"] == "detections" and a["parity_images"] == 4
    assert a["parity_reference_detections"] > 8 and a["parity_matched"] == a["parity_reference_detections"]
    assert a["parity_artifact_detections"] == a["parity_reference_detections"] and a["parity_min_iou"] > 0.999
    assert a["parity_max_score_diff"] < 1e-4 and a["parity_max_abs_diff"] < 1e-2
    other = a["dynamic_size_check"]  # a free height / width: the boxes matched at a second size too
    assert other["image_size"] == [96, 160] and other["detections"]["matched"] > 0 and other["max_abs_diff"] < 1e-2
    folds = {r["pass"]: r for r in exported["export"].result["folds"]["student"]}
    assert folds["bn_fuse"]["params_after"] < folds["bn_fuse"]["params_before"]  # dense outputs compared
    assert all(r["max_abs_diff"] < 1e-3 for r in folds.values())
    assert exported["export"].result["detection"] == NMS
    proto = onnx.load(str(exported["export"].dir / a["path"]))
    assert [n.op_type for n in proto.graph.node].count("NonMaxSuppression") == 1
    (out,), (inp,) = proto.graph.output, proto.graph.input
    assert out.name == "detections"
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["detections", 7]
    assert inp.type.tensor_type.shape.dim[0].dim_param == "batch"
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta["nms"]) == NMS and "batch_index, x1, y1, x2, y2, score, class" in meta["output"]
    assert "NCHW, RGB" in meta["input"] and "no letterbox" in meta["input"]  # how an app makes the input
    assert json.loads(meta["preprocess"])["size"] == list(HW)


def test_the_artifacts_map_is_measured_through_its_runner_and_equals_pytorchs(exported):
    a = _onnx(exported)
    assert a["metric"] == "map50" and a["test_score"] == a["test_map50"]
    assert 0.2 < a["test_map50"] < 0.95 and a["test_map"] <= a["test_map50"]
    assert a["test_map50"] == pytest.approx(a["pytorch_test_map50"], abs=1e-9)
    assert a["test_map"] == pytest.approx(a["pytorch_test_map"], abs=1e-9)
    # the [K, 7] rows are split into per-image predictions in input pixels: every box where it is scores 1
    perfect = _planted(exported["test"], jitter=0, false_positives=0)
    assert detection_scores(perfect, exported["test"], Preprocess(HW), 3) == {"map50": pytest.approx(1.0),
                                                                             "map": pytest.approx(1.0)}


def test_perturbed_boxes_fail_parity_with_a_clear_message(build, monkeypatch, tmp_path):
    from vfm_toolchain.export.formats import onnx_format

    real = onnx_format.cpu_runner

    def shifted(path):  # the artifact's boxes 3 px to the right: the same count, visibly other boxes
        run = real(path)

        def go(x):
            out = run(x).copy()
            out[:, [1, 3]] += 3.0
            return out
        return go

    monkeypatch.setattr(onnx_format, "cpu_runner", shifted)
    with pytest.raises(ParityError, match=r"student onnx: the artifact's final detections differ from PyTorch's .*"
                                          r"0 matched as the same box, IoU >= 0.99.*best IoU 0\.\d+"):
        _export(build, tmp_path / "export")


def _rows(*rows):
    return np.asarray(rows, dtype=np.float32).reshape(-1, 7)


def test_box_matching_on_hand_made_detections():
    ref = _rows([0, 10, 10, 50, 50, 0.9, 1], [0, 60, 10, 90, 40, 0.7, 2], [1, 5, 5, 25, 25, 0.0502, 0])
    # the same boxes a hair apart, in another order; the last one fell just under the threshold
    got = _rows([0, 60, 10, 90, 40.0001, 0.70001, 2], [0, 10, 10, 50, 50, 0.9, 1])
    summary = check_detection_parity("x", ref, got, 1e-3, NMS["score_thresh"], NMS["iou"], NMS["max_det"])
    assert summary["matched"] == 2 and summary["excused"] == 1 and summary["min_iou"] > 0.999
    # NMS kept the other of two near-equal, overlapping boxes: explained, not a failure
    tie_ref, tie_got = _rows([0, 10, 10, 50, 50, 0.8, 1]), _rows([0, 12, 10, 52, 50, 0.8003, 1])
    assert match_detections(tie_ref, tie_got, 1e-3, 0.05, 0.6, 100)["problems"] == []
    # a box overlapping a better one by the NMS threshold itself, kept on one side only: explained too
    kept = _rows([0, 0, 0, 40, 40, 0.9, 1], [0, 10, 0, 50, 40, 0.5, 1])  # IoU 30 / 50 = 0.6
    assert match_detections(kept, kept[:1], 1e-3, 0.05, 0.6, 100)["problems"] == []
    assert len(match_detections(kept, kept[:1], 1e-3, 0.05, 0.5, 100)["problems"]) == 1  # 0.6 is no tie with 0.5
    # a box PyTorch has and the artifact does not, the class changed, a score off by more than the tolerance
    with pytest.raises(ParityError, match=r"1 difference: PyTorch's image 0 class 2 score 0\.7000 .* no artifact"):
        check_detection_parity("x", ref[:2], got[1:], 1e-3, 0.05, 0.6, 100)
    wrong_class = got.copy()
    wrong_class[1, 6] = 0
    assert len(match_detections(ref[:2], wrong_class, 1e-3, 0.05, 0.6, 100)["problems"]) == 2
    off = got.copy()
    off[1, 5] = 0.85
    with pytest.raises(ParityError, match=r"scores 0\.8500 in the artifact \(\|diff\| 0\.05 > 0\.001\)"):
        check_detection_parity("x", ref[:2], off, 1e-3, 0.05, 0.6, 100)
    with pytest.raises(ParityError, match=r"\[K, 7\]"):
        check_detection_parity("x", ref, got[:, :6], 1e-3, 0.05, 0.6, 100)


@pytest.fixture
def no_detection_format():
    """A format registered as unable to take a detector (a plugin's, say): what the recipe check refuses."""
    from vfm_toolchain.export.formats.base import FORMATS, register_format

    register_format("plain_only", runtime=None, suffix=".bin", devices="none", detection=False)(lambda *a: None)
    yield "plain_only"
    FORMATS.unregister("plain_only")


def test_the_recipe_check_refuses_formats_that_cannot_take_a_detector(no_detection_format):
    from vfm_toolchain.export import _check_task_formats, task_formats

    assert {"onnx", "tensorrt", "coreml", "executorch_int8", "tflite_int8", "openvino_int8"} <= set(task_formats("detection"))
    _check_task_formats(_recipe())  # onnx alone passes
    _check_task_formats(_recipe(formats=["onnx", "onnx_int8", "openvino", "executorch", "tflite_int8",
                                              "tensorrt"]))
    with pytest.raises(ToolchainError, match=r"detection exports coreml, .*plain_only is not available for "
                                             r"detection.*export.formats=\[onnx,coreml\]"):
        _check_task_formats(_recipe(formats=["onnx", "coreml", no_detection_format]))
    _check_task_formats(recipe_from_dict({"data": {"source": "synthetic"}}))  # classification: untouched
    # the NMS settings are part of a detection build's export key only
    assert "detection" in ExportConvert().config(_recipe())["export"]
    assert "detection" not in ExportConvert().config(recipe_from_dict({"data": {"source": "synthetic"}}))["export"]


def test_bench_times_the_detector_with_its_nms_and_plots_map50(exported):
    from vfm_toolchain.bench.latency import BenchLatency

    inputs = {**exported["inputs"], "export.convert": exported["export"]}
    wd = exported["root"] / "bench"
    wd.mkdir()
    result = BenchLatency().run(StageContext(recipe=_recipe(), workdir=wd, inputs=inputs, log=logging.getLogger("t")))
    rows = {r["artifact"]: r for r in result["bench"]}
    assert set(rows) == {"student eager (unfolded)", "student eager (folded)", "student onnx"}
    assert all(r["p50_ms"] > 0 and r["macs"] > 0 and r["batch"] == 1 for r in rows.values())
    assert result["detection"] == NMS and not result["unavailable"]
    out = StageOutput("bench.latency", "k", wd, json.loads(json.dumps(result)))
    for r in out.result["bench"]:
        r.pop("unstable", None)  # a busy test machine must not empty the plot
    a = _onnx(exported)
    build = ReportContext(_recipe(), {**inputs, "bench.latency": out})
    build.sections["student.finetune"] = ReportSection(scores=[Score("student_distilled_map", "student", 0.5,
                                                                     model="student", plot="distilled")])
    section = BenchLatency().report(out, build)
    assert any("include the NMS" in line for line in section.lines)
    points = {p.label: p.score for p in section.points}  # mAP50, not the table's 0.5
    assert points["distilled onnx"] == pytest.approx(a["test_map50"])
    assert points["distilled eager (folded)"] == pytest.approx(a["pytorch_test_map50"])
    lines = "\n".join(ExportConvert().report(exported["export"], build).lines)
    assert "max IoU deviation" in lines and "test mAP50" in lines and "vs PyTorch" in lines


def test_the_memory_probe_runs_a_pytorch_detector_with_its_nms(exported):
    from vfm_toolchain.bench.memory_probe import probe_memory

    peaks = probe_memory("pytorch", exported["root"] / "finetune" / "model", HW, [1], fold=True, detection=NMS)
    assert peaks[1] is not None and peaks[1] > 0


def _planted(records, jitter: float, false_positives: int, seed: int = 0):
    """``run(images) -> [K, 7]`` that answers each image in turn (as the scorers feed them, in order) with its
    own boxes at the input size, moved by up to ``jitter`` px, random scores, and ``false_positives`` random boxes
    of random classes."""
    rng = np.random.default_rng(seed)
    seen = iter(range(len(records)))

    def run(x):
        rows = []
        for k in range(len(x)):
            r = records[next(seen)]
            scale = np.asarray([HW[1] / r["width"], HW[0] / r["height"]] * 2)
            boxes = np.asarray(r["boxes"], dtype=np.float64).reshape(-1, 4) * scale
            boxes = boxes + rng.uniform(-jitter, jitter, boxes.shape)
            # corners in order, as a detector's are (an inverted box has no agreed IoU)
            boxes = np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]), np.maximum(boxes[:, :2], boxes[:, 2:])], 1)
            labels = np.asarray(r["labels"], dtype=np.float64)
            extra = rng.uniform(0, 1, (false_positives, 4)) * np.asarray([HW[1], HW[0]] * 2)
            extra = np.concatenate([extra[:, :2].clip(max=[HW[1] - 20, HW[0] - 20]),
                                    extra[:, :2].clip(max=[HW[1] - 20, HW[0] - 20]) + 20], axis=1)
            boxes = np.concatenate([boxes, extra]).clip(0, [HW[1], HW[0]] * 2)
            labels = np.concatenate([labels, rng.integers(0, 3, false_positives)])
            scores = rng.uniform(0.1, 1.0, len(boxes)) if jitter or false_positives else np.ones(len(boxes))
            rows += [[k, *b, s, c] for b, s, c in zip(boxes, scores, labels)]
        return np.asarray(rows, dtype=np.float32).reshape(-1, 7)
    return run


def test_the_bundle_scores_a_detection_slice_with_cocos_map50_in_numpy(exported, tmp_path):
    """The device bundle's runner (NumPy only) gives the build's mAP50 (faster_coco_eval) on the same images: for
    an answer with misses, near-misses and false positives, and for the exported artifact through its runner."""
    from vfm_toolchain.bench import bundle_runner
    from vfm_toolchain.bench.bundle import write_test_slice
    from vfm_toolchain.export.formats.onnx_format import cpu_runner

    test, pp = exported["test"], Preprocess(HW)
    (tmp_path / "build" / "stages").mkdir(parents=True)  # a build folder's links into the store
    (tmp_path / "build" / "stages" / "data.prepare").symlink_to(exported["root"] / "prep")
    (tmp_path / "build" / "stages" / "student.finetune").symlink_to(exported["root"] / "finetune")
    info = write_test_slice(tmp_path / "build", "student", tmp_path, 200)
    assert info == {"file": "test_student.npz", "task": "detection", "images": len(test), "metric": "map50"}
    here = bundle_runner.score(_planted(test, jitter=6, false_positives=3), tmp_path / info["file"])
    build = detection_scores(_planted(test, jitter=6, false_positives=3), test, pp, 3)["map50"]
    assert 0.1 < here < 0.99 and here == pytest.approx(build, abs=1e-6)
    run = cpu_runner(exported["export"].dir / _onnx(exported)["path"])
    assert bundle_runner.score(run, tmp_path / info["file"]) == pytest.approx(_onnx(exported)["test_map50"], abs=1e-6)


def test_the_runtime_layers_nms_gives_the_graphs_detections():
    """export/runtimes/nms.py (what ExecuTorch and LiteRT artifacts end with, and what an app ports) against the
    PyTorch selection the ONNX graph holds, on candidates with many overlaps and a cap that falls across classes
    (the NumPy side takes one pass in score order over all classes, at most max_det steps)."""
    from vfm_toolchain.blocks.detection import select_detections
    from vfm_toolchain.export.runtimes.nms import select_detections as numpy_nms

    g = torch.Generator().manual_seed(0)
    b, n, c = 3, 300, 4
    xy = torch.rand(b, n, 2, generator=g) * 100
    wh = torch.rand(b, n, 2, generator=g) * 30 + 1
    boxes = torch.cat([xy, xy + wh], -1)
    scores = torch.rand(b, c, n, generator=g) ** 3
    for thresh, iou, max_det in ((0.05, 0.6, 100), (0.3, 0.3, 7), (0.99, 0.5, 10)):
        ref = select_detections(boxes, scores, thresh, iou, max_det).numpy()
        got = numpy_nms(torch.cat([boxes, scores.transpose(1, 2)], -1).numpy(), thresh, iou, max_det)
        assert got.shape == ref.shape and got.dtype == np.float32
        order = lambda a: a[np.lexsort((a[:, 6], -a[:, 5], a[:, 0]))]
        np.testing.assert_allclose(order(got), order(ref), atol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, N, 4 \+ C\]"):
        numpy_nms(np.zeros((2, 5)))


# in parts, each a test of its own, so that workers convert them side by side (together: 90 s here)
ON_DEVICE = {"nms in the graph": ["onnx", "onnx_int8", "openvino"], "executorch": ["onnx", "executorch"],
             "litert": ["onnx", "tflite"]}


@pytest.mark.edge
@pytest.mark.parametrize("where", list(ON_DEVICE))
def test_a_detector_exports_to_the_on_device_formats_with_final_boxes_checked(build, tmp_path, where):
    """OpenVINO holds the NMS in its graph; ExecuTorch and LiteRT return candidates that the runtime layer's NMS
    finishes (recorded, so that the bench and a device bundle run it): every fp32 artifact's boxes are matched to
    PyTorch's, and an int8 one is judged by its test mAP50 against fp32 (its NMS in the graph stays float)."""
    formats = ON_DEVICE[where]
    result = _export(build, tmp_path / "export", _recipe(formats=formats, max_accuracy_drop=1.0))
    by_kind = {a["kind"]: a for a in result["artifacts"]}
    assert set(by_kind) == set(formats) and all(a["status"] == "ok" for a in by_kind.values())
    for kind in sorted({"openvino", "executorch", "tflite"} & set(formats)):
        a = by_kind[kind]
        assert a["parity"] == "detections" and a["parity_matched"] == a["parity_reference_detections"] > 8, kind
        assert a["test_map50"] == pytest.approx(a["pytorch_test_map50"], abs=0.003), kind
    if where == "nms in the graph":
        assert "runtime_nms" not in by_kind["openvino"] and "runtime_nms" not in by_kind["onnx_int8"]
        q = by_kind["onnx_int8"]
        assert q["metric"] == "map50" and 0.0 <= q["test_score"] <= 1.0 and q["fp32_test_score"] > 0.2
    else:  # no NMS op in its graph: the runtime layer's
        a = by_kind[formats[-1]]
        assert a["runtime_nms"] == NMS and "candidates [B, N, 4 + C]" in a["output"]
    from vfm_toolchain.bench.latency import BenchLatency

    bench_recipe = _recipe(formats=formats)
    inputs = {**build["inputs"], "export.convert": StageOutput("export.convert", "k", tmp_path / "export",
                                                               json.loads(json.dumps(result)))}
    (tmp_path / "bench").mkdir()
    rows = BenchLatency().run(StageContext(recipe=bench_recipe, workdir=tmp_path / "bench", inputs=inputs,
                                           log=logging.getLogger("t")))["bench"]
    by_artifact = {r["artifact"]: r for r in rows}
    if where == "nms in the graph":
        assert "nms_ms" not in by_artifact["student openvino"]  # its NMS is inside the graph's time
    else:
        timed = by_artifact[f"student {formats[-1]}"]
        assert 0 < timed["nms_ms"] < timed["p99_ms"]  # inside its time


def test_a_core_ml_detector_is_a_pipeline_ending_in_its_nms_model(build, tmp_path):
    """Converted here (predicted on macOS only): the network's class scores and relative boxes feed Core ML's
    NonMaximumSuppression model (per class, the export's thresholds as overridable defaults); the macOS runtime
    turns its outputs into the rows every detection artifact returns."""
    ct = pytest.importorskip("coremltools")
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.export.formats import export_format
    from vfm_toolchain.export.runtimes.coreml_runtime import detection_rows
    from vfm_toolchain.students.fold import deployable

    net = deployable(load_model(build["root"] / "finetune" / "model"), NMS)
    res = export_format("coreml", net, torch.zeros(1, 3, *HW), tmp_path, metadata={"classes": CLASSES},
                        preprocess=Preprocess(HW).to_dict())
    spec = ct.utils.load_spec(str(res.path))
    assert [m.WhichOneof("Type") for m in spec.pipeline.models] == ["mlProgram", "nonMaximumSuppression"]
    suppress = spec.pipeline.models[1].nonMaximumSuppression
    assert suppress.pickTop.perClass and list(suppress.stringClassLabels.vector) == CLASSES
    assert suppress.iouThreshold == pytest.approx(0.6) and suppress.confidenceThreshold == pytest.approx(0.05)
    assert [i.name for i in spec.description.input] == ["input", "iouThreshold", "confidenceThreshold"]
    assert res.meta["nms"] == NMS and "NonMaximumSuppression" in res.meta["output"]
    rows = detection_rows(np.array([[0.1, 0.7, 0.2], [0.9, 0.0, 0.0]]), np.array([[0.5, 0.5, 0.5, 0.25],
                                                                                   [0.25, 0.25, 0.5, 0.5]]), HW, 5)
    np.testing.assert_allclose(rows, [[0, 0, 0, 64, 32, 0.9, 0], [0, 32, 24, 96, 40, 0.7, 1]], atol=1e-5)


def test_executorch_int8_keeps_named_modules_float_and_knows_a_detectors_fan_out_maps():
    """The per-module configuration behind export.options.executorch_int8.float_modules names the fewest modules
    that cover everything but the kept ones; the automatic fallback keeps the last weighted layer of every map the
    neck reads that the next stage also reads (FastViT-T8: stages 1 and 2, not the deepest)."""
    pytest.importorskip("executorch")
    from vfm_toolchain.export.formats.executorch_format import _covering, _fan_out_layers
    from vfm_toolchain.students.fold import deployable, nms_outside

    candidates, _ = nms_outside(deployable(build_student_detector("fastvit_t8", 3, neck_channels=16, head_convs=1),
                                           NMS))
    keep = _fan_out_layers(candidates)
    assert keep == ["detector.backbone.stages_1.blocks.1.layer_scale",
                    "detector.backbone.stages_2.blocks.3.layer_scale"]
    covered = _covering(candidates, keep)
    assert "detector.neck" in covered and "detector.head" in covered and "detector.backbone.stages_3" in covered
    assert "detector.backbone.stages_1.blocks.1.mlp" in covered and "detector.backbone.stages_1.blocks.0" in covered
    assert not any(c == k or c.startswith(k + ".") or k.startswith(c + ".") for c in covered for k in keep)
    everything = _covering(candidates, [])
    assert everything == ["detector"]  # nothing kept: one name covers it all
    assert _covering(candidates, ["detector.backbone.stages_*"])[:2] == ["detector.backbone.stem_0",
                                                                         "detector.backbone.stem_1"]


def test_student_auto_for_detection_is_timed_on_a_format_that_takes_a_detector(no_detection_format):
    from vfm_toolchain.export import _check_task_formats

    auto = {"name": "auto", "image_size": list(HW), "budget_ms": 5}
    for target in ("pytorch", "onnx", "executorch", "tensorrt"):
        _check_task_formats(recipe_from_dict({**_base(), "student": {**auto, "target": target}}))
    with pytest.raises(ToolchainError, match=r"plain_only \(student.target\) is not available.*student.target: onnx"):
        _check_task_formats(recipe_from_dict({**_base(), "student": {**auto, "target": no_detection_format}}))


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available(),
                    reason="TensorRT and an NVIDIA GPU: run `pytest -m gpu` in the Docker image")
def test_a_detector_tensorrt_engine_returns_candidates_the_shared_nms_finishes(build, tmp_path):
    """TensorRT builds the detector's candidates (no NMS in the engine) and the runtime layer's NMS finishes them:
    box parity against PyTorch as for ExecuTorch and LiteRT."""
    result = _export(build, tmp_path / "export", _recipe(formats=["onnx", "tensorrt"], max_accuracy_drop=1.0,
                                                         options={"tensorrt": {"precision": "fp32"}}))
    trt = next(a for a in result["artifacts"] if a["kind"] == "tensorrt")
    assert trt["status"] == "ok" and trt["runtime_nms"] == NMS and "candidates" in trt["output"]
    assert trt["parity"] == "detections" and trt["parity_matched"] == trt["parity_reference_detections"]


def _base():
    return {"name": "det", "data": {"task": "detection", "source": "synthetic"}, "export": {"formats": ["onnx"]},
            "teacher": {"name": "timm:resnet10t", "weights": "none", "image_size": list(HW)}}
