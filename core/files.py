"""Files written whole or not at all: a reader sees the old file or the new one, never half, and every file gets the
mode a plain ``open()`` would give it.  The store seals folders with these; data writers (COCO, tag CSVs) and
reports write single files with them."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_npy", "place_file",
           "FILE_MODE", "DIR_MODE"]

# Files we create get the mode a plain open() would give them (0666 less the umask), not mkstemp's 0600:
# artifacts and reports are meant to be read by the people and services the build is shared with.
_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK


def atomic_write(path: Path, writer: Callable[[Path], None]) -> Path:
    """Call ``writer(tmp_path)`` then rename onto ``path``: readers see the old file or the new, never half.
    The file gets the usual permissions (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        writer(tmp_path)
        if tmp_path.is_dir():
            raise RuntimeError("atomic_write writes files; use ArtifactStore for directories")
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, FILE_MODE)
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda p: p.write_bytes(data))


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def place_file(src: str | Path, dst: Path, copy: bool = False) -> Path:
    """``src`` at ``dst`` (its folder made): a link to the original (an absolute one), or a copy with ``copy`` or
    where the filesystem has no links.  For folders of existing images handed to a person or a reader (pseudo-labels,
    grown label sets); never for store entries, whose files must not change behind them.  A file or link already
    at ``dst`` is replaced, never written through: a copy onto an old link would overwrite the image it names."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    if not copy:
        try:
            os.symlink(os.path.abspath(src), dst)
            return dst
        except OSError:  # a filesystem without links: copy
            pass
    shutil.copy2(src, dst)
    return dst


def atomic_write_npy(path: Path, arr: Any) -> Path:
    import numpy as np

    def write(p: Path) -> None:
        with open(p, "wb") as fh:  # a file object: np.save would add ".npy" to a temporary name
            np.save(fh, arr)

    return atomic_write(path, write)
