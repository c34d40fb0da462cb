"""The procedural multi-label task (``data.task: multilabel`` with ``source: synthetic``): 1-3 shapes per image on
clutter, tagged with the shapes it shows (data/synthetic.py draws them), in the ``tags.csv`` layout
data/tags.py reads, with the same unlabeled pools as the classification task."""
from __future__ import annotations

import math
import random
from pathlib import Path

from PIL import ImageDraw

from vfm_toolchain.data.synthetic import SHAPES, _background, _draw_shape, write_pools
from vfm_toolchain.data.tags import write_tags_csv

__all__ = ["MULTILABEL_GENERATOR_VERSION", "generate_multilabel_task", "render_tagged_image"]

MULTILABEL_GENERATOR_VERSION = 1


def render_tagged_image(rng: random.Random, shapes, size: int):
    """An image with 1-3 shapes (a shape may repeat) and the sorted names of the shapes it shows."""
    im = _background(rng, size)
    draw = ImageDraw.Draw(im)
    shown = set()
    for _ in range(rng.randint(1, 3)):
        shape = rng.choice(shapes)
        r = size * rng.uniform(0.12, 0.22)
        cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
        bg = im.getpixel((int(cx), int(cy)))
        _draw_shape(draw, shape, cx, cy, r, rng.uniform(0, 2 * math.pi), tuple(rng.randint(0, 255) for _ in range(3)),
                    bg)
        shown.add(shape)
    return im, sorted(shown)


def generate_multilabel_task(out: Path, classes: int, labeled_per_class: int, val_per_class: int,
                             test_per_class: int, pool_size: int, distractor_size: int, image_size: int,
                             seed: int) -> dict:
    """``classes`` shape tags: ``<split>/images`` + ``<split>/tags.csv`` (``per_class`` x ``classes`` images a
    split), ``train/classes.txt``, and a pool with its withheld tags (``pool_labels.csv``) beside distractors."""
    out = Path(out)
    shapes = SHAPES[:classes]
    rng = random.Random(seed + 104729)
    for split, n in (("train", labeled_per_class), ("val", val_per_class), ("test", test_per_class)):
        images = out / split / "images"
        images.mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(n * classes):
            im, tags = render_tagged_image(rng, shapes, image_size)
            im.save(images / f"{i:05d}.png")
            rows.append((f"{i:05d}.png", [t for t in shapes if t in tags]))
        write_tags_csv(out / split / "tags.csv", rows)
    (out / "train" / "classes.txt").write_text("".join(f"{s}\n" for s in shapes))
    def tagged(rng: random.Random):
        im, tags = render_tagged_image(rng, shapes, image_size)
        return im, ";".join(tags)

    task_dir, distractor_dir = write_pools(out, pool_size, distractor_size, image_size, rng, tagged, "tags", "")
    return {"train": str(out / "train"), "val": str(out / "val"), "test": str(out / "test"),
            "pools": [str(task_dir), str(distractor_dir)], "classes": shapes}
