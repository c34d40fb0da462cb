"""Every benchmark command README.md and docs/ show still runs, at a tiny size (a change that breaks one fails here).

Each runs as the docs show it, ``python -m benchmarks.<name> ARGS`` from the checkout's root (the benchmarks live
beside the package, not in the wheel), through ``runpy`` as ``-m`` does, inside this test process: a process of
its own would spend 7-8 s of a 2-core machine importing torch, timm and PEFT again before each.  The numbers are
not judged (they are meaningless at this size), only that the script runs to its table.  ``benchmarks.store_bench``
runs in a process of its own, the documented command verbatim, in tests/test_hostile_store.py.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import shared_data_or_skip, tiny_recipe

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch, capsys):
    """``bench(name, *args, cwd=REPO)`` runs ``python -m benchmarks.<name> *args`` and returns what it printed."""
    def run(name: str, *args: str, cwd: Path = REPO) -> str:
        monkeypatch.chdir(cwd)
        monkeypatch.syspath_prepend(str(REPO))  # as from the checkout's root, wherever cwd is
        monkeypatch.setattr(sys, "argv", [name, *args])
        code = 0
        try:
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)
        except SystemExit as exit_:  # argparse's errors and sys.exit(n) end a command-line run
            code = exit_.code
        printed = capsys.readouterr()
        assert code in (None, 0) and "Traceback" not in printed.err, (printed.out + printed.err)[-4000:]
        return printed.out
    return run


def test_export_bench(bench, tmp_path):
    # the ONNX rows only: the on-device formats' exports are tests/test_edge_formats.py's, and cost minutes here
    out = bench("export_bench", "--students", "mobilevitv2_050", "--size", "32", "--rounds", "1", "--no-coreml",
                "--formats", "onnx", "onnx_int8", "--json", str(tmp_path / "rows.json"))
    assert "| mobilevitv2_050 |" in out and (tmp_path / "rows.json").is_file()
    assert "n/a (not asked for (--formats))" in out


def test_export_bench_times_a_detector_per_head_norm(bench, tmp_path):
    import json

    out = bench("export_bench", "--students", "fastvit_t8", "--detection", "3", "--head-norm", "group", "batch",
                "--size", "64", "96", "--rounds", "1", "--formats", "onnx", "--json", str(tmp_path / "rows.json"))
    assert "| fastvit_t8 (group head) |" in out and "| fastvit_t8 (batch head) |" in out and "64x96 px" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["image_size"] for r in rows] == [[64, 96], [64, 96]] and all("ORT fp32" in r["p50_ms"] for r in rows)
    assert all(r["max_fold_deviation"] < 1e-3 for r in rows)


def test_search_bench(bench, tmp_path):
    out = bench("search_bench", "--pool", "3000", "--dim", "16", "--queries", "50", "--tune-queries", "20",
                "--k", "5", "--centres", "8", "--exact-max", "1000", "--workdir", str(tmp_path))
    assert "recall" in out.lower()


def test_teacher_cache_bench(bench, tmp_path):
    out = bench("teacher_cache_bench", "--teacher", "timm:vit_tiny_patch16_224", "--teacher-size", "32",
                "--student", "mobilevitv2_050", "--student-size", "32", "--pool", "16", "--epochs", "1",
                "--views", "1", "--work", str(tmp_path))
    assert "caching speed-up" in out


def test_compare_adapters(bench, tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task, **{"teacher.epochs": 1})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = bench("compare_adapters", str(path), "linear", "lora", cwd=tmp_path)
    assert "| `linear` |" in out and "| `lora` |" in out


@pytest.mark.shared_data
def test_selection_bench(bench, tmp_path):
    data = shared_data_or_skip()
    # each strategy, at each seed, is a logistic-regression fit of seconds
    out = bench("selection_bench", "--data", str(data), "--limit", "120", "--seeds", "0", "--image-size", "32",
                "--strategies", "random", "uncertainty+typicality", "--work", str(tmp_path))
    assert "| + 10 per class: uncertainty+typicality |" in out and "25 -> 35 labels per class" in out


@pytest.mark.shared_data
def test_selection_seg_bench(bench, tmp_path):
    data = shared_data_or_skip()
    out = bench("selection_seg_bench", "--data", str(data), "--limit", "30", "--seeds", "0", "--image-size", "64", "96",
                "--steps", "5", "--add", "6")
    assert "| + 6: uncertainty+typicality |" in out and "40 -> 46 labeled images" in out
    assert "| + 6: uncertainty+typicality,true_classes |" in out


@pytest.mark.shared_data
def test_curation_bench(bench, tmp_path):
    data = shared_data_or_skip()
    out = bench("curation_bench", "--data", str(data), "--limit", "60", "--budgets", "20", "--image-size", "32",
                "--work", str(tmp_path))
    assert "| 20 | query_balanced_image |" in out
