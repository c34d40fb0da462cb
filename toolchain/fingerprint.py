"""Content fingerprints of data folders: what keys ``data.prepare`` and so every stage built on the data.

The fingerprint must change when the data changes and only then.  Size + mtime is cheap but a copy, a fresh
checkout, a container or network mount, ``cp`` without ``-p`` or an rsync without ``-t`` gives every file a
new mtime, and with it every stage built on that data (teacher finetuning, distillation: hours) would run
again for bytes that did not change.  So the fingerprint is every file's path relative to its root, its size
and the sha256 of its bytes.  Reading every byte on every build would cost minutes on a large pool, so each
file's sha256 is remembered per (absolute path, size, mtime, inode) in a small sqlite memo in the store
the build named (``<store>/fingerprints.sqlite``): an unchanged folder is read once per machine, a re-copied one once more, and a build after
that only stats its files.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from vfm_toolchain.core.console import Track
from vfm_toolchain.core.roots import DataRoots
from vfm_toolchain.data.pools import expand_sources
from vfm_toolchain.store import default_store_root, sha256_file

__all__ = ["fingerprint_paths", "file_sha256", "memo_path", "memo_in"]

log = logging.getLogger("toolchain")

# A file stat as the memo keys it: a changed size, mtime or inode means the bytes are read again.
_Stat = Tuple[int, int, int]


# The store a build named (runner.build sets it): the memo lives in it, so a build with --store elsewhere
# never writes the default store in the home folder (read-only on shared CI runners and some clusters)
_STORE: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("fingerprint_store", default=None)


@contextlib.contextmanager
def memo_in(store: Any) -> Iterator[None]:
    """Inside the block the memo is ``<store>/fingerprints.sqlite``, or none when the store is read-only."""
    token = _STORE.set(store)
    try:
        yield
    finally:
        _STORE.reset(token)


def memo_path() -> Optional[Path]:
    """Where the memo is: in the store the running build named, else in the default store."""
    store = _STORE.get()
    if store is None:
        return default_store_root() / "fingerprints.sqlite"
    return store.root / "fingerprints.sqlite" if store.writable else None


class _Memo:
    """sha256 per (path, stat) in sqlite; silently a plain dict when the memo cannot be opened or written
    (a read-only home, a full disk): a fingerprint is never wrong for want of the memo, only slower."""

    def __init__(self, path: Optional[Path]):
        self.db: Optional[sqlite3.Connection] = None
        self.pending: Dict[str, Tuple[_Stat, str]] = {}
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(path), timeout=30)
            self.db.execute("CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER, "
                            "mtime INTEGER, inode INTEGER, sha256 TEXT)")
        except (OSError, sqlite3.Error) as e:
            log.debug("fingerprint memo %s unavailable (%s); hashing without it", path, e)
            self.db = None

    def get(self, path: str, stat: _Stat) -> Optional[str]:
        if self.db is None:
            return None
        try:
            row = self.db.execute("SELECT size, mtime, inode, sha256 FROM files WHERE path = ?", (path,)).fetchone()
        except sqlite3.Error:
            return None
        return row[3] if row and tuple(row[:3]) == stat else None

    def put(self, path: str, stat: _Stat, sha: str) -> None:
        self.pending[path] = (stat, sha)
        if len(self.pending) >= 1000:  # a killed first hash of a large pool keeps what it has read
            self.flush()

    def flush(self) -> None:
        if self.db is None or not self.pending:
            self.pending.clear()
            return
        try:
            with self.db:
                self.db.executemany("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?)",
                                    [(p, *st, sha) for p, (st, sha) in self.pending.items()])
        except sqlite3.Error as e:
            log.debug("fingerprint memo not written (%s)", e)
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        if self.db is not None:
            self.db.close()


def _files(root: str, allowed: Optional[DataRoots] = None) -> Iterator[Tuple[str, str, Optional[str]]]:
    """(name in the fingerprint, path, None) of every file under ``root`` in a fixed order: a folder walked sorted
    (symlinked folders followed once each), a file list or tar shard as itself, a glob as the files it matches.

    With ``allowed``, a symlink (to a file or a folder) that leads outside it is never opened nor followed: it is
    ``(name, path, where it points)``, as is a symlink that leads nowhere.  The readers refuse such a link where
    they would read it (core/roots.py); elsewhere in a data folder nothing reads it."""
    rp = Path(root)
    if any(ch in root for ch in "*?["):
        for f in expand_sources(root):
            if os.path.isfile(f):
                yield os.path.basename(f), f, None
    elif rp.is_file():
        yield rp.name, str(rp), None
    elif rp.is_dir():
        seen = {os.path.realpath(rp)}
        for dirpath, dirnames, filenames in os.walk(rp, followlinks=True):
            for d in sorted(dirnames):
                path = os.path.join(dirpath, d)
                if not os.path.islink(path):
                    continue
                real = os.path.realpath(path)
                if real in seen or (allowed is not None and not allowed.admits(path)):
                    dirnames.remove(d)  # a loop, or a folder outside: not walked
                    if real not in seen:
                        yield os.path.relpath(path, rp), path, os.readlink(path)
                seen.add(real)
            dirnames.sort()
            for fn in sorted(filenames):
                path = os.path.join(dirpath, fn)
                link = os.path.islink(path) and (not os.path.exists(path) or
                                                 (allowed is not None and not allowed.admits(path)))
                yield os.path.relpath(path, rp), path, os.readlink(path) if link else None


def fingerprint_paths(roots: Sequence[Optional[str]], memo: Optional[Path] = None, files: Sequence[str] = (),
                      data_roots: Optional[Sequence[str]] = None) -> str:
    """sha256 over every file of ``roots`` (folders, file lists, tar shards, globs): its root's position, its
    path under the root, its size and the sha256 of its bytes.  The files' times do not count, so a data set
    copied again to the same place keeps its key (where it lives is in the stage's config beside this).
    ``files``: single files besides, by their own path (what a data file names outside the folders: a pool
    list's images); one that does not exist counts as missing.  ``memo``: the sqlite memo (default
    ``memo_path()``).  ``data_roots``: a symlink in a folder that leads outside it and them (core/roots.py)
    counts by where it points, and nothing outside is opened."""
    listing: List[Tuple[int, str, str, Optional[str]]] = []
    for i, root in enumerate(roots):
        if root is None:
            continue
        allowed = DataRoots(root, data_roots) if data_roots is not None and os.path.isdir(root) else None
        found = list(_files(str(root), allowed))
        if not found and not Path(root).exists():
            listing.append((i, "<missing>", "", None))  # a later stage says what is wrong with it
        listing.extend((i, name, path, link) for name, path, link in found)
    for f in files:
        listing.append((-1, f, f, None) if os.path.isfile(f) else (-1, "<missing>", f, None))

    store = _Memo(memo if memo is not None else memo_path())  # None (read-only store): hash without a memo
    h = hashlib.sha256()
    track: Optional[Track] = None
    try:
        for n, (i, name, path, link) in enumerate(listing):
            if name == "<missing>":
                h.update(f"{i}|<missing>{'|' + path if path else ''}\n".encode())
                continue
            if link is not None:  # outside, or leading nowhere: the link itself counts, its target is not read
                h.update(f"{i}|{name}|-> {link}\n".encode())
                continue
            st = os.stat(path)
            stat = (st.st_size, st.st_mtime_ns, st.st_ino)
            absolute = os.path.abspath(path)
            sha = store.get(absolute, stat)
            if sha is None:
                if track is None:  # only shown when there is reading to do: a memoised folder is instant
                    track = Track("fingerprinting the data (read once, then remembered)", len(listing) - n, "file")
                sha = sha256_file(Path(path))
                store.put(absolute, stat, sha)
                track.advance()
            h.update(f"{i}|{name}|{st.st_size}|{sha}\n".encode())
    finally:
        if track is not None:
            track.close()
        store.close()
    return h.hexdigest()


def file_sha256(path: str) -> str:
    """The sha256 of one file's bytes (remembered in the memo like a data file's), or "<missing>"."""
    if not os.path.isfile(path):
        return "<missing>"
    st = os.stat(path)
    stat, absolute = (st.st_size, st.st_mtime_ns, st.st_ino), os.path.abspath(path)
    memo = _Memo(memo_path())
    try:
        sha = memo.get(absolute, stat)
        if sha is None:
            sha = sha256_file(Path(path))
            memo.put(absolute, stat, sha)
        return sha
    finally:
        memo.close()
