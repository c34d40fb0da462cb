"""Content-addressed artifact store with atomic writes, shared safely between builds.

Layout::

    <root>/<stage>/<key>/                 a sealed stage output (immutable; DONE lists its files)
    <root>/<stage>/<key>.partial/         a stage at work; a killed build resumes here
    <root>/<stage>/<key>.lock             held by the one build working on (or sealing) that key
    <root>/<stage>/<key>.used             touched on every use (``toolchain store gc --older-than``)
    <root>/<stage>/<key>.damaged-<time>/  a sealed entry that failed verification, set aside for gc

A stage's key is the hash of its config, its inputs' keys and the environment, so the same recipe finds every
stage done, and a changed student setting misses only the stages downstream of it.

Sharing: two builds (processes, or machines on a shared filesystem) that need the same key take its lock
(``filelock``: ``flock`` on POSIX, released by the kernel when a holder dies); the second waits, then finds
the entry sealed and reuses it.  A sealed entry is never replaced by another copy; only one that fails
verification is set aside and rebuilt.

Trust: sealing records every file's size and sha256 in ``DONE``.  A cache hit checks that every file is there
at its size, and hashes small metadata files and, for stages that ask (artifacts), everything; ``toolchain
store verify`` hashes everything.  Nothing inside an entry refers to the store by absolute path, so a store
can be moved or mounted elsewhere.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from toolchain.errors import ToolchainError

__all__ = ["ArtifactStore", "Entry", "atomic_write", "atomic_write_bytes", "atomic_write_json", "atomic_write_npy", "sha256_file",
           "hash_obj", "default_store_root", "FILE_MODE", "DIR_MODE", "is_writable_dir", "permission_hint"]

# Files we create get the mode a plain open() would give them (0666 less the umask), not mkstemp's 0600:
# artifacts and reports are meant to be read by the people and services the build is shared with.
_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK
DIR_MODE = 0o777 & ~_UMASK
# Files hashed on every cache hit whatever the stage: small, and the ones a later stage parses.
_METADATA_SUFFIXES = {".json", ".csv", ".txt", ".yaml", ".yml", ".md"}
_METADATA_MAX_BYTES = 4 << 20


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


def is_writable_dir(path: Path) -> bool:
    """True when files can be created in the existing folder ``path`` (tried, not guessed from mode bits:
    root ignores them, read-only mounts do not show in them)."""
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe.")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


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


def atomic_write_npy(path: Path, arr: Any) -> Path:
    import numpy as np

    def write(p: Path) -> None:
        with open(p, "wb") as fh:  # a file object: np.save would add ".npy" to a temporary name
            np.save(fh, arr)

    return atomic_write(path, write)


def _files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _files(folder))


@dataclass
class Entry:
    """One folder of the store, as ``toolchain store`` lists it."""

    stage: str
    key: str
    path: Path
    state: str            # sealed | partial | damaged
    bytes: int
    modified: float       # seconds since the epoch (sealing time for sealed entries)
    last_used: float
    recipe: Optional[str]


class ArtifactStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ToolchainError(f"--store '{self.root}' is a file, not a folder; give a folder for the artifact "
                                 f"store (it is created when missing)")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ToolchainError(f"cannot create the artifact store '{self.root}': {exc.strerror}; give a writable "
                                 f"--store (or set VFM_TOOLCHAIN_CACHE)") from None
        self.writable = is_writable_dir(self.root)

    # ---- paths

    def _sidecar(self, stage: str, key: str, suffix: str) -> Path:
        """``<root>/<stage>/<key[:24]><suffix>``: the one place that names a key's files and folders."""
        return self.root / stage / f"{key[:24]}{suffix}"

    def final_dir(self, stage: str, key: str) -> Path:
        return self._sidecar(stage, key, "")

    def partial_dir(self, stage: str, key: str) -> Path:
        return self._sidecar(stage, key, ".partial")

    def shared_dir(self) -> Optional[Path]:
        """``<root>/_shared``: caches that outlive a key (not an entry; never listed or collected)."""
        return self.root / "_shared" if self.writable else None

    def is_done(self, stage: str, key: str) -> bool:
        return (self.final_dir(stage, key) / "DONE").is_file()

    def read_meta(self, stage: str, key: str) -> Optional[Dict[str, Any]]:
        p = self.final_dir(stage, key) / "DONE"
        try:
            return json.loads(p.read_text()) if p.is_file() else None
        except (OSError, ValueError):
            return None

    # ---- sharing

    def _require_writable(self, stage: str) -> None:
        if not self.writable:
            raise ToolchainError(
                f"{stage} is not built in the artifact store '{self.root}', which is read-only. Give a writable "
                f"--store (a read-only store can only serve stages that are already built there)")

    @contextlib.contextmanager
    def lock(self, stage: str, key: str, on_wait: Optional[Callable[[], None]] = None) -> Iterator[None]:
        """Hold ``key``'s lock for the block; ``on_wait`` is called once if another build holds it now.

        A read-only store cannot be locked; its sealed entries are safe to read without a lock (they never
        change), and a stage that must run fails with a clear message in ``begin``."""
        from filelock import FileLock, Timeout

        if not self.writable:
            yield
            return
        path = self._sidecar(stage, key, ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path), mode=FILE_MODE)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait()
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def touch_used(self, stage: str, key: str) -> None:
        if self.writable:
            with contextlib.suppress(OSError):
                self._sidecar(stage, key, ".used").touch()

    # ---- building

    def begin(self, stage: str, key: str) -> Path:
        """The working folder of a stage; kept across kills so long stages can resume from checkpoints."""
        self._require_writable(stage)
        d = self.partial_dir(stage, key)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def commit(self, stage: str, key: str, meta: Dict[str, Any]) -> Path:
        """Seal a finished stage: drop leftovers of interrupted writes, record every file's size and sha256 in
        DONE, then rename the folder into place.  Called under the key's lock; a valid sealed copy already in
        place (sealed by a build that did not take the lock, e.g. an older toolchain) is kept, never replaced."""
        src, dst = self.partial_dir(stage, key), self.final_dir(stage, key)
        for tmp in src.rglob(".*.tmp"):  # an atomic write killed before its rename
            tmp.unlink(missing_ok=True)
        for p in [src, *src.rglob("*")]:  # libraries write through mkstemp/mkdtemp (0600/0700): readable by all
            if not p.is_symlink():
                mode = p.stat().st_mode
                os.chmod(p, DIR_MODE if p.is_dir() else FILE_MODE | (stat.S_IMODE(mode) & 0o111 & DIR_MODE))
        files = {str(p.relative_to(src)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in _files(src)}
        atomic_write_json(src / "DONE", {**meta, "sealed_at": time.time(), "files": files})
        if dst.exists():
            if self.is_done(stage, key) and not self.verify(stage, key):
                shutil.rmtree(src)
                return dst
            self.quarantine(stage, key, "replaced by a complete rebuild")
        os.replace(src, dst)
        self.touch_used(stage, key)
        return dst

    # ---- trust

    def verify(self, stage: str, key: str, full: bool = False) -> List[str]:
        """What is wrong with a sealed entry ([] when nothing): a file missing, or at another size than when it
        was sealed, or (metadata files always, every file with ``full``) with another sha256."""
        folder = self.final_dir(stage, key)
        meta = self.read_meta(stage, key)
        if meta is None:
            return ["DONE is missing or unreadable"]
        files = meta.get("files")
        if files is None:  # sealed by a toolchain before manifests: the least we can check
            return [] if (folder / "result.json").is_file() else ["result.json is missing"]
        problems = []
        for rel, want in files.items():
            p = folder / rel
            try:
                size = p.stat().st_size
            except OSError:
                problems.append(f"{rel} is missing")
                continue
            if size != want["bytes"]:
                problems.append(f"{rel} is {size} bytes, {want['bytes']} when sealed")
                continue
            small_meta = p.suffix in _METADATA_SUFFIXES and size <= _METADATA_MAX_BYTES
            if (full or small_meta) and sha256_file(p) != want["sha256"]:
                problems.append(f"{rel} changed since it was sealed (sha256 differs)")
        return problems

    def quarantine(self, stage: str, key: str, reason: str) -> Optional[Path]:
        """Set a damaged sealed entry aside (``<key>.damaged-<time>``) so the stage is rebuilt; ``toolchain
        store gc`` deletes it.  Returns where it went, or None when it could not be moved."""
        src = self.final_dir(stage, key)
        if not src.exists():
            return None
        self._require_writable(stage)
        dst = src.with_name(f"{src.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(src, dst)
        with contextlib.suppress(OSError):
            (dst / "DAMAGED").write_text(reason + "\n")
        return dst

    # ---- listing and clean-up (``toolchain store``)

    def entries(self) -> Iterator[Entry]:
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("_")):
            for d in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                name = d.name
                state = "partial" if name.endswith(".partial") else "damaged" if ".damaged-" in name else "sealed"
                key = name.split(".")[0]
                meta = {}
                if state == "sealed":
                    with contextlib.suppress(OSError, ValueError):
                        meta = json.loads((d / "DONE").read_text())
                    if not meta:
                        state = "damaged"
                used = stage_dir / f"{key}.used"
                modified = meta.get("sealed_at") or d.stat().st_mtime
                yield Entry(stage=stage_dir.name, key=key, path=d, state=state, bytes=_dir_bytes(d),
                            modified=modified, last_used=used.stat().st_mtime if used.exists() else modified,
                            recipe=meta.get("recipe"))

    def gc(self, older_than_days: Optional[float] = None, dry_run: bool = False) -> List[Entry]:
        """Delete damaged entries, working folders no build holds, and with ``older_than_days`` sealed entries
        no build used for that long.  Returns what was (or, with ``dry_run``, would be) deleted."""
        from filelock import FileLock, Timeout

        self._require_writable("store gc")
        now, gone = time.time(), []
        for e in list(self.entries()):
            if e.state == "sealed" and (older_than_days is None or now - e.last_used < older_than_days * 86400):
                continue
            lock = FileLock(str(self._sidecar(e.stage, e.key, ".lock")), mode=FILE_MODE)
            try:
                lock.acquire(timeout=0)  # a build working on this key right now keeps it
            except Timeout:
                continue
            try:
                if not dry_run:
                    shutil.rmtree(e.path, ignore_errors=True)
                    if e.state == "sealed":
                        self._sidecar(e.stage, e.key, ".used").unlink(missing_ok=True)
                gone.append(e)
            finally:
                lock.release()
        return gone


def permission_hint(exc: OSError) -> str:
    """A short explanation of a filesystem error, for messages."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    return exc.strerror or str(exc)
