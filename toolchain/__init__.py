"""vfm-toolchain: turn a vision foundation model into a small, fast, on-device model with one command."""

__version__ = "0.1.0"
