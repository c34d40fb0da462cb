"""The procedural detection task: shapes with boxes on cluttered backgrounds, generated offline.

The detection form of data/synthetic.py's shapes task (same shapes, same backgrounds, same
distractors), built so the method has something to show on 2 cores in minutes: several shapes per image, of
different classes and sizes (10% to 40% of the image's side), some images with none (negatives); a
detector needs to find them whatever their colour, rotation and background, which a few labels teach a
pretrained teacher better than a small network from scratch, and the unlabeled pool, with the same
distribution, is where the teacher's knowledge transfers.

Written in the COCO layout that :mod:`vfm_toolchain.data.detection` reads for users' data (so the quickstart goes
through the same reader and checks): ``train/ val/ test/`` each ``images/*.png`` + ``annotations.json``,
``pool/task/`` (shapes, no boxes), ``pool/distractor/`` (textures, no shapes) and ``pool_annotations.json``
(the pool's hidden boxes, only for judging a transfer set or pseudo-labels, never for training).  Boxes are
the tight bounds of each shape's drawn pixels, so a rotated star's box is the star's, not its circle's.
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import List, Sequence, Tuple

from PIL import Image, ImageDraw, ImageFilter

from vfm_toolchain.data.detection import write_coco
from vfm_toolchain.data.synthetic import SHAPES, _background, _draw_shape, render_distractor_image

__all__ = ["DETECTION_GENERATOR_VERSION", "render_detection_image", "generate_detection_task"]

# Part of the data.prepare key of synthetic detection tasks: bump it whenever the rendering changes.
DETECTION_GENERATOR_VERSION = 1

MAX_EXTRA_OBJECTS = 3  # besides the image's anchor class: 1 to 4 shapes on an image that has any
NEGATIVE_FRACTION = 0.1  # images with no shape, in every split and the task pool
SIZE_RANGE = (0.05, 0.2)  # a shape's radius as a fraction of the image's side: small to large objects
MAX_OVERLAP = 0.2  # of the smaller box, so every shape stays recognisable


def _overlap(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over the smaller box's area."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return iw * ih / smaller


def render_detection_image(rng: random.Random, shapes: Sequence[str], size: int,
                           objects: Sequence[int]) -> Tuple[Image.Image, List[List[float]], List[int]]:
    """An image with the shapes ``objects`` (class indices into ``shapes``, the first always placed) on clutter,
    and each placed shape's tight box (xyxy pixels) and class.  A shape with no free room left (20 tries) is
    left out, so the boxes always describe the image."""
    im = _background(rng, size)
    draw = ImageDraw.Draw(im)
    boxes: List[List[float]] = []
    labels: List[int] = []
    for k in objects:
        for _ in range(20):
            r = size * rng.uniform(*SIZE_RANGE)
            cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
            if all(_overlap((cx - r, cy - r, cx + r, cy + r), b) <= MAX_OVERLAP for b in boxes):
                break
        else:
            continue
        rot = rng.uniform(0, 2 * math.pi)
        mask = Image.new("L", (size, size), 0)
        _draw_shape(ImageDraw.Draw(mask), shapes[k], cx, cy, r, rot, 255, 0)
        bbox = mask.getbbox()  # (left, top, right + 1, bottom + 1): pixel i spans [i, i + 1], COCO's convention
        if bbox is None:  # a shape too small to cover a pixel
            continue
        bg = im.getpixel((int(cx), int(cy)))
        _draw_shape(draw, shapes[k], cx, cy, r, rot, tuple(rng.randint(0, 255) for _ in range(3)), bg)
        boxes.append([float(v) for v in bbox])
        labels.append(k)
    if rng.random() < 0.3:
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    return im, boxes, labels


def _plan(rng: random.Random, classes: int, per_class: int) -> List[List[int]]:
    """The objects of each image of a split: every class anchors ``per_class`` images (so each class is in at
    least that many), each with up to MAX_EXTRA_OBJECTS shapes of any class besides, plus NEGATIVE_FRACTION
    images with none, in a shuffled order."""
    plan = []
    for i in range(classes * per_class):
        plan.append([i % classes] + [rng.randrange(classes) for _ in range(rng.randint(0, MAX_EXTRA_OBJECTS))])
    plan += [[] for _ in range(max(1, round(NEGATIVE_FRACTION * len(plan))))]
    rng.shuffle(plan)
    return plan


def _write_images(rng: random.Random, images: Path, shapes: Sequence[str], size: int, plan: List[List[int]]) -> list:
    """Render the plan's images into the folder ``images``; their records (see vfm_toolchain.data.detection)."""
    images.mkdir(parents=True, exist_ok=True)
    records = []
    for i, objects in enumerate(plan):
        im, boxes, labels = render_detection_image(rng, shapes, size, objects)
        path = images / f"{i:05d}.png"
        im.save(path)
        records.append({"path": str(path), "width": size, "height": size, "boxes": boxes, "labels": labels})
    return records


def generate_detection_task(out: Path, classes: int, labeled_per_class: int, val_per_class: int,
                            test_per_class: int, pool_size: int, distractor_size: int, image_size: int,
                            seed: int) -> dict:
    """Write the whole task under ``out`` (see the module docstring); each ``*_per_class`` is the number of
    images each class appears in at least, plus a tenth as many negatives.  Returns the folder paths."""
    out = Path(out)
    shapes = SHAPES[:classes]
    rng = random.Random(seed + 104729)  # its own stream: the classification task of the same seed is unrelated
    for split, n in (("train", labeled_per_class), ("val", val_per_class), ("test", test_per_class)):
        records = _write_images(rng, out / split / "images", shapes, image_size, _plan(rng, classes, n))
        write_coco(out / split / "annotations.json", records, shapes, out / split / "images",
                   info={"description": f"procedural shapes detection task, {split} (seed {seed})"})
    task_dir, distractor_dir = out / "pool" / "task", out / "pool" / "distractor"
    pool_plan = [[rng.randrange(classes) for _ in range(rng.randint(1, MAX_EXTRA_OBJECTS + 1))]
                 if rng.random() >= NEGATIVE_FRACTION else [] for _ in range(pool_size)]
    if pool_size:
        pool_records = _write_images(rng, task_dir, shapes, image_size, pool_plan)
        write_coco(out / "pool_annotations.json", pool_records, shapes, out / "pool",
                   info={"description": "the task pool's hidden boxes: for judging a transfer set, never training"})
    distractor_dir.mkdir(parents=True, exist_ok=True)
    for i in range(distractor_size):
        render_distractor_image(rng, image_size).save(distractor_dir / f"{i:06d}.png")
    pools = ([str(task_dir)] if pool_size else []) + ([str(distractor_dir)] if distractor_size else [])
    return {"train": str(out / "train"), "val": str(out / "val"), "test": str(out / "test"), "pools": pools,
            "classes": list(shapes)}
