from toolchain.registry import Registry

__all__ = ["RUNTIMES", "Unavailable"]

# each entry declares ``runs``: the runtime family whose artifacts it loads, matched against the ``runtime``
# a format declares (export/formats/base.py), so a new format of an existing family touches no runtime file
RUNTIMES = Registry("runtime")


class Unavailable(Exception):
    """The runtime cannot run on this machine (library or hardware missing); the message is the reason the
    bench records beside the artifact instead of a timing."""
