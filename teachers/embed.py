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
from typing import List, Optional, Union

import numpy as np
import torch

from vfm_toolchain.core.console import Track
from vfm_toolchain.core.files import atomic_write_json, atomic_write_npy
from vfm_toolchain.data.images import ImageListDataset, Preprocess, eval_transform
from vfm_toolchain.devices import inference_autocast, inference_batch_size, on_device
from vfm_toolchain.teachers.vectors import PoolVectors
from vfm_toolchain.training import loader

__all__ = ["embed_sharded", "load_shards", "embed_backbone"]


def _shard_file(folder: Path, s: int) -> Path:
    return folder / f"emb_{s:05d}.npy"


def _batch_size(requested: Union[int, str], encode, pp: Preprocess, device: torch.device, log=None) -> int:
    """The recipe's batch, or ``auto`` from the device policy (measured on blank inputs on CUDA)."""
    size = inference_batch_size(requested, lambda b: encode(torch.zeros(b, 3, *pp.hw, device=device)))
    if log is not None and requested == "auto":
        log.info("embedding batch %d (auto, %s)", size, device)
    return size


@torch.no_grad()
def embed_sharded(model, paths: List[str], pp: Preprocess, folder: Path, shard_size: int = 4096,
                  batch_size: Union[int, str] = "auto", rank: int = 0, world: int = 1, log=None,
                  normalize: bool = True) -> int:
    """Embed this process's shards of ``paths`` into ``folder``; returns how many shards it computed.  Images
    are decoded by the device policy's loader workers."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = max(1, math.ceil(len(paths) / shard_size))
    atomic_write_json(folder / "manifest.json", {"images": len(paths), "shard_size": shard_size,
                                                 "shards": n_shards})
    model.eval()
    computed = []
    mine = list(range(rank, n_shards, world))
    todo = [s for s in mine if not _shard_file(folder, s).is_file()]  # finished before a kill: resume after them
    if log is not None and len(todo) < len(mine):
        log.info("embedding: %d of %d shards already done, resuming at shard %d", len(mine) - len(todo), len(mine),
                 todo[0] + 1 if todo else len(mine))
    n_todo = sum(len(paths[s * shard_size:(s + 1) * shard_size]) for s in todo)
    bar = Track(f"embedding {len(todo)} shards" + (f" (rank {rank}/{world})" if world > 1 else ""), n_todo,
                unit="img", log=log)
    encode = model.backbone if hasattr(model, "backbone") else model.forward_features  # pooled features
    with bar, on_device(model) as device:
        batch_size = _batch_size(batch_size, encode, pp, device, log) if todo else batch_size
        for s in todo:
            _embed_shard(encode, paths[s * shard_size:(s + 1) * shard_size], pp, _shard_file(folder, s), batch_size,
                         device, normalize, bar)
            computed.append(s)
            bar.set(shard=f"{s + 1}/{n_shards}")
            if log is not None:
                log.debug("embedded shard %d/%d%s", s + 1, n_shards, f" on rank {rank}/{world}" if world > 1 else "")
    atomic_write_json(folder / f"rank_{rank}.json", {"rank": rank, "world": world, "computed": computed})
    return len(computed)


def _embed_shard(encode, chunk: List[str], pp: Preprocess, out: Path, batch_size: int, device: torch.device,
                 normalize: bool, bar: Track) -> None:
    ds = ImageListDataset([(p, 0) for p in chunk], eval_transform(pp), cache_mb=0)
    feats = []
    for x, _ in loader(ds, None, batch_size, shuffle=False):
        with inference_autocast():  # fp16 on CUDA; nothing on the CPU
            f = encode(x.to(device, non_blocking=True))
        f = f.float()
        feats.append((torch.nn.functional.normalize(f, dim=1) if normalize else f).cpu().numpy())
        bar.advance(len(x))
    atomic_write_npy(out, np.concatenate(feats).astype(np.float32))


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
def embed_backbone(backbone: torch.nn.Module, paths: Union[List[str], torch.utils.data.Dataset], pp: Preprocess,
                   batch_size: Union[int, str] = "auto") -> torch.Tensor:
    """Pooled / CLS features ``(N, D)`` of images through a backbone (eval transform, eval mode).  ``paths``:
    image paths, or a dataset of ``(image tensor, _)`` already through the eval transform (object crops)."""
    was_training = backbone.training
    backbone.eval()
    ds = paths if isinstance(paths, torch.utils.data.Dataset) else \
        ImageListDataset([(p, 0) for p in paths], eval_transform(pp), cache_mb=0)
    feats = []
    with Track(f"embedding {len(ds)} images", len(ds), unit="img") as bar, on_device(backbone) as device:
        for x, _ in loader(ds, None, _batch_size(batch_size, backbone, pp, device), shuffle=False):
            with inference_autocast():
                feats.append(backbone(x.to(device, non_blocking=True)).float().cpu())
            bar.advance(len(x))
    backbone.train(was_training)
    return torch.cat(feats)
