"""``full``: every backbone weight trains.  Nothing to fold."""
from teachers.adapters.base import ADAPTERS


def apply(backbone, cfg):
    for p in backbone.parameters():
        p.requires_grad_(True)
    return backbone


ADAPTERS.register("full", foldable=True, trains="all weights", source="full finetuning")(
    {"apply": apply, "fold": lambda backbone: backbone})
