from toolchain.registry import Registry

__all__ = ["RUNTIMES", "Unavailable"]

RUNTIMES = Registry("runtime")


class Unavailable(Exception):
    """The runtime cannot run on this machine (library or hardware missing); the message is the reason the
    bench records beside the artifact instead of a timing."""
