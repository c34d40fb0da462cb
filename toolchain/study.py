"""The label-efficiency study: every method at every label budget, repeated over seeds (seed 004 Tables
1-3, accuracy against labels per class; for segmentation, mIoU against labeled images).

Each (method, budget, seed) is an ordinary build of the recipe with a few fields changed, sharing one
store: the label subset and the teacher of a (budget, seed) are built once and reused by every method
that needs them, and a killed study resumes with everything finished cached.

    label_only      the student trained on the labels only (student.baseline, no weights)
    imagenet        the student from ImageNet weights, finetuned on the labels (student.baseline)
    task_agnostic   feature distillation from the frozen teacher as the recipe's distill section says,
                    then finetuning (student.finetune)
    task_agnostic_contrastive / task_agnostic_regression
                    the same on the teacher's global features, contrastive (seed 004) or cosine regression
    task_oriented   distillation of the finetuned teacher's predictions, then finetuning

With ``tracking.mlflow`` (or ``--track``) the study is an MLflow parent run and each build a run nested in it.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from vfm_toolchain.errors import ToolchainError
from vfm_toolchain.recipe import Recipe, recipe_to_dict
from vfm_toolchain.tracking import StudyTracker
from vfm_toolchain.store import atomic_write, atomic_write_bytes, atomic_write_json

__all__ = ["run_study", "METHODS"]

log = logging.getLogger("toolchain.study")

# method -> (the stage whose test metric is the result, recipe fields it sets)
METHODS: Dict[str, Any] = {
    "label_only": ("student.baseline", lambda s: {"student.weights": "none", "baseline.enabled": True}),
    "imagenet": ("student.baseline", lambda s: {"student.weights": s.imagenet_weights, "baseline.enabled": True}),
    "task_agnostic": ("student.finetune", lambda s: {"distill.mode": "task_agnostic"}),
    "task_agnostic_contrastive": ("student.finetune", lambda s: {"distill.mode": "task_agnostic", "distill.features":
                                                                 "global", "distill.feature_loss": "contrastive"}),
    "task_agnostic_regression": ("student.finetune", lambda s: {"distill.mode": "task_agnostic", "distill.features":
                                                                "global", "distill.feature_loss": "cosine"}),
    "task_oriented": ("student.finetune", lambda s: {"distill.mode": "task_oriented"}),
}


def _variant(recipe: Recipe, fields: Dict[str, Any]) -> Recipe:
    raw = recipe_to_dict(recipe)
    for key, value in fields.items():
        node = raw
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return Recipe.model_validate(raw)


def run_study(recipe: Recipe, out_dir: Path, store_root: Path) -> Dict[str, Any]:
    """Run every (method, budget, seed) build and write ``study.json``, ``study.md`` and ``study.png``."""
    st = recipe.study
    if not st.budgets:
        raise ToolchainError("study.budgets is empty; list labels per class, e.g. study: {budgets: [5, 10, 25]}")
    out_dir = Path(out_dir)
    with StudyTracker(recipe, out_dir) as tracker:
        return _run_study(recipe, out_dir, store_root, tracker)


def _run_study(recipe: Recipe, out_dir: Path, store_root: Path, tracker: StudyTracker) -> Dict[str, Any]:
    from vfm_toolchain.runner import build

    from vfm_toolchain.plugins import load_plugins
    from vfm_toolchain.stage import RECIPE_CHECKS

    st = recipe.study
    load_plugins()
    for method in st.methods:  # a method this task cannot take fails now, not after the methods before it ran
        variant = _variant(recipe, {**METHODS[method][1](st), "data.labeled_per_class": st.budgets[0]})
        try:
            for check in RECIPE_CHECKS:
                check(variant)
        except ToolchainError as exc:
            raise ToolchainError(f"study method {method}: {exc} (drop it from study.methods)") from None
    rows: List[Dict[str, Any]] = []
    for budget in st.budgets:
        for seed in st.seeds:
            for method in st.methods:
                stage, fields = METHODS[method]
                variant = _variant(recipe, {**fields(st), "seed": seed, "data.labeled_per_class": budget,
                                            "name": f"{recipe.name}_{method}_b{budget}_s{seed}",
                                            **tracker.member_fields()})
                log.info("study: %s, %d labels per class, seed %d", method, budget, seed)
                build_dir = out_dir / "builds" / variant.name
                record = build(variant, build_dir, store_root, only=[stage], parent_run=tracker.run_id)
                result = _stage_result(build_dir, stage)
                m = next(k[5:] for k in result["metrics"] if k.startswith("test_"))  # top1, miou or map50
                row = {"method": method, "budget": budget, "seed": seed, "metric": m,
                       "test": result["metrics"][f"test_{m}"], "val": result["metrics"][f"val_{m}"],
                       "seconds": sum(s["seconds"] for s in record["stages"])}
                if stage == "student.finetune":  # a distilled student: the step before its finetune, and the
                    # teacher whose predictions it learnt (a task-agnostic student learnt a frozen model's features)
                    upstream = {"distilled": "student.distill"}
                    if variant.distill.mode == "task_oriented":
                        upstream["teacher"] = "teacher.finetune"
                    for key, name in upstream.items():
                        row[f"{key}_test"] = _stage_result(build_dir, name)["metrics"][f"test_{m}"]
                rows.append(row)
                atomic_write_json(out_dir / "study.json", {"recipe": recipe.name, "rows": rows})
    table = summarize(rows)
    atomic_write_json(out_dir / "study.json", {"recipe": recipe.name, "rows": rows, "summary": table})
    # what a budget counts: labels per class; for segmentation labeled images; for detection images per class
    label, unit = {"miou": ("mIoU", "labeled images"), "map50": ("mAP50", "images per class")}.get(
        rows[0]["metric"], ("top-1", "labels per class"))
    md = study_markdown(recipe.name, table, st.budgets, label, unit) + against_teacher_markdown(rows, label)
    atomic_write_bytes(out_dir / "study.md", md.encode())
    plot_study(out_dir / "study.png", table, st.budgets, label, unit)
    tracker.summary(table)
    return {"rows": rows, "summary": table}


def _stage_result(build_dir: Path, stage: str) -> Dict[str, Any]:
    """A stage's result.json in a finished build (every stage it ran or reused is linked under stages/)."""
    import json

    return json.loads((build_dir / "stages" / stage / "result.json").read_text())


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Dict[int, Dict[str, float]]]:
    """method -> budget -> {mean, std, n} of the test metric over seeds (std with n - 1; 0 for one seed)."""
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    for r in rows:
        out.setdefault(r["method"], {}).setdefault(r["budget"], []).append(r["test"])
    return {m: {b: {"mean": float(np.mean(v)), "std": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, "n": len(v)}
                for b, v in by_budget.items()} for m, by_budget in out.items()}


def study_markdown(name: str, table, budgets: List[int], label: str = "top-1", unit: str = "labels per class") -> str:
    column = (lambda b: f"{b} / class") if unit == "labels per class" else (lambda b: f"{b} {unit}")
    L = [f"# Label efficiency: {name}", "", f"Test {label} (%), mean ± std over seeds.", "",
         "| method | " + " | ".join(column(b) for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method, by_budget in table.items():
        cells = [f"{100 * c['mean']:.1f} ± {100 * c['std']:.1f} (n={c['n']})" if (c := by_budget.get(b)) else ""
                 for b in budgets]
        L.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(L + ["", f"![{label} against {unit}](study.png)", ""])


def against_teacher_markdown(rows: List[Dict[str, Any]], label: str = "top-1") -> str:
    """Each distilled student beside its own teacher (seed 004's claim is that it reaches it), and how often it does."""
    pairs = [r for r in rows if r.get("teacher_test") is not None]
    if not pairs:
        return ""
    L = ["", "## Distilled students against their own teacher", "",
         f"Test {label} (%) of the same build's teacher, the student right after distillation and after its finetune.",
         "", "| method | budget | seed | teacher | distilled | distilled + finetune | student - teacher |",
         "|---|---|---|---|---|---|---|"]
    pct = lambda v: f"{100 * v:.2f}"
    for r in pairs:
        L.append(f"| {r['method']} | {r['budget']} | {r['seed']} | {pct(r['teacher_test'])} | "
                 f"{pct(r['distilled_test'])} | {pct(r['test'])} | {100 * (r['test'] - r['teacher_test']):+.2f} |")
    reached = sum(r["test"] >= r["teacher_test"] for r in pairs)
    return "\n".join(L + ["", f"At or above its teacher after finetune: {reached} of {len(pairs)}.", ""])


def plot_study(path: Path, table, budgets: List[int], label: str = "top-1", unit: str = "labels per class") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for method, by_budget in table.items():
        bs = [b for b in budgets if b in by_budget]
        ax.errorbar(bs, [100 * by_budget[b]["mean"] for b in bs], yerr=[100 * by_budget[b]["std"] for b in bs],
                    marker="o", capsize=3, label=method)
    ax.set_xscale("log")
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel(unit)
    ax.set_ylabel(f"test {label} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
