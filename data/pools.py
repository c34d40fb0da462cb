"""Unlabeled pool sources: image folders (recursive), file lists, WebDataset-style tar shards, and
precomputed embeddings from another tool.

A pool item is a string: a file path, or ``<shard.tar>::<member>`` for an image inside a tar shard (the
WebDataset format web-scale pools such as CC3M or YFCC15M come in).  Shards are read in place, never
extracted, through ``wids``' memory-mapped indexed tar reader: a member is a slice of the mapping, so there is
no shared file offset to race on.  Open shards are kept per process (a forked DataLoader worker opens its
own, never its parent's) in a small LRU that closes what it evicts, so a pool of thousands of shards holds
at most ``MAX_OPEN_SHARDS`` descriptors.

A precomputed-embedding pool is a folder holding ``paths.txt`` (one image per line, as in a file list)
and ``.npy`` shards whose rows, in file-name order, are the embeddings of those lines (what tools like
clip-retrieval write).  An optional ``info.json`` names the encoder (``{"encoder": "open_clip:ViT-L-14/openai"}``),
so curation can refuse to mix embedding spaces.  The images themselves are still needed: the student
learns from their pixels.
"""
from __future__ import annotations

import glob
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from wids.wids_lru import LRUCache
from wids.wids_mmtar import MMIndexedTar

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.roots import DataRoots, refuse_outside

__all__ = ["IMAGE_EXTENSIONS", "TAR_SEP", "EMBEDDING_PATHS", "list_pool_source", "read_item", "item_exists",
           "expand_sources", "embedding_files", "load_embedding_source", "check_embedding_rows", "embedding_bytes",
           "close_shards"]

TAR_SEP = "::"
EMBEDDING_PATHS = "paths.txt"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
MAX_OPEN_SHARDS = 64
_OPEN: Dict[str, object] = {"pid": None, "shards": None}


def _is_image_name(name: str) -> bool:
    base = os.path.basename(name)
    return base.lower().endswith(IMAGE_EXTENSIONS) and not base.startswith(".")


def expand_sources(source: str) -> List[str]:
    """A glob pattern (``/data/cc3m/{*}.tar`` style with ``*``/``?``) expands to its sorted matches."""
    if any(ch in source for ch in "*?["):
        matches = sorted(glob.glob(source))
        if not matches:
            raise ToolchainError(f"pool pattern '{source}' matches no files")
        return matches
    return [source]


def _shards() -> LRUCache:
    """This process's open shards.  After a fork the parent's table is dropped, not used: the child maps the
    shards again (the parent's mappings stay the parent's, to close when it evicts them)."""
    if _OPEN["pid"] != os.getpid():
        _OPEN["pid"] = os.getpid()
        _OPEN["shards"] = LRUCache(MAX_OPEN_SHARDS, release_handler=lambda _, shard: shard.close())
    return _OPEN["shards"]


def _tar(path: str) -> MMIndexedTar:
    shards = _shards()
    shard = shards[path]
    if shard is None:
        shard = MMIndexedTar(path, verbose=False)
        shards[path] = shard
    return shard


def _shard_members(path: str) -> List[str]:
    """The file members of a shard, checked against Python's tarfile: the indexed reader reads plain ustar
    headers, so a member whose name needs a PAX or GNU long-name record (over 100 characters) would be
    listed under a truncated name; such a shard is refused with the fix rather than read wrongly."""
    try:
        with tarfile.open(path, "r") as tf:
            names = [m.name for m in tf.getmembers() if m.isfile()]
        indexed = set(_tar(path).names())
    except (tarfile.TarError, OSError, ValueError) as exc:
        raise ToolchainError(f"pool shard '{path}' is not a readable tar file: {exc}") from None
    unreadable = [n for n in names if n not in indexed]
    if unreadable:
        raise ToolchainError(f"pool shard '{path}': {len(unreadable)} members have names the indexed tar reader "
                             f"cannot address (e.g. '{unreadable[0][:80]}...', over 100 characters); write "
                             f"shards with short keys, as webdataset.TarWriter does ('000123.jpg')")
    return names


def embedding_files(source: str) -> List[Path]:
    """The ``.npy`` shards of a precomputed-embedding pool, in order; [] when ``source`` is not one."""
    p = Path(source)
    if not (p.is_dir() and (p / EMBEDDING_PATHS).is_file()):
        return []
    return sorted(p.glob("*.npy"))


def load_embedding_source(source: str):
    """(memory-mapped arrays, info) of a precomputed-embedding pool, checked against its path list."""
    import numpy as np

    files = embedding_files(source)
    if not files:
        raise ToolchainError(f"'{source}' is not a precomputed-embedding pool (a folder with {EMBEDDING_PATHS} "
                             f"and .npy shards)")
    arrays = []
    for f in files:
        try:
            a = np.load(f, mmap_mode="r")
        except ValueError as exc:
            raise ToolchainError(f"embedding shard '{f}' is not a readable .npy array: {exc}") from None
        if a.ndim != 2:
            raise ToolchainError(f"embedding shard '{f}' has shape {a.shape}; expected (images, dim)")
        arrays.append(a)
    rows, lines = sum(len(a) for a in arrays), len(_read_list(Path(source) / EMBEDDING_PATHS))
    if rows != lines:
        raise ToolchainError(f"precomputed pool '{source}': {rows} embedding rows in {len(files)} .npy files but "
                             f"{lines} lines in {EMBEDDING_PATHS}; they must correspond one to one")
    info_file = Path(source) / "info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    return arrays, info


def check_embedding_rows(source: str) -> None:
    """Every embedding of a precomputed pool is finite.  Curation measures distances between embeddings and a
    NaN or inf row has none: the search answers it with no neighbours (-1), which ends far downstream in an
    error that names neither the file nor the row.  Streams each shard a block at a time.

    Raises:
        ToolchainError: :func:`load_embedding_source`'s checks, a shard of non-numbers, or rows that are not
            finite, naming each shard, the count and the first rows with their images.
    """
    arrays, _ = load_embedding_source(source)
    images = _read_list(Path(source) / EMBEDDING_PATHS)
    problems, offset = [], 0
    for f, a in zip(embedding_files(source), arrays):
        if a.dtype.kind not in "fiu":
            raise ToolchainError(f"embedding shard '{f}' holds {a.dtype} values; embeddings are numbers (float32 "
                                 f"or float16, one row per line of {EMBEDDING_PATHS})")
        bad = _nonfinite_rows(a) if a.dtype.kind == "f" else []
        if len(bad):
            rows = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
            whose = (f"the embedding of '{images[offset + bad[0]]}'" if len(bad) == 1 else
                     f"the embeddings of '{images[offset + bad[0]]}', ...")
            problems.append(f"embedding shard '{f}' has {len(bad)} of {len(a)} rows that are not finite (NaN or "
                            f"inf): row{'s' * (len(bad) > 1)} {rows} ({whose})")
        offset += len(a)
    if problems:
        raise ToolchainError("\n  ".join(problems) + f"\n  Curation measures distances between embeddings, and a "
                             f"NaN or inf has none: re-embed those images, or remove their lines from "
                             f"{Path(source) / EMBEDDING_PATHS} together with their rows")


def _nonfinite_rows(a, block_bytes: int = 64 << 20) -> List[int]:
    """Indices of the rows of ``a`` (memory-mapped) with a NaN or inf, reading ~``block_bytes`` at a time."""
    import numpy as np

    step = max(1, block_bytes // max(1, a.shape[1] * a.itemsize))
    bad = [s + np.flatnonzero(~np.isfinite(a[s:s + step]).all(axis=1)) for s in range(0, len(a), step)]
    return np.concatenate(bad).tolist() if bad else []


def embedding_bytes(source: str) -> int:
    """The size of a precomputed pool's .npy shards (0 when ``source`` is not one)."""
    return sum(f.stat().st_size for f in embedding_files(source))


def _list_lines(p: Path) -> List[Tuple[int, str, str]]:
    """(line number, as written, item) of a file list: a path relative to the list's folder or absolute, or
    ``<shard.tar>::<member>``; blank lines and ``#`` comments are not items."""
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ToolchainError(f"file list '{p}' is not UTF-8 text (byte {exc.start}); a list has one image path per "
                             f"line") from None
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            q = Path(line).expanduser()
            lines.append((number, line, str(q if q.is_absolute() else (p.parent / q))))
    return lines


def _read_list(p: Path) -> List[str]:
    return [item for _, _, item in _list_lines(p)]


def _checked_list(p: Path, data_roots: Sequence[str]) -> List[str]:
    """A file list's items, every one inside the list's folder or ``data_roots`` (core/roots.py)."""
    allowed = DataRoots(p.parent, data_roots)
    lines = _list_lines(p)
    refuse_outside(p, [(f"line {n}", written) for n, written, item in lines
                       if not allowed.admits(item.split(TAR_SEP, 1)[0])], allowed)
    return [item for _, _, item in lines]


def list_pool_source(source: str, data_roots: Sequence[str] = ()) -> List[str]:
    """The image items of one pool source (folder, ``.txt`` file list, ``.tar`` shard, precomputed-embedding
    folder, or a glob of them).  What a list (or a precomputed pool's ``paths.txt``) names, and what a symlink
    in a folder leads to, stays inside the list's folder, or the folder, and ``data_roots``.

    Raises:
        ToolchainError: a source that is missing or of no known kind, or an item that leads outside.
    """
    items: List[str] = []
    for src in expand_sources(source):
        p = Path(src)
        if embedding_files(src):
            items.extend(_checked_list(p / EMBEDDING_PATHS, data_roots))
        elif p.is_dir():
            files = [f for f in sorted(p.rglob("*")) if f.is_file() and _is_image_name(f.name)]
            DataRoots(p, data_roots).check_links(p, files)
            items.extend(map(str, files))
        elif p.is_file() and p.suffix == ".tar":
            items.extend(f"{p}{TAR_SEP}{name}" for name in sorted(_shard_members(str(p))) if _is_image_name(name))
        elif p.is_file() and p.suffix in (".txt", ".lst"):
            items.extend(_checked_list(p, data_roots))
        elif not p.exists():
            raise ToolchainError(f"pool source '{src}' does not exist")
        else:
            raise ToolchainError(f"pool source '{src}' is not a folder, a .txt/.lst file list or a .tar shard")
    return items


def item_exists(item: str) -> bool:
    path = item.split(TAR_SEP, 1)[0]
    return os.path.exists(path)


def read_item(item: str):
    """A file path, or a file-like object with the bytes of a tar member (KeyError if it is not there)."""
    if TAR_SEP not in item:
        return item
    shard, member = item.split(TAR_SEP, 1)
    _, data = _tar(shard).get_by_name(member)
    return io.BytesIO(data)


def close_shards() -> None:
    """Close this process's open shards (a long-lived process switching pools; tests)."""
    if _OPEN["pid"] == os.getpid() and _OPEN["shards"] is not None:
        _OPEN["shards"].clear()
    _OPEN["pid"] = _OPEN["shards"] = None
