"""``linear``: frozen backbone, only the new head trains (a linear probe).  Nothing to fold."""
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions


class LinearOptions(AdapterOptions):
    pass


def apply(backbone, opts):
    backbone.requires_grad_(False)
    return backbone


ADAPTERS.register("linear", foldable=True, trains="head only", source="linear probe", identity="exact")(
    Adapter(LinearOptions, apply, fold=lambda backbone: backbone))
