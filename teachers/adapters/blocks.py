"""Finding transformer blocks and inserting modules after their attention / FFN outputs.

timm ViTs (DINOv2) and open_clip towers both build blocks with ``attn`` and ``mlp`` children whose outputs
are added to the residual stream; an adapter inserted "after attention" transforms that output before
the addition (seed 001 Fig. 2).  Works on any model whose blocks follow that convention.
"""
from __future__ import annotations

from typing import Callable, List

import torch
from torch import nn

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["After", "transformer_blocks", "insert_after", "output_linear", "fold_linear_adapter", "WHERE"]

WHERE = {"attn": ("attn",), "mlp": ("mlp",), "both": ("attn", "mlp")}


class After(nn.Module):
    """``adapter(inner(...))``; for modules returning a tuple (nn.MultiheadAttention) the first element."""

    def __init__(self, inner: nn.Module, adapter: nn.Module):
        super().__init__()
        self.inner = inner
        self.adapter = adapter

    def __getattr__(self, name: str):
        # the model's own code may read attributes of the wrapped module (open_clip reads mlp.c_fc's dtype)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.adapter(out[0]), *out[1:])
        return self.adapter(out)


def transformer_blocks(model: nn.Module) -> List[nn.Module]:
    blocks = [m for m in model.modules() if isinstance(getattr(m, "attn", None), nn.Module)
              and isinstance(getattr(m, "mlp", None), nn.Module)]
    if not blocks:
        raise ToolchainError("this adapter needs a transformer backbone with attention and MLP blocks "
                             "(timm ViT / DINOv2, open_clip); use 'lora', 'linear' or 'full' for ConvNets")
    return blocks


def output_linear(module: nn.Module) -> nn.Linear:
    """The last Linear of a module: the projection whose output the adapter sees (attn.proj, mlp.fc2)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ToolchainError(f"{type(module).__name__} has no Linear output projection")
    return linears[-1]


def insert_after(model: nn.Module, where: str, make: Callable[[int, str], nn.Module]) -> int:
    """Wrap ``attn`` and/or ``mlp`` of every block; ``make(dim, slot)`` builds one adapter.  Returns the count."""
    n = 0
    for block in transformer_blocks(model):
        for slot in WHERE[where]:
            inner = getattr(block, slot)
            if isinstance(inner, After):
                raise ToolchainError("an adapter is already inserted in this backbone")
            setattr(block, slot, After(inner, make(output_linear(inner).out_features, slot)))
            n += 1
    return n


@torch.no_grad()
def fold_linear_adapter(inner: nn.Module, adapter: nn.Module) -> None:
    """Fold a linear adapter y -> y M (``adapter.matrix()`` is M) into the projection y = x A^T + b before it:
    A' = (A^T M)^T = M^T A, b' = b M."""
    proj = output_linear(inner)
    m = adapter.matrix()
    proj.weight.copy_(m.T @ proj.weight)
    if proj.bias is not None:
        proj.bias.copy_(proj.bias @ m)


def remove_after(model: nn.Module, fold: Callable[[nn.Module, nn.Module], None]) -> None:
    """Replace every ``After`` by its inner module after ``fold(inner, adapter)`` absorbed the adapter."""
    for block in transformer_blocks(model):
        for slot in ("attn", "mlp"):
            wrapped = getattr(block, slot)
            if isinstance(wrapped, After):
                fold(wrapped.inner, wrapped.adapter)
                setattr(block, slot, wrapped.inner)


class ThenAdapter(nn.Module):
    """``adapter(model(x))``: an adapter on the pooled / CLS embedding (CLIP-Adapter, LLU)."""

    def __init__(self, model: nn.Module, adapter: nn.Module):
        super().__init__()
        self.model = model
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.model(x))  # (B, D)
