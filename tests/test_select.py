"""``student.name: auto``: candidates timed on the target before training, the rule applied to a budget, the
latency cache shared across recipes, and a device's results file as the target."""
import json
import math
import subprocess
import sys

import pytest

from vfm_toolchain.bench.select import choose, measure_candidates, write_candidate_bundle
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build
from vfm_toolchain.store import ArtifactStore

from conftest import tiny_recipe

SMALL, LARGE = "timm:test_efficientnet", "timm:resnet18"  # 2.3 M vs 37 M MACs at 32 px


def _auto(task, **overrides):
    return tiny_recipe(task, **{"student.name": "auto", "student.candidates": [SMALL, LARGE],
                                "student.budget_ms": 1000.0, "bench.iters": 20, "bench.warmup": 3, **overrides})


def _measure(raw, store):
    import logging

    r = recipe_from_dict(raw)
    return {x["name"]: x for x in measure_candidates(r, r.student.candidates, 3, "classification",
                                                      ArtifactStore(store).shared_dir() / "candidate_latency",
                                                      logging.getLogger("test"))}


def test_the_budget_excludes_the_larger_candidate_and_the_timings_are_reused(tiny_task, tmp_path):
    raw = _auto(tiny_task)
    rows = _measure(raw, tmp_path / "s")  # what `toolchain candidates` prints, into the store's latency cache
    assert all(x["status"] == "ok" and x["macs"] > 0 and x["params"] > 0 for x in rows.values())
    small, large = rows[SMALL]["p50_ms"], rows[LARGE]["p50_ms"]
    if large <= small * 1.5:
        pytest.skip(f"this machine is too busy to tell the candidates apart (p50 {small:.3f} vs {large:.3f} ms)")

    raw["student"]["budget_ms"] = math.sqrt(small * large)  # the small one fits, the large one does not
    build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["student.baseline"])
    select = json.loads((tmp_path / "o" / "stages" / "student.select" / "result.json").read_text())
    assert select["chosen"] == SMALL
    by_name = {c["name"]: c for c in select["candidates"]}
    assert by_name[LARGE]["why"].startswith("over budget") and not by_name[LARGE]["chosen"]
    # a second recipe on this target measures nothing again (an unstable timing is not kept: measured anew)
    assert all(c.get("cached") for c in select["candidates"] if not rows[c["name"]].get("unstable"))
    spec = json.loads((tmp_path / "o" / "stages" / "student.baseline" / "model" / "spec.json").read_text())
    assert spec["name"] == SMALL  # the stages after the choice train the chosen one
    from vfm_toolchain.bench.select import StudentSelect
    from vfm_toolchain.stage import ReportContext, StageOutput

    section = StudentSelect().report(StageOutput("student.select", "", tmp_path, select),
                                     ReportContext(recipe_from_dict(raw), {}))
    report = "\n".join(section.lines)
    assert section.title == "Student selection" and f"| {SMALL} |" in report and "**yes**" in report

    raw["student"]["budget_ms"] = 10 * large  # both fit: the one with more MACs
    build(recipe_from_dict(raw), tmp_path / "o2", tmp_path / "s", only=["student.select"])
    select = json.loads((tmp_path / "o2" / "stages" / "student.select" / "result.json").read_text())
    assert select["chosen"] == LARGE


def test_a_budget_nothing_fits_fails_with_the_fastest_candidate_named(tiny_task, tmp_path):
    raw = _auto(tiny_task, **{"student.budget_ms": 1e-6})
    with pytest.raises(ToolchainError, match="no candidate student fits student.budget_ms 1e-06 .* the fastest"):
        build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["student.select"])
    record = json.loads((tmp_path / "o" / "build.json").read_text())
    assert [s["status"] for s in record["stages"] if s["name"] == "student.select"] == ["failed"]


def test_the_rule_prefers_compute_and_skips_unstable_and_failed_rows():
    rows = [{"name": "a", "status": "ok", "p50_ms": 1.0, "macs": 10, "params": 1},
            {"name": "b", "status": "ok", "p50_ms": 2.0, "macs": 30, "params": 1},
            {"name": "c", "status": "ok", "p50_ms": 1.5, "macs": 50, "params": 1, "unstable": "machine busy"},
            {"name": "d", "status": "failed", "reason": "export failed"},
            {"name": "e", "status": "ok", "p50_ms": 9.0, "macs": 90, "params": 1}]
    assert choose(rows, 3.0, "p50") == "c"  # an unstable row takes part by its p50, and says so
    assert [r["chosen"] for r in rows] == [False, False, True, False, False]
    assert rows[4]["why"].startswith("over budget") and "timing unstable" in rows[2]["why"]
    assert rows[1]["why"] == "within budget, fewer MACs than c" and rows[3]["why"] == "export failed"
    assert choose(rows, 1.2, "p50") == "a"


@pytest.mark.parametrize("student, match", [
    ({"name": "auto"}, "needs student.budget_ms"),
    ({"name": "fastvit_t8", "budget_ms": 5}, "only with student.name: auto"),
    ({"name": "auto", "budget_ms": 5, "weights": "/x/y.safetensors"}, "checkpoint of one architecture"),
])
def test_selection_fields_are_checked(tiny_task, student, match):
    raw = tiny_recipe(tiny_task)
    raw["student"].update(student)
    with pytest.raises(ToolchainError, match=match):
        recipe_from_dict(raw)


def test_unknown_target_and_candidate_fail_before_any_stage(tiny_task, tmp_path):
    with pytest.raises(ToolchainError, match="onnxx"):
        build(recipe_from_dict(_auto(tiny_task, **{"student.target": "onnxx"})), tmp_path / "o", tmp_path / "s")
    with pytest.raises(ToolchainError, match="does not exist"):
        build(recipe_from_dict(_auto(tiny_task, **{"student.target": str(tmp_path / "none.json")})), tmp_path / "o",
              tmp_path / "s")
    with pytest.raises(ToolchainError, match="unknown timm model"):
        build(recipe_from_dict(_auto(tiny_task, **{"student.candidates": ["timm:resnet18", "timm:resnet1888"]})),
              tmp_path / "o", tmp_path / "s")


def test_a_device_results_file_from_the_candidate_bundle_is_a_target(tiny_task, tmp_path):
    import logging

    # test_vit at 32 px resizes its position embedding bicubically, which ONNX opset 17 cannot export
    raw = _auto(tiny_task, **{"student.candidates": [SMALL, LARGE, "timm:test_vit"]})
    bundle = write_candidate_bundle(recipe_from_dict(raw), tmp_path / "bundle", "onnx", None, logging.getLogger("t"))
    spec = json.loads((bundle / "bundle.json").read_text())
    assert [a["model"] for a in spec["artifacts"]] == [SMALL, LARGE]
    assert "Not exported: timm:test_vit" in (bundle / "README.md").read_text()
    assert spec["bench"]["batch_sizes"] == [1] and all(a["macs"] > 0 for a in spec["artifacts"])
    out = subprocess.run([sys.executable, "run_bench.py", "--iters", "5", "--warmup", "1"], cwd=bundle,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads((bundle / "results.json").read_text())
    raw["student"].update(target=str(bundle / "results.json"), budget_ms=1e6)
    build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["student.select"])
    select = json.loads((tmp_path / "o" / "stages" / "student.select" / "result.json").read_text())
    by_name = {c["name"]: c for c in select["candidates"]}
    assert select["chosen"] == LARGE and by_name[LARGE]["runtime"] == "onnxruntime"
    assert by_name[LARGE]["p50_ms"] == next(r["p50_ms"] for r in results["bench"] if r["model"] == LARGE)
    assert by_name["timm:test_vit"]["status"] == "failed" and "not in the device" in by_name["timm:test_vit"]["why"]
    assert select["device"]["machine"]
