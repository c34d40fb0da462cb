"""``bottleneck``: adapters after attention and/or FFN, two branches averaged (seed 001 eq. 5).

    f_bo = f + F((f W1) W2, (f W3) W4),   F = mean,  W1, W3: d x d_a,  W2, W4: d_a x d

Weights are drawn from N(0, variance 1e-3) without bias (seed 001 A.2: "0/1e-3 for means/variances"),
so the adapter starts near the identity.  Eq. 5 has no nonlinearity between the projections, so the
adapter is linear: f (I + M) with M = mean_b(W_down_b W_up_b), and it folds exactly into the projection
before it, like ``pyramid``.  ``activation: gelu`` puts Houlsby et al.'s GELU between them (not the
seed's adapter); that one does not fold, and a build that exports such a teacher exports the extra ops.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from vfm_toolchain.teachers.adapters.blocks import After, fold_linear_adapter, insert_after, remove_after, transformer_blocks


class BottleneckOptions(AdapterOptions):
    hidden: int = Field(128, ge=1, description="bottleneck width d_a")
    where: Literal["attn", "mlp", "both"] = "both"
    branches: int = Field(2, ge=1, description="bottlenecks averaged at each insertion point")
    init_std: float = Field(1e-3 ** 0.5, gt=0, description="std of the initial weights (variance 1e-3)")
    activation: Literal["none", "gelu"] = Field("none", description="none: seed 001 eq. 5, linear, folds; "
                                                                    "gelu: Houlsby's nonlinearity, does not fold")


class Bottleneck(nn.Module):
    def __init__(self, dim: int, hidden: int, branches: int, init_std: float, activation: str = "none"):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(dim, hidden, bias=False) for _ in range(branches))
        self.up = nn.ModuleList(nn.Linear(hidden, dim, bias=False) for _ in range(branches))
        for layer in (*self.down, *self.up):
            nn.init.normal_(layer.weight, std=init_std)
        self.act = nn.GELU() if activation == "gelu" else nn.Identity()

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        return f + torch.stack([up(self.act(down(f))) for down, up in zip(self.down, self.up)]).mean(0)

    def matrix(self) -> torch.Tensor:
        """I + mean_b(W_down_b^T W_up_b^T): the d x d map a linear bottleneck applies (y' = y M)."""
        m = torch.stack([down.weight.T @ up.weight.T for down, up in zip(self.down, self.up)]).mean(0)
        return torch.eye(m.shape[0], dtype=m.dtype, device=m.device) + m


def apply(backbone, opts: BottleneckOptions):
    backbone.requires_grad_(False)
    insert_after(backbone.model, opts.where, lambda dim, slot: Bottleneck(dim, opts.hidden, opts.branches,
                                                                          opts.init_std, opts.activation))
    return backbone


def fold(backbone):
    for block in transformer_blocks(backbone.model):
        for slot in ("attn", "mlp"):
            wrapped = getattr(block, slot)
            if isinstance(wrapped, After) and not isinstance(wrapped.adapter.act, nn.Identity):
                raise ToolchainError("adapter 'bottleneck' with activation: gelu does not fold into plain weights; "
                                     "its extra ops are exported as they are (activation: none, seed 001 eq. 5, "
                                     "folds)")
    remove_after(backbone.model, fold_linear_adapter)
    return backbone


ADAPTERS.register("bottleneck", foldable=True, trains="bottleneck adapters", source="seed 001 eq. 5",
                  identity="near (weights of variance 1e-3)")(Adapter(BottleneckOptions, apply, fold))
