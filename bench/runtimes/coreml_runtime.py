"""Core ML: an ``.mlpackage`` predicted through coremltools on macOS, with the compute units the recipe
exported for (Neural Engine included with ALL).  Elsewhere the bench records it as unavailable."""
from __future__ import annotations

from bench.runtimes.base import RUNTIMES, Unavailable
from export.formats.base import Skipped


@RUNTIMES.register("coreml", runs="coreml", devices="macOS (cpu, gpu, neural engine)")
def load_coreml(path, threads=None, compute_units: str = "ALL"):
    try:
        import coremltools  # noqa: F401
        from export.formats.coreml_format import load_mlpackage

        run = load_mlpackage(path, compute_units)
    except (ImportError, Skipped) as why:
        raise Unavailable(str(why)) from None
    run.provider = f"coreml ({compute_units})"
    return run
