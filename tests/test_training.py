"""The training loop: exact resume (end of epoch and mid-epoch), non-finite losses, gradient
accumulation, and DistributedDataParallel on 2 gloo processes against one process."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vfm_toolchain.checkpoint import load_training_state
from vfm_toolchain.core.errors import NonFiniteLossError
from vfm_toolchain.training import TrainBatches, fit

log = logging.getLogger("test")
ROOT = Path(__file__).resolve().parents[1]


def _data(n=12):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x) + 0.01 * torch.randn_like(y), y)  # uses the global RNG


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _fit(model, loss, path, **kw):
    return fit(model, [{"params": model.parameters(), "lr": 0.1}], _data(), 4, loss, 4, path, log, seed=0, **kw)


def _dies_at(n):
    calls = {"n": 0}

    def dying(model, batch):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return _mse(model, batch)

    return dying


@pytest.mark.parametrize("checkpoint_steps,dies_at,ema", [(None, 8, 0.0), (1, 8, 0.0), (2, 9, 0.0), (2, 9, 0.9)])
def test_resume_after_kill_matches_uninterrupted(tmp_path, checkpoint_steps, dies_at, ema):
    """Killed in epoch 3 (in its second or third batch); the rerun continues at the last checkpoint (with
    ``ema``, the averaged weights it returns too)."""
    ref = _model()
    _fit(ref, _mse, tmp_path / "ref.pt", ema=ema)
    m = _model()
    with pytest.raises(KeyboardInterrupt):
        _fit(m, _dies_at(dies_at), tmp_path / "k.pt", checkpoint_steps=checkpoint_steps, ema=ema)
    state = load_training_state(tmp_path / "k.pt")
    assert state["batch"] == (None if checkpoint_steps is None else (1 if dies_at == 8 else 2))  # batches done in epoch 3
    torch.manual_seed(123)  # a fresh process has other RNG state; the checkpoint restores it
    m2 = _model()
    history = _fit(m2, _mse, tmp_path / "k.pt", checkpoint_steps=checkpoint_steps, ema=ema)
    assert torch.allclose(ref.weight, m2.weight, atol=1e-7) and torch.allclose(ref.bias, m2.bias, atol=1e-7)
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]


@pytest.mark.gpu
def test_resume_on_cuda_replays_the_cuda_generator(tmp_path):
    """The loss draws its noise on the GPU (as dropout does there): the rerun matches only if the checkpoint
    restored the CUDA generator too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: run `pytest -m gpu` in the Docker image (docs/development.md, GPU / Docker)")
    from vfm_toolchain import devices

    with devices.use("cuda"):
        ref = _model()
        _fit(ref, _mse, tmp_path / "ref.pt")
        m = _model()
        with pytest.raises(KeyboardInterrupt):
            _fit(m, _dies_at(9), tmp_path / "k.pt", checkpoint_steps=2)
        m2 = _model()  # seeds the CUDA generator to the run's start: only the checkpoint puts it where the kill was
        _fit(m2, _mse, tmp_path / "k.pt", checkpoint_steps=2)
    assert torch.allclose(ref.weight, m2.weight, atol=1e-7) and torch.allclose(ref.bias, m2.bias, atol=1e-7)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    m = _model()
    calls = {"n": 0}

    def exploding(model, batch):
        calls["n"] += 1
        loss = _mse(model, batch)
        return loss * float("nan") if calls["n"] > 4 else loss

    with pytest.raises(NonFiniteLossError, match=r"loss became nan at epoch 2, step 2.*kept"):
        _fit(m, exploding, tmp_path / "n.pt")
    state = load_training_state(tmp_path / "n.pt")
    assert state["epoch"] == 0 and all(torch.isfinite(v).all() for v in state["model"].values())


def _plain_mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def test_accumulating_two_half_batches_equals_one_full_batch(tmp_path):
    a, b = _model(), _model()
    fit(a, [{"params": a.parameters(), "lr": 0.1}], _data(), 4, _plain_mse, 3, tmp_path / "a.pt", log)
    fit(b, [{"params": b.parameters(), "lr": 0.1}], _data(), 2, _plain_mse, 3, tmp_path / "b.pt", log, accumulate=2)
    assert torch.allclose(a.weight, b.weight, atol=1e-6)


def test_ema_validates_and_keeps_the_average_of_the_trained_weights(tmp_path):
    """The weights after every optimizer step, averaged by hand with timm's warm-up (the first step copied,
    then decay min(d, 1 - (1 + s)^(-2/3))), are what validation sees and what the run returns; the training
    itself follows the same path as without an average."""
    def trace(steps):
        def loss(model, batch):
            steps.append(model.weight.detach().clone())  # the weights after the previous step
            return _plain_mse(model, batch)
        return loss

    plain, plain_steps = _model(), []
    fit(plain, [{"params": plain.parameters(), "lr": 0.1}], _data(), 4, trace(plain_steps), 3, tmp_path / "p.pt", log)
    trained = plain_steps[1:] + [plain.weight.detach()]  # after steps 1..9
    expected = trained[0]
    for t, w in enumerate(trained[1:], start=2):
        decay = min(0.9, 1 - (1 + (t - 1)) ** (-2 / 3))
        expected = decay * expected + (1 - decay) * w

    m, m_steps, seen = _model(), [], []
    fit(m, [{"params": m.parameters(), "lr": 0.1}], _data(), 4, trace(m_steps), 3, tmp_path / "e.pt", log, ema=0.9,
        on_epoch_end=lambda epoch: seen.append(m.weight.detach().clone()) or {})
    assert not torch.allclose(expected, trained[-1], atol=1e-3)  # the average is not the last weights
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain_steps, m_steps))  # same training path
    assert torch.allclose(m.weight, expected, atol=1e-5) and torch.allclose(seen[-1], expected, atol=1e-5)


def test_an_ema_the_warm_up_never_reaches_is_reported(tmp_path, caplog):
    """9 optimizer steps: timm's warm-up ends at 1 - 9^(-2/3) = 0.769, so 0.9 acts as 0.769 and the log says so;
    0.5 is reached and is not reported."""
    for decay, warned in ((0.9, True), (0.5, False)):
        caplog.clear()
        m = _model()
        with caplog.at_level(logging.WARNING):
            fit(m, [{"params": m.parameters(), "lr": 0.1}], _data(), 4, _plain_mse, 3, tmp_path / f"{decay}.pt", log,
                ema=decay)
        hits = [r.getMessage() for r in caplog.records if "warm-up reaches" in r.getMessage()]
        assert bool(hits) == warned, hits
        if warned:
            assert "0.7689" in hits[0] and "9 optimizer steps" in hits[0]


def test_ranks_split_each_global_batch():
    one = list(TrainBatches(12, 4, seed=0, epoch=3))
    ranks = [list(TrainBatches(12, 4, seed=0, epoch=3, rank=r, world=2)) for r in (0, 1)]
    assert [a + b for a, b in zip(*ranks)] == one


DDP_SCRIPT = """
import logging, sys, torch
sys.path.insert(0, {tests!r})
from test_training import _data, _model, _plain_mse
from vfm_toolchain import devices, distributed
from vfm_toolchain.training import fit
distributed.init("cpu")  # gloo on the CPU, as the reference it is compared with, on a GPU machine too
m = _model()
with devices.use("cpu"):
    fit(m, [{{"params": m.parameters(), "lr": 0.1}}], _data(), 4, _plain_mse, 3, {ckpt!r}, logging.getLogger("ddp"))
if distributed.is_main():
    torch.save(m.state_dict(), {out!r})
"""


def test_ddp_on_two_gloo_processes_matches_one_process(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=str(ROOT / "tests"), ckpt=str(tmp_path / "ddp.pt"),
                                        out=str(tmp_path / "w.pt")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script)], env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = _model()
    fit(ref, [{"params": ref.parameters(), "lr": 0.1}], _data(), 4, _plain_mse, 3, tmp_path / "ref.pt", log)
    ddp = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.allclose(ddp["weight"], ref.weight, atol=1e-5) and torch.allclose(ddp["bias"], ref.bias, atol=1e-5)
    assert not torch.allclose(ddp["weight"], _model().weight)  # it trained


def test_a_last_batch_too_small_to_split_is_dropped():
    assert [len(b) for b in TrainBatches(9, 4, seed=0, epoch=0)] == [4, 4]        # 1 image: BatchNorm fails
    assert [len(b) for b in TrainBatches(10, 4, seed=0, epoch=0)] == [4, 4, 2]
    assert [len(b) for b in TrainBatches(10, 4, seed=0, epoch=0, world=2)] == [2, 2]


def _mix_cfg(**kw):
    from vfm_toolchain.recipe import FinetuneConfig
    return FinetuneConfig(**kw)


def test_mixup_off_by_default_and_refused_where_labels_cannot_mix():
    """Refused when the recipe loads, naming the field, not when the finetune starts after distillation."""
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.training import _mixer

    assert _mixer(_mix_cfg(), 10) is None
    seg = {"name": "t", "data": {"source": "synthetic", "task": "segmentation"}, "student": {"image_size": 64}}
    with pytest.raises(ToolchainError, match="finetune.mixup blends the labels .* classification only"):
        recipe_from_dict({**seg, "finetune": {"mixup": 0.8}})
    with pytest.raises(ToolchainError, match="baseline.cutmix needs the plain cross-entropy.*student.gramian heads"):
        recipe_from_dict({"name": "t", "data": {"source": "synthetic"}, "baseline": {"cutmix": 1.0},
                          "student": {"gramian": {"heads": 2}}})
    recipe_from_dict({**seg, "finetune": {"mixup": 0.0}})  # off is fine


@pytest.mark.parametrize("n", [8, 7, 1])
def test_mixup_blends_images_and_targets_in_pairs(n):
    """Every soft target sums to 1 and puts its mass on the two labels of the pair that made the image; an odd
    batch leaves its middle image as it was, with a smoothed one-hot target."""
    from vfm_toolchain.training import _mixer

    torch.manual_seed(0)
    mix = _mixer(_mix_cfg(mixup=1.0, label_smoothing=0.1), 5)
    x, y = torch.randn(n, 3, 4, 4), torch.arange(n) % 5
    xm, soft = mix(x.clone(), y)
    assert xm.shape == x.shape and soft.shape == (n, 5)
    torch.testing.assert_close(soft.sum(1), torch.ones(n))
    if n == 1:
        torch.testing.assert_close(xm, x)
        assert soft[0].argmax() == y[0]
        return
    keep = [i for i in range(n) if not (n % 2 and i == n // 2)]
    partner = {a: b for a, b in zip(keep, reversed(keep))}
    off = 0.1 / 5
    for i, j in partner.items():  # x_i' = lam x_i + (1 - lam) x_j, the target likewise, one lam per batch
        if y[i] == y[j]:
            continue
        lam = float((soft[i, y[i]] - off) / 0.9)
        assert 0 < lam < 1
        torch.testing.assert_close(xm[i], lam * x[i] + (1 - lam) * x[j])
        assert float(soft[i, y[i]] + soft[i, y[j]]) == pytest.approx(1 - 3 * off)
    if n % 2:
        torch.testing.assert_close(xm[n // 2], x[n // 2])
        assert soft[n // 2, y[n // 2]] == pytest.approx(0.9 + 0.1 / 5)


def test_mixing_stops_for_the_last_mix_off_epochs(tiny_task, tmp_path, monkeypatch):
    """Every batch of the first epochs goes through mixup/cutmix, none of the last ``mix_off_epochs``: those train
    on the plain images with the label-smoothed cross-entropy."""
    import vfm_toolchain.training as training
    from vfm_toolchain.data.images import Preprocess, scan_image_folder
    from vfm_toolchain.recipe import FinetuneConfig

    mixed, epochs_seen = [], []
    real_mixer = training._mixer

    def spying_mixer(cfg, num_classes):
        mix = real_mixer(cfg, num_classes)

        def spy(x, y):
            mixed.append(epochs_seen[-1])
            return mix(x, y)
        return spy

    monkeypatch.setattr(training, "_mixer", spying_mixer)
    items = scan_image_folder(tiny_task["train"], "train").samples
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(3))
    model(torch.zeros(1, 3, 16, 16))
    cfg = FinetuneConfig(epochs=3, batch_size=6, mixup=0.8, mix_off_epochs=2, label_smoothing=0.1)
    real_fit = training.fit

    def counting_fit(*a, on_epoch_start, **kw):
        return real_fit(*a, on_epoch_start=lambda e: (epochs_seen.append(e), on_epoch_start(e)), **kw)

    monkeypatch.setattr(training, "fit", counting_fit)
    training.fit_classifier(model, [{"params": model.parameters(), "lr": 1e-3}], items, Preprocess(16), cfg,
                            tmp_path / "ckpt", log, seed=0, name="t", num_classes=3)
    assert epochs_seen == [0, 1, 2]
    assert mixed == [0] * 3  # 18 images at batch 6: every batch of epoch 0, none after


def test_mix_off_epochs_that_leave_nothing_mixed_are_refused():
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.recipe import recipe_from_dict

    base = {"name": "t", "data": {"source": "synthetic"}}
    with pytest.raises(ToolchainError, match="baseline.mix_off_epochs 10 leaves none of its 10 epochs mixed") as err:
        recipe_from_dict({**base, "baseline": {"epochs": 10, "cutmix": 1.0, "mix_off_epochs": 10}})
    assert "got {" not in str(err.value) and "Value error" not in str(err.value)  # the message, not the recipe
    with pytest.raises(ToolchainError, match="finetune.mix_off_epochs 5 leaves none of its 3 epochs"):
        recipe_from_dict({**base, "finetune": {"epochs": 3, "mixup": 0.2, "mix_off_epochs": 5}})
    recipe_from_dict({**base, "baseline": {"epochs": 10, "cutmix": 1.0, "mix_off_epochs": 9}})
    recipe_from_dict({**base, "finetune": {"epochs": 3, "mix_off_epochs": 5}})  # nothing mixes: nothing to stop


def test_baseline_takes_its_own_regularisation_and_falls_back_to_finetune():
    from vfm_toolchain.recipe import Recipe
    from vfm_toolchain.students.finetune import StudentBaseline

    r = Recipe.model_validate({"name": "t", "data": {"source": "synthetic"}, "finetune": {"augment": "light", "mixup": 0.2, "lr": 1e-4, "batch_size": 50},
                               "baseline": {"augment": "strong", "cutmix": 1.0, "lr": 2e-3, "epochs": 7,
                                            "batch_size": 16}})
    cfg = StudentBaseline._cfg(r)
    assert (cfg.augment, cfg.mixup, cfg.cutmix, cfg.lr, cfg.epochs, cfg.batch_size) == ("strong", 0.2, 1.0, 2e-3, 7, 16)
    assert r.finetune.augment == "light" and r.finetune.cutmix == 0.0  # the distilled student's finetune unchanged
    assert (r.finetune.batch_size, r.finetune.weight_decay, r.finetune.warmup_epochs) == (50, 0.05, 0)
    plain = Recipe.model_validate({"name": "t", "data": {"source": "synthetic"}, "finetune": {"warmup_epochs": 3}})
    assert StudentBaseline._cfg(plain).warmup_epochs == 3  # unset, the finetune's
    assert "mix_off_epochs" not in StudentBaseline().config(r)["train"]  # at 0 out of the key: stored builds stay valid
    r3 = r.model_copy(update={"baseline": r.baseline.model_copy(update={"mix_off_epochs": 2})})
    assert StudentBaseline().config(r3)["train"]["mix_off_epochs"] == 2 and StudentBaseline._cfg(r3).mix_off_epochs == 2


def test_top1_is_the_fraction_of_images_whose_highest_logit_is_their_label(tmp_path):
    """A model that answers each image's brightest channel: red, green and blue images right, a red one labeled 1
    wrong; 3 of 4."""
    from PIL import Image

    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.training import top1

    items = []
    for i, (colour, label) in enumerate([((255, 0, 0), 0), ((0, 255, 0), 1), ((0, 0, 255), 2), ((255, 0, 0), 1)]):
        Image.new("RGB", (16, 16), colour).save(tmp_path / f"{i}.png")
        items.append((str(tmp_path / f"{i}.png"), label))
    channel_means = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    pp = Preprocess(16, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    assert top1(channel_means, items, pp, batch_size=3) == 0.75
