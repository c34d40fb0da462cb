"""k-NN search over an embedded pool with faiss, auto-tuned to a recall target.

``spec='auto'`` chooses the index the way autofaiss does, from the pool size and a memory budget:

- up to ``exact_max`` vectors: exact (``Flat``); nothing to tune.
- the vectors fit the memory budget: ``IVF{nlist},Flat`` with nlist ~ 4 sqrt(n) (a power of two, at least
  39 of the ``train_max`` k-means training points per list).  Its build is one k-means on a sample and an
  assignment pass, a minute or two per million vectors; ``HNSW32`` searches faster but builds for many
  minutes per million vectors on a few cores, and a curation searches once, so HNSW is used only between
  ``exact_max`` and ``hnsw_max`` (default: never), or when named.
- they do not: ``IVF{nlist},PQ{m}`` holds only m bytes per vector, and the candidates it returns
  (``k_factor`` x k of them) are re-ranked with exact distances read from the pool's own memory-mapped
  vectors, so recall is limited by the IVF probe, not by the PQ approximation.  Above 2M vectors the coarse
  quantizer is an HNSW graph over the centroids (``IVF{nlist}_HNSW32``), so adding tens of millions of
  vectors does not cost a brute-force pass over every centroid each.

Any faiss index-factory string may be named instead (``IVF4096,PQ64``, ``HNSW32``, ...); ``refine`` adds the
exact re-ranking to it.  ``tune`` then raises the search breadth (``nprobe`` / ``efSearch``, and the
re-ranking depth) on a sample of the real queries, measured against exact search, until ``recall@k``
reaches the target, and records every step tried.  On GPU (the device policy's CUDA device with faiss-gpu
installed) IVF indexes are cloned onto the GPU; an index faiss cannot place there stays on the CPU, said so.

The pool is a :class:`~teachers.vectors.PoolVectors` (memory-mapped shards) added a block at a time, so the
raw embeddings never have to fit in memory; exact search over a pool larger than ``memory_rows`` streams
the shards through a running top-k.  Search results are global pool indices; ``keep`` leaves images out
(duplicates, near-copies of val/test).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import faiss
import numpy as np

from vfm_toolchain import devices
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.vectors import PoolVectors

__all__ = ["PoolIndex", "IndexPlan", "plan_index", "memory_budget", "describe_lines"]

K_FACTORS = (2, 4, 8)  # re-ranking depths tried, per probe breadth
EF_SEARCH = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class IndexPlan:
    spec: str
    refine: bool
    why: str


def memory_budget(gb: Optional[float] = None) -> int:
    """Bytes an index may hold: ``gb``, or half of this machine's physical memory."""
    if gb is not None:
        return int(gb * (1 << 30))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def plan_index(n: int, d: int, memory_bytes: int, exact_max: int = 200_000, hnsw_max: int = 0,
               train_max: int = 200_000) -> IndexPlan:
    """The index ``auto`` builds for ``n`` vectors of width ``d`` within ``memory_bytes`` (rule in the module doc)."""
    if n <= exact_max:
        return IndexPlan("flat", False, f"exact: {n:,} vectors <= curate.exact_max {exact_max:,}")
    flat_bytes = n * d * 4
    budget = f"{memory_bytes / (1 << 30):.1f} GiB memory budget"
    if flat_bytes <= memory_bytes and n <= hnsw_max:
        return IndexPlan("HNSW32", False, f"{n:,} vectors <= curate.hnsw_max {hnsw_max:,}, "
                                          f"{flat_bytes / (1 << 30):.1f} GiB fit the {budget}")
    nlist = _nlist(n, train_max)
    if flat_bytes <= memory_bytes:
        return IndexPlan(f"IVF{nlist},Flat", False, f"{flat_bytes / (1 << 30):.1f} GiB of vectors fit the {budget}")
    m = _pq_m(d)
    coarse = f"IVF{nlist}_HNSW32" if n > 2_000_000 else f"IVF{nlist}"
    return IndexPlan(f"{coarse},PQ{m}", True,
                     f"{flat_bytes / (1 << 30):.1f} GiB of vectors exceed the {budget}: {m}-byte PQ codes "
                     f"({n * m / (1 << 30):.2f} GiB) in memory, re-ranked exactly from the memory-mapped pool")


def _nlist(n: int, train_max: int) -> int:
    """~4 sqrt(n) lists, a power of two, with at least 39 k-means training points each (faiss's minimum for
    stable centroids) in the sample of min(n, train_max) the index is trained on."""
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    while nlist > 16 and nlist * 39 > min(n, train_max):
        nlist //= 2
    return max(16, min(nlist, 65536))


def _pq_m(d: int) -> int:
    for m in (64, 48, 32, 24, 16, 8, 4, 2, 1):
        if d % m == 0 and d // m >= 4:
            return m
    return 1


def _unwrap(index: faiss.Index) -> faiss.Index:
    index = faiss.downcast_index(index)
    while isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return index


class PoolIndex:
    """Euclidean k-NN over the rows of ``vectors`` selected by ``keep``.

    Args:
        spec: 'flat' (exact), 'auto' (see the module doc) or a faiss index-factory string.
        nprobe / ef_search: search breadth of IVF / HNSW indexes until ``tune`` sets it.
        memory_gb: the memory an ``auto`` index may take (default: half of this machine's).
        refine: re-rank a named approximate index's candidates exactly (``auto`` decides by itself).
        memory_rows: an exact index holds at most this many vectors in memory; beyond, it streams.
        block_rows: vectors read from the shards per step.
    """

    def __init__(self, vectors: Union[np.ndarray, PoolVectors], spec: str = "auto", exact_max: int = 200_000,
                 nprobe: int = 16, ef_search: int = 128, train_max: int = 200_000, seed: int = 0,
                 keep: Optional[np.ndarray] = None, memory_rows: int = 2_000_000, block_rows: int = 65536,
                 memory_gb: Optional[float] = None, hnsw_max: int = 0, refine: bool = False):
        self.vectors = vectors if isinstance(vectors, PoolVectors) else PoolVectors.from_array(vectors)
        self.ids = (np.arange(len(self.vectors), dtype=np.int64) if keep is None
                    else np.flatnonzero(np.asarray(keep)).astype(np.int64))
        self.block_rows = block_rows
        n, d = len(self.ids), self.vectors.dim
        if n == 0:
            raise ToolchainError("the pool index has no vectors (every pool image was left out)")
        plan = (plan_index(n, d, memory_budget(memory_gb), exact_max, hnsw_max, train_max) if spec == "auto"
                else IndexPlan(spec, refine and spec != "flat", "named in curate.index"))
        self.spec, self.refine, self.why = plan.spec, plan.refine, plan.why
        self.streaming = self.spec == "flat" and n > memory_rows
        self.gpu_note = ""
        self.on_gpu = False
        self.index: Optional[faiss.Index] = None
        self.params: Dict[str, int] = {}
        self.tuning: Optional[dict] = None
        self.kind, self.nlist = "flat", 0  # set from the CPU index in _build
        start = time.perf_counter()
        if not self.streaming:
            self.index = self._build(d, train_max, seed)
            self.set_params(nprobe=nprobe, efSearch=ef_search, k_factor=4)
        self.build_seconds = time.perf_counter() - start

    # ---------------------------------------------------------------------------------------------
    # build

    def _build(self, d: int, train_max: int, seed: int) -> faiss.Index:
        try:
            index = faiss.IndexFlatL2(d) if self.spec == "flat" else faiss.index_factory(d, self.spec)
        except RuntimeError as exc:
            raise ToolchainError(f"curate.index '{self.spec}' is not a faiss index-factory string: {exc}") from None
        base = _unwrap(index)
        if isinstance(base, (faiss.IndexIVFPQ, faiss.IndexPQ)):
            # polysemous training orders the codes for Hamming pre-filtering, which this search never uses,
            # and costs several times the PQ training itself (110 s against 17 s for 20k x 768 here)
            base.do_polysemous_training = False
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            sample = np.sort(rng.choice(self.ids, min(len(self.ids), train_max), replace=False))
            index.train(self.vectors.take(sample))
        if isinstance(base, faiss.IndexIVF):
            self.kind, self.nlist = "ivf", base.nlist
        elif isinstance(base, faiss.IndexHNSW):
            self.kind = "hnsw"
        elif self.spec != "flat":
            self.kind = "other"  # e.g. a PQ or LSH index: nothing to tune but the re-ranking depth
        index = self._to_gpu(index)
        for _, block in self.vectors.chunks(self.block_rows, self.ids):
            index.add(block)
        return index

    def _to_gpu(self, index: faiss.Index) -> faiss.Index:
        """The device policy's GPU when faiss-gpu can hold this index; otherwise the CPU, with the reason."""
        device = devices.faiss_gpu()
        if device is None:
            return index
        opts = faiss.GpuClonerOptions()
        opts.useFloat16 = True  # PQ codes of 56 bytes and more need fp16 lookup tables on the GPU
        opts.allowCpuCoarseQuantizer = True  # an HNSW coarse quantizer stays on the CPU, the lists move
        try:
            gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), device, index, opts)
        except RuntimeError as exc:
            self.gpu_note = f"faiss-gpu cannot hold '{self.spec}', searching on the CPU ({str(exc).splitlines()[0]})"
            return index
        self.on_gpu = True
        return gpu

    # ---------------------------------------------------------------------------------------------
    # search parameters

    def knobs(self) -> List[str]:
        """The search-time parameters this index has: nprobe (IVF), efSearch (HNSW), k_factor (re-ranking)."""
        out = {"ivf": ["nprobe"], "hnsw": ["efSearch"]}.get(self.kind, [])
        if self.refine:
            out.append("k_factor")
        return out

    def set_params(self, **params: int) -> None:
        knobs = self.knobs()
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        for name, value in params.items():
            if name not in knobs:
                continue
            if name == "k_factor":
                self.params[name] = int(value)
                continue
            if name == "nprobe":
                value = min(int(value), self._max_nprobe())
                if "_HNSW" in self.spec:  # the HNSW coarse quantizer must look at least nprobe centroids deep
                    space.set_index_parameter(self.index, "quantizer_efSearch", max(64, 2 * value))
            space.set_index_parameter(self.index, name, int(value))
            self.params[name] = int(value)

    def _max_nprobe(self) -> int:
        return min(self.nlist, 2048) if self.on_gpu else self.nlist  # faiss-gpu probes at most 2048 lists

    def _breadths(self, k: int) -> List[Dict[str, int]]:
        """Search breadths from cheapest to broadest; the last one of an IVF-Flat index is exhaustive."""
        knobs = self.knobs()
        if "nprobe" in knobs:
            top = self._max_nprobe()
            return [{"nprobe": min(2 ** i, top)} for i in range(math.ceil(math.log2(top)) + 1)]
        if "efSearch" in knobs:
            return [{"efSearch": ef} for ef in sorted({max(ef, k) for ef in EF_SEARCH})]  # HNSW looks >= k deep
        return [{}]

    # ---------------------------------------------------------------------------------------------
    # search

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def exact(self) -> bool:
        return self.spec == "flat"

    def search(self, queries: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """(distances, global ids), each (Q, k); distances are Euclidean (not squared); id -1 = not found."""
        k = min(k, len(self.ids))
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if self.streaming:
            return self._stream_exact(q, k)
        depth = min(len(self.ids), k * self.params.get("k_factor", 1)) if self.refine else k
        d2, local = self.index.search(q, depth)
        gids = np.where(local >= 0, self.ids[np.maximum(local, 0)], -1)
        if self.refine:
            d2, gids = self._rerank(q, gids, k)
        return np.sqrt(np.maximum(d2, 0)), gids

    def _rerank(self, q: np.ndarray, cand: np.ndarray, k: int, chunk: int = 256) -> Tuple[np.ndarray, np.ndarray]:
        """Exact distances to each query's candidates, read from the pool's vectors; the k nearest kept."""
        out_d = np.full((len(q), k), np.inf, dtype=np.float32)
        out_i = np.full((len(q), k), -1, dtype=np.int64)
        for s in range(0, len(q), chunk):
            c = cand[s:s + chunk]
            uniq, inv = np.unique(c[c >= 0], return_inverse=True)
            rows = self.vectors.take(uniq)
            d2 = np.full(c.shape, np.inf, dtype=np.float32)
            qi, ci = np.nonzero(c >= 0)
            diff = rows[inv] - q[s:s + chunk][qi]
            d2[qi, ci] = np.einsum("ij,ij->i", diff, diff)
            order = np.argsort(d2, axis=1, kind="stable")[:, :k]
            out_d[s:s + len(c), :order.shape[1]] = np.take_along_axis(d2, order, 1)
            out_i[s:s + len(c), :order.shape[1]] = np.where(np.isfinite(np.take_along_axis(d2, order, 1)),
                                                           np.take_along_axis(c, order, 1), -1)
        return out_d, out_i

    def _stream_exact(self, q: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        """Exact k-NN one block of shards at a time, merged in a running heap: memory ~ one block."""
        heap = faiss.ResultHeap(len(q), k)
        for gids, block in self.vectors.chunks(self.block_rows, self.ids):
            d2, local = faiss.knn(q, block, min(k, len(block)))
            heap.add_result(np.ascontiguousarray(d2), np.where(local >= 0, gids[np.maximum(local, 0)], -1))
        heap.finalize()
        return np.sqrt(np.maximum(heap.D, 0)), heap.I

    # ---------------------------------------------------------------------------------------------
    # recall

    def _sample(self, queries: np.ndarray, sample: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        pick = np.sort(rng.choice(len(queries), min(sample, len(queries)), replace=False))
        return np.ascontiguousarray(queries[pick], dtype=np.float32)

    @staticmethod
    def _per_query(truth: np.ndarray, got: np.ndarray) -> np.ndarray:
        """recall@k of each query: the share of its exact neighbours (a row of ``truth``) the index found."""
        return np.asarray([len(set(a) & set(b)) for a, b in zip(truth.tolist(), got.tolist())]) / truth.shape[1]

    @staticmethod
    def _lower_bound(per: np.ndarray) -> float:
        """One-sided 95% lower confidence bound of recall@k over the query population, from the per-query recalls
        of the sample: tuning on a sample must not pick a setting that only just reaches the target on it (on the
        10M bench, 0.956 on 500 tuning queries was 0.936 on others)."""
        return float(per.mean() - 1.645 * per.std(ddof=1) / np.sqrt(len(per))) if len(per) > 1 else float(per.mean())

    def recall(self, queries: np.ndarray, k: int, sample: int = 200, seed: int = 0) -> float:
        """recall@k of this index against exact search on up to ``sample`` of the queries (1.0 if exact)."""
        if self.exact:
            return 1.0
        q, k = self._sample(queries, sample, seed), min(k, len(self.ids))
        return float(self._per_query(self._stream_exact(q, k)[1], self.search(q, k)[1]).mean())

    def tune(self, queries: np.ndarray, k: int, target: float, sample: int = 200, seed: int = 0) -> dict:
        """The cheapest search setting whose recall@k on a sample of ``queries`` reaches ``target`` with 95%
        confidence (the lower bound of the sample's recall, not its mean).

        Raises:
            ToolchainError: no setting of this index reaches the target (the message says what to change).
        """
        k = min(k, len(self.ids))
        if self.exact:
            self.tuning = {"exact": True, "recall": 1.0, "k": k, "target": target, "params": {}, "sample": 0,
                           "trials": []}
            return self.tuning
        q = self._sample(queries, sample, seed)
        truth = self._stream_exact(q, k)[1]
        trials: List[dict] = []

        def trial(setting: Dict[str, int]) -> float:
            self.set_params(**setting)
            start = time.perf_counter()
            got = self.search(q, k)[1]
            ms = (time.perf_counter() - start) * 1000 / len(q)
            per = self._per_query(truth, got)
            trials.append({**setting, "recall": round(float(per.mean()), 4),
                           "recall_low": round(self._lower_bound(per), 4), "ms_per_query": round(ms, 3)})
            return trials[-1]["recall_low"]

        def reached() -> bool:
            for breadth in self._breadths(k):
                previous = -1.0
                for kf in (K_FACTORS if self.refine else (0,)):
                    recall = trial({**breadth, **({"k_factor": kf} if kf else {})})
                    if recall >= target:
                        return True
                    if recall <= previous + 0.005:
                        break  # deeper re-ranking no longer helps: the probe breadth is the limit
                    previous = recall
            return False

        if not reached():
            best = max(trials, key=lambda t: t["recall_low"])
            raise ToolchainError(f"curate.index '{self.spec}' reaches recall@{k} {best['recall']:.3f} (95% lower bound "
                                 f"{best['recall_low']:.3f}) at its broadest search, below curate.min_recall {target}; "
                                 f"use a finer index "
                                 f"(curate.index: auto or flat) or lower curate.min_recall")
        self.tuning = {"exact": False, "recall": trials[-1]["recall"], "recall_low": trials[-1]["recall_low"], "k": k,
                       "target": target,
                       "params": dict(self.params), "sample": len(q), "trials": trials}
        return self.tuning

    def describe(self) -> dict:
        """What was built, why, how long it took and how it searches: for the stage result and the report."""
        return {"spec": self.spec, "why": self.why, "refine": self.refine, "vectors": len(self.ids),
                "build_seconds": round(self.build_seconds, 2), "on_gpu": self.on_gpu, "gpu_note": self.gpu_note,
                "params": dict(self.params), "tuning": self.tuning}


def describe_lines(described: Optional[dict]) -> List[str]:
    """``PoolIndex.describe()`` as the report's markdown: the rule's reason, the build time and every search
    setting tried on the sample of queries.  Nothing for exact search, which has nothing to choose or tune."""
    if not described or described.get("spec") == "flat":
        return []
    where = " on the GPU" if described.get("on_gpu") else ""
    note = f"; {described['gpu_note']}" if described.get("gpu_note") else ""
    lines = [f"Index `{described['spec']}` ({described['why']}), built in {described['build_seconds']:.1f} s"
             f"{where}{note}."]
    tuning = described.get("tuning")
    if tuning and tuning.get("trials"):
        lines += [f"Tuned on {tuning['sample']} queries until the 95% lower bound of recall@{tuning['k']} reached "
                  f"{tuning['target']}: chose {tuning['params']}.", "",
                  "| setting | recall | 95% lower bound | ms / query |", "|---|---|---|---|"]
        for t in tuning["trials"]:
            setting = ", ".join(f"{k} {v}" for k, v in t.items() if k not in ("recall", "recall_low", "ms_per_query"))
            lines.append(f"| {setting} | {t['recall']:.3f} | {t.get('recall_low', t['recall']):.3f} | "
                         f"{t['ms_per_query']:.3f} |")
    return lines
