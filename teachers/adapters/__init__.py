"""Teacher adapters, one file each, registered in :data:`ADAPTERS` with whether they fold into plain
weights.  The contract is documented once, in :mod:`teachers.adapters.base`."""
from vfm_toolchain.teachers.adapters.base import (ADAPTERS, PretrainContext, adapter_options, adapter_regularizer, apply_adapter,
                                    fold_adapter, init_adapter_from_features, needs_features, pretrain_adapter)
from vfm_toolchain.teachers.adapters import (linear, full, lora, bottleneck, pyramid, clip_adapter, llu, msa,  # noqa: F401
                               grappa)

__all__ = ["ADAPTERS", "PretrainContext", "pretrain_adapter", "adapter_options", "adapter_regularizer", "apply_adapter", "fold_adapter",
           "init_adapter_from_features", "needs_features"]
