"""Normalisation layers a finetune keeps as they were (the classification and detection teachers both)."""
from __future__ import annotations

from torch import nn

__all__ = ["keep_norm_frozen"]


def keep_norm_frozen(backbone: nn.Module) -> None:
    """BatchNorm layers of a backbone in eval mode while the rest trains: an adapter finetune on a few labels keeps
    the pretrained statistics (a handful of small batches would overwrite them)."""
    for m in backbone.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
