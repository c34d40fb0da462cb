"""A pool's embeddings as memory-mapped pieces addressed by one global index.

A web-scale pool does not fit in memory (15M x 768 float32 is 46 GB), so the embeddings stay in their
shard files (ours, written by :mod:`teachers.embed`, or another tool's precomputed ``.npy`` shards) and
are read a block at a time.  Rows come back as float32, L2-normalised when asked (the form curation
searches in; another tool's embeddings may not be unit length).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PoolVectors"]


class PoolVectors:
    """N embeddings spread over ``arrays``.

    Args:
        arrays: (n_i, D) array-likes, usually ``np.load(..., mmap_mode='r')``.
        locations: optional (N, 2) int64 table of (array, row) per global index; without it the pool is the
            arrays one after another.  The table lets a pool mix our shards with precomputed ones in any order.
        normalize: return rows scaled to unit length.
    """

    def __init__(self, arrays: Sequence[np.ndarray], locations: Optional[np.ndarray] = None,
                 normalize: bool = False):
        if not arrays:
            raise ValueError("PoolVectors needs at least one array")
        dims = {a.shape[1] for a in arrays}
        if len(dims) != 1:
            raise ValueError(f"embedding arrays have different widths {sorted(dims)}")
        self.arrays: List[np.ndarray] = list(arrays)
        self.dim = dims.pop()
        self.locations = locations
        self.normalize = normalize
        self._offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays])])

    @classmethod
    def from_array(cls, x: np.ndarray) -> "PoolVectors":
        return cls([np.asarray(x)])

    def __len__(self) -> int:
        return int(len(self.locations) if self.locations is not None else self._offsets[-1])

    @property
    def shape(self) -> Tuple[int, int]:
        return len(self), self.dim

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (global indices) as a (len(idx), D) float32 array."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.locations is not None:
            which, rows = self.locations[idx, 0], self.locations[idx, 1]
        else:
            which = np.searchsorted(self._offsets, idx, side="right") - 1
            rows = idx - self._offsets[which]
        out = np.empty((len(idx), self.dim), dtype=np.float32)
        for a in np.unique(which):
            m = which == a
            r = rows[m]
            order = np.argsort(r, kind="stable")  # memory maps read fastest front to back
            block = np.empty((len(r), self.dim), dtype=np.float32)
            block[order] = self.arrays[a][r[order]]
            out[m] = block
        if self.normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def chunks(self, rows: int = 65536, ids: Optional[np.ndarray] = None) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """(global ids, vectors) blocks of at most ``rows``, over ``ids`` (default: the whole pool)."""
        ids = np.arange(len(self), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        for s in range(0, len(ids), rows):
            block = ids[s:s + rows]
            yield block, self.take(block)
