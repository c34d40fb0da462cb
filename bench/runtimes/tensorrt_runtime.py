"""TensorRT: a serialized engine from ``export.formats.tensorrt`` run through its execution context on
the GPU.  Without TensorRT or an NVIDIA GPU the bench records it as unavailable with the reason."""
from __future__ import annotations

from bench.runtimes.base import RUNTIMES, Unavailable
from export.formats.base import Skipped


@RUNTIMES.register("tensorrt", runs="tensorrt", devices="nvidia gpu")
def load_tensorrt(path, threads=None):
    from export.formats.tensorrt_format import load_engine

    try:
        run = load_engine(path)
    except Skipped as why:
        raise Unavailable(str(why)) from None
    run.provider = "tensorrt"
    return run
