"""``teacher.curate``: embed the unlabeled pool once with the finetuned teacher and select the transfer set.

The labeled training images are the queries (seed 004 sec. 3.5).  Embeddings are L2-normalised
pooled/CLS features, so Euclidean distance ranks like cosine similarity.  Output: ``manifest.csv``
(path, score = distance to its query, query path) in selection order, and the embeddings themselves.
"""
from __future__ import annotations

import csv
import io
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from teachers.backbones import create_backbone
from teachers.model import TeacherClassifier, embed_features, zero_shot_text_embeddings
from teachers.curate_plots import plot_map, plot_neighbours
from teachers.embed import embed_sharded, load_shards
from teachers.search import PoolIndex
from teachers.strategies import STRATEGIES, select_transfer_set
from teachers.strategies.base import knn
from toolchain.errors import ToolchainError
from toolchain.checkpoint import load_model
from toolchain.data import Preprocess
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.store import atomic_write, atomic_write_bytes

__all__ = ["TeacherCurate", "embed_images"]


def text_queries(encoder, classes: List[str], prompts) -> np.ndarray:
    """One unit query per class: the class name in every template, encoded by the text tower and averaged."""
    rows = zero_shot_text_embeddings(encoder.backbone, classes, prompts, "curate.strategy query_balanced_text")
    return rows.numpy().astype(np.float32)


def embed_images(model, paths: List[str], pp: Preprocess, batch_size: int) -> np.ndarray:
    return embed_features(model, paths, pp, batch_size, normalize=True).numpy().astype(np.float32)


@register_stage
class TeacherCurate(Stage):
    name = "teacher.curate"
    inputs = ("data.prepare", "teacher.finetune")

    def config(self, recipe) -> Dict[str, Any]:
        return {"curate": recipe.curate.model_dump(mode="json")}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        c = ctx.recipe.curate
        index = load_index(ctx.input("data.prepare"))
        teacher = load_model(ctx.input("teacher.finetune").path("model"))
        if c.encoder:  # a separate retrieval encoder (seed 004 retrieves with OpenCLIP ViT-L/14)
            encoder = TeacherClassifier(create_backbone(c.encoder, c.encoder_weights, c.encoder_image_size), 1, True)
        else:
            encoder = teacher
        pp = encoder.backbone.preprocess
        pool = index["pool"]
        t0 = time.time()
        if STRATEGIES.meta(c.strategy).get("queries") == "text":
            queries = [f"text: {name}" for name in index["classes"]]
            q_emb = text_queries(encoder, index["classes"], c.prompts)
        else:
            queries = [p for p, _ in index["train"]]
            q_emb = self._cached_embed(ctx.workdir / "query_emb.npy", encoder, queries, pp, c.batch_size)
        embed_sharded(encoder, pool, pp, ctx.workdir / "pool_embeddings", c.shard_size, c.batch_size,
                      ctx.recipe.data.workers, log=ctx.log)  # resumes at the first unfinished shard
        p_emb = load_shards(ctx.workdir / "pool_embeddings", len(pool))
        seconds = time.time() - t0
        throughput = (len(queries) + len(pool)) / max(seconds, 1e-9)
        ctx.log.info("embedded %d queries + %d pool images (%.0f images/s)", len(queries), len(pool), throughput)
        warnings = []
        keep, removed = self._guards(ctx, encoder, index, pp, p_emb)
        kept = np.flatnonzero(keep)
        if len(kept) == 0:
            raise ToolchainError("every pool image was removed as a duplicate or a near-copy of val/test; "
                                 "check data.pools or raise curate.dedup_distance / curate.leakage_distance")
        if c.budget > len(kept):
            warnings.append(f"curate.budget {c.budget} exceeds the usable pool ({len(kept)} images); "
                            f"the whole pool is used")
        pool_index = PoolIndex(p_emb[kept], c.index, c.exact_max, c.nprobe, seed=c.seed)
        k_check = min(100, len(kept))
        recall = pool_index.recall(q_emb, k_check, c.recall_sample, c.seed)
        if c.min_recall is not None and recall < c.min_recall:
            raise ToolchainError(f"curate.index '{pool_index.spec}' has recall@{k_check} {recall:.3f} against exact "
                                 f"search, below curate.min_recall {c.min_recall}; raise curate.nprobe or use a "
                                 f"finer index")
        sub = select_transfer_set(c.strategy, q_emb, p_emb[kept], c.budget, c.seed, pool_index)
        sel = type(sub)(kept[sub.indices], sub.distances, sub.queries)
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["path", "score", "query"])
        for i, d, q in zip(sel.indices, sel.distances, sel.queries):
            w.writerow([pool[i], f"{float(d):.6f}", queries[q]])
        atomic_write_bytes(ctx.workdir / "manifest.csv", buf.getvalue().encode())
        plot_neighbours(ctx.workdir / "neighbours.png", queries, [pool[i] for i in sel.indices], sel.queries,
                        sel.distances)
        plot_map(ctx.workdir / "map.png", q_emb, p_emb, sel.indices, seed=c.seed)
        roots = index["pool_roots"]
        by_root = Counter(roots[index["pool_source"][i]] for i in sel.indices)
        per_query = np.bincount(sel.queries, minlength=len(queries))
        stats = {"selected": int(len(sel.indices)), "pool": len(pool), "strategy": c.strategy,
                 "removed": removed, "index": pool_index.spec, "index_on_gpu": pool_index.on_gpu,
                 f"recall_at_{k_check}": recall,
                 "from_pool_root": {r: int(by_root.get(r, 0)) for r in roots},
                 "per_query_min": int(per_query.min()), "per_query_max": int(per_query.max()),
                 "mean_distance": float(np.mean(sel.distances))}
        ctx.log.info("transfer set: %d images by %s; from each pool folder: %s", stats["selected"], c.strategy,
                     stats["from_pool_root"])
        return {"manifest": "manifest.csv", "stats": stats, "warnings": warnings,
                "pictures": ["neighbours.png", "map.png"],
                "embed_seconds": round(seconds, 3), "embed_images_per_s": round(throughput, 1)}

    def _guards(self, ctx, encoder, index, pp, p_emb):
        """Near-duplicates inside the pool and near-copies of val/test images are removed before selection."""
        c = ctx.recipe.curate
        keep = np.ones(len(p_emb), dtype=bool)
        removed = {"duplicates": 0, "leakage": 0}
        if c.dedup_distance is not None and len(p_emb) > 1:
            d, ids = PoolIndex(p_emb, c.index, c.exact_max, c.nprobe, seed=c.seed).search(p_emb, 8)
            rows = np.arange(len(p_emb))[:, None]
            dup = ((ids >= 0) & (ids < rows) & (d <= c.dedup_distance)).any(axis=1)  # an earlier near-copy exists
            keep &= ~dup
            removed["duplicates"] = int(dup.sum())
        if c.leakage_distance is not None:
            held_out = [p for p, _ in index["val"]] + [p for p, _ in index["test"]]
            e_emb = self._cached_embed(ctx.workdir / "heldout_emb.npy", encoder, held_out, pp, c.batch_size)
            dist, _ = knn(e_emb, p_emb, 1)  # each pool image's distance to its closest val/test image
            leak = dist[:, 0] <= c.leakage_distance
            removed["leakage"] = int((leak & keep).sum())
            keep &= ~leak
        if any(removed.values()):
            ctx.log.info("removed from the pool before selection: %s", removed)
        return keep, removed

    @staticmethod
    def _cached_embed(path: Path, model, paths, pp, batch_size) -> np.ndarray:
        """Embeddings are written once per stage folder, so a resumed curation does not embed twice."""
        if path.is_file():
            arr = np.load(path)
            if len(arr) == len(paths):
                return arr
        arr = embed_images(model, paths, pp, batch_size)
        atomic_write(path, lambda p: np.save(open(p, "wb"), arr))
        return arr
