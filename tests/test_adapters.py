"""Table-driven over the adapter registry, on a 2-block ViT at 32 px (seeds 001, 002)."""
import copy
import math
from pathlib import Path

import pytest
import timm
import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import Preprocess
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.teachers.adapters import ADAPTERS, adapter_regularizer, apply_adapter, fold_adapter, init_adapter_from_features
from vfm_toolchain.teachers.adapters.llu import LLU, cluster_representatives
from vfm_toolchain.teachers.backbones.base import Backbone
from vfm_toolchain.teachers.model import TeacherClassifier

OPTIONS = {"lora": {"r": 4, "alpha": 8}, "bottleneck": {"hidden": 16}, "grappa": {"hidden": 16}}


def _tiny(seed=0):
    torch.manual_seed(seed)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, num_classes=0, pretrained=False)
    return Backbone(vit, vit.num_features, Preprocess(32)).eval()


def _adapted(name, seed=0):
    base = _tiny(seed)
    cfg = AdapterConfig(name=name, **OPTIONS.get(name, {}))
    backbone = copy.deepcopy(base)
    base_ids = {id(p) for p in backbone.parameters()}
    model = TeacherClassifier(apply_adapter(backbone, cfg), 3, freeze_norm=True).eval()
    # the adapter's own weights: new parameters, or (full finetuning) the trainable backbone weights
    new = [p for p in backbone.parameters() if id(p) not in base_ids]
    model.adapter_params = new or [p for p in backbone.parameters() if p.requires_grad]
    torch.manual_seed(seed + 1)
    x = torch.randn(6, 3, 32, 32)
    init_adapter_from_features(model.backbone, cfg, model.forward_features(x).detach())
    return base, model, cfg, x


@pytest.mark.parametrize("name", ADAPTERS.list())
def test_initialisation_is_identity_within_the_documented_tolerance(name):
    base, model, _, x = _adapted(name)
    with torch.no_grad():
        f0, f1 = base(x), model.forward_features(x)
    identity = ADAPTERS.meta(name)["identity"]
    if identity.startswith("exact"):
        assert (f1 - f0).abs().max() < 1e-5
    elif identity.startswith("near"):  # small weights: a small relative change, far below the features' scale
        rel = (f1 - f0).norm(dim=1) / f0.norm(dim=1)
        assert 0 < rel.max() < 0.25
    elif identity.startswith("up to scale"):  # same direction
        assert torch.nn.functional.cosine_similarity(f0, f1).min() > 1 - 1e-5
    else:  # documented as not an identity at initialisation (msa_lora sums three scales, eq. 11)
        assert identity.startswith("no") and (f1 - f0).abs().max() > 1e-3


@pytest.mark.parametrize("name", ADAPTERS.list())
def test_perturbed_adapter_changes_output_and_foldable_ones_fold_exactly(name):
    _, model, cfg, x = _adapted(name)
    params = model.adapter_params
    if not params:
        pytest.skip(f"'{name}' has no backbone weights to perturb (only the head trains)")
    with torch.no_grad():
        before = model(x)
        g = torch.Generator().manual_seed(3)
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        after = model(x)
    assert (after - before).abs().max() > 1e-4, "the adapter must change the output before the merge test means anything"
    if ADAPTERS.meta(name)["foldable"]:
        folded = copy.deepcopy(model)
        folded.backbone = fold_adapter(folded.backbone, cfg)
        with torch.no_grad():
            assert (folded(x) - after).abs().max() < 1e-5
        leftovers = [n for n, _ in folded.named_modules() if n.split(".")[-1] in ("adapter", "lora_A", "lora_B")]
        assert not leftovers
    else:
        with pytest.raises(ToolchainError, match="does not fold"):
            fold_adapter(copy.deepcopy(model).backbone, cfg)


@pytest.mark.parametrize("name", ADAPTERS.list())
def test_training_steps_reduce_the_task_loss(name):
    _, model, cfg, x = _adapted(name)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_llu_regulariser_is_zero_at_the_identity_and_pulls_back():
    _, model, cfg, _ = _adapted("llu")
    reg = adapter_regularizer(model.backbone, cfg)
    assert reg().item() == 0.0
    g = model.backbone.model.adapter.g
    with torch.no_grad():
        g.weight.add_(0.01 * torch.randn(g.weight.shape))
    opt = torch.optim.SGD(g.parameters(), lr=1e-6)
    first = reg()
    opt.zero_grad()
    first.backward()
    opt.step()
    assert 0 < reg().item() < first.item()


def test_unknown_adapter_option_is_an_error_with_a_suggestion():
    with pytest.raises(ToolchainError, match="teacher.adapter.hiden.*Did you mean 'hidden'"):
        apply_adapter(_tiny(), AdapterConfig(name="bottleneck", hiden=64))
    with pytest.raises(ToolchainError, match="unknown adapter 'lorra'.*Did you mean 'lora'"):
        apply_adapter(_tiny(), AdapterConfig(name="lorra"))


def test_bottleneck_and_pyramid_need_a_transformer():
    import torchvision

    cnn = Backbone(torchvision.models.resnet18(num_classes=4), 4, Preprocess(32))
    with pytest.raises(ToolchainError, match="transformer backbone"):
        apply_adapter(cnn, AdapterConfig(name="pyramid"))


def test_llu_alpha_matches_a_hand_computation():
    llu = LLU(2, beta=0.5, gamma=20.0, lam=1e3)
    llu.representatives = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    f = torch.tensor([[3.0, 4.0]])  # x = (0.6, 0.8); x.d = 0.6, 0.8
    expected = 0.5 * max(math.exp(-20 * (1 - 0.6)), math.exp(-20 * (1 - 0.8)))
    assert llu.alpha(f).item() == pytest.approx(expected, rel=1e-6)


def test_llu_keeps_far_away_embeddings_and_updates_near_ones():
    llu = LLU(2, beta=0.5, gamma=20.0, lam=1e3)
    llu.representatives = torch.tensor([[1.0, 0.0]])
    with torch.no_grad():
        llu.g.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # a swap, far from the identity
    far, near = torch.tensor([[-1.0, 0.0]]), torch.tensor([[1.0, 0.0]])
    assert torch.allclose(llu(far), far, atol=1e-12)  # alpha = 0.5 exp(-40) ~ 2e-18
    assert torch.allclose(llu(near), torch.tensor([[0.5, 0.5]]))  # alpha = beta = 0.5
    assert llu.regularizer().item() > 0


def test_llu_clustering_bounds_the_representatives():
    feats = torch.randn(300, 8)
    reps = cluster_representatives(feats, k=20, max_inputs=200)
    assert reps.shape == (20, 8) and torch.allclose(reps.norm(dim=1), torch.ones(20), atol=1e-5)
    few = cluster_representatives(feats[:5], k=20, max_inputs=200)
    assert few.shape == (5, 8)


def test_llu_representatives_survive_save_and_load():
    _, model, cfg, _ = _adapted("llu")
    state = model.state_dict()
    fresh = TeacherClassifier(apply_adapter(_tiny(), cfg), 3, freeze_norm=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.backbone.model.adapter.representatives, model.backbone.model.adapter.representatives)


def test_msa_masks_against_a_hand_built_case():
    from vfm_toolchain.teachers.adapters.msa import band_mask_1d, grid_mask_2d, scale_masks

    band = band_mask_1d(4, 2).int()
    assert band.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    # 3x3 grid, width 2: a patch sees its 8-neighbourhood (Chebyshev distance < 2)
    g = grid_mask_2d(3, 3, 2)
    assert g.shape == (9, 9) and torch.equal(g, g.T)
    corner, centre = g[0].int().view(3, 3).tolist(), g[4].int().view(3, 3).tolist()
    assert corner == [[1, 1, 0], [1, 1, 0], [0, 0, 0]] and centre == [[1, 1, 1]] * 3
    assert grid_mask_2d(3, 3, 1).int().sum() == 9  # width 1: only itself
    # not a band matrix: row-major neighbours across a row end are not neighbours (patch 2 vs 3)
    assert not grid_mask_2d(3, 3, 2)[2, 3]
    m = scale_masks((3, 3), [3, 2, 1], prefix=1)
    assert m.shape == (3, 10, 10) and m[:, 0].all() and m[:, :, 0].all() and m[0].all()
    # width 2 on 3x3: corners see 4, edges 6, the centre 9 -> 49; the CLS row and column add 19
    assert [int(x.sum()) for x in m] == [100, 49 + 19, 9 + 19]


def test_msa_concatenated_pass_equals_per_branch_loop():
    from vfm_toolchain.teachers.adapters.msa import masked_attention, scale_masks

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 4) for _ in range(3))
    masks = scale_masks((3, 3), [3, 2, 1], prefix=1)
    together = masked_attention(q, k, v, masks, 0.5)
    for s in range(3):
        scores = (q * 0.5) @ k.transpose(-2, -1)
        scores = scores.masked_fill(~masks[s], float("-inf"))
        assert torch.allclose(together[:, s], scores.softmax(-1) @ v, atol=1e-6)
    # the large scale covers the grid: it is exactly the original attention
    full = ((q * 0.5) @ k.transpose(-2, -1)).softmax(-1) @ v
    assert torch.allclose(together[:, 0], full, atol=1e-6)


def test_msa_with_zero_side_blocks_is_exactly_the_base_model():
    base = _tiny()
    model = TeacherClassifier(apply_adapter(copy.deepcopy(base), AdapterConfig(name="msa", init_std=0.0)), 3, True)
    for m in model.modules():  # also silence the FFN bottleneck
        if type(m).__name__ == "Bottleneck":
            for p in m.parameters():
                torch.nn.init.zeros_(p)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (model.forward_features(x) - base(x)).abs().max() < 1e-5
    with pytest.raises(ToolchainError, match="large"):
        apply_adapter(_tiny(), AdapterConfig(name="msa", widths=[1, 1]))


def test_grappa_fusion_weights_sum_to_one_per_sample():
    from vfm_toolchain.teachers.adapters.grappa import grappa_blocks

    _, model, _, x = _adapted("grappa")
    blocks = grappa_blocks(model.backbone.model)
    assert len(blocks) == 2 and blocks[0].down.shape == (4, 192, 16) and blocks[0].up.shape == (4, 16, 192)
    with torch.no_grad():
        for b in blocks:
            b.up.add_(0.05 * torch.randn(b.up.shape))
        model(x)
    w = blocks[0].last_weights
    assert w.shape == (6, 4) and torch.allclose(w.sum(dim=1), torch.ones(6), atol=1e-6)
    assert w.std(dim=0).sum() > 0  # per-sample weights, not one global mix


def test_grappa_pretrain_learns_each_granularity_without_labels(tiny_task, tmp_path):
    import logging
    import os

    from vfm_toolchain.teachers.adapters import PretrainContext, pretrain_adapter
    from vfm_toolchain.teachers.adapters.grappa import grappa_blocks

    cfg = AdapterConfig(name="grappa", hidden=8, granularities=[2, 3], pretrain_epochs=1, pool_images=10)
    backbone = apply_adapter(_tiny(), cfg)
    train = sorted(str(p) for p in Path(tiny_task["train"]).rglob("*.png"))
    pool = sorted(os.path.join(tiny_task["pools"][0], f) for f in os.listdir(tiny_task["pools"][0]))
    pretrain_adapter(backbone, cfg, PretrainContext(train, pool, backbone.preprocess, 0, 8, tmp_path,
                                                    logging.getLogger("t")))
    for blk in grappa_blocks(backbone.model):
        assert blk.up[0].abs().sum() > 0 and blk.up[1].abs().sum() > 0  # both adaptors trained
        assert not blk.up.requires_grad and blk.Q.weight.requires_grad  # phase 2: only the fusion trains
    assert (tmp_path / "grappa_adaptors.pt").is_file()


def _silence_side_branches(model):
    for m in model.modules():
        if type(m).__name__ == "PyramidFuse":
            with torch.no_grad():
                d = m.weight.shape[1]
                m.weight[d:].zero_()
        if type(m).__name__ == "Bottleneck":
            for p in m.parameters():
                torch.nn.init.zeros_(p)


def test_msa_on_open_clip_image_and_text_towers():
    import open_clip

    from vfm_toolchain.teachers.adapters.msa import msa_text_tower
    from vfm_toolchain.teachers.backbones import create_backbone

    torch.manual_seed(0)
    base = create_backbone("open_clip:ViT-B-32", "none", 64)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = base(x)
    adapted = apply_adapter(copy.deepcopy(base), AdapterConfig(name="msa", init_std=0.0))
    _silence_side_branches(adapted)
    with torch.no_grad():
        assert (adapted(x) - ref).abs().max() < 1e-4  # large scale = full attention on the 2x2 grid + CLS
    # text: 1D bands on the 77-token sequence, on top of the causal mask
    clip = open_clip.create_model("ViT-B-32")
    tokens = open_clip.get_tokenizer("ViT-B-32")(["a photo of a cat", "a diagram"])
    with torch.no_grad():
        text_ref = clip.encode_text(tokens)
        msa_text_tower(clip, init_std=0.0)
        _silence_side_branches(clip)
        assert (clip.encode_text(tokens) - text_ref).abs().max() < 1e-4
        for m in clip.transformer.modules():  # the side scales change the text features once they have weight
            if type(m).__name__ == "PyramidFuse":
                m.weight[m.weight.shape[1]:].normal_(std=0.05)
        assert (clip.encode_text(tokens) - text_ref).abs().max() > 1e-3


def test_lora_on_open_clip_trains_attention_and_merges_exactly():
    """nn.MultiheadAttention reads its packed in_proj_weight and out_proj.weight directly: LoRA must target the
    attention module itself (PEFT's MultiheadAttention layer), or attention never adapts."""
    from vfm_toolchain.teachers.backbones import create_backbone

    torch.manual_seed(0)
    backbone = apply_adapter(create_backbone("open_clip:ViT-B-32", "none", 32), AdapterConfig(name="lora", r=4, alpha=8))
    model = TeacherClassifier(backbone, 3, freeze_norm=True)
    wrapped = [m for m in model.modules() if isinstance(m, torch.nn.Module) and hasattr(m, "lora_A")
               and type(m).__module__.startswith("peft") and type(m).__name__ == "MultiheadAttention"]
    assert len(wrapped) == 12  # every block's attention, QKV and output projection together
    attn_lora = {n: p for n, p in model.named_parameters() if ".attn." in n and "lora_" in n}
    x, y = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 0, 1, 2])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(4):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == 0:  # attention's LoRA weights receive gradients (B starts at zero, so A's are zero at step 0)
            b_grads = [p.grad for n, p in attn_lora.items() if "lora_B" in n]
            assert b_grads and all(g is not None and g.abs().sum() > 0 for g in b_grads)
        opt.step()
    assert all(p.abs().sum() > 0 for n, p in attn_lora.items() if "lora_B" in n)  # B != 0: the merge means something
    model.eval()
    with torch.no_grad():
        unmerged = model(x)
        folded = copy.deepcopy(model)
        folded.backbone = fold_adapter(folded.backbone, AdapterConfig(name="lora", r=4, alpha=8))
        assert not [n for n, _ in folded.named_modules() if "lora_" in n]
        assert (folded(x) - unmerged).abs().max() < 1e-5
        attention = [m for m in folded.modules() if type(m).__name__ == "MultiheadAttention"]
        assert len(attention) == 12 and all(type(m) is torch.nn.MultiheadAttention for m in attention)


def test_bottleneck_is_linear_by_default_and_the_gelu_variant_refuses_to_fold():
    """Seed 001 eq. 5 has no nonlinearity: the default folds exactly; Houlsby's GELU is opt-in and does not."""
    base = _tiny()
    cfg = AdapterConfig(name="bottleneck", hidden=16, activation="gelu")
    model = TeacherClassifier(apply_adapter(copy.deepcopy(base), cfg), 3, freeze_norm=True).eval()
    with torch.no_grad():
        for p in model.backbone.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        x = torch.randn(2, 3, 32, 32)
        assert (model.forward_features(x) - base(x)).abs().max() > 1e-3
    with pytest.raises(ToolchainError, match="activation: gelu does not fold"):
        fold_adapter(model.backbone, cfg)
