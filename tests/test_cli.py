import pytest
from typer.testing import CliRunner

from toolchain.cli import app

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
