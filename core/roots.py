"""Where a build may read: every path a data file names stays inside the folder the recipe names for it.

Data files name other files: a COCO ``file_name`` (joined to ``<split>/images``), a pool list's lines and a
precomputed pool's ``paths.txt`` (relative to their own folder), a symlink inside a split or pool folder, a mask
in ``study.oracle``.  A third party's annotation file that says ``../../../../etc/passwd`` must not make a build
open that file, nor train on an image outside the data set, nor tell by its error whether such a file exists.
So every named path is checked against its own folder and the recipe's ``data.roots`` (the folders a user keeps
images in elsewhere, named explicitly), after resolving ``..`` and symlinks, before anything opens it.  A path
outside them is refused with the data file, the entries that name it and the folders allowed; the refusal reads
the same whether the file exists or not.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence, Tuple

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["DataRoots", "refuse_outside", "is_under", "source_folders"]

_SHOWN = 5  # entries a refusal lists before "and N more"


def _norm(path: str | Path) -> str:
    return os.path.normpath(os.path.abspath(os.path.expanduser(str(path))))


def is_under(path: str, folder: str) -> bool:
    """Whether normalised ``path`` is ``folder`` or lies below it, by spelling alone."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def source_folders(sources: Sequence[str]) -> List[str]:
    """The folders data sources lie in, once each: a folder itself, a file's (a pool list, a tar shard) own folder
    and a glob's: what a recipe names in ``data.roots`` for files linked to them."""
    return list(dict.fromkeys(s if os.path.isdir(s) else os.path.dirname(s) for s in sources))


class DataRoots:
    """The folders one data source may read: its own folder (``own``) and ``extra`` (``data.roots``).

    :meth:`admits` answers from the path's spelling first, so a path that is outside by its spelling is refused
    without a single call on the file system; one inside by its spelling is then resolved (symlinks), and must
    still be inside once resolved.
    """

    def __init__(self, own: str | Path, extra: Sequence[str | Path] = ()):
        folders = [own, *extra]
        self.spelled = [_norm(f) for f in folders]
        self.real = [os.path.realpath(f) for f in self.spelled]
        self.names = list(dict.fromkeys(str(f) for f in folders))

    def admits(self, path: str | Path) -> bool:
        try:
            p = _norm(path)
            if not any(is_under(p, f) for f in self.spelled + self.real):
                return False
            real = os.path.realpath(p)
        except (ValueError, OSError):  # a NUL byte, a name the system cannot hold: nothing to read there
            return False
        return any(is_under(real, f) for f in self.real)

    def check_links(self, folder: str | Path, files: Sequence[str | Path]) -> None:
        """Refuse the symlinks among ``files`` (in ``folder``: the files a reader found, the folders its walk
        starts from) that lead outside.  A walk (``rglob``) follows the folder it starts from but no symlinked
        folder below it, so those are the links a reader would follow; each is read, never opened.

        Raises:
            ToolchainError: :func:`refuse_outside` for the links that lead outside.
        """
        links = [(os.path.relpath(f, folder), os.readlink(f)) for f in files
                 if os.path.islink(f) and not self.admits(f)]
        refuse_outside(folder, links, self, links=True)


def refuse_outside(data_file: str | Path, outside: Sequence[Tuple[str, str]], roots: DataRoots,
                   links: bool = False) -> None:
    """Raise the refusal for the ``outside`` entries (where, path as written) of ``data_file``, if there are
    any; ``links``: the entries are symlinks found in the folder ``data_file`` (their targets as written).

    Raises:
        ToolchainError: naming the data file, the entries, the folders allowed and the fix.
    """
    if not outside:
        return
    shown = "; ".join(f"{where}: '{path}'" for where, path in outside[:_SHOWN])
    more = f"; and {len(outside) - _SHOWN} more" if len(outside) > _SHOWN else ""
    allowed = " or ".join(f"'{f}'" for f in roots.names)
    n, s = len(outside), "s" * (len(outside) != 1)
    what = f"holds {n} symlink{s} that lead{'s' * (n == 1)}" if links else f"names {n} path{s}"
    raise ToolchainError(
        f"'{data_file}' {what} outside {allowed}, where its files "
        f"must be (after resolving '..' and symlinks): {shown}{more}. Nothing was opened. A data file only reads "
        f"inside the folders the recipe names: move the files there, or, if they are meant to come from "
        f"elsewhere, add the folder that holds them to data.roots (e.g. data.roots: [/data/images])")
