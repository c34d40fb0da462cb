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

With ``study.selection`` (``random``, ``active``) the labels grow from the first budget to each next one: the
budget's new labels are pool images chosen at random or by ``label-next`` on the previous budget's distilled
student, their labels revealed from ``study.oracle`` (toolchain/oracle.py), and every method is built again on the
grown set (val stays the first budget's), so the table shows what labeling the chosen images buys.

With ``tracking.mlflow`` (or ``--track``) the study is an MLflow parent run and each build a run nested in it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write, atomic_write_bytes, atomic_write_json
from vfm_toolchain.core.registry import Registry
from vfm_toolchain.core.roots import source_folders
from vfm_toolchain.recipe import Recipe, recipe_to_dict
from vfm_toolchain.tasks import task_of
from vfm_toolchain.tracking import StudyTracker

__all__ = ["run_study", "METHODS", "SELECTIONS"]

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
    from vfm_toolchain.runner import build, check_locations

    from vfm_toolchain.plugins import load_plugins
    from vfm_toolchain.stage import RECIPE_CHECKS, metric_label

    st = recipe.study
    check_locations(out_dir, Path(store_root))
    load_plugins()
    for method in st.methods:  # a method this task cannot take fails now, not after the methods before it ran
        variant = _variant(recipe, {**METHODS[method][1](st), "data.labeled_per_class": st.budgets[0]})
        try:
            for check in RECIPE_CHECKS:
                check(variant)
        except ToolchainError as exc:
            raise ToolchainError(f"study method {method}: {exc} (drop it from study.methods)") from None
    if st.selection:
        _check_selection(recipe)
    rows: List[Dict[str, Any]] = []
    # (selection, seed) -> the build dirs of the previous budget, by method: where the next budget's labels grow from
    previous: Dict[Any, Dict[str, Path]] = {}
    revealed: Dict[Any, set] = {}
    for step, budget in enumerate(st.budgets):
        for seed in st.seeds:
            for selection in (st.selection if step and st.selection else [None]):
                data, grown = {"data.labeled_per_class": budget}, None
                if selection is not None:
                    data, grown = _grow(recipe, selection, seed, st.budgets[step - 1], budget,
                                        previous[("base" if step == 1 else selection, seed)], out_dir, store_root,
                                        revealed)
                suffix = f"_{selection}" if selection else ""
                for method in st.methods:
                    stage, fields = METHODS[method]
                    variant = _variant(recipe, {**fields(st), "seed": seed, **data,
                                                "name": f"{recipe.name}_{method}{suffix}_b{budget}_s{seed}",
                                                **tracker.member_fields()})
                    log.info("study: %s, %d labels per class, seed %d%s", method, budget, seed,
                             f", labels grown by {selection} selection" if selection else "")
                    build_dir = out_dir / "builds" / variant.name
                    record = build(variant, build_dir, store_root, only=[stage], parent_run=tracker.run_id)
                    previous.setdefault((selection or "base", seed), {})[method] = build_dir
                    result = _stage_result(build_dir, stage)
                    m = task_of(recipe).metric  # top1, miou or map50
                    row = {"method": method, "budget": budget, "seed": seed, "metric": m,
                           "test": result["metrics"][f"test_{m}"], "val": result["metrics"][f"val_{m}"],
                           "seconds": sum(s["seconds"] for s in record["stages"]),
                           **({"selection": selection, **grown} if selection else {})}
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
    label, unit = metric_label(task_of(recipe).metric), task_of(recipe).budget_unit
    md = (study_markdown(recipe.name, table, st.budgets, label, unit) + selection_markdown(rows, label)
          + against_teacher_markdown(rows, label))
    atomic_write_bytes(out_dir / "study.md", md.encode())
    plot_study(out_dir / "study.png", table, st.budgets, label, unit)
    tracker.summary(table)
    return {"rows": rows, "summary": table}


# study.selection: name -> choose(pool, n, already labeled, the previous budget's distilled build's recipe (or None),
# store root, a folder of its own, a seed string) -> n pool paths to label.  "active" is label-next
# (students/label_next.py, registered there: it reads a teacher and a student).
SELECTIONS = Registry("study selection")


@SELECTIONS.register("random")
def _random_choice(pool: List[str], n: int, labeled: set, previous, store_root: Path, folder: Path,
                   seed: str) -> List[str]:
    import random

    free = [p for p in pool if p not in labeled]
    return random.Random(seed).sample(free, min(n, len(free)))


def _check_selection(recipe: Recipe) -> None:
    """What the selection axis needs, said before the first build."""
    st = recipe.study
    if recipe.data.source != "folders":
        raise ToolchainError("study.selection grows labels from a pool with withheld labels: it needs data.source "
                             "folders (the procedural task's pool has no oracle file)")
    if st.oracle is None:
        raise ToolchainError("study.selection grows the labels by revealing the chosen pool images' withheld "
                             "labels: set study.oracle (a csv of file,label for classification, a folder of "
                             "masks for segmentation)")
    task_of(recipe).oracle(st.oracle, [], recipe.data.roots)  # read now: a malformed oracle says what to set
    if len(st.budgets) < 2 or any(b <= a for a, b in zip(st.budgets, st.budgets[1:])):
        raise ToolchainError(f"study.selection grows the labels from one budget to the next: study.budgets must be "
                             f"two or more, increasing (e.g. [25, 35]); got {st.budgets}")
    if "active" in st.selection and not any(METHODS[m][0] == "student.finetune" for m in st.methods):
        raise ToolchainError("study.selection active chooses with label-next, which reads a distilled student: add "
                             "task_oriented (or another distillation method) to study.methods")


def _grow(recipe: Recipe, selection: str, seed: int, before: int, budget: int, builds: Dict[str, Path],
          out_dir: Path, store_root: Path, revealed: Dict[Any, set]):
    """The labels of the next budget: the previous build's labeled images plus pool images chosen by
    ``selection`` (random, or label-next on the previous distilled student), labeled by the oracle; returns the
    recipe fields that point a build at them and what was added.  ``revealed``: (selection, seed) -> the pool
    images that chain had labeled so far, never chosen twice."""
    from vfm_toolchain.prepare import load_index
    from vfm_toolchain.recipe import load_recipe
    from vfm_toolchain.stage import StageOutput

    first = next(iter(builds.values()))
    prepare = StageOutput("data.prepare", "", (first / "stages" / "data.prepare").resolve(),
                          _stage_result(first, "data.prepare"))
    index = load_index(prepare)
    task, classes = task_of(index), index["classes"]
    n = task.budget_images(budget - before, len(classes))
    oracle = task.oracle(recipe.study.oracle, classes, recipe.data.roots)
    revealed_before = revealed.setdefault((selection, seed), set())
    folder = out_dir / "labels" / f"{selection}_b{budget}_s{seed}"
    distilled = next((m for m in recipe.study.methods if METHODS[m][0] == "student.finetune" and m in builds), None)
    previous = load_recipe(builds[distilled] / "recipe.resolved.yaml") if distilled else None
    chosen = SELECTIONS.get(selection)(index["pool"], n, revealed_before, previous, store_root,
                                       folder.with_name(folder.name + "_choice"), f"{recipe.name} {seed} {budget}")
    added, skipped = [], {}
    for path in chosen:
        label, why = oracle.reveal(path)
        if label is None:
            skipped[path] = why
        else:
            added.append((path, label))
    revealed_before.update(chosen)
    log.info("study: %s selection labeled %d pool images (%d without a task label: %s)", selection, len(chosen),
             len(skipped), "; ".join(sorted(set(skipped.values()))) or "none")
    paths = oracle.write_labeled(folder, classes, list(map(tuple, index["train"])) + added,
                                 list(map(tuple, index["val"])))
    # the grown folders link to the labeled images, the pool's and the oracle's: the folders those lie in are
    # the next build's data.roots (core/roots.py), as a person would name them
    d = recipe.data
    folders = [d.train, d.val, *source_folders(d.pools), recipe.study.oracle]
    roots = list(dict.fromkeys([*d.roots, *(f for f in folders if f and os.path.isdir(f))]))
    return ({"data.train": paths["train"], "data.val": paths["val"], "data.labeled_per_class": None,
             "data.roots": roots},
            {"chosen": len(chosen), "added": len(added), "without_label": len(skipped)})


def _stage_result(build_dir: Path, stage: str) -> Dict[str, Any]:
    """A stage's result.json in a finished build (every stage it ran or reused is linked under stages/)."""
    import json

    return json.loads((build_dir / "stages" / stage / "result.json").read_text())


def summarize(rows: List[Dict[str, Any]]) -> Dict[str, Dict[int, Dict[str, float]]]:
    """method -> budget -> {mean, std, n} of the test metric over seeds (std with n - 1; 0 for one seed).  With
    the selection axis a method grown by a selection is its own line, "method, selection", which starts from
    the method's first budget (shared by both selections)."""
    out: Dict[str, Dict[int, Dict[str, float]]] = {}
    grown = {(r["method"], r["selection"]) for r in rows if r.get("selection")}
    for r in rows:
        names = [f"{r['method']}, {r['selection']}"] if r.get("selection") else \
            [r["method"]] + [f"{m}, {sel}" for m, sel in sorted(grown) if m == r["method"]]
        for name in names:
            out.setdefault(name, {}).setdefault(r["budget"], []).append(r["test"])
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


def selection_markdown(rows: List[Dict[str, Any]], label: str = "top-1") -> str:
    """What labeling the chosen images buys: per method and grown budget, random against active selection (mean
    over the seeds both have), and how many chosen images had no task label."""
    grown = [r for r in rows if r.get("selection")]
    if not grown:
        return ""
    L = ["", "## What labeling the chosen images buys", "",
         f"Test {label} (%) after growing the labels with pool images chosen at random or by label-next (their "
         f"labels revealed from study.oracle), mean over seeds; chosen images without a task label are spent too.", "",
         "| method | budget | random | active | active - random | seeds | chosen without a label (random / active) |",
         "|---|---|---|---|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in grown):
        for budget in sorted({r["budget"] for r in grown if r["method"] == method}):
            by = {sel: {r["seed"]: r for r in grown if (r["method"], r["budget"], r["selection"]) == (method, budget, sel)}
                  for sel in ("random", "active")}
            both = sorted(set(by["random"]) & set(by["active"]))
            mean = lambda sel, seeds: float(np.mean([by[sel][s]["test"] for s in seeds])) if seeds else None
            cell = lambda v: f"{100 * v:.2f}" if v is not None else ""
            r_, a_ = mean("random", both or sorted(by["random"])), mean("active", both or sorted(by["active"]))
            diff = f"{100 * (a_ - r_):+.2f}" if both else ""
            spent = " / ".join(str(sum(x["without_label"] for x in by[sel].values())) for sel in ("random", "active"))
            L.append(f"| {method} | {budget} | {cell(r_)} | {cell(a_)} | {diff} | {len(both)} | {spent} |")
    return "\n".join(L + [""])


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
