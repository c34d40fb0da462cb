"""``llu``: localized latent updates (seed 002).

An affine map g (initialised at the identity) is applied to the embedding only near the training data:

    f' = alpha(x, D) * g(f) + (1 - alpha(x, D)) * f,     alpha(x, D) = beta * max_{d in D} exp(-gamma (1 - x.d))

with x the normalised embedding and D representatives of the training embeddings: all of them, or at most
``max_representatives`` cluster centres (agglomerative clustering, complete linkage on cosine distance,
centre = normalised mean).  The identity regulariser lambda (||W - I||_2 + ||b||_2) keeps g close to the
identity.  Far from the training data alpha -> 0 and the original embedding is kept, which is what
preserves zero-shot behaviour.  The backbone is frozen: training never backpropagates through it.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions
from vfm_toolchain.teachers.adapters.blocks import ThenAdapter


class LLUOptions(AdapterOptions):
    beta: float = Field(0.5, ge=0, le=1)
    gamma: float = Field(20.0, gt=0)
    lam: float = Field(1e3, ge=0, description="identity regularisation weight lambda")
    max_representatives: int = Field(512, ge=1)
    max_cluster_inputs: int = Field(8192, ge=2, description="training embeddings sampled for clustering "
                                                            "(complete linkage needs n^2 memory)")


class LLU(nn.Module):
    def __init__(self, dim: int, beta: float, gamma: float, lam: float):
        super().__init__()
        self.beta, self.gamma, self.lam = beta, gamma, lam
        self.g = nn.Linear(dim, dim)
        with torch.no_grad():
            self.g.weight.copy_(torch.eye(dim))
            self.g.bias.zero_()
        self.register_buffer("representatives", torch.zeros(0, dim))  # D: (K, dim), unit rows

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # the number of representatives is data dependent: take the saved one's shape
        key = prefix + "representatives"
        if key in state_dict:
            self.representatives = torch.empty_like(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def alpha(self, f: torch.Tensor) -> torch.Tensor:  # (B,)
        if self.representatives.numel() == 0:
            return torch.zeros(f.shape[0], dtype=f.dtype, device=f.device)
        x = F.normalize(f, dim=-1)
        sim = x @ self.representatives.T  # (B, K)
        return self.beta * torch.exp(-self.gamma * (1 - sim)).max(dim=1).values

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # (B, D)
        a = self.alpha(f).unsqueeze(1)
        return a * self.g(f) + (1 - a) * f

    def regularizer(self) -> torch.Tensor:
        # ||.||_2 of the matrix entries (Frobenius): its gradient is 0 at the identity, where g starts,
        # so the penalty only pulls back once the task loss has moved g (the spectral norm's SVD gradient
        # is arbitrary there and would kick g away from the identity with force lambda).
        eye = torch.eye(self.g.weight.shape[0], dtype=self.g.weight.dtype, device=self.g.weight.device)
        return self.lam * ((self.g.weight - eye).norm() + self.g.bias.norm())


def cluster_representatives(features: torch.Tensor, k: int, max_inputs: int, seed: int = 0) -> torch.Tensor:
    """At most ``k`` unit-norm representatives of ``features`` (N, D)."""
    x = F.normalize(features.float(), dim=1)
    if len(x) <= k:
        return x
    if len(x) > max_inputs:
        x = x[torch.from_numpy(np.random.default_rng(seed).choice(len(x), max_inputs, replace=False))]
    from sklearn.cluster import AgglomerativeClustering

    labels = AgglomerativeClustering(n_clusters=k, linkage="complete", metric="cosine").fit_predict(x.numpy())
    centres = torch.stack([x[torch.from_numpy(labels == c)].mean(0) for c in range(k)])
    return F.normalize(centres, dim=1)


def _llu(backbone) -> LLU:
    return backbone.model.adapter


def apply(backbone, opts: LLUOptions):
    backbone.requires_grad_(False)
    llu = LLU(backbone.num_features, opts.beta, opts.gamma, opts.lam)
    llu.max_representatives, llu.max_cluster_inputs = opts.max_representatives, opts.max_cluster_inputs
    backbone.model = ThenAdapter(backbone.model, llu)
    return backbone


def init_from_features(backbone, features: torch.Tensor) -> None:
    llu = _llu(backbone)
    llu.representatives = cluster_representatives(features, llu.max_representatives, llu.max_cluster_inputs)


ADAPTERS.register("llu", foldable=False, trains="affine map near the training data", source="seed 002",
                  identity="exact (g starts at the identity)")(
    Adapter(LLUOptions, apply, init_from_features=init_from_features, regularizer=lambda b: _llu(b).regularizer()))
