"""``teacher.curate``: embed the unlabeled pool once and select the transfer set.

The encoder (``curate.encoder``) is by default the teacher's own pretrained foundation model without its
adapter: queries and pool are then in the space the model was trained for, and text prompts go through the
text tower of that same model (an adapted image tower would no longer match the untouched text tower).

The labeled training images are the queries (seed 004 sec. 3.5), or class-name prompts for
``query_balanced_text``; for detection also each labeled box, cropped with some context, with shares of the
budget that give every class an equal part (teachers/object_queries.py).  Embeddings are L2-normalised
pooled/CLS features (a detection teacher's too: its backbone still pools), so Euclidean distance ranks like
cosine similarity.  The pool is embedded in resumable shards (under torchrun, each process embeds
its own), or read from another tool's precomputed shards, and is never concatenated in memory.

Output: ``manifest.csv`` (source, path, distance to its query, query) in selection order, per-query
coverage (``coverage.csv``), the embeddings, and two pictures.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Union

import numpy as np
import torch

from vfm_toolchain import distributed
from vfm_toolchain.checkpoint import load_model
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes, atomic_write_npy
from vfm_toolchain.data.images import Preprocess, load_image
from vfm_toolchain.data.pools import load_embedding_source
from vfm_toolchain.prepare import load_index, store_relative
from vfm_toolchain.stage import ReportContext, ReportSection, Stage, StageContext, StageOutput, register_stage
from vfm_toolchain.tasks import task_of
from vfm_toolchain.teachers.backbones import create_backbone
from vfm_toolchain.teachers.backbones.base import check_backbone, has_text_tower, resolve_weights
from vfm_toolchain.teachers.curate_plots import check_map, plot_map, plot_neighbours
from vfm_toolchain.teachers.embed import embed_sharded, load_shards
from vfm_toolchain.teachers.model import TeacherClassifier, embed_features, zero_shot_text_embeddings
from vfm_toolchain.teachers.object_queries import (ObjectCrops, object_queries, per_class_counts, query_weights,
                                                   sample_path)
from vfm_toolchain.teachers.search import PoolIndex, describe_lines
from vfm_toolchain.teachers.strategies import STRATEGIES, select_transfer_set
from vfm_toolchain.teachers.strategies.base import knn
from vfm_toolchain.teachers.tasks import teacher_task
from vfm_toolchain.teachers.vectors import PoolVectors

__all__ = ["TeacherCurate", "check_curate", "embed_images", "pool_vectors", "stored_pool_vectors", "stored_val_overlap",
           "transfer_paths", "val_overlap"]

log = logging.getLogger("toolchain")

RECALL_K = 100  # the depth at which an approximate index is tuned for selection (strategies search ~this deep)
DEDUP_K = 8  # neighbours looked at for near-duplicates


def text_queries(encoder, classes: List[str], prompts) -> np.ndarray:
    """One unit query per class: the class name in every template, encoded by the text tower and averaged."""
    rows = zero_shot_text_embeddings(encoder.backbone, classes, prompts, "curate.strategy query_balanced_text")
    return rows.numpy().astype(np.float32)


def embed_images(model, paths: Union[List[str], torch.utils.data.Dataset], pp: Preprocess,
                 batch_size: Union[int, str] = "auto") -> np.ndarray:
    """Unit embeddings of image paths, or of a dataset of transformed images (object crops)."""
    return embed_features(model, paths, pp, batch_size, normalize=True).numpy().astype(np.float32)


def transfer_paths(curate: StageOutput, prepare: StageOutput) -> List[str]:
    """The transfer set's image paths in selection order, resolved wherever the store now is."""
    pool = load_index(prepare)["pool"]
    with open(curate.path("manifest.csv"), newline="") as fh:
        return [pool[int(row["pool_index"])] for row in csv.DictReader(fh)]


def pool_vectors(index: Dict[str, Any], rows: np.ndarray, todo: np.ndarray, folder: Path, shard_size: int,
                 dim: int | None = None, encoder=None):
    """The pool's embeddings in pool order: our shards in ``folder`` for what curation embedded (``todo``), the
    precomputed sources' own shards for the rest (memory-mapped, never concatenated).  ``encoder``: the retrieval
    encoder's (name, weights, size), or False for the finetuned teacher, to check the precomputed sources against
    (and ``dim``, the query width); None reads them unchecked (a stored curation, checked when it ran).  Returns
    the vectors and notes for the build's warnings."""
    notes = []
    n = len(index["pool"])
    computed = load_shards(folder, len(todo)) if len(todo) else None
    if len(todo) == n:
        return computed, notes
    arrays = list(computed.arrays) if computed is not None else []
    loc = np.empty((n, 2), dtype=np.int64)
    j = np.arange(len(todo))
    loc[todo, 0], loc[todo, 1] = j // shard_size, j % shard_size
    sources = np.asarray(index["pool_source"], dtype=np.int64)
    encoder_name = encoder[0] if encoder else "the finetuned teacher"
    for s in sorted(set(sources[rows >= 0].tolist())):
        root = index["pool_roots"][s]
        arrs, info = load_embedding_source(root)
        made_by = info.get("encoder")
        if encoder is not None:
            if not encoder or (made_by and made_by != encoder[0]):
                raise ToolchainError(
                    f"precomputed pool '{root}' was embedded by {made_by or 'an unnamed encoder'}, but queries are "
                    f"embedded by {encoder_name}; set curate.encoder to the model that made those embeddings")
            if made_by is None:
                notes.append(f"precomputed pool '{root}' has no info.json naming its encoder; assumed to be "
                             f"{encoder_name}")
            if dim is not None and arrs[0].shape[1] != dim:
                raise ToolchainError(f"precomputed pool '{root}' has {arrs[0].shape[1]}-d embeddings but "
                                     f"{encoder_name} embeds queries in {dim}-d; they must come from the same model")
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrs])])
        items = np.flatnonzero(sources == s)
        which = np.searchsorted(offsets, rows[items], side="right") - 1
        loc[items, 0], loc[items, 1] = len(arrays) + which, rows[items] - offsets[which]
        arrays += arrs
    return PoolVectors(arrays, loc, normalize=True), notes


def stored_pool_vectors(curate: StageOutput, prepare: StageOutput) -> PoolVectors:
    """A finished curation's pool embeddings, in the pool order of its data index (what ``label-next`` reads)."""
    index = load_index(prepare)
    rows = np.asarray(index.get("pool_rows") or [-1] * len(index["pool"]), dtype=np.int64)
    todo = np.flatnonzero(rows < 0)
    shard = json.loads((curate.dir / "pool_embeddings" / "manifest.json").read_text()).get("shard_size") \
        if len(todo) else None
    vectors, _ = pool_vectors(index, rows, todo, curate.dir / "pool_embeddings", shard or 4096)
    return vectors


def val_overlap(val_emb: np.ndarray, vectors: PoolVectors, selected: np.ndarray, val_paths: List[str],
                pool: List[str], folder: Path, shown=str) -> Dict[str, Any]:
    """How close the transfer set comes to each val image: the distance (unit embeddings, the leakage guard's
    measure) from every val image to its nearest transfer image, written to ``val_overlap.csv`` in ``folder``
    (val image, distance, that transfer image; closest first).  The guard drops near-copies (``leakage_distance``);
    this sees what it lets through, e.g. the frame next to a val frame in a video pool, which makes val a judge
    that has half-seen the transfer set: ``student.finetune`` reads ``nearest`` to decide whether val may choose
    between the distilled and the finetuned weights (``finetune.val_overlap_distance``).  ``shown`` names an image
    in the file (generated data relative to its store entry)."""
    selected = np.asarray(selected, dtype=np.int64)
    best = np.full(len(val_emb), np.inf, dtype=np.float32)
    which = np.full(len(val_emb), -1, dtype=np.int64)
    if len(val_emb) and len(selected):
        for ids, block in vectors.chunks(ids=selected):  # the transfer set a block at a time: bounded memory
            d, j = knn(block, val_emb, 1)
            closer = d[:, 0] < best
            best[closer], which[closer] = d[closer, 0], ids[j[closer, 0]]
    order = np.argsort(best, kind="stable")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["val_image", "distance", "nearest_transfer_image"])
    for k in order:
        w.writerow([shown(val_paths[k]), f"{best[k]:.6f}", shown(pool[which[k]]) if which[k] >= 0 else ""])
    atomic_write_bytes(folder / "val_overlap.csv", buf.getvalue().encode())
    return {"file": "val_overlap.csv", "nearest": [round(float(x), 6) for x in best]}


def stored_val_overlap(curate: StageOutput, prepare: StageOutput, folder: Path) -> Dict[str, Any] | None:
    """:func:`val_overlap` of a curate output: its own record, or, for one stored before curation measured it,
    measured now from its files (the val embeddings the leakage guard wrote, the pool embeddings, the manifest)
    with its csv in ``folder`` (a stored entry is not written to); None when the guard was off (no val
    embeddings kept)."""
    if "val_overlap" in curate.result:
        return curate.result["val_overlap"]
    index = load_index(prepare)
    held = curate.dir / "heldout_emb.npy"
    if not held.is_file():
        return None
    val_emb = np.load(held)[:len(index["val"])].astype(np.float32)
    with open(curate.path("manifest.csv"), newline="") as fh:
        selected = np.asarray([int(row["pool_index"]) for row in csv.DictReader(fh)], dtype=np.int64)
    return val_overlap(val_emb, stored_pool_vectors(curate, prepare), selected,
                       [sample_path(x) for x in index["val"]], index["pool"], folder,
                       partial(store_relative, prepare))


def check_curate(recipe) -> None:
    """What teacher.curate needs, said before the first stage instead of after the teacher trained: a named
    encoder exists, takes its input size and has readable weights; text queries have a text tower to go
    through; the map's library is installed.  (Local checkpoint files are checked with the other paths by
    toolchain/preflight.py.)"""
    c, t = recipe.curate, recipe.teacher
    named = c.encoder not in ("auto", "teacher")
    if not named and c.encoder_weights != "pretrained":
        # said, not refused: switching the encoder with --set curate.encoder=auto on a recipe that names one
        # and its weights is a normal comparison, and the weights left behind are simply not read
        uses = "teacher.name with teacher.weights" if c.encoder == "auto" else "the finetuned teacher"
        log.warning("curate.encoder_weights '%s' is not used: curate.encoder %s embeds with %s (encoder_weights "
                    "belong to a named curate.encoder)", c.encoder_weights, c.encoder, uses)
    source = TeacherCurate._encoder_source(recipe)
    if named:
        check_backbone(c.encoder, c.encoder_weights, c.encoder_image_size, "curate.encoder_image_size")
        if c.encoder_weights.startswith("package:"):  # a packaged file that is not there
            resolve_weights(c.encoder_weights)
    elif c.encoder == "auto" and c.encoder_image_size is not None:  # else: the teacher's size, checked with it
        check_backbone(t.name, t.weights, c.encoder_image_size, "curate.encoder_image_size")
    if STRATEGIES.meta(c.strategy).get("queries") == "text":
        model = source[0] if source else t.name  # 'teacher': the finetuned teacher keeps its library's towers
        if not has_text_tower(model):
            which = (f"curate.encoder {c.encoder}" if named else
                     f"curate.encoder {c.encoder} (the teacher, {model})")
            raise ToolchainError(f"curate.strategy query_balanced_text embeds class-name prompts with the encoder's "
                                 f"text tower, and {which} has no text tower (only open_clip models have one); set "
                                 f"curate.encoder to an open_clip model (e.g. open_clip:ViT-B-32/openai), or use "
                                 f"curate.strategy query_balanced_image")
    check_map(c.map)


@register_stage
class TeacherCurate(Stage):
    name = "teacher.curate"
    inputs = ("data.prepare", "teacher.finetune")
    version = "3"  # no absolute store paths in manifest/coverage (a moved store works)
    distributed = True  # under torchrun every process embeds its share of the pool shards

    def config(self, recipe) -> Dict[str, Any]:
        # fields only another task reads stay out, so each task's keys are what they were before it existed
        return {"curate": recipe.curate.model_dump(mode="json", exclude=task_of(recipe).foreign("curate"))}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        c = ctx.recipe.curate
        index = load_index(ctx.input("data.prepare"))
        encoder = self._encoder(ctx)
        pp = encoder.backbone.preprocess
        pool = index["pool"]
        rows = np.asarray(index.get("pool_rows") or [-1] * len(pool), dtype=np.int64)
        todo = np.flatnonzero(rows < 0)  # images without precomputed embeddings
        folder = ctx.workdir / "pool_embeddings"
        t0 = time.time()
        if len(todo):
            embed_sharded(encoder, [pool[i] for i in todo], pp, folder, c.shard_size, c.batch_size,
                          rank=ctx.rank, world=ctx.world, log=ctx.log)  # resumable
        distributed.barrier()  # every rank's shards are written
        if ctx.rank != 0:
            return {}
        shown = partial(store_relative, ctx.input("data.prepare"))
        weights, objects, query_image = None, None, None
        if STRATEGIES.meta(c.strategy).get("queries") == "text":
            queries = [f"text: {name}" for name in index["classes"]]
            q_emb = text_queries(encoder, index["classes"], c.prompts)
        elif teacher_task(task_of(index).name).object_queries:
            queries, q_emb, weights, objects, query_image = self._detection_queries(ctx, encoder, index, pp)
        else:
            queries = [sample_path(x) for x in index["train"]]
            q_emb = self._cached_embed(ctx.workdir / "query_emb.npy", encoder, queries, pp, c.batch_size)
        vectors, notes = self._pool_vectors(ctx, index, rows, todo, folder, q_emb.shape[1])
        seconds = time.time() - t0
        throughput = (len(queries) + len(todo)) / max(seconds, 1e-9)
        ctx.log.info("embedded %d queries + %d pool images (%.0f images/s); %d precomputed", len(queries),
                     len(todo), throughput, len(pool) - len(todo))
        warnings = list(notes)
        keep, removed, dedup_index = self._guards(ctx, encoder, index, pp, vectors)
        if not keep.any():
            raise ToolchainError("every pool image was removed as a duplicate or a near-copy of val/test; "
                                 "check data.pools or raise curate.dedup_distance / curate.leakage_distance")
        if c.budget > keep.sum():
            warnings.append(f"curate.budget {c.budget} exceeds the usable pool ({int(keep.sum())} images); "
                            f"the whole pool is used")
        if dedup_index is not None and keep.all():
            pool_index = dedup_index  # nothing was removed: the guard's index serves the selection too
        else:
            pool_index = self._index(ctx, vectors, keep)
        k_check = min(RECALL_K, len(pool_index))
        recall = self._tune(ctx, pool_index, q_emb, k_check, "the queries")
        sel = select_transfer_set(c.strategy, q_emb, pool_index, c.budget, c.seed, weights=weights)
        # generated data lives in the data.prepare entry: name it relative to that entry, never by an absolute
        # path into the store (a moved store must still work; readers go through transfer_paths)
        self._write_manifest(ctx.workdir, index, [shown(q) for q in queries], sel, shown)
        coverage = self._write_coverage(ctx.workdir, [shown(q) for q in queries], sel)
        plot_neighbours(ctx.workdir / "neighbours.png", queries, [pool[i] for i in sel.indices], sel.queries,
                        sel.distances, query_image=query_image)
        plot_map(ctx.workdir / "map.png", q_emb, vectors, sel.indices, method=c.map, seed=c.seed)
        roots = [shown(r) for r in index["pool_roots"]]
        by_root = Counter(roots[index["pool_source"][i]] for i in sel.indices)
        source = self._encoder_source(ctx.recipe)
        stats = {"selected": int(len(sel.indices)), "pool": len(pool), "strategy": c.strategy,
                 "encoder": source[0] if source else "the finetuned teacher",
                 "precomputed": int(len(pool) - len(todo)), "embedded_by": ctx.world,
                 "removed": removed, "index": pool_index.spec, "index_on_gpu": pool_index.on_gpu,
                 f"recall_at_{k_check}": recall, "search": pool_index.describe(),
                 "from_pool_root": {r: int(by_root.get(r, 0)) for r in roots},
                 **coverage, "mean_distance": float(np.mean(sel.distances))}
        if objects is not None:
            stats["queries"] = self._query_counts(index, objects, weights, sel, c)
            ctx.log.info("object queries per class (objects, transfer images they brought in): %s",
                         {k: (v["object_queries"], v["selected"]) for k, v in stats["queries"]["per_class"].items()})
        ctx.log.info("transfer set: %d images by %s; from each pool folder: %s", stats["selected"], c.strategy,
                     stats["from_pool_root"])
        overlap = val_overlap(self._heldout_embeddings(ctx, encoder, index, pp)[:len(index["val"])], vectors,
                              sel.indices, [sample_path(x) for x in index["val"]], pool, ctx.workdir, shown)
        if overlap["nearest"]:
            ctx.log.info("the transfer set's nearest image to each val image: median distance %.3f, closest %.3f "
                         "(val_overlap.csv)", float(np.median(overlap["nearest"])), min(overlap["nearest"]))
        return {"manifest": "manifest.csv", "coverage": "coverage.csv", "stats": stats, "warnings": warnings,
                "val_overlap": overlap,
                "pictures": ["neighbours.png", "map.png"],
                "embed_seconds": round(seconds, 3), "embed_images_per_s": round(throughput, 1)}

    def report(self, out: StageOutput, build: ReportContext) -> ReportSection:
        """Where the transfer set came from, what was removed, how the pool index was chosen, the pictures."""
        c, r = build.recipe.curate, out.result
        s = r["stats"]
        roots = list(s["from_pool_root"])
        common = os.path.commonpath(roots) if len(roots) > 1 else os.path.dirname(roots[0])
        removed = s.get("removed") or {}
        lines = [f"{s['selected']} of {s['pool']} pool images by `{s['strategy']}`; teacher embedding throughput "
                 f"{r['embed_images_per_s']:.0f} images/s.", "", "| pool folder | selected |", "|---|---|"]
        lines += [f"| `{os.path.relpath(k, common)}` | {v} |" for k, v in s["from_pool_root"].items()] + [""]
        lines += [f"Removed before selection: {removed.get('duplicates', 0)} near-duplicates, "
                  f"{removed.get('leakage', 0)} near-copies of val/test images. Search index `{s.get('index')}`"
                  + "".join(f", {k.replace('_', ' ')} {v:.3f}" for k, v in s.items() if k.startswith("recall_at"))
                  + ".", ""]
        search = describe_lines(s.get("search"))
        if search:
            lines += search + [""]
        if "per_query_mean" in s:
            lines += [f"Per query: {s['per_query_min']} to {s['per_query_max']} images (mean {s['per_query_mean']}); "
                      f"{s['queries_without_images']} queries brought in none (`coverage.csv` in the curate stage). "
                      f"{s.get('precomputed', 0)} pool embeddings were precomputed; embedded by "
                      f"{s.get('embedded_by', 1)} process(es).", ""]
        lines += self._query_lines(s.get("queries"))
        pictures = {f"transfer_{p}": p for p in r.get("pictures", [])}  # the transfer set, as a person sees it
        lines += [f"![{p}]({shown})" for shown, p in pictures.items()]
        return ReportSection(title="Transfer set", lines=lines, files=pictures,
                             summary=[f"transfer set: `{c.strategy}`, budget {c.budget}"],
                             record={"teacher": {"embed_images_per_s": r.get("embed_images_per_s")}})

    def _detection_queries(self, ctx: StageContext, encoder, index, pp: Preprocess):
        """Detection's image queries: the labeled images (their share ``1 - curate.object_share``) and every
        labeled box cropped with context (the rest, an equal part per class); returns the query names, their
        embeddings, their shares, the object queries, and a function that draws query k for the neighbours
        picture."""
        c = ctx.recipe.curate
        records = index["train"]
        use_images, use_objects = c.object_share < 1, c.object_share > 0
        images = [r["path"] for r in records] if use_images else []
        objects = object_queries(records) if use_objects else []
        # a crop is named by its image, the box's place on it and its class (manifest.csv, coverage.csv)
        names = images + [f"{records[q.record]['path']}#box{q.box}:{index['classes'][q.label]}" for q in objects]
        parts = []
        if images:
            parts.append(self._cached_embed(ctx.workdir / "query_emb.npy", encoder, images, pp, c.batch_size))
        crops = ObjectCrops(records, objects, pp, c.crop_context)
        if objects:
            parts.append(self._cached_embed(ctx.workdir / "object_query_emb.npy", encoder, crops, pp, c.batch_size))
            if crops.failed:
                ctx.log.warning("%d object crops came from images that are no longer readable; they are black",
                                crops.failed)
        weights = query_weights(len(images), [q.label for q in objects], c.object_share)
        ctx.log.info("queries: %d labeled images and %d object crops (object_share %.2f)", len(images), len(objects),
                     c.object_share)

        def query_image(k: int):
            return load_image(images[k]) if k < len(images) else crops.crop(k - len(images))

        return names, np.concatenate(parts), weights, objects, query_image

    @staticmethod
    def _query_counts(index, objects, weights, sel, c) -> Dict[str, Any]:
        """Detection: how many queries of each kind, and per class its images, object queries, share of the
        budget and the transfer images its objects brought in (result ``stats.queries``)."""
        n_images = len(weights) - len(objects)
        by_images = int(np.sum(np.asarray(sel.queries) < n_images))
        return {"images": n_images, "objects": len(objects), "object_share": c.object_share,
                "crop_context": c.crop_context, "selected_by_images": by_images,
                "shares_used": bool(STRATEGIES.meta(c.strategy).get("weights")),
                "per_class": per_class_counts(index["train"], index["classes"], objects, weights, n_images,
                                              sel.queries, int(len(sel.indices)))}

    @staticmethod
    def _query_lines(q) -> List[str]:
        """The report's table of detection queries per class (nothing for other tasks)."""
        if not q:
            return []
        if q.get("shares_used", True):
            shares = (f"the crops share {100 * q['object_share']:.0f}% of the budget, an equal part per class, so a "
                      f"rare class's few objects each bring in more")
        else:
            shares = "the strategy ranks by distance or draws at random, so the shares below were not applied"
        lines = [f"Queries: {q['images']} labeled images and {q['objects']} object crops (each box with "
                 f"{100 * q['crop_context']:.0f}% context a side); {shares}. The whole images brought in "
                 f"{q['selected_by_images']} transfer images.", "",
                 "| class | labeled images | object queries | its share of the budget | transfer images its "
                 "objects brought in |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {v['images']} | {v['object_queries']} | {100 * v['share']:.1f}% "
                  f"(about {v['share_images']:g} images) | {v['selected']} |" for name, v in q["per_class"].items()]
        return lines + [""]

    @staticmethod
    def _encoder_source(recipe):
        """(registry name, weights, image size) of the retrieval encoder; None for the finetuned teacher."""
        c, t = recipe.curate, recipe.teacher
        if c.encoder == "teacher":
            return None
        if c.encoder == "auto":
            return t.name, t.weights, c.encoder_image_size or t.image_size
        return c.encoder, c.encoder_weights, c.encoder_image_size

    def _encoder(self, ctx: StageContext):
        source = self._encoder_source(ctx.recipe)
        if source is None:
            ctx.log.info("retrieval encoder: the finetuned teacher")
            return load_model(ctx.input("teacher.finetune").path("model"))
        ctx.log.info("retrieval encoder: %s (%s weights), without the teacher's adapter", source[0], source[1])
        # Seeded, so that whatever the weights leave to random initialisation (all of it for weights: none)
        # is the same in every process: distributed ranks embed their shards with one and the same encoder.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.recipe.seed)
            return TeacherClassifier(create_backbone(*source), 1, True)

    def _pool_vectors(self, ctx, index, rows, todo, folder, dim):
        """The pool's embeddings in pool order (:func:`pool_vectors`), the precomputed sources checked to come
        from this build's retrieval encoder."""
        return pool_vectors(index, rows, todo, folder, ctx.recipe.curate.shard_size, dim,
                            self._encoder_source(ctx.recipe) or False)

    def _guards(self, ctx, encoder, index, pp, vectors: PoolVectors):
        """Near-duplicates inside the pool and near-copies of val/test images are removed before selection.
        Both stream the pool a block at a time."""
        c = ctx.recipe.curate
        keep = np.ones(len(vectors), dtype=bool)
        removed = {"duplicates": 0, "leakage": 0}
        dedup_index = None
        if c.dedup_distance is not None and len(vectors) > 1:
            dedup_index = self._index(ctx, vectors, None)
            sample = np.random.default_rng(c.seed).choice(len(vectors), min(len(vectors), c.recall_sample),
                                                          replace=False)
            self._tune(ctx, dedup_index, vectors.take(np.sort(sample)), min(DEDUP_K, len(dedup_index)),
                       "pool images (near-duplicate search)")
            for gids, block in vectors.chunks(dedup_index.block_rows):
                d, ids = dedup_index.search(block, DEDUP_K)
                # an earlier near-copy exists: the first of a group stays
                keep[gids] &= ~((ids >= 0) & (ids < gids[:, None]) & (d <= c.dedup_distance)).any(axis=1)
            removed["duplicates"] = int((~keep).sum())
        if c.leakage_distance is not None:
            e_emb = self._heldout_embeddings(ctx, encoder, index, pp)
            for gids, block in vectors.chunks():
                dist, _ = knn(e_emb, block, 1)  # each pool image's distance to its closest val/test image
                leak = dist[:, 0] <= c.leakage_distance
                removed["leakage"] += int((leak & keep[gids]).sum())
                keep[gids] &= ~leak
        if any(removed.values()):
            ctx.log.info("removed from the pool before selection: %s", removed)
        return keep, removed, dedup_index

    def _heldout_embeddings(self, ctx, encoder, index, pp) -> np.ndarray:
        """Unit embeddings of the val images, then the test images (the leakage guard and val_overlap read them).
        With the guard off only val's: val_overlap reads the first rows, and the test images need not be read."""
        held_out = [sample_path(x) for x in index["val"]]
        if ctx.recipe.curate.leakage_distance is not None:
            held_out += [sample_path(x) for x in index["test"]]
        return self._cached_embed(ctx.workdir / "heldout_emb.npy", encoder, held_out, pp, ctx.recipe.curate.batch_size)

    @staticmethod
    def _index(ctx, vectors: PoolVectors, keep) -> PoolIndex:
        c = ctx.recipe.curate
        ctx.log.info("building the pool index over %d vectors (curate.index %s)", len(vectors) if keep is None
                     else int(np.sum(keep)), c.index)
        index = PoolIndex(vectors, c.index, c.exact_max, c.nprobe or 16, seed=c.seed, keep=keep,
                          memory_gb=c.index_memory_gb, hnsw_max=c.hnsw_max)
        ctx.log.info("pool index: %s (%s), built in %.1fs%s", index.spec, index.why, index.build_seconds,
                     f"; {index.gpu_note}" if index.gpu_note else (" on the GPU" if index.on_gpu else ""))
        return index

    @staticmethod
    def _tune(ctx, index: PoolIndex, queries: np.ndarray, k: int, what: str) -> float:
        """recall@k of ``index`` on a sample of ``queries``: tuned up to curate.min_recall when the breadth is
        left to the toolchain, checked against it when curate.nprobe fixes it."""
        c = ctx.recipe.curate
        if index.exact:
            return 1.0
        if c.min_recall is not None and c.nprobe is None:
            tuning = index.tune(queries, k, c.min_recall, c.recall_sample, c.seed)
            ctx.log.info("tuned on %d %s: %s gives recall@%d %.3f (%.3f ms/query; %d settings tried)",
                         tuning["sample"], what, tuning["params"], k, tuning["recall"],
                         tuning["trials"][-1]["ms_per_query"], len(tuning["trials"]))
            return float(tuning["recall"])
        recall = index.recall(queries, k, c.recall_sample, c.seed)
        ctx.log.info("recall@%d of %s %s on %s: %.3f", k, index.spec, index.params, what, recall)
        if c.min_recall is not None and recall < c.min_recall:
            raise ToolchainError(f"curate.index '{index.spec}' with {index.params} has recall@{k} {recall:.3f} "
                                 f"against exact search, below curate.min_recall {c.min_recall}; leave "
                                 f"curate.nprobe unset to tune it, or use a finer index")
        return recall

    @staticmethod
    def _write_manifest(workdir: Path, index, queries, sel, shown) -> None:
        """One row per transfer image: where it comes from, and which query brought it in at what distance;
        ``pool_index`` is the row of data.prepare's pool list (what ``transfer_paths`` reads)."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["path", "source", "pool_index", "distance", "query"])
        roots, sources, pool = index["pool_roots"], index["pool_source"], index["pool"]
        for i, d, q in zip(sel.indices, sel.distances, sel.queries):
            w.writerow([shown(pool[i]), shown(roots[sources[i]]), int(i), f"{float(d):.6f}", queries[q]])
        atomic_write_bytes(workdir / "manifest.csv", buf.getvalue().encode())

    @staticmethod
    def _write_coverage(workdir: Path, queries, sel) -> Dict[str, Any]:
        """Per query: how many transfer images it brought in and how far they are (seed 004 Fig. 8)."""
        counts = np.bincount(sel.queries, minlength=len(queries))
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["query", "selected", "mean_distance", "max_distance"])
        for q, name in enumerate(queries):
            d = sel.distances[sel.queries == q]
            w.writerow([name, int(counts[q]), f"{d.mean():.6f}" if len(d) else "", f"{d.max():.6f}" if len(d) else ""])
        atomic_write_bytes(workdir / "coverage.csv", buf.getvalue().encode())
        return {"per_query_min": int(counts.min()), "per_query_max": int(counts.max()),
                "per_query_mean": round(float(counts.mean()), 2), "queries_without_images": int((counts == 0).sum())}

    @staticmethod
    def _cached_embed(path: Path, model, paths, pp, batch_size) -> np.ndarray:
        """Embeddings are written once per stage folder, so a resumed curation does not embed twice.  ``paths``:
        image paths, or a dataset of transformed images (object crops)."""
        if path.is_file():
            arr = np.load(path)
            if len(arr) == len(paths):
                return arr
        arr = embed_images(model, paths, pp, batch_size)
        atomic_write_npy(path, arr)
        return arr
