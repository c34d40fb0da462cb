"""``msa`` and ``msa_lora``: multi-scale attention ensembles (seed 001 sec. 3, eqs. 7-11, A.2).

Each ViT attention is split into three scales by masks: on the 2D patch grid (vision, eq. 8) a patch i
sees patch j when max(|x_i - x_j|, |y_i - y_j|) < D; on a 1D token sequence (text, eq. 7) when
|i - j| < D.  Prefix tokens (CLS, registers) see and are seen by every token.  The large scale covers the
whole grid, so it is the original attention.  All scales run in one concatenated pass: the masks are a
(S, N, N) stack broadcast against the scores, one softmax, one product with V (seed 001 Table 7's
parallel form), checked against a per-branch loop in the tests.

``msa``: the branch outputs are fused by a pyramid projection, f = [f_L, f_M, f_S] W (eq. 10), whose
large-scale block starts as the identity and the others small (std ``init_std``, variance 1e-3 as in
A.2), plus a linear bottleneck adapter (eq. 5) after the FFN.  ``msa_lora``: eq. 11 with a LoRA B shared by all branches and one A per branch
(rank 16): the large branch adds B A_L x parallel to the attention, the middle and small branches add
B A_* f_* after theirs, and the three are summed; after the FFN, one shared A and three B's, summed.
Neither folds: the masked branches are extra ops.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from vfm_toolchain.teachers.adapters.blocks import After, transformer_blocks
from vfm_toolchain.teachers.adapters.bottleneck import Bottleneck

__all__ = ["grid_mask_2d", "band_mask_1d", "scale_masks", "MultiScaleAttention", "MultiScaleMHA", "masked_attention",
           "install_msa", "msa_text_tower"]


def band_mask_1d(length: int, width: int) -> torch.Tensor:
    """Eq. 7: (T, T) bool, True where |i - j| < width."""
    i = torch.arange(length)
    return (i[:, None] - i[None, :]).abs() < width


def grid_mask_2d(rows: int, cols: int, width: int) -> torch.Tensor:
    """Eq. 8: (P, P) bool over row-major patches, True where max(|x_i - x_j|, |y_i - y_j|) < width."""
    k = torch.arange(rows * cols)
    x, y = k // cols, k % cols
    return torch.maximum((x[:, None] - x[None, :]).abs(), (y[:, None] - y[None, :]).abs()) < width


def scale_masks(grid: Sequence[int], widths: Sequence[int], prefix: int) -> torch.Tensor:
    """(S, N, N) masks for N = prefix + rows * cols tokens; prefix tokens are unmasked."""
    rows, cols = grid
    out = []
    for w in widths:
        m = torch.ones(prefix + rows * cols, prefix + rows * cols, dtype=torch.bool)
        m[prefix:, prefix:] = grid_mask_2d(rows, cols, w)
        out.append(m)
    return torch.stack(out)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: torch.Tensor, scale: float,
                     additive: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All scales at once: q, k, v (B, H, N, d), masks (S, N, N) -> (B, S, H, N, d).

    ``additive`` (N, N) is the model's own mask (a text tower's causal -inf), applied on top."""
    scores = (q * scale) @ k.transpose(-2, -1)                         # (B, H, N, N)
    if additive is not None:
        scores = scores + additive
    scores = scores.unsqueeze(1).masked_fill(~masks[None, :, None], float("-inf"))  # (B, S, H, N, N)
    return scores.softmax(dim=-1) @ v.unsqueeze(1)                     # (B, S, H, N, d)


class MultiScaleAttention(nn.Module):
    """Wraps a timm ``Attention``: same q, k, v and output projection, S masked branches.

    ``fuse`` maps the branch outputs (B, S, N, C) and the block input x (B, N, C) to (B, N, C).
    """

    def __init__(self, attn: nn.Module, masks: torch.Tensor, fuse: nn.Module):
        super().__init__()
        for needed in ("qkv", "num_heads", "proj"):
            if not hasattr(attn, needed):
                raise ToolchainError("msa supports timm ViT attention (qkv, proj); this backbone's attention differs")
        self.attn = attn
        self.register_buffer("masks", masks, persistent=False)
        self.fuse = fuse

    def branches(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, C) -> (B, S, N, C)
        a = self.attn
        B, N, C = x.shape
        qkv = a.qkv(x).reshape(B, N, 3, a.num_heads, C // a.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = a.q_norm(q), a.k_norm(k)
        out = masked_attention(q, k, v, self.masks, a.scale)           # (B, S, H, N, d)
        out = out.permute(0, 1, 3, 2, 4).reshape(B, self.masks.shape[0], N, C)
        out = a.norm(out) if hasattr(a, "norm") else out
        return a.proj_drop(a.proj(out))

    def forward(self, x: torch.Tensor, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ToolchainError("msa does not combine with an external attention mask")
        return self.fuse(self.branches(x), x)


class MultiScaleMHA(nn.Module):
    """The same for ``nn.MultiheadAttention`` (open_clip towers): masks for a patch grid, or 1D bands
    built for the sequence length at hand (text, eq. 7), combined with the model's own causal mask."""

    def __init__(self, mha: nn.MultiheadAttention, widths: Sequence[int], fuse: nn.Module,
                 grid: Optional[Sequence[int]] = None, prefix: int = 0):
        super().__init__()
        if not mha._qkv_same_embed_dim or not mha.batch_first:
            raise ToolchainError("msa supports batch-first self-attention with a packed in_proj (open_clip)")
        self.mha, self.widths, self.fuse, self.grid, self.prefix = mha, list(widths), fuse, grid, prefix
        self._masks: dict = {}

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["mha"], name)

    def masks(self, n: int, device) -> torch.Tensor:
        if n not in self._masks:
            if self.grid is not None:
                m = scale_masks(self.grid, self.widths, self.prefix)
            else:
                m = torch.stack([band_mask_1d(n, w) for w in self.widths])
            self._masks[n] = m
        return self._masks[n].to(device)

    def forward(self, query, key=None, value=None, need_weights: bool = False, attn_mask=None, **kwargs):
        if key is not None and key is not query:
            raise ToolchainError("msa applies to self-attention only")
        m = self.mha
        B, N, C = query.shape
        qkv = F.linear(query, m.in_proj_weight, m.in_proj_bias)
        q, k, v = qkv.view(B, N, 3, m.num_heads, C // m.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        masks = self.masks(N, query.device)
        additive = None
        if attn_mask is not None:
            additive = attn_mask if attn_mask.dtype != torch.bool else \
                torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(attn_mask, float("-inf"))
        out = masked_attention(q, k, v, masks, (C // m.num_heads) ** -0.5, additive)  # (B, S, H, N, d)
        out = m.out_proj(out.permute(0, 1, 3, 2, 4).reshape(B, masks.shape[0], N, C))  # (B, S, N, C)
        return self.fuse(out, query), None


class PyramidFuse(nn.Module):
    """Eq. 10: [f_L, f_M, f_S] W with W's large-scale block starting as the identity."""

    def __init__(self, dim: int, scales: int, init_std: float):
        super().__init__()
        w = torch.randn(scales * dim, dim) * init_std
        w[:dim] = torch.eye(dim)
        self.weight = nn.Parameter(w)

    def forward(self, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # f: (B, S, N, C)
        B, S, N, C = f.shape
        return f.permute(0, 2, 1, 3).reshape(B, N, S * C) @ self.weight


class LoraFuse(nn.Module):
    """Eq. 11: f_* + B A_* (.), B shared (zero-init), branches summed."""

    def __init__(self, dim: int, scales: int, rank: int):
        super().__init__()
        self.A = nn.Parameter(torch.empty(scales, rank, dim))
        nn.init.kaiming_uniform_(self.A.view(scales * rank, dim), a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(dim, rank))

    def forward(self, f: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # f: (B, S, N, C), x: (B, N, C)
        # the large branch's low-rank path runs parallel to the attention (on x), the others after it (on f_*)
        inputs = torch.cat([x.unsqueeze(1), f[:, 1:]], dim=1)             # (B, S, N, C)
        low = torch.einsum("bsnc,src->bsnr", inputs, self.A)               # (B, S, N, r), one pass for all
        return (f + low @ self.B.T).sum(dim=1)                             # (B, N, C)


class LoraFFN(nn.Module):
    """After the FFN: one A, S B's concatenated (the parallel form), outputs summed."""

    def __init__(self, dim: int, branches: int, rank: int):
        super().__init__()
        self.A = nn.Linear(dim, rank, bias=False)
        self.B = nn.Linear(rank, branches * dim, bias=False)
        nn.init.zeros_(self.B.weight)
        self.branches = branches

    def forward(self, y: torch.Tensor) -> torch.Tensor:  # (B, N, C)
        out = self.B(self.A(y))                                            # (B, N, S*C)
        return y + out.view(*y.shape[:-1], self.branches, y.shape[-1]).sum(-2)


class MSAOptions(AdapterOptions):
    widths: Optional[List[int]] = Field(None, description="mask widths D (patches) for large, middle, small; "
                                                          "None: whole grid, half, quarter")
    init_std: float = Field(1e-3 ** 0.5, ge=0, description="std of the middle/small pyramid blocks, large = identity "
                                                           "(seed 001 A.2: variance 1e-3)")
    ffn_hidden: int = Field(128, ge=1, description="bottleneck width after the FFN")


class MSALoraOptions(AdapterOptions):
    widths: Optional[List[int]] = None
    rank: int = Field(16, ge=1)


def _grid(model: nn.Module):
    """(rows, cols) of the patch grid and the number of prefix tokens: timm ViT or open_clip visual."""
    for m in model.modules():
        pe = getattr(m, "patch_embed", None)
        if getattr(pe, "grid_size", None) is not None:
            return tuple(pe.grid_size), int(getattr(m, "num_prefix_tokens", 1))
        if getattr(m, "class_embedding", None) is not None and getattr(m, "grid_size", None) is not None:
            return tuple(m.grid_size), 1  # open_clip VisionTransformer: one class token
    raise ToolchainError("msa needs a ViT image tower (timm or open_clip) with a patch grid")


def _widths(side: int, widths):
    widths = widths or [side, max(1, math.ceil(side / 2)), max(1, math.ceil(side / 4))]
    if len(widths) < 2 or widths[0] < side:
        raise ToolchainError(f"msa widths {widths}: the first (large) scale must cover the grid (>= {side}) "
                             f"so that it is the original attention, and at least two scales are needed")
    return widths


def install_msa(model: nn.Module, widths, make_fuse, make_ffn, sequence_length: Optional[int] = None) -> None:
    """Put multi-scale attention into every block of ``model``: on its patch grid, or, with
    ``sequence_length``, on a 1D token sequence (a text tower)."""
    if sequence_length is None:
        grid, prefix = _grid(model)
        widths = _widths(max(grid), widths)
    else:
        grid, prefix = None, 0
        widths = _widths(sequence_length, widths)
    for block in transformer_blocks(model):
        if isinstance(block.attn, nn.MultiheadAttention):
            dim = block.attn.embed_dim
            block.attn = MultiScaleMHA(block.attn, widths, make_fuse(dim, len(widths)), grid, prefix)
        else:
            if grid is None:
                raise ToolchainError("1D (text) multi-scale attention supports nn.MultiheadAttention towers")
            dim = block.attn.proj.out_features
            block.attn = MultiScaleAttention(block.attn, scale_masks(grid, widths, prefix), make_fuse(dim, len(widths)))
        block.mlp = After(block.mlp, make_ffn(dim, len(widths)))


def _install(backbone, widths, make_fuse, make_ffn):
    backbone.requires_grad_(False)
    install_msa(backbone.model, widths, make_fuse, make_ffn)
    return backbone


def msa_text_tower(clip_model: nn.Module, widths=None, init_std: float = 1e-3 ** 0.5, ffn_hidden: int = 128) -> nn.Module:
    """MSA with 1D band masks (eq. 7) in an open_clip model's text transformer, in place."""
    install_msa(clip_model.transformer, widths, lambda d, s: PyramidFuse(d, s, init_std),
                lambda d, s: Bottleneck(d, ffn_hidden, branches=1, init_std=1e-3 ** 0.5),
                sequence_length=clip_model.context_length)
    return clip_model


def apply_msa(backbone, opts: MSAOptions):
    return _install(backbone, opts.widths, lambda d, s: PyramidFuse(d, s, opts.init_std),
                    lambda d, s: Bottleneck(d, opts.ffn_hidden, branches=1, init_std=1e-3 ** 0.5))


def apply_msa_lora(backbone, opts: MSALoraOptions):
    return _install(backbone, opts.widths, lambda d, s: LoraFuse(d, s, opts.rank),
                    lambda d, s: LoraFFN(d, s, opts.rank))


ADAPTERS.register("msa", foldable=False, trains="pyramid over masked attention scales + FFN bottleneck",
                  source="seed 001 eqs. 7-10",
                  identity="no: large scale = identity, but the middle/small blocks (variance 1e-3, A.2) add "
                           "about sqrt(d / 1000) times their branch outputs")(
    Adapter(MSAOptions, apply_msa))
ADAPTERS.register("msa_lora", foldable=False, trains="low-rank per-scale updates, shared B",
                  source="seed 001 eq. 11, A.2", identity="no (eq. 11 sums the three scales)")(
    Adapter(MSALoraOptions, apply_msa_lora))
