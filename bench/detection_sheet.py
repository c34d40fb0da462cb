"""The report's sheet of test images for a detection build: the ground truth, then each detector's boxes (the
teacher's, the distilled student's, the label-only student's), one row per image.

A table of mAP says how often a detector is right; the sheet shows how it is wrong (a missed small fish, a
penguin boxed twice, a shark called a fish), which is what a person decides from.  The stages that train a
detector name their model in ``ReportSection.sheet``; the report stage runs each on a few test images here and
draws the boxes at the images' own resolution (mapped back through the resize, as the mAP is scored).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.data.images import Preprocess, load_image
from vfm_toolchain.detmetrics import to_original
from vfm_toolchain.devices import on_device

__all__ = ["pick_sheet_images", "predict_boxes", "draw_detection_sheet", "build_sheet", "SHEET_SCORE", "SHEET_IMAGES"]

SHEET_IMAGES = 6
# Boxes drawn from this score: the mAP counts every box down to export.detection.score_thresh (0.05), where a
# picture would drown in low-score boxes; 0.3 is about where a detector's boxes start to be believed.
SHEET_SCORE = 0.3
_PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45", "#fabed4",
            "#469990", "#dcbeff", "#9a6324", "#800000", "#aaffc3", "#808000", "#000075"]


def pick_sheet_images(records: Sequence[Dict[str, Any]], n: int = SHEET_IMAGES) -> List[Dict[str, Any]]:
    """``n`` images spread evenly over the split in path order (the same ones in every build of the data), among
    those with at least one box where there are enough."""
    pool = sorted((r for r in records if r["boxes"]), key=lambda r: r["path"])
    if len(pool) < n:
        pool = sorted(records, key=lambda r: r["path"])
    if len(pool) <= n:
        return list(pool)
    return [pool[round(i * (len(pool) - 1) / (n - 1))] for i in range(n)] if n > 1 else [pool[0]]


@torch.no_grad()
def predict_boxes(model_dir: Path, records: Sequence[Dict[str, Any]],
                  score_thresh: float = SHEET_SCORE) -> List[Dict[str, torch.Tensor]]:
    """A saved detector (its folder: spec.json + weights) on the records, on the build's device (the one device
    policy): per image ``boxes`` (xyxy in the image's own pixels), ``scores`` and ``labels`` at or above
    ``score_thresh``, on the CPU."""
    from vfm_toolchain.data.detection import DetectionDataset, detection_collate

    model = load_model(Path(model_dir)).eval()
    pp = Preprocess.from_dict(json.loads((Path(model_dir) / "spec.json").read_text())["preprocess"])
    x, targets = detection_collate([DetectionDataset(records, pp, train=False)[i] for i in range(len(records))])
    with on_device(model) as device:
        found = model.decode(model.forward_levels(x.to(device)), score_thresh=score_thresh)
    return [{"boxes": to_original(p["boxes"].cpu(), t["scale"], t["orig_size"]), "scores": p["scores"].cpu(),
             "labels": p["labels"].cpu()} for p, t in zip(found, targets)]


def _drawn(path: str, boxes: torch.Tensor, labels: Sequence[int], scores, classes: Sequence[str]):
    """The image with its boxes as an (H, W, 3) uint8 array: torchvision's ``draw_bounding_boxes``, a colour per
    class, the class name (and score) on each box."""
    from torchvision.transforms.v2 import functional as TF
    from torchvision.utils import draw_bounding_boxes

    im = load_image(path)
    img = TF.pil_to_tensor(im) if im is not None else torch.zeros(3, 64, 64, dtype=torch.uint8)
    names = [classes[int(c)] + ("" if scores is None else f" {float(s):.2f}")
             for c, s in zip(labels, scores if scores is not None else [None] * len(labels))]
    colors = [_PALETTE[int(c) % len(_PALETTE)] for c in labels]
    width = max(1, round(max(img.shape[1:]) / 200))
    if len(boxes):
        img = draw_bounding_boxes(img, boxes.float().reshape(-1, 4), labels=names, colors=colors, width=width)
    return img.permute(1, 2, 0).numpy()


def draw_detection_sheet(path: Path, records: Sequence[Dict[str, Any]], classes: Sequence[str],
                         columns: Sequence[Tuple[str, Path]], score_thresh: float = SHEET_SCORE) -> None:
    """Write the sheet (a PNG, atomically): one row per record, the ground truth first (captioned with the file's
    name), then one column per (label, saved detector folder)."""
    from vfm_toolchain.sheets import Cell, save_sheet

    preds = {label: predict_boxes(folder, records, score_thresh) for label, folder in columns}
    rows = []
    for row, rec in enumerate(records):
        truth = _drawn(rec["path"], torch.tensor(rec["boxes"], dtype=torch.float32), rec["labels"], None, classes)
        rows.append([Cell(truth, Path(rec["path"]).name)]
                    + [Cell(_drawn(rec["path"], p["boxes"], p["labels"].tolist(), p["scores"].tolist(), classes))
                       for p in (preds[label][row] for label, _ in columns)])
    save_sheet(Path(path), rows, f"Test images: boxes with score >= {score_thresh:g}", cell=(352, 288),
               heads=["ground truth"] + [label for label, _ in columns])


def build_sheet(ctx, outputs: Dict[str, Any], columns: Sequence[Tuple[str, Path]], warnings: List[str]) -> str:
    """The report stage's sheet: ``detections.png`` in its folder from the columns (label, saved detector) on the
    build's test images (else val); the sentence report.md puts above it, or "" with a warning when it could not be
    drawn (the report itself never fails for a picture)."""
    from vfm_toolchain.prepare import load_index

    if "data.prepare" not in outputs:
        return ""
    index = load_index(outputs["data.prepare"])
    split = "test" if index.get("test") else "val"
    records = pick_sheet_images(index.get(split) or [])
    if not records:
        return ""
    ctx.log.info("drawing %d %s images with the boxes of %s", len(records), split,
                 ", ".join(label for label, _ in columns))
    try:
        draw_detection_sheet(ctx.workdir / "detections.png", records, index["classes"], columns)
    except Exception as exc:  # a picture is not worth a failed build: said, and the build goes on
        warnings.append(f"the sheet of {split} images could not be drawn ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200]})")
        return ""
    return (f"{len(records)} {split} images spread over the split: the ground truth, then each detector's boxes "
            f"with score >= {SHEET_SCORE:g} at the image's own resolution (the mAP counts boxes down to "
            f"export.detection.score_thresh).")
