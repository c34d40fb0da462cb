"""``data.prepare``: turn the recipe's data section into a checked index every later stage reads.

Folders are scanned and every image decoded once: corrupt files are skipped and counted, each with its
reason (the log and the report say why, index.json keeps every one), class sets are checked across splits,
empty classes and empty pools are errors that say what to fix.  ``source: synthetic`` generates the
procedural quickstart task instead.

Each split of the index is a list of samples: ``[path, class]`` (classification), ``[image, mask]``
(segmentation), or for detection one record per image, ``{"path", "width", "height", "boxes": [[x1, y1, x2,
y2], ...] (pixels of the image's own resolution), "labels": [class, ...]}`` (toolchain/detdata.py).
"""
from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from typing import Any, Dict, List, Tuple

from vfm_toolchain.data import check_same_classes, scan_image_folder, scan_pool_with_reasons, set_max_image_pixels
from vfm_toolchain.detdata import (EDGE_TOLERANCE, boxes_per_class, check_same_detection_classes, detect_format,
                                   images_per_class, parse_detection_split, read_yolo_names,
                                   scan_detection_split, select_labeled)
from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.fingerprint import fingerprint_paths
from vfm_toolchain.pools import TAR_SEP, check_embedding_rows, embedding_files, expand_sources, list_pool_source
from vfm_toolchain.stage import ReportContext, ReportSection, Stage, StageContext, StageOutput, register_stage
from vfm_toolchain.store import atomic_write_json
from vfm_toolchain.segdata import check_label_budget, read_classes, scan_segmentation_folder
from vfm_toolchain.tasks import task_of
from vfm_toolchain.synthetic import GENERATOR_VERSION, generate_segmentation_task, generate_task
from vfm_toolchain.synthetic_detection import DETECTION_GENERATOR_VERSION, generate_detection_task

__all__ = ["PrepareData", "load_index", "sample_paths", "store_relative", "class_count"]


def load_index(output) -> Dict[str, Any]:
    """Read a ``data.prepare`` output's index; generated images are stored relative to the stage folder
    (which is renamed when the stage is sealed), user folders by absolute path."""
    index = json.loads(output.path("index.json").read_text())
    if index.get("relative_to_stage"):
        base = str(output.dir)
        fix = lambda p: os.path.join(base, p)
        for split in ("train", "val", "test"):
            index[split] = [_move_sample(x, fix) for x in index[split]]
        index["pool"] = [fix(p) for p in index["pool"]]
        index["pool_roots"] = [fix(p) for p in index["pool_roots"]]
    return index


def sample_paths(samples) -> List[str]:
    """The image paths of a split's samples: detection records (dicts) or [path, label or mask] pairs."""
    return [x["path"] if isinstance(x, dict) else x[0] for x in samples]


def _move_sample(sample, fix):
    """A sample with its paths passed through ``fix``: a detection record (a dict), or [path, label or mask]."""
    if isinstance(sample, dict):
        return {**sample, "path": fix(sample["path"])}
    p, y = sample
    return [fix(p), fix(y) if isinstance(y, str) else y]


def store_relative(output, path: str) -> str:
    """``path`` relative to a data.prepare output when it lies inside it (generated data), else unchanged:
    what other stages write into the store names generated images this way, never by an absolute path."""
    base = os.path.join(str(output.dir), "")
    return path[len(base):] if isinstance(path, str) and path.startswith(base) else path


def _subset_per_class(samples: List[Tuple[str, int]], n: int, seed: int) -> List[Tuple[str, int]]:
    by_class: Dict[int, List[Tuple[str, int]]] = defaultdict(list)
    for s in samples:
        by_class[s[1]].append(s)
    rng = random.Random(seed)
    out = []
    for label in sorted(by_class):
        items = sorted(by_class[label])
        rng.shuffle(items)
        out.extend(sorted(items[:n]))
    return out


def _split(samples, fraction: float, seed: int):
    by_class: Dict[int, list] = defaultdict(list)
    for s in samples:
        by_class[s[1]].append(s)
    rng = random.Random(seed)
    train, val = [], []
    for label in sorted(by_class):
        items = sorted(by_class[label])
        rng.shuffle(items)
        k = max(1, int(round(len(items) * fraction))) if len(items) > 1 else 0
        val.extend(items[:k])
        train.extend(items[k:])
    return sorted(train), sorted(val)


@register_stage
class PrepareData(Stage):
    name = "data.prepare"
    inputs = ()
    version = "4"  # skipped images with their reasons; segmentation: the labels outside the budget are val

    def config(self, recipe) -> Dict[str, Any]:
        d = recipe.data
        detection = d.task == "detection"
        # workers: how images are decoded, not which (like the device); format: detection only, so the keys of
        # classification and segmentation builds stay what they were before detection existed
        # roots: where the data files may name files, not which they name (those are fingerprinted below)
        cfg = d.model_dump(mode="json", exclude={"workers", "roots"} if detection else {"workers", "format", "roots"})
        if d.source == "synthetic":
            cfg["generator_version"] = DETECTION_GENERATOR_VERSION if detection else GENERATOR_VERSION
        else:
            cfg.pop("synthetic")
            named = _named_files(d, detection)  # first: what the data files name is checked before anything is hashed
            cfg["fingerprint"] = fingerprint_paths([d.train, d.val, d.test, *d.pools], data_roots=d.roots)
            if named:  # only then: the keys of builds whose data files name nothing outside stay as they were
                cfg["named_files"] = fingerprint_paths([], files=named)
            if detection and detect_format(d.train, "train", d.format) == "yolo":
                # YOLO's class names may live above the split folders, outside the fingerprint
                cfg["yolo_names"] = {role: read_yolo_names(split, d.roots) for role, split in
                                     (("train", d.train), ("val", d.val), ("test", d.test)) if split}
        return {"data": cfg, "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        d, seed = ctx.recipe.data, ctx.recipe.seed
        # which images are accepted is this stage's config; the build also sets the limit for every later stage
        # (toolchain/preflight.py check_data_files)
        set_max_image_pixels(d.max_image_pixels)
        if d.source == "synthetic":
            s = d.synthetic
            ctx.log.info("generating the procedural shapes %s task (%d classes)", d.task, s.classes)
            gen = {"segmentation": generate_segmentation_task, "detection": generate_detection_task}.get(
                d.task, generate_task)
            paths = gen(ctx.workdir / "synthetic", s.classes, s.labeled_per_class, s.val_per_class,
                        s.test_per_class, s.pool_size, s.distractor_size, s.image_size, s.seed)
            train_dir, val_dir, test_dir, pools = paths["train"], paths["val"], paths["test"], paths["pools"]
        else:
            train_dir, val_dir, test_dir, pools = d.train, d.val, d.test, d.pools
        for root in pools:  # embeddings that do not match their paths, or NaN rows: said before any decoding
            if embedding_files(str(root)):
                check_embedding_rows(str(root))
        if d.task == "segmentation":
            return self._segmentation(ctx, train_dir, val_dir, test_dir, pools)
        if d.task == "detection":
            return self._detection(ctx, train_dir, val_dir, test_dir, pools)

        train = scan_image_folder(train_dir, "train", data_roots=d.roots)
        test = scan_image_folder(test_dir, "test", data_roots=d.roots)
        val = scan_image_folder(val_dir, "val", data_roots=d.roots) if val_dir else None
        for role, other in (("val", val), ("test", test)):
            if other is not None:
                check_same_classes(train.classes, other.classes, role)
        train_samples = train.samples
        rest = []
        if d.labeled_per_class:
            train_samples = _subset_per_class(train.samples, d.labeled_per_class, seed)
            chosen = set(map(tuple, train_samples))
            rest = [s for s in train.samples if tuple(s) not in chosen]
        if val is None and rest:
            # labels left out of the budget are never trained on; they are the validation set
            val_samples = rest
            ctx.log.info("no val folder: the %d labels outside the budget are the validation set", len(rest))
        elif val is None:
            train_samples, val_samples = _split(train_samples, d.val_fraction, seed)
            ctx.log.info("no val folder: held out %d of the labels for validation", len(val_samples))
        else:
            val_samples = val.samples
        pool, pool_corrupt, pool_source, pool_rows = _scan_pools(pools, d.roots)
        index = {
            "classes": train.classes,
            "train": train_samples, "val": val_samples, "test": test.samples,
            "pool": pool, "pool_roots": list(map(str, pools)), "pool_source": pool_source, "pool_rows": pool_rows,
            "corrupt": {"train": train.corrupt, "val": val.corrupt if val else {}, "test": test.corrupt,
                        "pool": pool_corrupt},
        }
        return self._write(ctx, index)

    def _write(self, ctx, index, extra: Dict[str, Any] | None = None, notes: List[str] = ()) -> Dict[str, Any]:
        """Write index.json and return the stage's result; ``extra`` joins the result and ``notes`` its
        warnings (detection: boxes kept, dropped and clipped)."""
        index["task"] = ctx.recipe.data.task
        if ctx.recipe.data.source == "synthetic":  # paths relative to the stage folder, which moves when sealed
            rel = lambda p: os.path.relpath(p, ctx.workdir)
            for split in ("train", "val", "test"):  # (path, label), (image, mask) or a detection record
                index[split] = [_move_sample(x, rel) for x in index[split]]
            index["pool"] = [rel(p) for p in index["pool"]]
            index["pool_roots"] = [rel(p) for p in index["pool_roots"]]
            index["relative_to_stage"] = True
        atomic_write_json(ctx.workdir / "index.json", index)
        counts = {k: len(index[k]) for k in ("train", "val", "test", "pool")}
        corrupt = {k: len(v) for k, v in index["corrupt"].items()}
        ctx.log.info("data: %s; corrupt skipped: %s", counts, corrupt)
        warnings = _skipped_lines(index["corrupt"]) + list(notes)
        for line in warnings:
            ctx.log.warning("%s", line)
        return {"classes": index["classes"], "task": index["task"], "counts": counts, "corrupt": corrupt,
                "warnings": warnings, "index": "index.json", **(extra or {})}

    def _segmentation(self, ctx, train_dir, val_dir, test_dir, pools) -> Dict[str, Any]:
        """Image/mask pairs; a label budget counts images.  Without a val folder, as in classification, the labels
        outside the budget are the validation set, or without a budget a fraction of train is held out."""
        d, seed = ctx.recipe.data, ctx.recipe.seed
        classes = read_classes(train_dir, d.roots)
        train, bad_train = scan_segmentation_folder(train_dir, "train", len(classes), d.roots)
        test, bad_test = scan_segmentation_folder(test_dir, "test", len(classes), d.roots)
        val, bad_val = scan_segmentation_folder(val_dir, "val", len(classes), d.roots) if val_dir else (None, {})
        # the recipe checks counted the pairs from the listing; decoding may have skipped some since
        check_label_budget(train_dir, len(train), d.labeled_per_class, val is not None)
        order = list(train)
        random.Random(seed).shuffle(order)
        if d.labeled_per_class:
            order, rest = order[:d.labeled_per_class], order[d.labeled_per_class:]
            if val is None:
                val = rest
                ctx.log.info("no val folder: the %d labeled images outside the budget are the validation set",
                             len(rest))
        elif val is None:
            k = max(1, int(round(len(order) * d.val_fraction)))
            val, order = order[:k], order[k:]
            ctx.log.info("no val folder: held out %d of the labeled images for validation", len(val))
        train = sorted(order)
        pool, pool_corrupt, pool_source, pool_rows = _scan_pools(pools, d.roots)
        index = {"classes": classes, "train": train, "val": sorted(val), "test": test, "pool": pool,
                 "pool_roots": list(map(str, pools)), "pool_source": pool_source, "pool_rows": pool_rows,
                 "corrupt": {"train": bad_train, "val": bad_val, "test": bad_test, "pool": pool_corrupt}}
        return self._write(ctx, index)

    def _detection(self, ctx, train_dir, val_dir, test_dir, pools) -> Dict[str, Any]:
        """COCO or YOLO splits read into records (toolchain/detdata.py); a label budget picks whole images so
        each class appears in at least ``labeled_per_class`` of them.  Without a val folder, as in
        classification, the images outside the budget are the validation set, or without a budget a fraction of
        train is held out."""
        d, seed = ctx.recipe.data, ctx.recipe.seed
        fmt = "coco" if d.source == "synthetic" else d.format
        train = scan_detection_split(train_dir, "train", fmt, d.roots)
        test = scan_detection_split(test_dir, "test", fmt, d.roots)
        val = scan_detection_split(val_dir, "val", fmt, d.roots) if val_dir else None
        for role, other in (("val", val), ("test", test)):
            if other is not None:
                check_same_detection_classes(train.classes, other.classes, role)
        classes = train.classes
        notes: List[str] = []
        labeled, rest = train.records, []
        if d.labeled_per_class:
            labeled, rest = select_labeled(train.records, len(classes), d.labeled_per_class, seed)
            have = images_per_class(train.records, len(classes))
            short = [f"'{c}' {n}" for c, n in zip(classes, have) if n < d.labeled_per_class]
            if short:
                notes.append(f"data.labeled_per_class is {d.labeled_per_class} but train has fewer images containing "
                             f"{', '.join(short)}; each such class keeps every image it is in")
        if val is None and rest:
            val_records = rest  # labels outside the budget are never trained on; they are the validation set
            ctx.log.info("no val folder: the %d labeled images outside the budget are the validation set", len(rest))
        elif val is None:
            if len(labeled) < 2:
                raise ToolchainError(f"train folder '{train_dir}' has {len(labeled)} usable labeled image; without "
                                     f"data.val at least 2 are needed (one to train on, one to validate with): "
                                     f"add images or give data.val")
            order = list(labeled)
            random.Random(seed).shuffle(order)
            k = min(max(1, int(round(len(order) * d.val_fraction))), len(order) - 1)
            val_records, labeled = sorted(order[:k], key=_path), sorted(order[k:], key=_path)
            ctx.log.info("no val folder: held out %d of the labeled images for validation", k)
        else:
            val_records = val.records
        kept_boxes = boxes_per_class(labeled, len(classes))
        absent = [c for c, n in zip(classes, kept_boxes) if n == 0]
        if absent:
            notes.append(f"no box of class{'es' * (len(absent) > 1)} {', '.join(repr(c) for c in absent)} in the "
                         f"labeled train images: the detector cannot learn {'them' if len(absent) > 1 else 'it'} "
                         f"(a category with no annotations, such as a dataset-wide parent category, can be removed)")
        ctx.log.info("labeled train: %d images; boxes per class kept: %s", len(labeled),
                     dict(zip(classes, kept_boxes)))
        splits = {"train": labeled, "val": val_records, "test": test.records}
        scanned = {"train": train, "val": val, "test": test}
        dropped = {role: s.dropped_boxes if s else {} for role, s in scanned.items()}
        clipped = {role: s.clipped if s else 0 for role, s in scanned.items()}
        notes += _dropped_box_lines(dropped)
        for role, n in clipped.items():
            if n:
                ctx.log.info("%s: %d box%s reached more than %g px past the image and were clipped to it", role, n,
                             "es" * (n != 1), EDGE_TOLERANCE)
        pool, pool_corrupt, pool_source, pool_rows = _scan_pools(pools, d.roots)
        index = {"classes": classes, "format": train.format, **splits, "pool": pool,
                 "pool_roots": list(map(str, pools)), "pool_source": pool_source, "pool_rows": pool_rows,
                 "corrupt": {"train": train.skipped, "val": val.skipped if val else {}, "test": test.skipped,
                             "pool": pool_corrupt},
                 "dropped_boxes": dropped, "clipped_boxes": clipped}
        extra = {"format": train.format,
                 "boxes": {role: sum(len(r["boxes"]) for r in recs) for role, recs in splits.items()},
                 "boxes_per_class": {role: dict(zip(classes, boxes_per_class(recs, len(classes))))
                                     for role, recs in splits.items()},
                 "images_per_class": {role: dict(zip(classes, images_per_class(recs, len(classes))))
                                      for role, recs in splits.items()},
                 "dropped_boxes": {role: len(v) for role, v in dropped.items()}, "clipped_boxes": clipped}
        return self._write(ctx, index, extra, notes)

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        r = out.result
        counts, corrupt = r.get("counts"), r.get("corrupt")
        section = ReportSection(
            summary=[f"data: {counts} images, {len(r.get('classes', []))} classes; corrupt skipped: {corrupt}"],
            record={"data": {"counts": counts, "corrupt": corrupt}})
        if any((corrupt or {}).values()):  # the result's warnings say which files and why; this, how many
            section.warnings.append(f"corrupt images skipped: {corrupt}")
        if r.get("task") == "detection":
            dropped = r.get("dropped_boxes", {})
            section.summary.append(f"boxes ({r.get('format')}): {r.get('boxes')}; boxes per class in the labeled "
                                   f"train images: {r.get('boxes_per_class', {}).get('train')}")
            section.record["data"].update(boxes=r.get("boxes"), boxes_per_class=r.get("boxes_per_class"),
                                          dropped_boxes=dropped, clipped_boxes=r.get("clipped_boxes"))
            if any(dropped.values()):
                section.warnings.append(f"boxes dropped (outside their image or with no area): {dropped}")
        return section


def _scan_pools(pools, data_roots):
    """Every pool source's readable images, per source (the report says where the transfer set came from);
    precomputed-embedding sources also give each image's row."""
    pool, pool_corrupt, pool_source, pool_rows = [], {}, [], []
    for i, root in enumerate(pools):
        good, bad = scan_pool_with_reasons([root], data_roots=data_roots)
        pool += good
        pool_corrupt.update(bad)
        pool_source += [i] * len(good)
        if embedding_files(str(root)):  # precomputed embeddings: remember each image's row
            row_of = {p: r for r, p in reversed(list(enumerate(list_pool_source(str(root), data_roots))))}
            pool_rows += [row_of[p] for p in good]
        else:
            pool_rows += [-1] * len(good)
    return pool, pool_corrupt, pool_source, pool_rows


def _named_files(d, detection: bool) -> List[str]:
    """The files the data files name outside the folders the fingerprint walks: a pool list's or a precomputed
    pool's images, COCO file_names under data.roots.  Fingerprinted beside the folders, so that every file
    data.prepare reads is in its key (a symlink in a walked folder is hashed by what it leads to)."""
    walked = [os.path.normpath(x) for x in (d.train, d.val, d.test, *d.pools) if x and os.path.isdir(x)]
    named: List[str] = []
    if detection:
        for role, split in (("train", d.train), ("val", d.val), ("test", d.test)):
            if split and detect_format(split, role, d.format) == "coco":
                named += [str(e.path) for e in parse_detection_split(split, role, "coco", d.roots).entries]
    for pool in d.pools:
        for src in expand_sources(pool):  # lists and path files only: a tar shard's members are inside it
            if embedding_files(src) or (os.path.isfile(src) and src.endswith((".txt", ".lst"))):
                named += [item.split(TAR_SEP, 1)[0] for item in list_pool_source(src, d.roots)]
    named = {os.path.normpath(p) for p in named}
    return sorted(p for p in named if not any(p == w or p.startswith(w + os.sep) for w in walked))


def _path(record: Dict[str, Any]) -> str:
    return record["path"]


def _dropped_box_lines(dropped: Dict[str, Dict[str, str]], shown: int = 5) -> List[str]:
    """One line per split with dropped boxes: how many, and the first few with where and why."""
    return _listing(dropped, "box", "es", "dropped", "{}", shown)


def _skipped_lines(corrupt: Dict[str, Dict[str, str]], shown: int = 5) -> List[str]:
    """One line per split with skipped images: how many, and the first few with why (index.json has all)."""
    return _listing(corrupt, "image", "s", "skipped", "'{}'", shown)


def _listing(bad_by_split: Dict[str, Dict[str, str]], noun: str, plural: str, what: str, item: str,
             shown: int) -> List[str]:
    lines = []
    for split, bad in bad_by_split.items():
        if bad:
            first = "; ".join(f"{item.format(where)}: {why}" for where, why in list(bad.items())[:shown])
            more = f"; and {len(bad) - shown} more (every one with its reason in the data.prepare index.json)" \
                if len(bad) > shown else ""
            lines.append(f"{split}: {len(bad)} {noun}{plural * (len(bad) != 1)} {what}: {first}{more}")
    return lines


def class_count(recipe) -> int:
    """The recipe's number of classes, without running data.prepare (the head's width is part of the timing)."""
    return task_of(recipe).class_count(recipe)
