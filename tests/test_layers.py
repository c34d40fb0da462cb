"""The floors follow the pipeline: toolchain < teachers < students < export < bench.

An area may import its own floor and the floors below it, never one above (issue 37): a student that imports
the bench, or an export format that imports a bench runtime, ties two floors into one and every change to
either into both.  The command line (``toolchain/cli.py``) and the Python API (``toolchain/api.py``) sit on top of everything
and are excepted.

``KNOWN_UPWARD`` lists the imports that still point up, each with what removes it; the test fails on any new
one, and on a listed one that is gone (so the list only shrinks).
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["toolchain", "teachers", "students", "export", "bench"]
EXCEPTED = {"toolchain/cli.py", "toolchain/api.py"}  # the top of the house: they call every area

# (file, module it imports): imports that still point up, each with what removes it; empty since the runtimes became
# one layer below export (issue 37)
KNOWN_UPWARD: set = set()


def upward_imports() -> List[Tuple[str, str, int]]:
    rank = {name: i for i, name in enumerate(FLOORS)}
    found = []
    for floor in FLOORS:
        for f in sorted((REPO / floor).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if rel in EXCEPTED:
                continue
            for node in ast.walk(ast.parse(f.read_text(), rel)):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for m in modules:
                    top = m.split(".")[0]
                    if top in rank and rank[top] > rank[floor]:
                        found.append((rel, m, node.lineno))
    return found


def test_no_import_points_up_the_pipeline():
    found = upward_imports()
    new = sorted({(f, m) for f, m, _ in found} - KNOWN_UPWARD)
    assert not new, "imports that point up the pipeline (toolchain < teachers < students < export < bench):\n" + \
        "\n".join(f"  {f}:{line} imports {m}" for f, m, line in found if (f, m) in new)
    gone = sorted(KNOWN_UPWARD - {(f, m) for f, m, _ in found})
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD: {gone}"


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The parser finds what it must: a students file importing the bench."""
    import tests.test_layers as layers

    for floor in FLOORS:
        (tmp_path / floor).mkdir()
    (tmp_path / "students" / "bad.py").write_text("import numpy\nfrom bench.select import choose\n")
    (tmp_path / "bench" / "fine.py").write_text("from students.models import STUDENTS\n")
    monkeypatch.setattr(layers, "REPO", tmp_path)
    assert layers.upward_imports() == [("students/bad.py", "bench.select", 2)]
