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

from teachers.model import embed_features
from teachers.strategies import select_transfer_set
from toolchain.checkpoint import load_model
from toolchain.data import Preprocess
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.store import atomic_write, atomic_write_bytes

__all__ = ["TeacherCurate", "embed_images"]


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
        pp = teacher.backbone.preprocess
        queries = [p for p, _ in index["train"]]
        pool = index["pool"]
        t0 = time.time()
        q_emb = self._cached_embed(ctx.workdir / "query_emb.npy", teacher, queries, pp, c.batch_size)
        p_emb = self._cached_embed(ctx.workdir / "pool_emb.npy", teacher, pool, pp, c.batch_size)
        seconds = time.time() - t0
        throughput = (len(queries) + len(pool)) / max(seconds, 1e-9)
        ctx.log.info("embedded %d queries + %d pool images (%.0f images/s)", len(queries), len(pool), throughput)
        warnings = []
        if c.budget > len(pool):
            warnings.append(f"curate.budget {c.budget} exceeds the pool ({len(pool)} images); the whole pool is used")
        sel = select_transfer_set(c.strategy, q_emb, p_emb, c.budget, c.seed)
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["path", "score", "query"])
        for i, d, q in zip(sel.indices, sel.distances, sel.queries):
            w.writerow([pool[i], f"{float(d):.6f}", queries[q]])
        atomic_write_bytes(ctx.workdir / "manifest.csv", buf.getvalue().encode())
        roots = index["pool_roots"]
        by_root = Counter(next((r for r in roots if pool[i].startswith(r)), "?") for i in sel.indices)
        per_query = np.bincount(sel.queries, minlength=len(queries))
        stats = {"selected": int(len(sel.indices)), "pool": len(pool), "strategy": c.strategy,
                 "from_pool_root": {r: int(by_root.get(r, 0)) for r in roots},
                 "per_query_min": int(per_query.min()), "per_query_max": int(per_query.max()),
                 "mean_distance": float(np.mean(sel.distances))}
        ctx.log.info("transfer set: %d images by %s; from each pool folder: %s", stats["selected"], c.strategy,
                     stats["from_pool_root"])
        return {"manifest": "manifest.csv", "stats": stats, "warnings": warnings,
                "embed_seconds": round(seconds, 3), "embed_images_per_s": round(throughput, 1)}

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
