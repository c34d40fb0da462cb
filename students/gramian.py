"""Extra heads with a decorrelation loss, deployed as a partial network: the training regime seed 003's
appendix reports, with a head of this project's own design.

What comes from seed 003 (its appendix is all we have of it): lightweight extra classification heads
trained beside the main one with a decorrelation loss that keeps them from being alike; the backbone
trained this way is better on its own ("w/o heads", Tables A-B); keeping a single head adds accuracy for
a negligible cost (Table C); partial networks are deployed by dropping heads (B.1).  The appendix does not
define the head's layers nor the loss's formula, so both below are this project's own, not the seed's:
a second-order (Gramian) pooling head, after the paper's title, and the loss written out below.  Each head:

    z = BN(Conv1x1(F))                       F: (B, C, h, w) -> z: (B, d, h*w)
    G = z z^T / (h*w)                         second-order (Gramian) pooling, (B, d, d)
    g = sign(G) sqrt(|G| + eps), upper triangle, L2-normalised
    logits = W g + b

Training loss: cross-entropy on the main head and on every extra head, plus ``decorrelation`` times the
mean squared correlation between the (batch-centred) logits of every pair of heads, which keeps the heads
from learning the same function.  ``deploy`` picks what ships: ``none`` (the plain timm model: backbone +
its linear head) or ``one`` (that plus head 0, logits averaged); the ``gramian_heads`` fold pass in
students/fold.py cuts the rest away.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GramianHead", "GramianStudent", "DeployedStudent", "gramian_loss"]


class GramianHead(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, dim: int = 32):
        super().__init__()
        self.reduce = nn.Sequential(nn.Conv2d(in_channels, dim, 1, bias=False), nn.BatchNorm2d(dim))
        self.register_buffer("triu", torch.triu_indices(dim, dim), persistent=False)
        self.fc = nn.Linear(dim * (dim + 1) // 2, num_classes)

    def forward(self, fmap: torch.Tensor) -> torch.Tensor:
        z = self.reduce(fmap).flatten(2)                              # (B, d, N)
        g = z @ z.transpose(1, 2) / z.shape[-1]                       # (B, d, d)
        g = torch.sign(g) * torch.sqrt(g.abs() + 1e-6)
        g = F.normalize(g[:, self.triu[0], self.triu[1]], dim=1)
        return self.fc(g)


class GramianStudent(nn.Module):
    """A timm student with ``heads`` extra Gramian heads.  Training forward: stacked logits
    ``(1 + heads, B, C)`` (main first); eval forward: the logits of the deployed path."""

    def __init__(self, model: nn.Module, num_classes: int, heads: int = 3, dim: int = 32, deploy: str = "none"):
        super().__init__()
        if deploy not in ("none", "one"):
            raise ValueError(f"gramian deploy '{deploy}': use 'none' or 'one'")
        self.model, self.deploy = model, deploy
        from vfm_toolchain.students.objectives import student_map_size

        channels = student_map_size(model, (64, 64))[0]
        self.heads = nn.ModuleList(GramianHead(channels, num_classes, dim) for _ in range(heads))

    def get_classifier(self) -> nn.Module:
        """Every classifier (the linear head and the Gramian heads), for head-only finetuning."""
        return nn.ModuleList([self.model.get_classifier(), self.heads])

    def forward_all(self, x: torch.Tensor) -> List[torch.Tensor]:
        fmap = self.model.forward_features(x)
        return [self.model.forward_head(fmap)] + [h(fmap) for h in self.heads]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return torch.stack(self.forward_all(x))
        fmap = self.model.forward_features(x)
        main = self.model.forward_head(fmap)
        return main if self.deploy == "none" else 0.5 * (main + self.heads[0](fmap))


class DeployedStudent(nn.Module):
    """What ships with ``deploy: one``: the backbone, its linear head and one Gramian head."""

    def __init__(self, model: nn.Module, head: GramianHead):
        super().__init__()
        self.model, self.head = model, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmap = self.model.forward_features(x)
        return 0.5 * (self.model.forward_head(fmap) + self.head(fmap))


def gramian_loss(stacked: torch.Tensor, y: torch.Tensor, ce: nn.Module, decorrelation: float) -> torch.Tensor:
    """Cross-entropy on every head + ``decorrelation`` x mean squared correlation between pairs of heads."""
    loss = sum(ce(logits, y) for logits in stacked)
    k = len(stacked)
    if k > 1 and decorrelation > 0:
        c = stacked - stacked.mean(dim=1, keepdim=True)               # centre over the batch
        c = F.normalize(c.flatten(1), dim=1)                           # (K, B*C)
        corr = c @ c.t()
        off = corr[~torch.eye(k, dtype=torch.bool, device=corr.device)]
        loss = loss + decorrelation * (off ** 2).mean()
    return loss
