import logging

import pytest
import torch

from toolchain.checkpoint import load_training_state
from toolchain.errors import NonFiniteLossError
from toolchain.training import fit

log = logging.getLogger("test")


def _data(epoch):
    g = torch.Generator().manual_seed(epoch)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)  # uses the global RNG


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def test_resume_after_kill_matches_uninterrupted(tmp_path):
    ref = _model()
    fit(ref, [{"params": ref.parameters(), "lr": 0.1}], _data, 3, _mse, 4, tmp_path / "ref.pt", log)

    calls = {"n": 0}

    def dying(model, batch):
        calls["n"] += 1
        if calls["n"] == 8:  # dies in epoch 3, after the checkpoint of epoch 2
            raise KeyboardInterrupt
        return _mse(model, batch)

    m = _model()
    with pytest.raises(KeyboardInterrupt):
        fit(m, [{"params": m.parameters(), "lr": 0.1}], _data, 3, dying, 4, tmp_path / "k.pt", log)
    torch.manual_seed(123)  # a fresh process has other RNG state; the checkpoint restores it
    m2 = _model()
    fit(m2, [{"params": m2.parameters(), "lr": 0.1}], _data, 3, _mse, 4, tmp_path / "k.pt", log)
    assert torch.allclose(ref.weight, m2.weight, atol=1e-7) and torch.allclose(ref.bias, m2.bias, atol=1e-7)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    m = _model()
    calls = {"n": 0}

    def exploding(model, batch):
        calls["n"] += 1
        loss = _mse(model, batch)
        return loss * float("nan") if calls["n"] > 4 else loss

    with pytest.raises(NonFiniteLossError, match=r"loss became nan at epoch 2, step 2.*kept"):
        fit(m, [{"params": m.parameters(), "lr": 0.1}], _data, 3, exploding, 3, tmp_path / "n.pt", log)
    state = load_training_state(tmp_path / "n.pt")
    assert state["epoch"] == 0 and all(torch.isfinite(v).all() for v in state["model"].values())
