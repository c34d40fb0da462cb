"""The floors follow the pipeline: core < data < toolchain < blocks < teachers < students < export < bench.

An area may import its own floor and the floors below it, never one above (issue 37): a student that imports
the bench, or an export format that imports a bench runtime, ties two floors into one and every change to
either into both.  ``core/`` (errors, registries, progress, atomic files) and ``data/`` (the readers) sit under the
orchestrator, so a reader never reaches for a stage or the store.  The command line (``toolchain/cli.py``) and the Python API (``toolchain/api.py``) sit on top of everything
and are excepted.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["core", "data", "toolchain", "blocks", "teachers", "students", "export", "bench"]
EXCEPTED = {"toolchain/cli.py", "toolchain/api.py"}  # the top of the house: they call every area

PACKAGE = "vfm_toolchain"  # the one import name: toolchain/ is the package, each area folder beneath it


def _imports(path: Path, rel: str):
    """(module, line) of every absolute import in a file."""
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def floor_of(module: str):
    """The floor a module of ours lives on, or None for anyone else's."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS and parts[1] != "toolchain" else "toolchain"


def upward_imports() -> List[Tuple[str, str, int]]:
    rank = {name: i for i, name in enumerate(FLOORS)}
    found = []
    for floor in FLOORS:
        for f in sorted((REPO / floor).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel in EXCEPTED:
                continue
            for m, line in _imports(f, rel):
                target = floor_of(m)
                if target is not None and rank[target] > rank[floor]:
                    found.append((rel, m, line))
    return found


def test_no_import_points_up_the_pipeline():
    found = upward_imports()
    assert not found, "imports that point up the pipeline (" + " < ".join(FLOORS) + "):\n" + \
        "\n".join(f"  {f}:{line} imports {m}" for f, m, line in found)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The parser finds what it must: a students file importing the bench."""
    import tests.test_layers as layers

    for floor in FLOORS:
        (tmp_path / floor).mkdir()
    (tmp_path / "students" / "bad.py").write_text("import numpy\nfrom vfm_toolchain.bench.select import choose\n")
    (tmp_path / "bench" / "fine.py").write_text("from vfm_toolchain.students.models import STUDENTS\n")
    (tmp_path / "teachers" / "fine.py").write_text("from vfm_toolchain.core.registry import Registry\n")
    monkeypatch.setattr(layers, "REPO", tmp_path)
    assert layers.upward_imports() == [("students/bad.py", "vfm_toolchain.bench.select", 2)]


def test_everything_imports_our_code_by_its_one_name():
    """A bare ``import export`` or ``from bench.x import`` works in a checkout (the folders are on the path) but not
    from the wheel, and beside ``vfm_toolchain.export`` it would load a second copy with registries of its own."""
    bare = []
    for folder in (*FLOORS, "tests", "benchmarks"):
        for f in sorted((REPO / folder).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            bare += [f"  {rel}:{line} imports {m}" for m, line in _imports(f, rel) if m.split(".")[0] in FLOORS]
    assert not bare, f"import our code as {PACKAGE}.<area> (or {PACKAGE} for toolchain/):\n" + "\n".join(bare)
