"""A procedural image task the toolchain generates itself, so the quickstart runs offline anywhere.

Task: recognise which shape (circle, square, triangle, star, ...) is drawn on a cluttered background,
whatever its colour, size, position and rotation.  It is built so that the method has something to show:

* a few labels per class are too few for a small network trained from scratch to learn shape
  invariance, while an ImageNet-pretrained teacher already has edge and shape features and learns it
  from the same few labels;
* the task-related unlabeled pool has the same distribution without labels, which is where
  distillation transfers the teacher's knowledge;
* the out-of-domain distractor pool (stripes, checkers, blobs, no shapes) is what curation should
  leave out.

Written as an ImageFolder tree: ``train/ val/ test/`` (``<class>/<n>.png``), ``pool/task/``,
``pool/distractor/`` and ``pool_labels.csv`` (hidden labels, only for judging a transfer set).
"""
from __future__ import annotations

import csv
import math
import random
from pathlib import Path
from typing import List, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = ["GENERATOR_VERSION", "SHAPES", "render_shape_image", "render_distractor_image", "generate_task",
           "render_segmentation_pair", "generate_segmentation_task"]

# Part of the data.prepare key: bump it whenever the rendering changes, so cached tasks are regenerated.
GENERATOR_VERSION = 2

SHAPES = ["circle", "square", "triangle", "star", "cross", "ring", "hexagon", "diamond", "arrow", "crescent"]


def _polygon(cx: float, cy: float, r: float, n: int, rot: float, inner: float = 1.0) -> List[Tuple[float, float]]:
    pts = []
    steps = n * (2 if inner != 1.0 else 1)
    for i in range(steps):
        rr = r if (i % 2 == 0 or inner == 1.0) else r * inner
        a = rot + 2 * math.pi * i / steps
        pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
    return pts


def _rotate(pts: List[Tuple[float, float]], cx: float, cy: float, rot: float) -> List[Tuple[float, float]]:
    c, s = math.cos(rot), math.sin(rot)
    return [(cx + (x - cx) * c - (y - cy) * s, cy + (x - cx) * s + (y - cy) * c) for x, y in pts]


def _background(rng: random.Random, size: int) -> Image.Image:
    c0 = [rng.randint(0, 255) for _ in range(3)]
    c1 = [rng.randint(0, 255) for _ in range(3)]
    grad = Image.linear_gradient("L").resize((size, size)).rotate(rng.uniform(0, 360), fillcolor=128)
    im = Image.composite(Image.new("RGB", (size, size), tuple(c0)), Image.new("RGB", (size, size), tuple(c1)), grad)
    draw = ImageDraw.Draw(im)
    for _ in range(rng.randint(0, 3)):  # clutter: thin lines and dots
        col = tuple(rng.randint(0, 255) for _ in range(3))
        if rng.random() < 0.6:
            draw.line([(rng.uniform(0, size), rng.uniform(0, size)) for _ in range(2)], fill=col,
                      width=rng.randint(1, 2))
        else:
            x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(1, size * 0.05)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=col)
    return im


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, rot: float, fill, bg) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.polygon(_polygon(cx, cy, r, 4, rot + math.pi / 4), fill=fill)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, rot), fill=fill)
    elif shape == "star":
        draw.polygon(_polygon(cx, cy, r, 5, rot, inner=0.45), fill=fill)
    elif shape == "cross":
        w = r * 0.35
        for pts in ([(cx - r, cy - w), (cx + r, cy - w), (cx + r, cy + w), (cx - r, cy + w)],
                    [(cx - w, cy - r), (cx + w, cy - r), (cx + w, cy + r), (cx - w, cy + r)]):
            draw.polygon(_rotate(pts, cx, cy, rot), fill=fill)
    elif shape == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        ri = r * 0.55
        draw.ellipse([cx - ri, cy - ri, cx + ri, cy + ri], fill=bg)
    elif shape == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, rot), fill=fill)
    elif shape == "diamond":
        pts = [(cx, cy - r), (cx + r * 0.55, cy), (cx, cy + r), (cx - r * 0.55, cy)]
        draw.polygon(_rotate(pts, cx, cy, rot), fill=fill)
    elif shape == "arrow":
        w = r * 0.25
        pts = [(cx - r, cy - w), (cx + r * 0.1, cy - w), (cx + r * 0.1, cy - r * 0.6), (cx + r, cy),
               (cx + r * 0.1, cy + r * 0.6), (cx + r * 0.1, cy + w), (cx - r, cy + w)]
        draw.polygon(_rotate(pts, cx, cy, rot), fill=fill)
    elif shape == "crescent":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        ox, oy = r * 0.45 * math.cos(rot), r * 0.45 * math.sin(rot)
        draw.ellipse([cx - r + ox, cy - r + oy, cx + r * 0.9 + ox, cy + r * 0.9 + oy], fill=bg)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def render_shape_image(rng: random.Random, shape: str, size: int) -> Image.Image:
    im = _background(rng, size)
    draw = ImageDraw.Draw(im)
    r = size * rng.uniform(0.25, 0.42)
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    bg = im.getpixel((int(cx), int(cy)))
    fill = tuple(rng.randint(0, 255) for _ in range(3))
    _draw_shape(draw, shape, cx, cy, r, rng.uniform(0, 2 * math.pi), fill, bg)
    if rng.random() < 0.3:
        im = im.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    return im


def render_distractor_image(rng: random.Random, size: int) -> Image.Image:
    """Out-of-domain: textures with no object (stripes, checkers, blobs, noise)."""
    kind = rng.choice(["stripes", "checker", "blobs", "noise"])
    c0 = tuple(rng.randint(0, 255) for _ in range(3))
    c1 = tuple(rng.randint(0, 255) for _ in range(3))
    im = Image.new("RGB", (size, size), c0)
    draw = ImageDraw.Draw(im)
    if kind == "stripes":
        step = rng.randint(3, 10)
        for x in range(-size, 2 * size, step * 2):
            draw.polygon([(x, 0), (x + step, 0), (x + step + size // 2, size), (x + size // 2, size)], fill=c1)
    elif kind == "checker":
        step = rng.randint(4, 12)
        for i in range(0, size, step):
            for j in range(0, size, step):
                if (i // step + j // step) % 2:
                    draw.rectangle([i, j, i + step - 1, j + step - 1], fill=c1)
    elif kind == "blobs":
        for _ in range(rng.randint(10, 30)):
            x, y, r = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(2, size / 6)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.randint(0, 255) for _ in range(3)))
        im = im.filter(ImageFilter.GaussianBlur(2))
    else:
        # Gaussian grey noise around 128, seeded by the draw (PIL's effect_noise reads C's rand(): other pixels each
        # run, under the same stage key); one draw from rng as before, so the images after it stay the same
        sigma = rng.uniform(20, 80)
        noise = np.random.default_rng(int(sigma * 1e9)).normal(128, sigma, (size, size))
        im = Image.fromarray(noise.clip(0, 255).astype(np.uint8), "L").convert("RGB")
    return im


def write_pools(out: Path, pool_size: int, distractor_size: int, image_size: int, rng: random.Random, render,
                header: str = "label", distractor_label: str = "distractor") -> Tuple[Path, Path]:
    """The unlabeled pools of a procedural task: ``pool/task`` (``render(rng) -> (image, its withheld label as
    text)``) and ``pool/distractor`` (textures), with ``pool_labels.csv`` (path, ``header``) for judging a transfer
    set; returns the two folders."""
    task_dir, distractor_dir = out / "pool" / "task", out / "pool" / "distractor"
    task_dir.mkdir(parents=True, exist_ok=True)
    distractor_dir.mkdir(parents=True, exist_ok=True)
    with open(out / "pool_labels.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", header])
        for i in range(pool_size):
            im, label = render(rng)
            p = task_dir / f"{i:06d}.png"
            im.save(p)
            writer.writerow([str(p.relative_to(out)), label])
        for i in range(distractor_size):
            p = distractor_dir / f"{i:06d}.png"
            render_distractor_image(rng, image_size).save(p)
            writer.writerow([str(p.relative_to(out)), distractor_label])
    return task_dir, distractor_dir


def generate_task(out: Path, classes: int, labeled_per_class: int, val_per_class: int, test_per_class: int,
                  pool_size: int, distractor_size: int, image_size: int, seed: int) -> dict:
    """Write the whole task under ``out``; returns the folder paths."""
    out = Path(out)
    shapes = SHAPES[:classes]
    rng = random.Random(seed)
    splits = {"train": labeled_per_class, "val": val_per_class, "test": test_per_class}
    for split, n in splits.items():
        for shape in shapes:
            d = out / split / shape
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                render_shape_image(rng, shape, image_size).save(d / f"{i:05d}.png")

    def labeled(rng: random.Random):
        shape = rng.choice(shapes)
        return render_shape_image(rng, shape, image_size), shape

    task_dir, distractor_dir = write_pools(out, pool_size, distractor_size, image_size, rng, labeled)
    return {"train": str(out / "train"), "val": str(out / "val"), "test": str(out / "test"),
            "pools": [str(task_dir), str(distractor_dir)], "classes": shapes}


# ---------------------------------------------------------------------------------------------------
# the segmentation form: several shapes per image, a label map of which shape covers each pixel


def render_segmentation_pair(rng: random.Random, shapes: List[str], size: int):
    """An image with 1-3 shapes on clutter and its label map (0 = background, k = shapes[k - 1])."""
    im = _background(rng, size)
    mask = Image.new("L", (size, size), 0)
    draw, mdraw = ImageDraw.Draw(im), ImageDraw.Draw(mask)
    for _ in range(rng.randint(1, 3)):
        k = rng.randrange(len(shapes))
        r = size * rng.uniform(0.14, 0.3)
        cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
        rot = rng.uniform(0, 2 * math.pi)
        bg = im.getpixel((int(cx), int(cy)))
        _draw_shape(draw, shapes[k], cx, cy, r, rot, tuple(rng.randint(0, 255) for _ in range(3)), bg)
        _draw_shape(mdraw, shapes[k], cx, cy, r, rot, k + 1, 0)  # holes (ring, crescent) go back to background
    return im, mask


def generate_segmentation_task(out: Path, classes: int, labeled: int, val: int, test: int, pool_size: int,
                               distractor_size: int, image_size: int, seed: int) -> dict:
    """``classes`` shape classes plus background: ``<split>/images``, ``<split>/masks``, ``train/classes.txt``,
    and the same unlabeled pools as the classification task."""
    out = Path(out)
    shapes = SHAPES[:classes]
    rng = random.Random(seed + 7919)
    for split, n in (("train", labeled), ("val", val), ("test", test)):
        (out / split / "images").mkdir(parents=True, exist_ok=True)
        (out / split / "masks").mkdir(parents=True, exist_ok=True)
        for i in range(n):
            im, mask = render_segmentation_pair(rng, shapes, image_size)
            im.save(out / split / "images" / f"{i:05d}.png")
            mask.save(out / split / "masks" / f"{i:05d}.png")
    (out / "train" / "classes.txt").write_text("\n".join(["background", *shapes]) + "\n")
    task_dir, distractor_dir = out / "pool" / "task", out / "pool" / "distractor"
    task_dir.mkdir(parents=True, exist_ok=True)
    distractor_dir.mkdir(parents=True, exist_ok=True)
    for i in range(pool_size):
        render_segmentation_pair(rng, shapes, image_size)[0].save(task_dir / f"{i:06d}.png")
    for i in range(distractor_size):
        render_distractor_image(rng, image_size).save(distractor_dir / f"{i:06d}.png")
    pools = [str(task_dir)] + ([str(distractor_dir)] if distractor_size else [])
    return {"train": str(out / "train"), "val": str(out / "val"), "test": str(out / "test"), "pools": pools,
            "classes": ["background", *shapes]}
