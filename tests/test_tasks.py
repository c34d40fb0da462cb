"""The task seam (issue 65): one registered object per task, asked by the stages instead of testing names.

Also the ratchet on the name tests that remain outside the task modules: it may only go down (the issue's target
is 5), so a branch on a task's name added anywhere else fails here with the place to move it to.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.conftest import tiny_recipe
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import load_recipe, recipe_from_dict
from vfm_toolchain.tasks import LEGACY_TASK, TASKS, Task, task_of

REPO = Path(__file__).resolve().parents[1]

# tests of a task's name in the product, outside the files and folders whose name says task (the grep)
NAME_TEST = re.compile(r'task (==|!=|in) |\.task ==|is_detector\(|== "detection"|== "segmentation"|"classification"')
CEILING = 0  # the issue allowed 5; none remain: a stage asks the task (or the model) what differs


def name_tests() -> list:
    found = []
    for floor in ("core", "data", "toolchain", "blocks", "teachers", "students", "export", "bench"):
        for f in sorted((REPO / floor).rglob("*.py")):
            rel = f.relative_to(REPO).as_posix()
            if "task" in Path(rel).name or any("task" in part for part in Path(rel).parts[:-1]):
                continue
            found += [f"{rel}:{i}" for i, line in enumerate(f.read_text().splitlines(), 1) if NAME_TEST.search(line)]
    return found


def test_the_product_tests_task_names_no_more_often_than_the_ceiling():
    found = name_tests()
    assert len(found) <= CEILING, (
        f"{len(found)} tests of a task's name outside toolchain/tasks/ (at most {CEILING}); ask the task instead "
        f"(task_of(recipe).<what differs>) and add what differs to the Task classes:\n  " + "\n  ".join(found))


def test_the_grep_sees_a_name_test():
    assert NAME_TEST.search('    if recipe.data.task == "detection":')
    assert not NAME_TEST.search("    if task_of(recipe).metric == 'map50':")


def test_every_task_answers_the_contract():
    assert {"classification", "detection", "segmentation"} <= set(TASKS.list())
    for name in TASKS.list():
        task = task_of(name)
        assert isinstance(task, Task) and task.name == name
        assert task.metric and task.reads and task.budget_unit
        assert TASKS.meta(name)["metric"] == task.metric  # what `toolchain list tasks` shows


def test_task_of_reads_recipes_indexes_and_names_and_refuses_an_unknown_task(tiny_task):
    recipe = recipe_from_dict(tiny_recipe(tiny_task, **{"data.task": "segmentation"}))
    assert task_of(recipe).name == "segmentation"
    assert task_of({"task": "detection", "classes": []}).metric == "map50"
    assert task_of({"classes": ["a", "b"]}).name == LEGACY_TASK  # an index written before indexes named the task
    with pytest.raises(ToolchainError, match=r"unknown task 'detections'.*Did you mean 'detection'"):
        task_of("detections")


def test_the_recipe_takes_any_registered_task_and_names_them_on_a_typo():
    with pytest.raises(ToolchainError, match=r"'segmantation' is not a task\. Did you mean 'segmentation'\? Tasks: "
                                             r"classification, detection, (.*, )?segmentation"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["data.task=segmantation"])


def test_what_only_detection_reads_is_refused_for_the_other_tasks():
    with pytest.raises(ToolchainError, match=r"data.format coco says how detection boxes are written; data.task "
                                             r"segmentation reads images with masks"):
        load_recipe(REPO / "recipes" / "quickstart.yaml", ["data.task=segmentation", "data.format=coco"])


def test_a_stage_that_does_not_take_the_task_refuses_the_build_before_the_first_stage(tiny_task, monkeypatch):
    from vfm_toolchain.plugins import load_plugins
    from vfm_toolchain.stage import STAGES, check_stages_take_the_task

    load_plugins()
    recipe = recipe_from_dict(tiny_recipe(tiny_task, **{"data.task": "segmentation"}))
    check_stages_take_the_task(recipe)  # every stage takes every registered task
    monkeypatch.setattr(STAGES.get("export.convert"), "tasks", ("classification",))
    with pytest.raises(ToolchainError, match=r"data.task segmentation: export.convert cannot build it yet \(they "
                                             r"take classification\)"):
        check_stages_take_the_task(recipe)


def test_budget_images_count_what_the_budget_counts():
    assert task_of("classification").budget_images(5, 10) == 50  # labels per class
    assert task_of("segmentation").budget_images(5, 10) == 5  # labeled images


def test_each_oracle_writes_a_grown_label_set_its_task_reads_back(tmp_path):
    """The study's simulated labeler: a revealed label per task, and the folders it writes are what the task's own
    reader takes (ImageFolder; images + masks + classes.txt)."""
    from PIL import Image

    from vfm_toolchain.data.images import scan_image_folder
    from vfm_toolchain.data.segmentation import scan_segmentation_folder

    pool = tmp_path / "pool"
    pool.mkdir()
    for i in range(3):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(pool / f"{i}.png")
    (tmp_path / "labels.csv").write_text("file,label\n0.png,cat\n1.png,dog\n2.png,car\n")
    masks = tmp_path / "masks"
    masks.mkdir()
    for i in range(2):
        Image.new("L", (16, 16), 1).save(masks / f"{i}.png")
    images = [str(pool / f"{i}.png") for i in range(3)]

    csv_oracle = task_of("classification").oracle(str(tmp_path / "labels.csv"), ["cat", "dog"])
    assert [csv_oracle.reveal(p) for p in images] == [(0, ""), (1, ""), (None, "labeled 'car', not one of the "
                                                                               "task's classes")]
    grown = csv_oracle.write_labeled(tmp_path / "cls", ["cat", "dog"], [(images[0], 0), (images[1], 1)],
                                     [(images[1], 1)])
    assert [y for _, y in scan_image_folder(grown["train"], "train", data_roots=[str(pool)]).samples] == [0, 1]

    mask_oracle = task_of("segmentation").oracle(str(masks), ["background", "thing"])
    assert mask_oracle.reveal(images[2]) == (None, "no mask in the oracle")
    label, _ = mask_oracle.reveal(images[0])
    grown = mask_oracle.write_labeled(tmp_path / "seg", ["background", "thing"], [(images[0], label)],
                                      [(images[1], mask_oracle.reveal(images[1])[0])])
    pairs, skipped = scan_segmentation_folder(grown["train"], "train", 2, [str(pool), str(masks)])
    assert len(pairs) == 1 and not skipped

    with pytest.raises(ToolchainError, match=r"detection has no oracle: remove study.selection"):
        task_of("detection").oracle(str(masks), ["fish"])


def test_every_task_has_its_part_on_each_floor():
    """A task is complete when each floor that has a part of it registers one (teachers/tasks/, students/tasks/
    today); a task a floor lacks is named with the floor's folder."""
    from vfm_toolchain.students.tasks import STUDENT_TASKS, student_task
    from vfm_toolchain.teachers.tasks import TEACHER_TASKS, teacher_task

    assert TEACHER_TASKS.list() == STUDENT_TASKS.list() == TASKS.list()
    for name in TASKS.list():
        assert teacher_task(name).name == student_task(name).name == name
    with pytest.raises(ToolchainError, match=r"data.task nothing has no teacher part \(teachers/tasks/\)"):
        teacher_task("nothing")
    with pytest.raises(ToolchainError, match=r"data.task nothing has no student part \(students/tasks/\)"):
        student_task("nothing")


def _abstract(cls) -> set:
    """The methods of a contract that every task must write (their base raises NotImplementedError)."""
    return {n for n, f in vars(cls).items() if inspect.isfunction(f) and "raise NotImplementedError" in
            inspect.getsource(f)}


def test_every_part_of_every_task_writes_what_its_contract_leaves_open():
    from vfm_toolchain.students.tasks import STUDENT_TASKS, StudentTask
    from vfm_toolchain.teachers.tasks import TEACHER_TASKS, TeacherTask

    for base, registry in ((Task, TASKS), (TeacherTask, TEACHER_TASKS), (StudentTask, STUDENT_TASKS)):
        assert _abstract(base), base  # the check sees the contract's open methods
        for name in registry.list():
            part = registry.get(name)
            cls = part if isinstance(part, type) else type(part)
            open_ = _abstract(base)
            if base is Task and cls.fit is not Task.fit:  # a task with its own fit builds its own dataset
                open_.discard("train_dataset")
            missing = sorted(m for m in open_ if getattr(cls, m) is getattr(base, m))
            assert not missing, f"{base.__name__} {name} leaves {missing} to the base, which raises"


def test_every_procedural_task_writes_the_same_bytes_on_every_run(tmp_path):
    """The generated data's stage key is its parameters, so the bytes must follow from them alone (PIL's
    effect_noise, which reads C's rand(), once made the noise distractors differ from run to run)."""
    import hashlib

    from vfm_toolchain.recipe import SyntheticData

    s = SyntheticData(classes=2, labeled_per_class=2, val_per_class=1, test_per_class=1, pool_size=6,
                      distractor_size=12, image_size=64, seed=3)

    def digest(folder: Path) -> dict:
        return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".json"}

    for name in TASKS.list():
        first, second = tmp_path / name / "a", tmp_path / name / "b"
        task_of(name).generate(first, s)
        task_of(name).generate(second, s)
        assert digest(first) == digest(second), name
