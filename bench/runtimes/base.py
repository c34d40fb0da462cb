from toolchain.registry import Registry

__all__ = ["RUNTIMES", "Unavailable", "per_image"]

# each entry declares ``runs``: the runtime family whose artifacts it loads, matched against the ``runtime``
# a format declares (export/formats/base.py), so a new format of an existing family touches no runtime file
RUNTIMES = Registry("runtime")


def per_image(call):
    """``run(batch)`` for programs exported at batch 1 (ExecuTorch, LiteRT): the images one after another."""
    import numpy as np

    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return np.concatenate([call(x[i:i + 1]) for i in range(len(x))])
    return run


class Unavailable(Exception):
    """The runtime cannot run on this machine (library or hardware missing); the message is the reason the
    bench records beside the artifact instead of a timing."""
