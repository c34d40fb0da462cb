"""Content-addressed artifact store with atomic writes, shared safely between builds.

Layout::

    <root>/<stage>/<key>/                 a sealed stage output (immutable; DONE lists its files)
    <root>/<stage>/<key>.partial/         a stage at work; a killed build resumes here
    <root>/<stage>/<key>.lock             held by the one build working on (or sealing) that key
    <root>/<stage>/<key>.used             touched on every use (``toolchain store --gc --older-than``)
    <root>/<stage>/<key>.lease            shared-locked by every running build that reads the entry
    <root>/<stage>/<key>.suspect          ``toolchain store --verify`` found the entry damaged while a build held it
    <root>/<stage>/<key>.damaged-<time>/  a sealed entry that failed verification, set aside for gc

Only folders named like that (24 hex digits, the suffixes above) are entries; ``gc`` never touches anything
else, whatever folder it sits in.

A stage's key is the hash of its config, its inputs' keys and the environment, so the same recipe finds every
stage done, and a changed student setting misses only the stages downstream of it.

Sharing: two builds (processes, or machines on a shared filesystem) that need the same key take its lock
(``filelock``: ``flock`` on POSIX, released by the kernel when a holder dies); the second waits, then finds
the entry sealed and reuses it.  A sealed entry is never replaced by another copy; only one that fails
verification is set aside and rebuilt.

Readers: a build takes a shared ``flock`` on ``<key>.lease`` for every entry it uses and holds it until it
ends; ``gc`` deletes an entry only under an exclusive one, taken without waiting, so it skips what a running
build reads (and says so).

Trust: sealing records every file's size, mtime and sha256 in ``DONE``, and for files over ``_SAMPLED_ABOVE``
a hash of 64 blocks spread over the file.  A cache hit hashes every file up to that size whole (weights,
metadata); a larger one (pool embeddings, teacher caches, a ViT-L checkpoint) whole when its size or mtime
changed since sealing, else its sampled blocks, so a hit costs milliseconds, not a re-read of gigabytes.
Stages that ask (exported artifacts) and ``toolchain store --verify`` hash everything whole.  Nothing inside an
entry refers to the store by absolute path, so a store can be moved or mounted elsewhere.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

try:
    import fcntl  # POSIX: leases are flock(2) locks
except ImportError:  # pragma: no cover - Windows: no leases, gc cannot tell what a build reads
    fcntl = None

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import DIR_MODE, FILE_MODE, atomic_write_bytes, atomic_write_json

__all__ = ["ArtifactStore", "Entry", "sha256_file", "hash_obj", "default_store_root", "is_writable_dir",
           "permission_hint"]

# Files up to this size are hashed whole on every cache hit; larger ones by sampled blocks while their size and
# mtime are those recorded at sealing (sha256 runs at about 1 GB/s: 64 MiB is tens of milliseconds)
_SAMPLED_ABOVE = 64 << 20
_SAMPLE_BLOCKS, _SAMPLE_BYTES = 64, 4096
_ENTRY_NAME = re.compile(r"^(?P<key>[0-9a-f]{24})(?P<suffix>|\.partial|\.damaged-[0-9A-Za-z_-]+)$")


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


def sampled_sha256(path: Path, size: Optional[int] = None) -> str:
    """sha256 of ``_SAMPLE_BLOCKS`` blocks spread evenly over the file, the first and the last included."""
    size = path.stat().st_size if size is None else size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        for i in range(_SAMPLE_BLOCKS):
            fh.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLE_BLOCKS - 1))
            h.update(fh.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _file_record(p: Path) -> Dict[str, Any]:
    st = p.stat()
    rec = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(p)}
    if st.st_size > _SAMPLED_ABOVE:
        rec["sampled_sha256"] = sampled_sha256(p, st.st_size)
    return rec


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
    state: str            # sealed | suspect (verify found it damaged while in use) | partial | damaged
    bytes: int
    modified: float       # seconds since the epoch (sealing time for sealed entries)
    last_used: float
    recipe: Optional[str]


class ArtifactStore:
    def __init__(self, root: Path, create: bool = True):
        """The store at ``root``, created when missing unless ``create`` is False (then a missing folder is an
        error: ``toolchain store`` lists, verifies and cleans a store, it never makes one)."""
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ToolchainError(f"--store '{self.root}' is a file, not a folder; give a folder for the artifact "
                                 f"store (it is created when missing)")
        if not create and not self.root.is_dir():
            raise ToolchainError(f"there is no artifact store at '{self.root}' (no such folder); give the --store "
                                 f"(or VFM_TOOLCHAIN_CACHE) your builds used; a build creates it")
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

    @contextlib.contextmanager
    def lease(self, stage: str, key: str) -> Iterator[None]:
        """A reader's claim on ``key``'s entry for the block: a shared ``flock`` on ``<key>.lease``, so ``gc``
        (which needs an exclusive one) leaves the entry alone while any build uses it.  Waits only while a gc is
        deleting that very entry.  A read-only store has no gc to fear: no lease."""
        if not self.writable or fcntl is None:
            yield
            return
        path = self._sidecar(stage, key, ".lease")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _try_exclusive(self, stage: str, key: str) -> Optional[int]:
        """An exclusive lease (the fd to close), or None when a build holds the entry now."""
        if fcntl is None:
            return os.open(os.devnull, os.O_RDONLY)
        path = self._sidecar(stage, key, ".lease")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

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
        """Seal a finished stage: drop leftovers of interrupted writes, record every file's size, mtime and
        sha256 in DONE, then rename the folder into place.  Called under the key's lock; a valid sealed copy
        already in place (sealed by a build that did not take the lock, e.g. an older toolchain) is kept."""
        src, dst = self.partial_dir(stage, key), self.final_dir(stage, key)
        for tmp in src.rglob(".*.tmp"):  # an atomic write killed before its rename
            tmp.unlink(missing_ok=True)
        for p in [src, *src.rglob("*")]:  # libraries write through mkstemp/mkdtemp (0600/0700): readable by all
            if not p.is_symlink():
                mode = p.stat().st_mode
                os.chmod(p, DIR_MODE if p.is_dir() else FILE_MODE | (stat.S_IMODE(mode) & 0o111 & DIR_MODE))
        files = {str(p.relative_to(src)): _file_record(p) for p in _files(src)}
        atomic_write_json(src / "DONE", {**meta, "sealed_at": time.time(), "files": files})
        if dst.exists():
            if self.is_done(stage, key) and not self.verify(stage, key):
                shutil.rmtree(src)
                return dst
            self.quarantine(stage, key, "replaced by a complete rebuild")
        os.replace(src, dst)
        self._sidecar(stage, key, ".suspect").unlink(missing_ok=True)
        self.touch_used(stage, key)
        return dst

    # ---- trust

    def verify(self, stage: str, key: str, full: bool = False) -> List[str]:
        """What is wrong with a sealed entry ([] when nothing): a file missing, at another size than when it was
        sealed, or with other bytes.  Files up to ``_SAMPLED_ABOVE`` are hashed whole; larger ones whole when
        ``full``, when their mtime changed or when ``verify --store`` marked the entry suspect, else by their
        sampled blocks."""
        folder = self.final_dir(stage, key)
        meta = self.read_meta(stage, key)
        if meta is None:
            return ["DONE is missing or unreadable"]
        files = meta.get("files")
        if files is None:  # sealed by a toolchain before manifests: the least we can check
            return [] if (folder / "result.json").is_file() else ["result.json is missing"]
        suspect = self._sidecar(stage, key, ".suspect")
        marked = suspect.exists()
        full = full or marked
        problems = []
        for rel, want in files.items():
            p = folder / rel
            try:
                st = p.stat()
            except OSError:
                problems.append(f"{rel} is missing")
                continue
            if st.st_size != want["bytes"]:
                problems.append(f"{rel} is {st.st_size} bytes, {want['bytes']} when sealed")
                continue
            sampled = want.get("sampled_sha256")
            if not full and sampled and st.st_mtime_ns == want.get("mtime_ns"):
                same = sampled_sha256(p, st.st_size) == sampled
            else:
                same = sha256_file(p) == want["sha256"]
            if not same:
                problems.append(f"{rel} changed since it was sealed (sha256 differs)")
        if marked and not problems and self.writable:  # restored since it was marked: whole again
            suspect.unlink(missing_ok=True)
        return problems

    def quarantine(self, stage: str, key: str, reason: str) -> Optional[Path]:
        """Set a damaged sealed entry aside (``<key>.damaged-<time>``) so the stage is rebuilt; ``toolchain
        store --gc`` deletes it.  Returns where it went, or None when it could not be moved."""
        src = self.final_dir(stage, key)
        if not src.exists():
            return None
        self._require_writable(stage)
        dst = src.with_name(f"{src.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(src, dst)
        self._sidecar(stage, key, ".suspect").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (dst / "DAMAGED").write_text(reason + "\n")
        return dst

    def set_aside(self, entry: "Entry", problems: List[str]) -> str:
        """What ``toolchain store --verify`` does with a damaged entry: set it aside now when no build holds it
        (the next build rebuilds it, gc deletes it), else mark it suspect (the next build that needs it hashes it
        whole, finds the damage and rebuilds; gc deletes it once no build holds it).  Returns what was done."""
        reason = "; ".join(problems)
        fd = self._try_exclusive(entry.stage, entry.key) if self.writable else None
        if fd is None:
            if self.writable:
                atomic_write_bytes(self._sidecar(entry.stage, entry.key, ".suspect"), (reason + "\n").encode())
                return "marked (a running build holds it)"
            return "left (read-only store)"
        try:
            where = self.quarantine(entry.stage, entry.key, reason)
        finally:
            os.close(fd)
        return f"set aside as {where.name}" if where else "gone"

    # ---- listing and clean-up (``toolchain store``)

    def entries(self) -> Iterator[Entry]:
        """Every entry of the store.  A folder is an entry only by its own marks: a name of 24 hex digits (with
        ``.partial`` or ``.damaged-<time>``) in a stage folder, and for a sealed one its ``DONE``.  Anything else
        (a user's folder put in the store, an output folder) is not ours: see ``foreign``."""
        for d in self._candidates():
            m = _ENTRY_NAME.match(d.name)
            if m is None:
                continue
            suffix, key = m.group("suffix"), m.group("key")
            state = "partial" if suffix == ".partial" else "damaged" if suffix else "sealed"
            meta: Dict[str, Any] = {}
            if state == "sealed":
                with contextlib.suppress(OSError, ValueError):
                    meta = json.loads((d / "DONE").read_text())
                if not isinstance(meta, dict) or not str(meta.get("key", key)).startswith(key):
                    meta = {}
                if not meta:
                    state = "damaged"
                elif (d.parent / f"{key}.suspect").exists():
                    state = "suspect"
            used = d.parent / f"{key}.used"
            modified = meta.get("sealed_at") or d.stat().st_mtime
            yield Entry(stage=d.parent.name, key=key, path=d, state=state, bytes=_dir_bytes(d),
                        modified=modified, last_used=used.stat().st_mtime if used.exists() else modified,
                        recipe=meta.get("recipe"))

    def foreign(self) -> List[Path]:
        """Folders in the store that are not entries (gc leaves them; verify names them)."""
        return [d for d in self._candidates() if _ENTRY_NAME.match(d.name) is None]

    def _candidates(self) -> Iterator[Path]:
        for stage_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()
                                and not p.name.startswith(("_", "."))):
            yield from sorted(p for p in stage_dir.iterdir() if p.is_dir() and not p.is_symlink())

    def gc(self, older_than_days: Optional[float] = None, dry_run: bool = False) -> Tuple[List[Entry], List[Entry]]:
        """Delete damaged and suspect entries, working folders no build holds, and with ``older_than_days``
        sealed entries no build used for that long.  Entries a running build holds (its lock or a lease) are
        kept.  Returns (deleted, or with ``dry_run`` would be; kept because in use)."""
        from filelock import FileLock, Timeout

        if older_than_days is not None and not (older_than_days >= 0):  # also NaN
            raise ToolchainError(f"--older-than {older_than_days}: give a number of days >= 0 (0: every sealed "
                                 f"entry no running build uses)")
        self._require_writable("store gc")
        now, gone, held = time.time(), [], []
        for e in list(self.entries()):
            if e.state == "sealed" and (older_than_days is None or now - e.last_used < older_than_days * 86400):
                continue
            lock = FileLock(str(self._sidecar(e.stage, e.key, ".lock")), mode=FILE_MODE)
            try:
                lock.acquire(timeout=0)  # a build working on this key right now keeps it
            except Timeout:
                held.append(e)
                continue
            try:
                fd = self._try_exclusive(e.stage, e.key) if e.state in ("sealed", "suspect") else None
                if e.state in ("sealed", "suspect") and fd is None:
                    held.append(e)  # a running build reads it
                    continue
                try:
                    if not dry_run:
                        shutil.rmtree(e.path, ignore_errors=True)
                        if e.state in ("sealed", "suspect"):
                            self._sidecar(e.stage, e.key, ".used").unlink(missing_ok=True)
                            self._sidecar(e.stage, e.key, ".suspect").unlink(missing_ok=True)
                    gone.append(e)
                finally:
                    if fd is not None:
                        os.close(fd)
            finally:
                lock.release()
        return gone, held


def permission_hint(exc: OSError) -> str:
    """A short explanation of a filesystem error, for messages."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    return exc.strerror or str(exc)
