"""``full``: every backbone weight trains.  Nothing to fold."""
from vfm_toolchain.teachers.adapters.base import ADAPTERS, Adapter, AdapterOptions


class FullOptions(AdapterOptions):
    pass


def apply(backbone, opts):
    backbone.requires_grad_(True)
    return backbone


ADAPTERS.register("full", foldable=True, trains="all weights", source="full finetuning", identity="exact")(
    Adapter(FullOptions, apply, fold=lambda backbone: backbone))
