"""Sharded, resumable embedding of an image pool.

The pool is cut into shards of ``shard_size`` images; each finished shard is one ``.npy`` file written
atomically, and ``manifest.json`` records the layout.  A killed run resumes at the first unfinished
shard, and no more than one shard is ever held in memory while embedding.  ``rank`` / ``world`` give
each process a disjoint set of shards (round robin) so several processes or machines can share a pool.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from teachers.vectors import PoolVectors
from toolchain.data import ImageListDataset, Preprocess, eval_transform
from toolchain.store import atomic_write, atomic_write_json
from toolchain.training import loader

__all__ = ["embed_sharded", "load_shards", "embed_backbone"]


def _shard_file(folder: Path, s: int) -> Path:
    return folder / f"emb_{s:05d}.npy"


@torch.no_grad()
def embed_sharded(model, paths: List[str], pp: Preprocess, folder: Path, shard_size: int = 4096,
                  batch_size: int = 64, workers: int = 0, rank: int = 0, world: int = 1, log=None,
                  normalize: bool = True) -> int:
    """Embed this process's shards of ``paths`` into ``folder``; returns how many shards it computed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = max(1, math.ceil(len(paths) / shard_size))
    atomic_write_json(folder / "manifest.json", {"images": len(paths), "shard_size": shard_size,
                                                 "shards": n_shards})
    model.eval()
    use_half = torch.cuda.is_available() and next(model.parameters()).is_cuda
    computed = []
    for s in range(rank, n_shards, world):
        out = _shard_file(folder, s)
        if out.is_file():
            continue  # finished before a kill: resume after it
        chunk = paths[s * shard_size:(s + 1) * shard_size]
        ds = ImageListDataset([(p, 0) for p in chunk], eval_transform(pp), cache_mb=0)
        feats = []
        for x, _ in loader(ds, None, batch_size, shuffle=False, workers=workers):
            encode = model.backbone if hasattr(model, "backbone") else model.forward_features  # pooled features
            if use_half:
                with torch.autocast("cuda", dtype=torch.float16):
                    f = encode(x.cuda(non_blocking=True))
            else:
                f = encode(x)
            f = f.float()
            feats.append((torch.nn.functional.normalize(f, dim=1) if normalize else f).cpu().numpy())
        arr = np.concatenate(feats).astype(np.float32)
        atomic_write(out, lambda p: np.save(open(p, "wb"), arr))
        computed.append(s)
        if log is not None:
            log.info("embedded shard %d/%d (%d images)%s", s + 1, n_shards, len(chunk),
                     f" on rank {rank}/{world}" if world > 1 else "")
    atomic_write_json(folder / f"rank_{rank}.json", {"rank": rank, "world": world, "computed": computed})
    return len(computed)


def load_shards(folder: Path, expected: Optional[int] = None) -> PoolVectors:
    """All shards in order, memory-mapped (nothing is read yet); raises if a shard is missing."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    missing = [s for s in range(manifest["shards"]) if not _shard_file(folder, s).is_file()]
    if missing:
        raise FileNotFoundError(f"embedding shards {missing[:5]} of {manifest['shards']} are not finished in {folder}")
    vectors = PoolVectors([np.load(_shard_file(folder, s), mmap_mode="r") for s in range(manifest["shards"])])
    if expected is not None and len(vectors) != expected:
        raise ValueError(f"{folder} holds {len(vectors)} embeddings, expected {expected}")
    return vectors


@torch.no_grad()
def embed_backbone(backbone: torch.nn.Module, paths: List[str], pp: Preprocess, batch_size: int = 64) -> torch.Tensor:
    """Pooled / CLS features ``(N, D)`` of images through a backbone (eval transform, eval mode)."""
    from toolchain.progress import progress

    was_training = backbone.training
    backbone.eval()
    ds = ImageListDataset([(p, 0) for p in paths], eval_transform(pp), cache_mb=0)
    batches = loader(ds, None, batch_size, shuffle=False)
    feats = [backbone(x).float() for x, _ in progress(batches, len(batches), f"embedding {len(paths)} images")]
    backbone.train(was_training)
    return torch.cat(feats)
