"""The one device policy: where every network in the build runs, and how.

``device: auto | cpu | cuda | cuda:N`` in the recipe (``auto``: CUDA when present).  The runner sets the
policy once per build (``use``); stages never pick a device themselves, they ask this module:

- ``current().device``           where training, embedding, teacher-output caching, scoring and the probe run
                                 (under torchrun each process takes its ``LOCAL_RANK`` GPU)
- ``on_device(model)``           a block with the model on that device, put back where it was afterwards
- ``inference_autocast()``       fp16 autocast for inference on CUDA (pool embedding, teacher outputs);
                                 nothing on the CPU, where half precision is slower and less exact
- ``training_autocast(amp)``     bfloat16 autocast for training on CUDA (``train.amp``)
- ``loader_kwargs()``            pinned memory on CUDA, so host-to-device copies overlap compute
- ``EXPORT_DEVICE``              export and its parity reference run in fp32 on the CPU whatever the policy:
                                 the exporters trace CPU graphs, and the reference must be the exact model

Stage outputs do not depend on the device for their validity, so the device is not part of a stage key: a
store filled on a GPU server serves a CPU laptop, and the other way round.
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

import torch

from toolchain.errors import ToolchainError
from toolchain.recipe import DEVICE_PATTERN

__all__ = ["DevicePolicy", "resolve", "use", "current", "on_device", "inference_autocast", "training_autocast",
           "loader_kwargs", "EXPORT_DEVICE", "DEVICE_PATTERN"]

EXPORT_DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class DevicePolicy:
    device: torch.device

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve(spec: str = "auto") -> torch.device:
    """The device a recipe's ``device`` names on this machine.

    Raises:
        ToolchainError: CUDA asked for where there is none, or a GPU index that does not exist.
    """
    if not re.match(DEVICE_PATTERN, spec):
        raise ToolchainError(f"device '{spec}' is not one of auto, cpu, cuda, cuda:N")
    local = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun: one GPU per process
    if spec == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", local) if available else torch.device("cpu")
    if not available:
        raise ToolchainError(f"device '{spec}' asked for, but this machine has no CUDA device that PyTorch can use "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); set device: auto or cpu")
    index = int(spec.split(":")[1]) if ":" in spec else local
    count = torch.cuda.device_count()
    if index >= count:
        raise ToolchainError(f"device '{spec}': this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


_current: Optional[DevicePolicy] = None


def current() -> DevicePolicy:
    """The build's policy; outside a build (tests, notebooks) what ``auto`` resolves to."""
    return _current or DevicePolicy(resolve("auto"))


@contextlib.contextmanager
def use(spec: str) -> Iterator[DevicePolicy]:
    """Set the policy for the block (one build)."""
    global _current
    previous, _current = _current, DevicePolicy(resolve(spec))
    if _current.cuda:
        torch.cuda.set_device(_current.device)
    try:
        yield _current
    finally:
        _current = previous


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


@contextlib.contextmanager
def on_device(module: torch.nn.Module) -> Iterator[torch.device]:
    """``module`` on the policy's device for the block, then back where it was (stages keep models on the CPU
    between steps, so GPU memory holds one network at a time)."""
    home, device = _device_of(module), current().device
    module.to(device)
    try:
        yield device
    finally:
        module.to(home)


def inference_autocast() -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.float16) if current().cuda else contextlib.nullcontext()


def training_autocast(amp: bool) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if amp and current().cuda else contextlib.nullcontext()


def loader_kwargs() -> Dict[str, Any]:
    return {"pin_memory": current().cuda}
