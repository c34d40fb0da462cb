"""The label-efficiency study: builds per (method, budget, seed) in one store, the table and the plot."""
import json

import pytest
import torch
from safetensors.torch import save_file

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.students.models import create_student
from vfm_toolchain.study import run_study, summarize

from conftest import THREADS, tiny_recipe


def test_summary_is_mean_and_sample_std_over_seeds():
    rows = [{"method": "a", "budget": 5, "seed": s, "test": v} for s, v in enumerate([0.5, 0.7])]
    rows.append({"method": "a", "budget": 10, "seed": 0, "test": 0.9})
    t = summarize(rows)
    assert t["a"][5]["mean"] == pytest.approx(0.6) and t["a"][5]["std"] == pytest.approx(0.1414, abs=1e-3)
    assert t["a"][10] == {"mean": 0.9, "std": 0.0, "n": 1}


def test_study_runs_every_method_budget_and_seed(tiny_task, tmp_path):
    torch.manual_seed(1)  # "ImageNet" weights: a checkpoint the test writes (no downloads here)
    weights = tmp_path / "imagenet_student.safetensors"
    save_file(create_student("mobilevitv2_050", 1000).state_dict(), str(weights))
    raw = tiny_recipe(tiny_task, **{"teacher.epochs": 1, "distill.epochs": 1, "export.formats": [],
                                    "bench.runtimes": [],
                                    "study": {"budgets": [2, 4], "seeds": [0, 1],
                                              "methods": ["label_only", "imagenet", "task_oriented"],
                                              "imagenet_weights": str(weights)}})
    result = run_study(recipe_from_dict(raw), tmp_path / "study", tmp_path / "store")
    assert len(result["rows"]) == 2 * 2 * 3
    table = result["summary"]
    assert set(table) == {"label_only", "imagenet", "task_oriented"} and set(table["imagenet"]) == {2, 4}
    assert all(c["n"] == 2 for by_budget in table.values() for c in by_budget.values())
    md = (tmp_path / "study" / "study.md").read_text()
    assert "| imagenet |" in md and "2 / class" in md and (tmp_path / "study" / "study.png").stat().st_size > 0
    # each distilled student is shown beside its own teacher: the numbers of that build's stages
    for r in result["rows"]:
        build = tmp_path / "study" / "builds" / f"tiny_{r['method']}_b{r['budget']}_s{r['seed']}" / "stages"
        if r["method"] != "task_oriented":
            assert "teacher_test" not in r
            continue
        stage_test = {s: json.loads((build / s / "result.json").read_text())["metrics"]["test_top1"]
                      for s in ("teacher.finetune", "student.distill")}
        assert (r["teacher_test"], r["distilled_test"]) == (stage_test["teacher.finetune"], stage_test["student.distill"])
        assert f"| task_oriented | {r['budget']} | {r['seed']} | {100 * r['teacher_test']:.2f} |" in md
    reached = sum(r["test"] >= r["teacher_test"] for r in result["rows"] if r["method"] == "task_oriented")
    assert f"At or above its teacher after finetune: {reached} of 4." in md
    # the label subsets differ by budget: 2 and 4 labels per class of 3 classes
    counts = {b: json.loads((tmp_path / "study" / "builds" / f"tiny_label_only_b{b}_s0" / "stages" / "data.prepare"
                             / "result.json").read_text())["counts"]["train"] for b in (2, 4)}
    assert counts == {2: 6, 4: 12}


def test_selection_axis_grows_the_labels_with_random_and_active_choices(tiny_task, tmp_path):
    """study.selection: from 2 to 4 labels per class, 6 pool images are chosen at random or by label-next on the
    2-label build, labeled from the oracle (pool_labels.csv: a distractor is chosen but labels nothing), and the
    grown builds train on the 6 base labels plus the revealed ones, with the base val kept."""
    from pathlib import Path

    oracle = Path(tiny_task["train"]).parent / "pool_labels.csv"
    raw = tiny_recipe(tiny_task, **{"teacher.epochs": 1, "distill.epochs": 1, "finetune.epochs": 1,
                                    "study": {"budgets": [2, 4], "seeds": [0], "methods": ["task_oriented"],
                                              "selection": ["random", "active"], "oracle": str(oracle)}})
    result = run_study(recipe_from_dict(raw), tmp_path / "study", tmp_path / "store")
    rows = {(r["budget"], r.get("selection")): r for r in result["rows"]}
    assert set(rows) == {(2, None), (4, "random"), (4, "active")}
    builds = tmp_path / "study" / "builds"
    base = json.loads((builds / "tiny_task_oriented_b2_s0" / "stages" / "data.prepare" / "index.json").read_text())
    for sel in ("random", "active"):
        r = rows[(4, sel)]
        assert r["chosen"] == 6 and r["added"] + r["without_label"] == 6
        index = json.loads((builds / f"tiny_task_oriented_{sel}_b4_s0" / "stages" / "data.prepare" / "index.json")
                           .read_text())
        assert len(index["train"]) == 6 + r["added"] and len(index["val"]) == len(base["val"])
        assert sorted((str(Path(p).resolve()), y) for p, y in index["val"]) == \
            sorted((str(Path(p).resolve()), y) for p, y in base["val"])  # links to the same labeled images
    ranked = (tmp_path / "study" / "labels" / "active_b4_s0_choice" / "label_next.csv").read_text()
    assert ranked.count(",chosen,") == 6
    table = result["summary"]
    assert set(table) == {"task_oriented", "task_oriented, random", "task_oriented, active"}
    assert set(table["task_oriented, active"]) == {2, 4}  # the shared first budget starts both lines
    md = (tmp_path / "study" / "study.md").read_text()
    assert "## What labeling the chosen images buys" in md
    diff = 100 * (rows[(4, "active")]["test"] - rows[(4, "random")]["test"])
    assert f"| task_oriented | 4 | {100 * rows[(4, 'random')]['test']:.2f} | " in md and f"{diff:+.2f} | 1 |" in md


def test_selection_axis_says_what_it_needs(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task, **{"study": {"budgets": [2, 4], "seeds": [0], "methods": ["label_only"],
                                              "selection": ["active"], "oracle": str(tmp_path)}})
    with pytest.raises(ToolchainError, match="must be a csv of file,label"):
        run_study(recipe_from_dict(raw), tmp_path / "s", tmp_path / "store")
    raw["study"]["oracle"] = str(__import__("pathlib").Path(tiny_task["train"]).parent / "pool_labels.csv")
    with pytest.raises(ToolchainError, match="add task_oriented"):
        run_study(recipe_from_dict(raw), tmp_path / "s", tmp_path / "store")
    raw["study"].update(budgets=[4, 2], methods=["task_oriented"])
    with pytest.raises(ToolchainError, match="two or more, increasing"):
        run_study(recipe_from_dict(raw), tmp_path / "s", tmp_path / "store")


def test_study_without_budgets_says_what_to_add(tiny_task, tmp_path):
    with pytest.raises(ToolchainError, match="study.budgets"):
        run_study(recipe_from_dict(tiny_recipe(tiny_task)), tmp_path / "s", tmp_path / "store")


def test_segmentation_study_scores_miou_per_method_and_labeled_images(tmp_path):
    from vfm_toolchain.data.synthetic import generate_segmentation_task

    seg = generate_segmentation_task(tmp_path / "seg", 2, 8, 3, 3, 16, 0, 32, 0)
    raw = {"name": "seg", "threads": THREADS,
           "data": {"task": "segmentation", **{k: seg[k] for k in ("train", "val", "test", "pools")}},
           "teacher": {"name": "timm:vit_tiny_patch16_224", "weights": "none", "image_size": 32,
                       "adapter": {"name": "lora", "r": 4, "alpha": 8}, "epochs": 1, "batch_size": 4},
           "curate": {"strategy": "query_balanced_image", "budget": 12},
           "student": {"name": "mobilevitv2_050", "image_size": 32},
           "distill": {"epochs": 1, "batch_size": 8, "views": 1},
           "finetune": {"epochs": 1, "batch_size": 4}, "baseline": {"epochs": 1},
           "export": {"formats": []}, "bench": {"runtimes": []},
           "study": {"budgets": [4], "seeds": [0], "methods": ["label_only", "task_oriented"]}}
    result = run_study(recipe_from_dict(raw), tmp_path / "study", tmp_path / "store")
    assert {(r["method"], r["budget"]) for r in result["rows"]} == {("label_only", 4), ("task_oriented", 4)}
    assert all(r["metric"] == "miou" and 0 <= r["test"] <= 1 for r in result["rows"])
    md = (tmp_path / "study" / "study.md").read_text()
    assert "Test mIoU" in md and "| 4 labeled images |" in md
    prepared = tmp_path / "study" / "builds" / "seg_label_only_b4_s0" / "stages" / "data.prepare" / "result.json"
    assert json.loads(prepared.read_text())["counts"]["train"] == 4  # labeled images, not 4 per class (of 3)
