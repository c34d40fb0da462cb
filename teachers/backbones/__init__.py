"""Teacher backbones, one file per model library; each registers a ``<library>:`` namespace.

A backbone maps images to pooled features ``(B, D)``, exposes ``num_features`` and carries the
:class:`~toolchain.data.Preprocess` its weights expect.
"""
from vfm_toolchain.teachers.backbones.base import BACKBONES, Backbone, create_backbone, resolve_weights
from vfm_toolchain.teachers.backbones import timm_backbone, open_clip_backbone, torchvision_backbone  # noqa: F401  (register)

__all__ = ["BACKBONES", "Backbone", "create_backbone", "resolve_weights"]
