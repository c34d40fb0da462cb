"""``linear``: frozen backbone, only the new head trains (a linear probe).  Nothing to fold."""
from teachers.adapters.base import ADAPTERS


def apply(backbone, cfg):
    for p in backbone.parameters():
        p.requires_grad_(False)
    return backbone


ADAPTERS.register("linear", foldable=True, trains="head only", source="linear probe")(
    {"apply": apply, "fold": lambda backbone: backbone})
