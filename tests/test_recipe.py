from pathlib import Path

import pytest
import yaml

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import load_recipe
from tests.conftest import tiny_recipe


def _write(tmp_path: Path, raw: dict) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_quickstart_recipe_is_valid():
    r = load_recipe(Path(__file__).parents[1] / "recipes" / "quickstart.yaml")
    assert r.data.source == "synthetic" and r.student.name == "fastvit_t8"


@pytest.mark.parametrize("name", ["cifar10_fewshot", "stanford_background"])
def test_real_data_recipes_are_valid(name):
    """They need ../shared/data to run, not to load: a renamed key must not wait for a benchmark to show."""
    r = load_recipe(Path(__file__).parents[1] / "recipes" / f"{name}.yaml")
    assert r.study.budgets and r.study.seeds == [0, 1, 2]


def test_typo_names_key_and_suggests(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task)
    raw["student"]["imgae_size"] = 64
    with pytest.raises(ToolchainError) as err:
        load_recipe(_write(tmp_path, raw))
    msg = str(err.value)
    assert "student.imgae_size" in msg and "Did you mean 'image_size'" in msg


def test_set_overrides_and_rejects_unknown_keys(tiny_task, tmp_path):
    p = _write(tmp_path, tiny_recipe(tiny_task))
    r = load_recipe(p, ["student.name=fastvit_s12", "distill.epochs=7", "export.formats=[onnx]"])
    assert (r.student.name, r.distill.epochs, r.export.formats) == ("fastvit_s12", 7, ["onnx"])
    with pytest.raises(ToolchainError, match="Did you mean 'distill'"):
        load_recipe(p, ["distil.epochs=3"])
    with pytest.raises(ToolchainError, match="KEY=VALUE"):
        load_recipe(p, ["student.name"])


def test_bad_values_and_missing_sections(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task)
    raw["distill"]["epochs"] = -1
    with pytest.raises(ToolchainError, match="distill.epochs"):
        load_recipe(_write(tmp_path, raw))
    raw = tiny_recipe(tiny_task)
    del raw["data"]["train"]
    with pytest.raises(ToolchainError, match="data.train is required"):
        load_recipe(_write(tmp_path, raw))


def test_relative_paths_resolve_against_recipe_folder(tmp_path):
    raw = {"data": {"train": "d/train", "test": "d/test", "pools": ["d/pool"]}}
    r = load_recipe(_write(tmp_path, raw))
    assert r.data.train == str((tmp_path / "d" / "train").resolve())


def test_image_size_is_one_side_or_height_width(tiny_task, tmp_path):
    p = _write(tmp_path, tiny_recipe(tiny_task))
    r = load_recipe(p, ["student.image_size=[192, 256]", "teacher.image_size=[224, 224]"])
    assert r.student.image_size == (192, 256)
    assert r.teacher.image_size == 224  # a square pair is its side: square recipes keep their store keys
    assert load_recipe(p).student.image_size == 32
    for bad, msg in (("[192, 256, 3]", r"\[height, width\]"), ("[8, 64]", "at least 16"), ("big", "one side")):
        with pytest.raises(ToolchainError, match=msg):
            load_recipe(p, [f"student.image_size={bad}"])


def test_every_recipe_field_says_why_it_is_there():
    """docs/recipe.md's audit table (issue 65) names every leaf field of the recipe, and no field that is gone: a
    field earns its place by a shipped recipe, a seed's method, a measured result or operation."""
    from pathlib import Path
    from typing import Union, get_args, get_origin

    from pydantic import BaseModel

    from vfm_toolchain.recipe import AdapterConfig, Recipe

    def section(ann):
        if get_origin(ann) is Union:
            inner = [a for a in get_args(ann) if a is not type(None)]
            ann = inner[0] if len(inner) == 1 else None
        return ann if isinstance(ann, type) and issubclass(ann, BaseModel) and ann is not AdapterConfig else None

    def leaves(model, prefix=""):
        for name, f in model.model_fields.items():
            inner = section(f.annotation)
            yield from leaves(inner, f"{prefix}{name}.") if inner is not None else [f"{prefix}{name}"]

    doc = (Path(__file__).resolve().parents[1] / "docs" / "recipe.md").read_text()
    table = doc[doc.index("## Why each field is there"):]
    listed = {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}
    fields = set(leaves(Recipe))
    assert fields - listed == set(), f"fields without a reason in docs/recipe.md: {sorted(fields - listed)}"
    assert listed - fields == set(), f"docs/recipe.md lists fields the recipe no longer has: {sorted(listed - fields)}"
