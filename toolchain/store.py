"""Content-addressed artifact store with atomic writes.

Layout::

    <root>/<stage>/<key>/            a finished stage output (immutable; has DONE)
    <root>/<stage>/<key>.partial/    a stage at work; a killed build resumes here

A stage's key is the hash of its config, its inputs' keys and the environment, so the same recipe
finds every stage done, and a changed student setting misses only the stages downstream of it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

__all__ = ["ArtifactStore", "atomic_write", "atomic_write_bytes", "atomic_write_json", "sha256_file", "hash_obj",
           "default_store_root"]


def default_store_root() -> Path:
    env = os.environ.get("VFM_TOOLCHAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vfm-toolchain"


def hash_obj(obj: Any) -> str:
    """sha256 of the canonical JSON form of ``obj``."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: Path, writer: Callable[[Path], None]) -> Path:
    """Call ``writer(tmp_path)`` then rename onto ``path``: readers see the old file or the new, never half."""
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
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda p: p.write_bytes(data))


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:24]

    def partial_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / f"{key[:24]}.partial"

    def is_done(self, stage: str, key: str) -> bool:
        return (self.final_dir(stage, key) / "DONE").is_file()

    def begin(self, stage: str, key: str) -> Path:
        """The working folder of a stage; kept across kills so long stages can resume from checkpoints."""
        d = self.partial_dir(stage, key)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self, stage: str, key: str, meta: Dict[str, Any]) -> Path:
        """Seal a finished stage: write DONE inside the partial folder, then rename it into place."""
        src, dst = self.partial_dir(stage, key), self.final_dir(stage, key)
        atomic_write_json(src / "DONE", meta)
        if dst.exists():  # a crashed earlier commit left a sealed copy without DONE; replace it
            shutil.rmtree(dst)
        os.replace(src, dst)
        return dst

    def entries(self) -> Iterator[Path]:
        for stage_dir in sorted(self.root.glob("*")):
            if stage_dir.is_dir():
                yield from sorted(p for p in stage_dir.iterdir() if p.is_dir())

    def read_meta(self, stage: str, key: str) -> Optional[Dict[str, Any]]:
        p = self.final_dir(stage, key) / "DONE"
        return json.loads(p.read_text()) if p.is_file() else None
