import pytest
from typer.testing import CliRunner

from vfm_toolchain.cli import app

runner = CliRunner()


@pytest.mark.parametrize("kind,expected", [
    ("adapters", ["lora", "linear", "full"]), ("students", ["fastvit_s12", "mobilevitv2_100", "timm:"]),
    ("teachers", ["timm:", "open_clip:", "torchvision:"]), ("formats", ["onnx", "coreml", "tensorrt"]),
    ("runtimes", ["pytorch", "onnxruntime"]),
    ("strategies", ["random", "best_matches", "query_balanced_image"]), ("stages", ["teacher.finetune", "report"]),
])
def test_list(kind, expected):
    res = runner.invoke(app, ["list", kind])
    assert res.exit_code == 0, res.output
    for name in expected:
        assert name in res.output


def test_list_unknown_kind_suggests():
    res = runner.invoke(app, ["list", "adapter"])
    assert res.exit_code == 2 and "Did you mean 'adapters'" in res.output


def test_build_with_a_recipe_typo_exits_2_with_the_fix(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("data: {train: a, test: b, pools: [c]}\nstudnet: {name: fastvit_s12}\n")
    res = runner.invoke(app, ["build", str(p), "--store", str(tmp_path / "s")])
    assert res.exit_code == 2
    assert "unknown key 'studnet'" in res.output and "Did you mean 'student'" in res.output


def test_study_prints_its_markdown_as_written(tmp_path, monkeypatch):
    # rich would read "[top-1 against labels per class]" as a markup tag and print "!(study.png)"
    from vfm_toolchain import study

    def fake_run_study(recipe, out_dir, store_root):
        out_dir.mkdir(parents=True)
        (out_dir / "study.md").write_text(study.study_markdown("t", {"a": {5: {"mean": 0.5, "std": 0, "n": 1}}},
                                                                          [5]))
        return {"rows": [], "summary": {}}  # what run_study returns
    monkeypatch.setattr(study, "run_study", fake_run_study)
    p = tmp_path / "r.yaml"
    p.write_text(f"data: {{train: {tmp_path}, test: {tmp_path}, pools: [{tmp_path}]}}\nstudy: {{budgets: [5]}}\n")
    res = runner.invoke(app, ["study", str(p), "--out", str(tmp_path / "out"), "--store", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert "![top-1 against labels per class](study.png)" in res.output
