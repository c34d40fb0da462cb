"""Gramian heads (seed 003): the loss, the training/eval paths, and removal for deployment."""
import json

import pytest
import torch

from vfm_toolchain.students.fold import FOLDS, fold_model
from vfm_toolchain.students.gramian import GramianStudent, gramian_loss
from vfm_toolchain.students.models import create_student
from vfm_toolchain.recipe import recipe_from_dict
from vfm_toolchain.runner import build

from conftest import tiny_recipe


def test_decorrelation_penalises_heads_that_agree():
    torch.manual_seed(0)
    y = torch.randint(0, 4, (8,))
    ce = torch.nn.CrossEntropyLoss()
    a = torch.randn(8, 4)
    same = torch.stack([a, a, a])
    different = torch.stack([a, torch.randn(8, 4), torch.randn(8, 4)])
    plain = sum(ce(h, y) for h in same)
    assert torch.isclose(gramian_loss(same, y, ce, 1.0) - plain, torch.tensor(1.0), atol=1e-5)  # corr = 1
    assert gramian_loss(different, y, ce, 1.0) - sum(ce(h, y) for h in different) < 0.5
    assert torch.isclose(gramian_loss(same, y, ce, 0.0), plain)


@pytest.mark.parametrize("deploy", ["none", "one"])
def test_deployed_network_computes_exactly_the_kept_path(deploy):
    torch.manual_seed(0)
    g = GramianStudent(create_student("mobilevitv2_050", 5), 5, heads=3, dim=8, deploy=deploy)
    x = torch.randn(4, 3, 64, 64)
    g.train()
    assert g(x).shape == (4, 4, 5)  # main + 3 heads
    g.eval()
    with torch.no_grad():
        for h in g.heads:  # heads that differ from the main head, so dropping them would show
            h.fc.weight.normal_()
        trained = g(x)
        deployed = FOLDS.get("gramian_heads")(g, {"family": "student"}).eval()
        main, *heads = g.forward_all(x)
        assert not torch.allclose(heads[1], main)
        assert torch.equal(deployed(x), trained)
        expected = main if deploy == "none" else 0.5 * (main + heads[0])
        assert torch.allclose(trained, expected, atol=1e-6)
    kept = sum(p.numel() for p in deployed.parameters())
    assert kept < sum(p.numel() for p in g.parameters())
    assert not any(k.startswith("heads.") for k in deployed.state_dict())
    _, records = fold_model(g, {"family": "student"}, x)
    assert records[1]["pass"] == "gramian_heads" and records[1]["max_abs_diff"] == 0.0


def test_build_with_gramian_heads_exports_the_deployed_path(tiny_task, tmp_path):
    # keep_best off: the finetuned (Gramian) weights ship whatever one tiny epoch scores on val against the
    # distilled ones, which carry no heads (the CI machine once shipped the distilled weights here)
    raw = tiny_recipe(tiny_task, **{"student.gramian": {"heads": 2, "dim": 8, "deploy": "one"},
                                    "finetune.keep_best": False, "bench.runtimes": []})
    build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["export.convert"])
    stages = tmp_path / "o" / "stages"
    spec = json.loads((stages / "student.finetune" / "model" / "spec.json").read_text())
    assert spec["gramian"]["heads"] == 2
    res = json.loads((stages / "export.convert" / "result.json").read_text())
    text = json.dumps(res)
    assert "gramian_heads" in text and '"status": "ok"' in text
