"""``bottleneck``: Houlsby adapters after attention and/or FFN, two branches averaged (seed 001 eq. 5).

    f_bo = f + F((f W1) W2, (f W3) W4),   F = mean,  W1, W3: d x d_a,  W2, W4: d_a x d

Weights are drawn from N(0, variance 1e-3) without bias (seed 001 A.2: "0/1e-3 for means/variances"),
so the adapter starts near the identity; a GELU sits between the projections as in Houlsby et al.  The
nonlinearity is why it does not fold: a build that exports such a teacher exports the extra ops.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from teachers.adapters.blocks import insert_after


class BottleneckOptions(AdapterOptions):
    hidden: int = Field(128, ge=1, description="bottleneck width d_a")
    where: Literal["attn", "mlp", "both"] = "both"
    branches: int = Field(2, ge=1, description="bottlenecks averaged at each insertion point")
    init_std: float = Field(1e-3 ** 0.5, gt=0, description="std of the initial weights (variance 1e-3)")


class Bottleneck(nn.Module):
    def __init__(self, dim: int, hidden: int, branches: int, init_std: float):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(branches))
        self.up = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(branches))
        for layer in (*self.down, *self.up):
            nn.init.normal_(layer.weight, std=init_std)
        self.act = nn.GELU()

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        return f + torch.stack([up(self.act(down(f))) for down, up in zip(self.down, self.up)]).mean(0)


def apply(backbone, opts: BottleneckOptions):
    backbone.requires_grad_(False)
    insert_after(backbone.model, opts.where, lambda dim, slot: Bottleneck(dim, opts.hidden, opts.branches,
                                                                          opts.init_std))
    return backbone


ADAPTERS.register("bottleneck", foldable=False, trains="bottleneck adapters", source="seed 001 eq. 5 (Houlsby)",
                  identity="near (weights of variance 1e-3)")(Adapter(BottleneckOptions, apply))
