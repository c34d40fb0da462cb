"""``pyramid``: the ensemble f + [f, ..., f] W (seed 001 eq. 1) after attention and/or FFN.

W is N stacked d x d blocks, each a base learner; [f,...,f] W = f (W_1 + ... + W_N), so the adapter is
linear and folds exactly into the projection before it: A' = (I + M)^T A, b' = b (I + M).  W starts at
zero: the adapter starts as the exact identity.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from vfm_toolchain.teachers.adapters.blocks import fold_linear_adapter, insert_after, remove_after


class PyramidOptions(AdapterOptions):
    copies: int = Field(2, ge=1, description="N, the number of concatenated copies (base learners)")
    where: Literal["attn", "mlp", "both"] = "both"


class Pyramid(nn.Module):
    def __init__(self, dim: int, copies: int):
        super().__init__()
        self.copies = copies
        self.weight = nn.Parameter(torch.zeros(copies * dim, dim))  # W_ens: (N d, d)

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # (..., D)
        return f + torch.cat([f] * self.copies, dim=-1) @ self.weight

    def matrix(self) -> torch.Tensor:
        """I + sum of the N blocks: the d x d map the adapter applies."""
        d = self.weight.shape[1]
        eye = torch.eye(d, dtype=self.weight.dtype, device=self.weight.device)
        return eye + self.weight.view(self.copies, d, d).sum(0)


def apply(backbone, opts: PyramidOptions):
    backbone.requires_grad_(False)
    insert_after(backbone.model, opts.where, lambda dim, slot: Pyramid(dim, opts.copies))
    return backbone


def fold(backbone):
    remove_after(backbone.model, fold_linear_adapter)
    return backbone


ADAPTERS.register("pyramid", foldable=True, trains="pyramid ensemble projections", source="seed 001 eq. 1",
                  identity="exact (W starts at zero)")(Adapter(PyramidOptions, apply, fold))
