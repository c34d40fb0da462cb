"""Stages own their report sections (issue 37): a stage added to the build brings its part of the report with it,
and bench/report.py only assembles, knowing no stage's result."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import tiny_recipe
from vfm_toolchain.plugins import load_plugins
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.stage import (PIPELINE, STAGES, ReportSection, Score, Stage, StageContext, StageOutput,
                             register_stage)

REPO = Path(__file__).resolve().parents[1]
load_plugins()


class Dummy(Stage):
    """A stage the report has never heard of, with something to say in every part of the report."""

    name = "test.dummy"
    inputs = ("data.prepare",)

    def config(self, recipe):
        return {}

    def run(self, ctx):
        return {}

    def report(self, out, build):
        return ReportSection(title="Dummy findings", lines=[f"The dummy counted {out.result['count']} things.", "",
                                                            "![figure](dummy_figure.png)"],
                             summary=["dummy: counted things"], scores=[Score("dummy_top1", "dummy model", 0.5)],
                             findings=["The dummy finds things."], warnings=["the dummy warns"],
                             files={"dummy_figure.png": "figure.png"}, record={"dummy": {"count": out.result["count"]}})


@pytest.fixture
def dummy():
    register_stage(Dummy)
    yield Dummy
    STAGES.unregister(Dummy.name)


def _output(tmp_path: Path, name: str, result: dict) -> StageOutput:
    folder = tmp_path / "store" / name
    folder.mkdir(parents=True)
    return StageOutput(name, "k", folder, result)


@pytest.mark.parametrize("after", ["data.prepare", "student.select"])
def test_a_new_stage_appears_in_pipeline_order_without_touching_the_report(dummy, after, tiny_task, tmp_path):
    from vfm_toolchain.bench.report import Report

    pipeline = list(PIPELINE)
    pipeline.insert(pipeline.index(after) + 1, Dummy.name)  # how an area adds a stage to the build
    outputs = {
        "data.prepare": _output(tmp_path, "data.prepare", {
            "classes": ["a", "b"], "task": "classification", "counts": {"train": 4, "val": 2, "test": 2, "pool": 8},
            "corrupt": {"train": 0, "val": 0, "test": 0, "pool": 0}, "warnings": []}),
        "student.select": _output(tmp_path, "student.select", {
            "chosen": "small", "rule": "most MACs within budget", "budget_ms": 5.0, "stat": "p50", "target": "onnx",
            "device": None, "image_size": 32,
            "candidates": [{"name": "small", "status": "ok", "family": "f", "params": 1e6, "macs": 2e6,
                            "p50_ms": 1.0, "p90_ms": 1.2, "chosen": True, "why": "most MACs within budget"}]}),
        Dummy.name: _output(tmp_path, Dummy.name, {"count": 3, "warnings": ["a warning of the dummy's result"]}),
    }
    (outputs[Dummy.name].dir / "figure.png").write_bytes(b"png")
    history = [{"name": n, "status": "ran" if n in outputs else "skipped", "seconds": 1.0,
                "reason": None if n in outputs else "not in this test"} for n in pipeline]
    history[-1]["status"] = "running"  # the report, at work
    ctx = StageContext(recipe=recipe_from_dict(tiny_recipe(tiny_task)), workdir=tmp_path / "report",
                       inputs={n: outputs.get(n) for n in pipeline if n != "report"}, log=logging.getLogger("test"),
                       history=history)
    ctx.workdir.mkdir()
    result = Report().run(ctx)
    md = (ctx.workdir / "report.md").read_text()

    titles = [line for line in md.splitlines() if line.startswith("## ")]
    own = ["## Student selection", "## Dummy findings"]
    assert [t for t in titles if t in own] == (own[::-1] if after == "data.prepare" else own)
    assert md.index("- data: {'train': 4") < md.index("- dummy: counted things") < md.index("## Accuracy")
    assert "| dummy model | 50.0% |" in md and "The dummy finds things." in md
    assert "The dummy counted 3 things." in md and "| test.dummy | ran | 1.0 |  |" in md
    assert "- a warning of the dummy's result\n- the dummy warns" in md
    assert result["metrics"] == {"dummy_top1": 0.5} and result["dummy"] == {"count": 3}
    assert result["data"] == {"counts": {"train": 4, "val": 2, "test": 2, "pool": 8},
                              "corrupt": {"train": 0, "val": 0, "test": 0, "pool": 0}}
    assert "dummy_figure.png" in result["publish"] and (ctx.workdir / "dummy_figure.png").read_bytes() == b"png"


def test_a_stage_that_rewords_its_section_rebuilds_the_report(dummy, monkeypatch):
    from vfm_toolchain.bench.report import Report

    before = Report().version
    monkeypatch.setattr(Dummy, "report_version", "2")
    assert Report().version != before


def test_the_report_holds_no_stage_result_keys_or_wording():
    """What moved into the stages' own files (their result keys, stage names and sentences) stays there."""
    source = (REPO / "bench" / "report.py").read_text()
    moved = ["teacher_outputs", "sweep", "Gramian", "from_pool_root", "embed_images_per_s", "per_query_mean",
             "parity_max_abs_diff", "layers_fp32", "opset_written", "folds", "unavailable", "unfolded", "corrupt",
             "trainable_params", "student_distilled_", "Fold passes", "near-duplicates", "Student selection"]
    moved += [n for n in PIPELINE if n != "report"]
    assert [k for k in moved if k in source] == []
