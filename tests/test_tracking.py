"""Experiment tracking (toolchain/tracking.py): builds and a study tracked into a real MLflow store, read back with
MLflow's own client.

The builds reuse the tiny build every hostile-use test shares (``hostile_env``), from a copy of its store: every
stage is cached, which is itself the check that tracking changes no stage key, and a cached stage's history is
logged like a fresh one's.
"""
from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest
import yaml

from vfm_toolchain import __version__, api, tracking
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.failures import StageFailed
from vfm_toolchain.recipe import recipe_from_dict, recipe_to_dict
from vfm_toolchain.runner import environment, stage_key
from vfm_toolchain.stage import PIPELINE, STAGES

from conftest import stage_statuses, tiny_recipe

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def cached_store(hostile_env, tmp_path_factory) -> Path:
    """A copy of the shared tiny build's store: the builds here lease and touch its entries."""
    copy = tmp_path_factory.mktemp("tracking") / "store"
    shutil.copytree(hostile_env.store, copy)
    return copy


def _runs(uri: str, experiment: str):
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment '{experiment}' in {uri}"
    return client, client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


def _artifact_paths(client, run_id: str, path: str = None) -> set:
    paths = set()
    for info in client.list_artifacts(run_id, path):
        paths |= _artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return paths


def test_a_build_is_one_run_with_params_histories_metrics_files_and_stage_keys(hostile_env, cached_store, tmp_path):
    out = tmp_path / "out"
    result = api.build(hostile_env.raw, out=out, store=cached_store, track=True)
    # every stage cached: the tracked recipe has the stage keys of the untracked build that filled the store
    assert set(stage_statuses(result.record).values()) == {"cached"}

    uri = f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}"
    client, runs = _runs(uri, "tiny")  # the experiment defaults to the recipe's name
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    # params: the resolved recipe, flattened
    params = run.data.params
    assert params["student.name"] == "mobilevitv2_050" and params["teacher.epochs"] == "2"
    assert params["export.formats"] == '["onnx"]' and params["tracking.mlflow.uri"] == "null"
    # metrics: per-epoch histories as steps, each stage's final metrics and the build's
    loss = client.get_metric_history(run.info.run_id, "teacher.finetune/epoch/loss")
    assert [m.step for m in loss] == [1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "student.distill/epoch/loss")] == [1, 2]
    metrics = run.data.metrics
    assert metrics["student_distilled_top1"] == pytest.approx(result.metrics["student_distilled_top1"])
    assert metrics["student.finetune/test_top1"] == pytest.approx(result.metrics["student_distilled_top1"])
    assert "bench/student onnx/onnxruntime/batch1/p50_ms" in metrics
    # tags: each stage's store key (as build.json has it), the build's status and the toolchain
    tags = run.data.tags
    for s in result.stages:
        assert tags[f"stage.{s['name']}.status"] == s["status"]
        if s["key"]:
            assert tags[f"stage.{s['name']}.key"] == s["key"]
    assert tags["build.status"] == "complete" and tags["toolchain.version"] == __version__
    # files: the report, its plot, the exported model, the record
    files = _artifact_paths(client, run.info.run_id)
    assert {"report.md", "accuracy_vs_latency.png", "build.json", "recipe.resolved.yaml",
            "artifacts/student/model.onnx"} <= files
    logged = Path(client.download_artifacts(run.info.run_id, "artifacts/student/model.onnx", str(tmp_path)))
    assert logged.read_bytes() == result.artifact("student", "onnx").path.read_bytes()

    # a second, cached build: a second run in the same store, with the same stage keys
    api.build(hostile_env.raw, out=out, store=cached_store, track=True)
    client, runs = _runs(uri, "tiny")
    assert len(runs) == 2
    keys = [{k: v for k, v in r.data.tags.items() if k.endswith(".key")} for r in runs]
    assert keys[0] == keys[1] and len(keys[0]) == sum(1 for s in result.stages if s["key"])


def test_a_failed_build_ends_its_run_failed_with_its_record(hostile_env, cached_store, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(StageFailed):
        api.build(hostile_env.raw, {"export.parity_atol": 1e-30}, out=out, store=cached_store, track=True)
    client, runs = _runs(f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}", "tiny")
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    tags = runs[0].data.tags
    assert tags["build.status"] == "failed" and tags["stage.export.convert.status"] == "failed"
    assert tags["stage.student.finetune.status"] == "cached" and "stage.export.convert.key" in tags
    assert {"build.json", "recipe.resolved.yaml"} <= _artifact_paths(client, runs[0].info.run_id)


def test_tracking_is_part_of_no_stage_key(tiny_task, tmp_path):
    plain = recipe_from_dict(tiny_recipe(tiny_task))
    tracked = recipe_from_dict({**tiny_recipe(tiny_task), "tracking": {"mlflow": {"uri": f"sqlite:///{tmp_path}/x.db",
                                                                           "experiment": "elsewhere"}}})
    env, keys = environment(), {}
    for name in PIPELINE:
        stage = STAGES.get(name)()
        inputs = {i: keys.get(i) for i in (*stage.inputs, *stage.optional_inputs)}
        keys[name] = stage_key(stage, plain, inputs, env)
        assert stage_key(stage, tracked, inputs, env) == keys[name], name


def test_the_recipe_section_turns_it_on_and_a_dumped_recipe_reads_back_the_same(tiny_task):
    raw = tiny_recipe(tiny_task)
    # `mlflow:` with nothing under it is YAML's null: the section is there, so tracking is on with the defaults
    on = recipe_from_dict(yaml.safe_load(yaml.safe_dump(raw) + "tracking:\n  mlflow:\n"))
    assert on.tracking.mlflow is not None and on.tracking.mlflow.uri is None
    off = recipe_from_dict(raw)
    assert off.tracking.mlflow is None and recipe_to_dict(off)["tracking"] == {}
    for r in (on, off):
        assert recipe_from_dict(recipe_to_dict(r)) == r
    assert tracking.enable(off).tracking.mlflow is not None and off.tracking.mlflow is None  # a copy
    assert api.load(raw, ["tracking.mlflow.experiment=exp1"]).tracking.mlflow.experiment == "exp1"
    with pytest.raises(ToolchainError, match=r"unknown key 'tracking.mlflow.urll'. Did you mean 'uri'"):
        api.load(raw, {"tracking.mlflow.urll": "x"})


def test_the_cli_track_flag_and_a_recipe_uri_and_experiment(hostile_env, cached_store, tmp_path):
    from typer.testing import CliRunner

    from vfm_toolchain.cli import app

    db = tmp_path / "elsewhere" / "mlflow.db"
    db.parent.mkdir()
    raw = tiny_recipe(hostile_env.task, **{"bench.runtimes": ["onnxruntime"], "bench.batch_sizes": [1],
                                          "tracking.mlflow.uri": f"sqlite:///{db}"})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["build", str(recipe), "--store", str(cached_store), "--out", str(out), "--track",
                                   "--set", "tracking.mlflow.experiment=cli"])
    assert res.exit_code == 0, res.output
    client, runs = _runs(f"sqlite:///{db}", "cli")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert not (out / "mlflow").exists()  # the recipe's store, not the default one
    # the artifacts lie beside the store named by the recipe, not in the folder the build ran from
    assert "artifacts/student/model.onnx" in _artifact_paths(client, runs[0].info.run_id)
    assert (db.parent / "artifacts").is_dir()


def test_a_tracking_server_that_is_down_warns_once_and_the_build_completes(hostile_env, cached_store, tmp_path, caplog):
    with socket.socket() as s:  # a port nothing listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level("WARNING", logger="toolchain"):
        result = api.build(hostile_env.raw, {"tracking.mlflow.uri": f"http://127.0.0.1:{port}"}, out=tmp_path / "out",
                           store=cached_store)
    assert result.status == "complete" and (tmp_path / "out" / "report.md").is_file()
    warnings = [r.getMessage() for r in caplog.records if "experiment tracking stopped" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0], warnings


def test_tracking_without_mlflow_fails_before_any_stage_with_the_install(hostile_env, cached_store, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` meets where it is not installed
    with pytest.raises(ToolchainError, match=r"pip install 'vfm-toolchain\[tracking\]'"):
        api.build(hostile_env.raw, out=tmp_path / "out", store=tmp_path / "store", track=True)
    assert not (tmp_path / "store").exists() and not (tmp_path / "out").exists()
    # without tracking, a build needs no MLflow
    assert api.build(hostile_env.raw, out=tmp_path / "plain", store=cached_store).status == "complete"
    assert not (tmp_path / "plain" / "mlflow").exists()


def test_a_folder_uri_is_refused_before_any_stage(tiny_task, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ToolchainError, match=r"is a folder .*sqlite:///"):
        api.build(tiny_recipe(tiny_task), {"tracking.mlflow.uri": str(tmp_path / "mlruns")}, out=tmp_path / "out",
                  store=tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_a_study_is_a_parent_run_with_a_nested_run_per_build(tiny_task, tmp_path):
    raw = tiny_recipe(tiny_task, **{"export.formats": [], "bench.runtimes": [],
                                          "study": {"budgets": [2], "seeds": [0, 1], "methods": ["label_only"]}})
    out = tmp_path / "study"
    result = api.study(raw, out=out, store=tmp_path / "store", track=True)
    assert len(result.rows) == 2

    client, runs = _runs(f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}", "tiny")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.params["study.seeds"] == "[0, 1]"
    assert "label_only/b2/test_mean" in parent.data.metrics
    assert {"study.md", "study.png", "study.json"} <= _artifact_paths(client, parent.info.run_id)
    members = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in members) == ["tiny_label_only_b2_s0", "tiny_label_only_b2_s1"]
    for r in members:
        assert r.info.status == "FINISHED" and "stage.student.baseline.key" in r.data.tags
        assert [m.step for m in client.get_metric_history(r.info.run_id, "student.baseline/epoch/loss")] == [1]
    # each member build kept the parent's store: none of their own
    assert not list((out / "builds").glob("*/mlflow"))
