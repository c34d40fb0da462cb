"""Teacher adapters, one file each, registered in :data:`ADAPTERS` with whether they fold into plain
weights.  The contract is documented once, in :mod:`teachers.adapters.base`."""
from teachers.adapters.base import (ADAPTERS, adapter_options, adapter_regularizer, apply_adapter, fold_adapter,
                                    init_adapter_from_features, needs_features)
from teachers.adapters import linear, full, lora, bottleneck, pyramid, clip_adapter, llu, msa  # noqa: F401  (register)

__all__ = ["ADAPTERS", "adapter_options", "adapter_regularizer", "apply_adapter", "fold_adapter",
           "init_adapter_from_features", "needs_features"]
