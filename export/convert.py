"""``export.convert``: fold the trained model into plain weights and emit each requested format.

Every artifact passes the parity gate on real test images against the folded PyTorch model before it
is accepted; a failure fails the build.  Formats that cannot be produced on this machine (TensorRT
without a GPU) are recorded as skipped with the reason, and Core ML parity is skipped off macOS.

A detector ships with its NMS (``export.detection``: score threshold, IoU, detections per image), inside the
graph where the format holds one, else finished by the runtime layer's NMS (students/fold.py ``nms_outside``,
export/runtimes/nms.py), so every artifact's runner returns final detections: an fp32 artifact's are matched to the
folded PyTorch model's box by box (export/parity.py), and its test mAP50 / mAP, computed through the artifact's own
runner, is recorded beside the trained PyTorch model's; fp16 / int8 (and Core ML, whose NMS keeps one class per
box) are judged by test mAP50 against fp32.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from vfm_toolchain import __version__
from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import ImageListDataset, Preprocess, eval_transform, size_text
from vfm_toolchain.devices import EXPORT_DEVICE
from vfm_toolchain.export.fallback import fallback_summary
from vfm_toolchain.export.formats import FORMATS, ExportInputs, Skipped, export_chain, format_options
from vfm_toolchain.export.formats.base import FormatOptions
from vfm_toolchain.export.formats.onnx_format import external_data_file
from vfm_toolchain.export.formats.openvino_format import weights_file
from vfm_toolchain.export.parity import ParityError, check_detection_parity, check_parity
from vfm_toolchain.prepare import load_index, sample_paths
from vfm_toolchain.stage import (ReportContext, ReportSection, Stage, StageContext, StageOutput, metric_label, percent,
                             register_stage)
from vfm_toolchain.store import hash_obj, sha256_file
from vfm_toolchain.students.fold import deployable, fold_model, holds_nms
from vfm_toolchain.students.qat import QAT_MODEL
from vfm_toolchain.tasks import task_of
from vfm_toolchain.tasks.detection import artifact_scores
from vfm_toolchain.teachers.curate import transfer_paths
from vfm_toolchain.training import metric_name

__all__ = ["AccuracyGate", "ExportConvert", "MODEL_SOURCES", "parity_inputs", "artifact_digest", "artifact_files", "task_score",
           "DETECTION_OUTPUT", "INPUT_CONTRACT", "MAP50_TARGET"]

# export.models entry -> the stage whose model it is (student_qat: the folded student after quantization-aware training)
MODEL_SOURCES = {"student": "student.finetune", "teacher": "teacher.finetune", QAT_MODEL: "student.qat"}


# How every artifact's input is made from a picture, written into its metadata beside ``preprocess`` (size, mean,
# std, interpolation) so an app reads it from the file
INPUT_CONTRACT = ("float32 NCHW, RGB: the image resized (stretched, no letterbox) to preprocess.size (h, w) with "
                  "preprocess.interpolation, scaled to 0-1, then (x - mean) / std per channel; a detector's boxes map "
                  "back to the image by x * width / w, y * height / h")
# What a detection artifact returns, written into its metadata so an app reads the contract from the file
DETECTION_OUTPUT = ("detections [K, 7] float32: (batch_index, x1, y1, x2, y2, score, class) per row, boxes in input "
                    "pixels, sorted by batch index then score (best first); NMS inside the graph")
# The target for an fp32 detection artifact (issue 38): test mAP50 within 0.3 points of PyTorch's; a
# larger gap is a warning (the box-by-box parity check is the gate)
MAP50_TARGET = 0.003


def parity_inputs(items, pp: Preprocess, n: int) -> torch.Tensor:
    """The first ``n`` items preprocessed as the build evaluates them: (path, label) pairs, or detection records
    (dicts), which are resized as DetectionDataset does."""
    if items and isinstance(items[0], dict):
        from vfm_toolchain.data.detection import DetectionDataset

        ds = DetectionDataset(items[:n], pp, train=False)
    else:
        ds = ImageListDataset(items[:n], eval_transform(pp), cache_mb=0)
    return torch.stack([ds[i][0] for i in range(len(ds))])


def artifact_files(path: Path) -> List[Path]:
    """The artifact and the files it cannot work without, which must stay beside it under their exact names:
    ONNX external data (``model.onnx.data``), an OpenVINO IR's or an ncnn graph's weights (``model.xml`` reads
    ``model.bin``, ``model.ncnn.param`` reads ``model.ncnn.bin``: the same rule)."""
    path = Path(path)
    companions = [external_data_file(path)] + ([weights_file(path)] if path.suffix in (".xml", ".param") else [])
    return [path] + [c for c in companions if path.is_file() and c.is_file()]


def artifact_digest(path: Path) -> Dict[str, Any]:
    if path.is_dir():  # .mlpackage
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"sha256": hash_obj([(str(p.relative_to(path)), sha256_file(p)) for p in files]),
                "bytes": sum(p.stat().st_size for p in files)}
    files = artifact_files(path)
    if len(files) == 1:
        return {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return {"sha256": hash_obj([(p.name, sha256_file(p)) for p in files]), "bytes": sum(p.stat().st_size for p in files)}


@register_stage
class ExportConvert(Stage):
    name = "export.convert"
    version = "14"  # what each version changed is in git log
    verify_hashes = True  # what ships: a cache hit re-hashes the artifacts
    inputs = ("data.prepare", "student.finetune")
    # the transfer set calibrates int8; student.distill stays in the key of builds stored before student.qat was a
    # stage of its own (it trained inside this one); student.qat joins the key of the builds that export it
    optional_inputs = ("teacher.finetune", "teacher.curate", "student.distill", "student.qat")

    def read_inputs(self, recipe) -> Sequence[str]:
        return (*self.inputs, *(s for s in self.optional_inputs
                                if s != "student.qat" or QAT_MODEL in recipe.export.models))

    def config(self, recipe) -> Dict[str, Any]:
        # fields only another task reads (the NMS settings of detection artifacts) stay out: other keys stay
        cfg = {"export": recipe.export.model_dump(mode="json", exclude=task_of(recipe).foreign("export"))}
        cfg["export"].pop("qat", None)  # student.qat's key
        if any(FORMATS.meta(f)["batch_profile"] for f in recipe.export.formats):  # built for these batch sizes
            cfg["profile_batches"] = engine_batches(recipe)
        return cfg

    def skip_reason(self, recipe):
        return None if recipe.export.formats else "export.formats is empty"

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r, e = ctx.recipe, ctx.recipe.export
        options = {fmt: format_options(fmt, e.options.get(fmt)) for fmt in e.formats}
        index = load_index(ctx.input("data.prepare"))
        artifacts: List[Dict[str, Any]] = []
        folds: Dict[str, Any] = {}
        warnings: List[str] = []
        detection = e.detection.model_dump(mode="json")
        for which in e.models:
            src = ctx.input(MODEL_SOURCES[which])
            folder = src.path("model")
            spec = json.loads((folder / "spec.json").read_text())
            model = load_model(folder).to(EXPORT_DEVICE)  # exporters trace CPU graphs; fp32 reference
            pp = Preprocess.from_dict(spec["preprocess"])
            x = parity_inputs(index["test"], pp, e.parity_images)
            formats = e.formats
            if which == QAT_MODEL:  # folded before it trained (student.qat)
                folded, records = model, [{"pass": "all", "skipped": "folded before quantization-aware training"}]
                formats = _qat_formats(e.formats, options)
            else:
                try:
                    folded, records = fold_model(model, spec, x)
                except ToolchainError as exc:  # an adapter that does not fold: export its extra ops as they are
                    warnings.append(f"{which}: {exc}")
                    folded, records = model, [{"pass": "adapter_merge", "skipped": str(exc)}]
            folds[which] = records
            net = deployable(folded, detection)  # a detector ships with its NMS; other models as they are
            detects = holds_nms(net)  # its rows of final detections are compared box by box, and by mAP
            with torch.no_grad():
                ref = net(x).numpy()
            metadata = {"classes": spec["classes"], "preprocess": spec["preprocess"], "input": INPUT_CONTRACT,
                        "model": spec["name"], "recipe_hash": hash_obj(r.model_dump(mode="json"))[:16],
                        "toolchain": __version__}
            if detects:
                metadata.update(output=DETECTION_OUTPUT, nms=detection)
                if not len(ref):
                    warnings.append(f"{which}: PyTorch finds no detection above export.detection.score_thresh "
                                    f"{detection['score_thresh']} on the {len(x)} parity images, so the exported "
                                    f"boxes were not compared there (only the test mAP speaks for them)")
            task, n_classes = task_of(index).name, len(index["classes"])
            inputs = ExportInputs(metadata=metadata, preprocess=spec["preprocess"], batches=engine_batches(r),
                                  log=ctx.log.info,
                                  classes=task_of(task).classifier_labels(spec["classes"]),
                                  cache_dir=ctx.shared,
                                  judge=AccuracyGate(net, index["test"], pp, task, n_classes, e.max_accuracy_drop))
            made = export_chain(formats, net, x, ctx.workdir / which, options, inputs,
                                calibrate=lambda: self._calibration(ctx, index, pp, warnings))
            pytorch_map: Dict[str, float] = {}  # the trained model's test mAP, computed once, when first needed
            for fmt, res in made:
                entry: Dict[str, Any] = {"stage": self.name, "model": which, "kind": fmt, "image_size": pp.size}
                if isinstance(res, Skipped):
                    entry.update(status="skipped", reason=str(res))
                    artifacts.append(entry)
                    ctx.log.info("%s %s: skipped (%s)", which, fmt, res)
                    continue
                other = res.meta.get("dynamic_size_check")
                if other and other.get("max_abs_diff") is not None and other["max_abs_diff"] > e.parity_atol:
                    # a free height/width must hold at other sizes (a detector's boxes: checked below)
                    raise ParityError(f"{which} {fmt} at {size_text(other['image_size'])}: max |PyTorch - artifact| = "
                                      f"{other['max_abs_diff']:.3g} exceeds export.parity_atol {e.parity_atol:.3g}")
                reduced = res.meta.get("precision", FORMATS.meta(fmt)["precision"]) in ("fp16", "int8")
                # Core ML's NMS keeps one class per box, not every class above the threshold: judged by test mAP50
                reduced = reduced or (detects and fmt == "coreml")
                entry.update(status="ok", path=str(res.path.relative_to(ctx.workdir)), **artifact_digest(res.path),
                             **res.meta)
                if res.runner is not None and reduced:  # judged by accuracy, not by output drift
                    verdict = dict(res.accuracy or inputs.judge(res.runner))  # a format that chose by it has it
                    passed = verdict.pop("passed")
                    # a detector's rows are not element-wise comparable (their count moves); its gate is the mAP
                    drift = None if detects else float(np.abs(np.asarray(res.runner(x.numpy())) - ref).max())
                    metric = "map50" if detects else metric_name(task)
                    entry.update(verdict, metric=metric, parity_max_abs_diff=drift, parity_images=len(x))
                    if not passed:
                        tried = res.meta.get("fallback")
                        raise ToolchainError(
                            f"{which} {fmt}: test {metric} {verdict['test_score']:.4f} is "
                            f"{verdict['accuracy_drop']:.4f} below fp32 ({verdict['fp32_test_score']:.4f}), more "
                            f"than export.max_accuracy_drop {e.max_accuracy_drop}"
                            + (f" after the {fallback_summary(tried)}" if tried else "")
                            + "; drop the format, calibrate on more images, or raise the bound")
                elif res.runner is not None and detects:
                    atol = options[fmt].parity_atol or e.parity_atol
                    entry.update(self._detection_parity(f"{which} {fmt}", net, res.runner, x, ref, atol, detection))
                    if other:
                        other.update(self._detection_at_size(f"{which} {fmt}", net, res.runner, x, other, atol,
                                                             detection))
                    if not pytorch_map:
                        with torch.no_grad():
                            trained = deployable(model.eval(), detection)
                            pytorch_map = artifact_scores(lambda a: trained(torch.from_numpy(a)).numpy(),
                                                           index["test"], pp, n_classes, what="PyTorch on ")
                    got = artifact_scores(res.runner, index["test"], pp, n_classes, what=f"{fmt} on ")
                    entry.update(metric="map50", test_score=got["map50"], test_map50=got["map50"],
                                 test_map=got["map"], pytorch_test_map50=pytorch_map["map50"],
                                 pytorch_test_map=pytorch_map["map"])
                    gap = pytorch_map["map50"] - got["map50"]
                    if gap > MAP50_TARGET:
                        warnings.append(f"{which} {fmt}: test mAP50 {percent(got['map50'])} is {100 * gap:.2f} "
                                        f"points below PyTorch's {percent(pytorch_map['map50'])} (the target is within "
                                        f"{100 * MAP50_TARGET:.1f}); its detections matched PyTorch's on the parity "
                                        f"images, so look at the test images past them")
                elif res.runner is not None:
                    atol = options[fmt].parity_atol or e.parity_atol
                    diff = check_parity(f"{which} {fmt}", ref, np.asarray(res.runner(x.numpy())), atol)
                    entry.update(parity_max_abs_diff=diff, parity_images=len(x))
                else:
                    entry.update(parity_max_abs_diff=None, parity_skipped=res.parity_skipped)
                    warnings.append(f"{which} {fmt}: parity not checked here ({res.parity_skipped})")
                artifacts.append(entry)
                diff = entry.get("parity_max_abs_diff")
                ctx.log.info("%s %s: %s (%.1f MB), parity %s", which, fmt, entry["path"], entry["bytes"] / 1e6,
                             _detection_line(entry) if entry.get("parity") == "detections" else
                             f"max |diff| {diff:.2g}" if diff is not None else
                             "by test score" if entry.get("accuracy_drop") is not None else
                             f"not checked here ({entry.get('parity_skipped')})")
        result = {"artifacts": artifacts, "folds": folds, "warnings": warnings}
        if task_of(index).artifact_settings(r) is not None:
            result["detection"] = detection  # what the bench wraps its eager detectors with
        return result

    @staticmethod
    def _detection_parity(name: str, net, runner, x: torch.Tensor, ref: np.ndarray, atol: float,
                          nms: Dict[str, Any]) -> Dict[str, Any]:
        """The artifact's final detections matched box by box to the folded PyTorch model's on the parity
        images (export/parity.py): the entry's parity keys, or :class:`ParityError`."""
        got = check_detection_parity(name, ref, np.asarray(runner(x.numpy())), atol, nms["score_thresh"],
                                     nms["iou"], nms["max_det"])
        # over the matched rows, |PyTorch - artifact| of every column (box corners in pixels, score): the
        # classifier's figure, for scripts reading one number
        return {"parity": "detections", "parity_images": len(x),
                "parity_max_abs_diff": max(got["max_box_diff_px"], got["max_score_diff"]),
                **{f"parity_{k}": v for k, v in got.items()}}

    @staticmethod
    def _detection_at_size(name: str, net, runner, x: torch.Tensor, other: Dict[str, Any], atol: float,
                           nms: Dict[str, Any]) -> Dict[str, Any]:
        """A free height / width checked the same way at the second size the format ran (its dynamic size
        check): the images resized as there."""
        hw = tuple(other["image_size"])
        xo = torch.nn.functional.interpolate(x[:2], size=hw, mode="bilinear", align_corners=False)
        with torch.no_grad():
            ref = net(xo).numpy()
        got = check_detection_parity(f"{name} at {size_text(list(hw))}", ref, np.asarray(runner(xo.numpy())), atol,
                                     nms["score_thresh"], nms["iou"], nms["max_det"])
        return {"max_abs_diff": max(got["max_box_diff_px"], got["max_score_diff"]), "detections": got}

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """Every artifact with its gate, and the artifacts themselves, published under ``artifacts/<model>/``
        (build.json's ``artifacts`` name them there)."""
        shipped, files = [], {}
        for a in out.result.get("artifacts", []):
            a = dict(a)
            if a.get("status") == "ok":
                src = out.dir / a["path"]
                for f in artifact_files(src):  # ONNX external data travels with its model
                    files[f"artifacts/{a['model']}/{f.name}"] = str(f.relative_to(out.dir))
                a["path"] = f"artifacts/{a['model']}/{src.name}"
            shipped.append(a)
        section = ReportSection(files=files, record={"artifacts": shipped})
        if not shipped:
            return section
        section.title = "Artifacts"
        section.lines = ["| model | format | status | size | parity max abs diff | notes |",
                         "|---|---|---|---|---|---|", *map(_artifact_row, shipped)]
        repaired = [a for a in shipped if a.get("fallback")]
        if repaired:  # what plain int8 lost, what the fallback won back, and what it cost at batch 1
            section.lines += ["", "int8 that missed the accuracy gate and was repaired (export/fallback.py; batch-1 "
                              "latency timed beside fp32 in the same run):", "",
                              "| model | format | int8 test | int8 ms | repaired test | repaired ms | fp32 ms | "
                              "layers in float | how |", "|---|---|---|---|---|---|---|---|---|"]
            for a in repaired:
                f = a["fallback"]
                first, last = f["steps"][0], f["steps"][-1]
                section.lines.append(
                    f"| {a['model']} | {a['kind']} | {percent(first['test_score'])} | {first['p50_ms']:.2f} | "
                    f"{percent(last['test_score'])} | {last['p50_ms']:.2f} | {f['fp32_p50_ms']:.2f} | "
                    f"{len(f['float_layers'])} of {f['ranked_layers']} | "
                    f"{f.get('method', 'sensitivity-ordered (export/fallback.py)')} |")
        for which, recs in out.result.get("folds", {}).items():
            section.lines += ["", f"Fold passes ({which}): " + ", ".join(
                f"{x['pass']} (max dev {x['max_abs_diff']:.1e})" if "max_abs_diff" in x else f"{x['pass']} skipped"
                for x in recs)]
        return section

    @staticmethod
    def _calibration(ctx, index, pp: Preprocess, warnings: List[str]) -> np.ndarray:
        """Preprocessed images for int8 calibration: a seeded sample of the transfer set (what the student
        sees in the field), else the labeled images."""
        import random

        n = ctx.recipe.export.calibration_images
        curate = ctx.inputs.get("teacher.curate")
        if curate is not None:
            paths = transfer_paths(curate, ctx.input("data.prepare"))
        else:  # (path, label) pairs, or a detector's records
            paths = sample_paths(index["train"])
        paths = random.Random(ctx.recipe.seed).sample(paths, min(n, len(paths)))
        if len(paths) < 200:
            warnings.append(f"int8 calibrated on {len(paths)} images; a few hundred give steadier ranges")
        # as the task's samples, so that they are resized as its models see them (a detector: no crop)
        return parity_inputs(task_of(index).unlabeled_samples(paths), pp, len(paths)).numpy()


SCORE_BATCH = 32  # artifacts are scored on the test split in batches of this size


class AccuracyGate:
    """``gate(runner)``: a reduced-precision artifact's test score against the folded fp32 model's, and whether the
    drop is within ``export.max_accuracy_drop``.  The fp32 score is computed once, on first use."""

    def __init__(self, folded: torch.nn.Module, items, pp: Preprocess, task: str, num_classes: int, max_drop: float):
        self.folded, self.items, self.pp, self.task, self.num_classes = folded, items, pp, task, num_classes
        self.max_drop, self._fp32 = max_drop, None

    def score(self, runner, items) -> float:
        """The task's score (top-1, mIoU, mAP50) of ``runner`` over ``items`` of a split, as the gate measures it."""
        return task_score(runner, items, self.pp, self.task, self.num_classes)

    def __call__(self, runner) -> Dict[str, Any]:
        if self._fp32 is None:
            with torch.no_grad():
                self._fp32 = task_score(lambda a: self.folded(torch.from_numpy(a)).numpy(), self.items, self.pp,
                                        self.task, self.num_classes)
        score = self.score(runner, self.items)
        return {"test_score": score, "fp32_test_score": self._fp32, "accuracy_drop": self._fp32 - score,
                "passed": self._fp32 - score <= self.max_drop}


def _qat_formats(formats: List[str], options: Dict[str, FormatOptions]) -> List[str]:
    """What the QAT student is exported to: the int8 formats, and ``onnx`` where one of them is built from it."""
    int8 = [f for f in formats if options[f].calibrates()]
    needs_onnx = any(FORMATS.meta(f)["source"] == "onnx" for f in int8)
    return [f for f in formats if f in int8 or (f == "onnx" and needs_onnx)]


def _artifact_row(a: Dict[str, Any]) -> str:
    """One artifact in the report's table: where it is, its size, how it passed (parity, or accuracy for reduced
    precision) and how it was made."""
    if a.get("status") != "ok":
        return f"| {a['model']} | {a['kind']} | skipped | | | {a.get('reason')} |"
    par = a.get("parity_max_abs_diff")
    par = f"{par:.2e}" if par is not None else \
        "by test accuracy" if a.get("accuracy_drop") is not None else f"not checked: {a.get('parity_skipped')}"
    note = f"opset {a['opset_written']}" if "opset_written" in a else a.get("precision", "")
    if a.get("parity") == "detections":  # final boxes matched to PyTorch's; the test mAP beside PyTorch's
        iou = a.get("parity_min_iou")
        par = (f"boxes: max IoU deviation {1 - iou:.1e}, max score diff {a['parity_max_score_diff']:.1e}"
               if iou is not None else "no detections to compare")
        # two decimals: the target for an fp32 artifact is within 0.3 mAP50 points of PyTorch (issue 38)
        pts = lambda v: "n/a" if v is None or v != v else f"{100 * v:.2f}%"
        note += (f", {_detection_line(a, detail=False)}; test mAP50 {pts(a['test_map50'])} vs PyTorch "
                 f"{pts(a['pytorch_test_map50'])}, mAP {pts(a['test_map'])} vs {pts(a['pytorch_test_map'])}")
    if "accuracy_drop" in a:
        note += (f", test {metric_label(a['metric'])} {percent(a['test_score'])} vs fp32 "
                 f"{percent(a['fp32_test_score'])} (max diff is not the gate)")
    if a.get("layout_reason"):  # an int8 layout chosen by timing: which and why
        note += f"; int8 layout {a['layout']}: {a['layout_reason']}"
    if a.get("fallback"):  # the int8 artifact missed the gate and was repaired (or not) layer by layer
        note += f"; {fallback_summary(a['fallback'])}"
    if a.get("layers_fp32"):  # measured per layer: int8 made these slower on the build's CPU
        note += f"; {len(a['layers_fp32'])} layers kept fp32 (slower in int8 on this CPU)"
    return f"| {a['model']} | {a['kind']} | `{a['path']}` | {a['bytes'] / 1e6:.2f} MB | {par} | {note} |"


def engine_batches(recipe) -> List[int]:
    """Every batch size the build feeds an artifact: the parity images at once, scoring, every bench batch."""
    return sorted({recipe.export.parity_images, SCORE_BATCH, *recipe.bench.batch_sizes})


def task_score(run, items, pp: Preprocess, task: str, num_classes: int, batch_size: int = SCORE_BATCH) -> float:
    """The task's main metric of an artifact, ``run(images) -> outputs``, over a split, the way the build scores
    PyTorch models (``Task.score_artifact``)."""
    return task_of(task).score_artifact(run, items, pp, num_classes, batch_size)


def _detection_line(a: Dict[str, Any], detail: bool = True) -> str:
    """A detection artifact's parity in words: how many of PyTorch's detections it matched, and how closely."""
    if not a.get("parity_reference_detections") and not a.get("parity_artifact_detections"):
        return f"no detection on the {a['parity_images']} parity images, on either side"
    line = f"{a['parity_matched']} of {a['parity_reference_detections']} PyTorch detections matched"
    if detail and a.get("parity_min_iou") is not None:
        line += f" (min IoU {a['parity_min_iou']:.6f}, max |score diff| {a['parity_max_score_diff']:.1e})"
    if a.get("parity_excused"):
        line += f", {a['parity_excused']} unmatched at a threshold or an NMS tie within the score tolerance"
    return line
