"""``lora``: low-rank updates W + (alpha/r) B A through PEFT, merged exactly into W at export.

Default targets: every ``nn.Linear`` (ViT ``qkv``/``proj``/MLP), every ``nn.MultiheadAttention`` and every
1x1 ``nn.Conv2d`` without groups in the backbone.  Depthwise convolutions are left out: PEFT's LoRA does not
merge them exactly.

``nn.MultiheadAttention`` (OpenCLIP towers, torchvision ViTs) reads its packed ``in_proj_weight`` and
``out_proj.weight`` as tensors inside ``F.multi_head_attention_forward``: a LoRA wrapped around ``out_proj``
as a Linear is never called, and the QKV projection is not a module at all.  So the attention module itself
is the target, through PEFT's ``MultiheadAttention`` layer, which adapts both projections and merges them
back; its ``out_proj`` child is never targeted on its own (PEFT says not to).
"""
from __future__ import annotations

import sys
from typing import List, Optional

from pydantic import Field
from torch import nn

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions


class LoraOptions(AdapterOptions):
    r: int = Field(8, ge=1, description="rank of the update")
    alpha: float = Field(16.0, gt=0, description="scale alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Optional[List[str]] = Field(
        None, description="module names (suffix match); None picks every Linear and 1x1 Conv2d without groups")


def default_targets(model: nn.Module) -> List[str]:
    attention = {name for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    names = []
    for name, m in model.named_modules():
        if name.rpartition(".")[0] in attention:  # out_proj of an attention module: adapted through it
            continue
        if isinstance(m, (nn.Linear, nn.MultiheadAttention)) or (
                isinstance(m, nn.Conv2d) and m.groups == 1 and m.kernel_size == (1, 1)):
            names.append(name)
    return names


def apply(backbone, cfg):
    targets = cfg.target_modules or default_targets(backbone.model)
    if not targets:
        raise ToolchainError("lora: the backbone has no Linear, MultiheadAttention or 1x1 Conv2d layers to adapt; "
                             "set teacher.adapter.target_modules or use adapter 'full'")
    # PEFT is imported here, not with the registry: it pulls in transformers, about 3 s of every process's start
    # on 2 cores (each memory probe, each CLI call) that never builds a LoRA
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets)
    try:
        backbone.model = LoraModel(backbone.model, config, "default")
    except ValueError as exc:  # PEFT: target modules not found
        raise ToolchainError(f"lora: {exc}. Valid targets are module names such as "
                             f"{default_targets(backbone.model)[:5]}") from None
    return backbone


def fold(backbone):
    lora = sys.modules.get("peft.tuners.lora")  # not imported: nothing here was built with a LoRA
    if lora is not None and isinstance(backbone.model, lora.LoraModel):
        backbone.model = backbone.model.merge_and_unload(safe_merge=True)
    return backbone


ADAPTERS.register("lora", foldable=True, trains="low-rank updates", source="LoRA (Hu et al.) via PEFT",
                  identity="exact (B starts at zero)")(
    Adapter(LoraOptions, apply, fold))
