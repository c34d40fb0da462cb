"""``data.prepare``: turn the recipe's data section into a checked index every later stage reads.

Folders are scanned and every image decoded once: corrupt files are skipped and counted, each with its
reason (the log and the report say why, index.json keeps every one), class sets are checked across splits,
empty classes and empty pools are errors that say what to fix.  ``source: synthetic`` generates the
procedural quickstart task instead.

The task reads its splits (``Task.read_splits``, toolchain/tasks/); this stage generates the synthetic task,
scans the pools, which every task reads alike, and writes the index.  Each split of the index is a list of
samples: ``[path, class]`` (classification), ``[image, mask]`` (segmentation), or for detection one record per
image, ``{"path", "width", "height", "boxes": [[x1, y1, x2, y2], ...] (pixels of the image's own resolution),
"labels": [class, ...]}`` (data/detection.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

from vfm_toolchain.core.files import atomic_write_json
from vfm_toolchain.core.roots import is_under
from vfm_toolchain.data.images import scan_pool_with_reasons, set_max_image_pixels
from vfm_toolchain.data.pools import TAR_SEP, check_embedding_rows, embedding_files, expand_sources, list_pool_source
from vfm_toolchain.fingerprint import fingerprint_paths
from vfm_toolchain.stage import ReportContext, ReportSection, Stage, StageContext, StageOutput, register_stage
from vfm_toolchain.tasks import task_of
from vfm_toolchain.tasks.base import per_split_lines

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


@register_stage
class PrepareData(Stage):
    name = "data.prepare"
    inputs = ()
    version = "4"  # skipped images with their reasons; segmentation: the labels outside the budget are val

    def config(self, recipe) -> Dict[str, Any]:
        d, task = recipe.data, task_of(recipe)
        # workers: how images are decoded, not which (like the device); roots: where the data files may name files,
        # not which they name (those are fingerprinted below); a field only another task reads (data.format) stays
        # out, so each task's keys are what they were before the other task existed
        cfg = d.model_dump(mode="json", exclude={"workers", "roots", *task.foreign("data")})
        if d.source == "synthetic":
            cfg["generator_version"] = task.generator_version()
        else:
            cfg.pop("synthetic")
            named = _named_files(d, task)  # first: what the data files name is checked before anything is hashed
            cfg["fingerprint"] = fingerprint_paths([d.train, d.val, d.test, *d.pools], data_roots=d.roots)
            if named:  # only then: the keys of builds whose data files name nothing outside stay as they were
                cfg["named_files"] = fingerprint_paths([], files=named)
            cfg.update(task.data_key(d))
        return {"data": cfg, "seed": recipe.seed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        d, task = ctx.recipe.data, task_of(ctx.recipe)
        # which images are accepted is this stage's config; the build also sets the limit for every later stage
        # (toolchain/preflight.py check_data_files)
        set_max_image_pixels(d.max_image_pixels)
        if d.source == "synthetic":
            s = d.synthetic
            ctx.log.info("generating the procedural shapes %s task (%d classes)", d.task, s.classes)
            paths = task.generate(ctx.workdir / "synthetic", s)
            train_dir, val_dir, test_dir, pools = paths["train"], paths["val"], paths["test"], paths["pools"]
        else:
            train_dir, val_dir, test_dir, pools = d.train, d.val, d.test, d.pools
        for root in pools:  # embeddings that do not match their paths, or NaN rows: said before any decoding
            if embedding_files(str(root)):
                check_embedding_rows(str(root))
        splits = task.read_splits(ctx, train_dir, val_dir, test_dir)
        pool, pool_corrupt, pool_source, pool_rows = _scan_pools(pools, d.roots)
        index = {**splits.index, "pool": pool, "pool_roots": list(map(str, pools)), "pool_source": pool_source,
                 "pool_rows": pool_rows}
        index["corrupt"] = {**splits.index["corrupt"], "pool": pool_corrupt}
        return self._write(ctx, index, splits.extra, splits.notes)

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

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        r = out.result
        counts, corrupt = r.get("counts"), r.get("corrupt")
        section = ReportSection(
            summary=[f"data: {counts} images, {len(r.get('classes', []))} classes; corrupt skipped: {corrupt}"],
            record={"data": {"counts": counts, "corrupt": corrupt}})
        if any((corrupt or {}).values()):  # the result's warnings say which files and why; this, how many
            section.warnings.append(f"corrupt images skipped: {corrupt}")
        task_of(r).describe_data(r, section)
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


def _named_files(d, task) -> List[str]:
    """The files the data files name outside the folders the fingerprint walks: a pool list's or a precomputed
    pool's images, and what the task's annotation files name (COCO file_names under data.roots).  Fingerprinted
    beside the folders, so that every file data.prepare reads is in its key (a symlink in a walked folder is
    hashed by what it leads to)."""
    walked = [os.path.normpath(x) for x in (d.train, d.val, d.test, *d.pools) if x and os.path.isdir(x)]
    named: List[str] = list(task.named_files(d))
    for pool in d.pools:
        for src in expand_sources(pool):  # lists and path files only: a tar shard's members are inside it
            if embedding_files(src) or (os.path.isfile(src) and src.endswith((".txt", ".lst"))):
                named += [item.split(TAR_SEP, 1)[0] for item in list_pool_source(src, d.roots)]
    named = {os.path.normpath(p) for p in named}
    return sorted(p for p in named if not any(is_under(p, w) for w in walked))


def _skipped_lines(corrupt: Dict[str, Dict[str, str]], shown: int = 5) -> List[str]:
    """One line per split with skipped images: how many, and the first few with why (index.json has all)."""
    return per_split_lines(corrupt, "image", "s", "skipped", "'{}'", shown)


def class_count(recipe) -> int:
    """The recipe's number of classes, without running data.prepare (the head's width is part of the timing)."""
    return task_of(recipe).class_count(recipe)
