from toolchain.registry import Registry

__all__ = ["RUNTIMES"]

RUNTIMES = Registry("runtime")
