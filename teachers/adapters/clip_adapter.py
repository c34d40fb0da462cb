"""``clip_adapter``: the CLIP-Adapter baseline (Gao et al.) the seeds compare against.

    f' = alpha * MLP(f) + (1 - alpha) * f,   MLP = Linear(d, d/r) ReLU Linear(d/r, d) ReLU

with one global residual ratio alpha, on the image embedding.  The last layer starts at zero, so at
initialisation f' = (1 - alpha) f: the base embedding up to scale (same direction, same predictions of a
cosine classifier).  Nonlinear: it does not fold.
"""
from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from vfm_toolchain.teachers.adapters.blocks import ThenAdapter


class ClipAdapterOptions(AdapterOptions):
    alpha: float = Field(0.2, ge=0, le=1, description="global residual ratio")
    reduction: int = Field(4, ge=1, description="hidden width d / reduction")


class ClipAdapter(nn.Module):
    def __init__(self, dim: int, alpha: float, reduction: int):
        super().__init__()
        self.alpha = alpha
        self.mlp = nn.Sequential(nn.Linear(dim, dim // reduction, bias=False), nn.ReLU(),
                                 nn.Linear(dim // reduction, dim, bias=False), nn.ReLU())
        nn.init.zeros_(self.mlp[2].weight)

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # (B, D)
        return self.alpha * self.mlp(f) + (1 - self.alpha) * f


def apply(backbone, opts: ClipAdapterOptions):
    backbone.requires_grad_(False)
    backbone.model = ThenAdapter(backbone.model, ClipAdapter(backbone.num_features, opts.alpha, opts.reduction))
    return backbone


ADAPTERS.register("clip_adapter", foldable=False, trains="residual MLP on the embedding",
                  source="CLIP-Adapter (Gao et al.), baseline in seeds 001/002", identity="up to scale")(
    Adapter(ClipAdapterOptions, apply))
