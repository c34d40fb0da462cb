"""``grappa``: granularity-aware adaptor fusion (seed 000, Algorithm 1).

Every ViT block gets N bottleneck adaptors and an attention that fuses them per sample:

    x = h1 + MSA(LN(h1));  y = MLP(LN(x));  h = y + x
    U_i = Adaptor_i(h) + y                        (B, T, N, D)
    q = pool_T(h) Q;  k_i = pool_T(U_i) K;  a = softmax_i(k_i . q)
    out = sum_i a_i U_i + x

Adaptors start at zero, so every U_i = y and the block is exactly the original one.  Training is in
two phases, the first needing no labels: (1) adaptor i is trained alone (the fusion pinned to it) to
classify pseudo-labels from k-means with k_i clusters on the frozen backbone's features, one k per
adaptor (the pseudo-granularities); (2) the fusion (Q, K) and the head train on the labels with the
adaptors frozen.  Nonlinear and input-dependent: it does not fold.
"""
from __future__ import annotations

import random
from typing import List, Optional

import numpy as np
import torch
from pydantic import Field
from torch import nn

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions, PretrainContext
from vfm_toolchain.teachers.adapters.blocks import transformer_blocks

__all__ = ["GrappaBlock", "grappa_blocks"]


class GrappaBlock(nn.Module):
    def __init__(self, block: nn.Module, adaptors: int, hidden: int):
        super().__init__()
        for needed in ("norm1", "attn", "norm2", "mlp"):
            if not hasattr(block, needed):
                raise ToolchainError("grappa supports timm ViT blocks (norm1, attn, norm2, mlp); "
                                     f"{type(block).__name__} differs")
        self.block = block
        dim = block.attn.proj.out_features
        self.down = nn.Parameter(torch.randn(adaptors, dim, hidden) * dim ** -0.5)
        self.up = nn.Parameter(torch.zeros(adaptors, hidden, dim))  # zero: U_i = y at initialisation
        self.act = nn.GELU()
        self.Q = nn.Linear(dim, dim, bias=False)
        self.K = nn.Linear(dim, dim, bias=False)
        self.only: Optional[int] = None  # pin the fusion to one adaptor (pseudo-label phase)
        self.last_weights: Optional[torch.Tensor] = None

    def forward(self, h1: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:  # (B, T, D)
        b = self.block
        ls1 = getattr(b, "ls1", nn.Identity())
        ls2 = getattr(b, "ls2", nn.Identity())
        x = h1 + ls1(b.attn(b.norm1(h1)))
        y = ls2(b.mlp(b.norm2(x)))
        h = y + x
        U = torch.einsum("btd,ndk->btnk", h, self.down)                    # (B, T, N, hidden)
        U = torch.einsum("btnk,nkd->btnd", self.act(U), self.up) + y.unsqueeze(2)  # (B, T, N, D)
        if self.only is not None:
            weights = torch.zeros(h.shape[0], U.shape[2], dtype=h.dtype, device=h.device)
            weights[:, self.only] = 1.0
        else:
            q = self.Q(h.mean(dim=1))                                      # (B, D)
            k = self.K(U.mean(dim=1))                                      # (B, N, D)
            weights = torch.einsum("bnd,bd->bn", k, q).softmax(dim=1)      # (B, N), sums to one
        self.last_weights = weights.detach()
        f = torch.einsum("btnd,bn->btd", U, weights)
        return f + x


def grappa_blocks(model: nn.Module) -> List[GrappaBlock]:
    return [m for m in model.modules() if isinstance(m, GrappaBlock)]


class GrappaOptions(AdapterOptions):
    granularities: List[int] = Field(default_factory=lambda: [4, 8, 16, 32],
                                     description="k of the k-means pseudo-labels, one adaptor each (N = len)")
    hidden: int = Field(128, ge=1, description="adaptor bottleneck width")
    pretrain_epochs: int = Field(5, ge=0, description="epochs per adaptor on pseudo-labels (0: skip)")
    pretrain_lr: float = Field(1e-3, gt=0)
    pool_images: int = Field(1000, ge=0, description="unlabeled pool images added to the pseudo-label set")


def apply(backbone, opts: GrappaOptions):
    backbone.requires_grad_(False)
    model = backbone.model
    blocks = {id(b) for b in transformer_blocks(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in blocks:
                setattr(parent, name, GrappaBlock(child, len(opts.granularities), opts.hidden))
    backbone.grappa_options = opts
    return backbone


def pretrain(backbone, ctx: PretrainContext) -> None:
    """Phase 1: each adaptor learns its pseudo-granularity, without labels; then freezes for phase 2."""
    import faiss

    from vfm_toolchain.recipe import LabelTrainConfig
    from vfm_toolchain.teachers.embed import embed_backbone
    from vfm_toolchain.training import fit_classifier

    opts: GrappaOptions = backbone.grappa_options
    blocks = grappa_blocks(backbone.model)
    done = ctx.workdir / "grappa_adaptors.pt"
    if done.is_file():
        state = torch.load(done, map_location="cpu", weights_only=True)
        for blk, (down, up) in zip(blocks, state):
            blk.down.data.copy_(down)
            blk.up.data.copy_(up)
    elif opts.pretrain_epochs > 0:
        rng = random.Random(ctx.seed)
        pool = rng.sample(ctx.pool_paths, min(opts.pool_images, len(ctx.pool_paths)))
        paths = list(ctx.train_paths) + pool
        feats = embed_backbone(backbone, paths, ctx.preprocess).numpy().astype(np.float32)  # adaptors are identity now
        feats /= np.linalg.norm(feats, axis=1, keepdims=True) + 1e-12
        for i, k in enumerate(opts.granularities):
            k = max(2, min(k, len(paths) // 2))
            km = faiss.Kmeans(feats.shape[1], k, niter=20, seed=ctx.seed + i, verbose=False)
            km.train(feats)
            _, labels = km.index.search(feats, 1)
            items = [(p, int(c)) for p, c in zip(paths, labels[:, 0])]
            for blk in blocks:
                blk.only = i
            head = _PseudoHead(backbone, k)
            params = [blk.down for blk in blocks] + [blk.up for blk in blocks]
            for p in params:
                p.requires_grad_(True)
            masks = _row_masks(blocks, i)
            hooks = [p.register_hook(lambda g, m=m: g * m) for p, m in zip(params, masks)]  # train adaptor i only
            cfg = LabelTrainConfig(epochs=opts.pretrain_epochs, lr=opts.pretrain_lr, batch_size=ctx.batch_size,
                                   weight_decay=0.0)
            fit_classifier(head, [{"params": params + list(head.head.parameters()), "lr": opts.pretrain_lr}],
                           items, ctx.preprocess, cfg, ctx.workdir / f"grappa_{i}.pt", ctx.log, ctx.seed,
                           f"grappa adaptor {i + 1}/{len(opts.granularities)} (k={k})")
            for hook in hooks:
                hook.remove()
        torch.save([(blk.down.detach().clone(), blk.up.detach().clone()) for blk in blocks], done)
    for blk in blocks:  # phase 2: the fusion (Q, K) trains on labels, the adaptors stay fixed
        blk.only = None
        blk.down.requires_grad_(False)
        blk.up.requires_grad_(False)
        blk.Q.requires_grad_(True)
        blk.K.requires_grad_(True)


def _row_masks(blocks, i):
    masks = []
    for blk in blocks:
        m = torch.zeros_like(blk.down)
        m[i] = 1
        masks.append(m)
    for blk in blocks:
        m = torch.zeros_like(blk.up)
        m[i] = 1
        masks.append(m)
    return masks


class _PseudoHead(nn.Module):
    def __init__(self, backbone, k: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, k)

    def forward(self, x):
        return self.head(self.backbone(x))


def fusion_train_mode(backbone) -> None:
    for blk in grappa_blocks(backbone.model):
        blk.Q.requires_grad_(True)
        blk.K.requires_grad_(True)


def apply_and_unfreeze_fusion(backbone, opts: GrappaOptions):
    backbone = apply(backbone, opts)
    fusion_train_mode(backbone)
    return backbone


ADAPTERS.register("grappa", foldable=False, trains="adaptors (pseudo-labels) + fusion (labels)",
                  source="seed 000 Algorithm 1", identity="exact (adaptors start at zero)")(
    Adapter(GrappaOptions, apply_and_unfreeze_fusion, pretrain=pretrain))
