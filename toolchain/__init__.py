"""vfm-toolchain: turn a vision foundation model into a small, fast, on-device model with one command."""

__version__ = "0.1.0"

import logging as _logging

# torchao (present with the [edge] extra, imported by PEFT whenever it is installed) registers two enums with
# torch's pytree at import, and torch 2.14 logs a deprecation warning for each on every start; it says nothing
# about the user's build, so that one logger is quieted (its errors still show)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
