"""Teacher adapters, one file each, registered in :data:`ADAPTERS` with whether they fold into plain weights.

Contract (documented once, here):
    ``apply(backbone, cfg) -> backbone``  makes the backbone trainable the adapter's way (in place).
    ``fold(backbone) -> backbone``        (foldable adapters only) returns plain weights computing the same.
"""
from teachers.adapters.base import ADAPTERS, apply_adapter, fold_adapter
from teachers.adapters import linear, full, lora  # noqa: F401  (register)

__all__ = ["ADAPTERS", "apply_adapter", "fold_adapter"]
