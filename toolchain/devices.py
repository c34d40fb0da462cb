"""The one device policy: where every network in the build runs, and how.

``device: auto | cpu | cuda | cuda:N`` in the recipe (``auto``: CUDA when present).  The runner sets the
policy once per build (``use``); stages never pick a device themselves, they ask this module:

- ``current().device``           where training, embedding, teacher-output caching, scoring and the probe run
                                 (under torchrun each process takes its ``LOCAL_RANK`` GPU)
- ``on_device(model)``           a block with the model on that device, put back where it was afterwards
- ``inference_autocast()``       fp16 autocast for inference on CUDA (pool embedding, teacher outputs);
                                 nothing on the CPU, where half precision is slower and less exact
- ``training_autocast(amp)``     bfloat16 autocast for training on CUDA (``train.amp``)
- ``loader_kwargs()``            pinned memory and decoding workers on CUDA (``data.workers``: auto is 0 on the
                                 CPU, where decoding would take cores from compute, and up to 8 per process
                                 on CUDA, where one process cannot decode fast enough to feed the GPU)
- ``inference_batch_size(...)``  a batch size given in the recipe, or ``auto``: 64 on the CPU, and on CUDA the
                                 largest power of two whose measured memory fits in the free GPU memory
- ``faiss_gpu()``                the GPU pool indexes go to: the policy's CUDA device when faiss-gpu is
                                 installed, else None (faiss-cpu searches; the wheels on PyPI for torch's CUDA
                                 13 are CPU-only, docs/development.md, "GPU / Docker")
- ``generator_state()``         the policy's CUDA generator state for checkpoints (None on the CPU), and
  ``set_generator_state(s)``     its restore: dropout and drop-path on a GPU draw from it, so an exact resume
                                 needs it beside the CPU generator's
- ``describe(threads)``          the machine in words for reports: the CPU model (``cpu_name()``), and the GPU
                                 under a CUDA policy
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
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import DEVICE_PATTERN

__all__ = ["DevicePolicy", "resolve", "use", "current", "on_device", "inference_autocast", "training_autocast",
           "loader_kwargs", "loader_workers", "inference_batch_size", "batch_from_memory", "faiss_gpu", "cpu_name", "describe",
           "generator_state", "set_generator_state",
           "EXPORT_DEVICE", "DEVICE_PATTERN"]

EXPORT_DEVICE = torch.device("cpu")


@dataclass(frozen=True)
class DevicePolicy:
    device: torch.device
    workers: Union[int, str] = "auto"  # data.workers

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
    if spec == "auto" and not available:
        return torch.device("cpu")
    if not available:
        raise ToolchainError(f"device '{spec}' asked for, but this machine has no CUDA device that PyTorch can use "
                             f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); set device: auto or cpu")
    index = int(spec.split(":")[1]) if ":" in spec else local
    count = torch.cuda.device_count()
    if index >= count and ":" not in spec:  # auto or cuda under torchrun: one GPU per process on this node
        raise ToolchainError(f"device '{spec}': torchrun started process {index} on this node (LOCAL_RANK), but it has "
                             f"{count} CUDA device(s), one per process: use --nproc_per_node {count} or less, or "
                             f"device: cpu")
    if index >= count:
        raise ToolchainError(f"device '{spec}': this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


_current: Optional[DevicePolicy] = None


def cuda_gpus() -> list:
    """The properties of every CUDA device PyTorch sees (``toolchain doctor`` lists them): what ``auto`` picks from."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]


def current() -> DevicePolicy:
    """The build's policy; outside a build (tests, notebooks) what ``auto`` resolves to."""
    return _current or DevicePolicy(resolve("auto"))


@contextlib.contextmanager
def use(spec: str, workers: Union[int, str] = "auto") -> Iterator[DevicePolicy]:
    """Set the policy for the block (one build): the recipe's ``device`` and ``data.workers``."""
    global _current
    previous, _current = _current, DevicePolicy(resolve(spec), workers)
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


def loader_workers(policy: Optional[DevicePolicy] = None) -> int:
    """Decoding worker processes per loader: the recipe's number, or for ``auto`` 0 on the CPU and
    min(8, CPUs per process) on CUDA."""
    policy = policy or current()
    if policy.workers != "auto":
        return int(policy.workers)
    if not policy.cuda:
        return 0
    per_process = (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(0, min(8, per_process - 1))  # one core stays with the process that drives the GPU


def loader_kwargs() -> Dict[str, Any]:
    """What every DataLoader in a stage takes from the policy."""
    workers = loader_workers()
    return {"pin_memory": current().cuda, "num_workers": workers, "persistent_workers": False,
            **({"prefetch_factor": 4} if workers else {})}


def generator_state(policy: Optional[DevicePolicy] = None) -> Optional[torch.Tensor]:
    """The CUDA generator's state on the policy's device (a CPU byte tensor, safe for weights_only loading), or
    None under a CPU policy."""
    policy = policy or current()
    return torch.cuda.get_rng_state(policy.device) if policy.cuda else None


def set_generator_state(state: Optional[torch.Tensor], policy: Optional[DevicePolicy] = None) -> None:
    """Restore what ``generator_state`` saved.  A checkpoint from a CPU run (None) resumed on a GPU, or one from a
    GPU resumed on the CPU, restores the CPU generator alone: the run continues, not bit for bit."""
    policy = policy or current()
    if state is not None and policy.cuda:
        torch.cuda.set_rng_state(state, policy.device)


def cpu_name() -> str:
    """The processor's model ("AMD EPYC 7B13") where Linux says it, else what ``platform`` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def describe(threads: int, policy: Optional[DevicePolicy] = None) -> str:
    """Where latency was measured, for the report: "AMD EPYC 7B13 (2 threads)", plus "; NVIDIA H200 (cuda:0)"
    under a CUDA policy.  CPU rows and GPU rows of one bench table ran on different chips: the reader needs both."""
    policy = policy or current()
    text = f"{cpu_name() or 'CPU'} ({threads} threads)"
    if policy.cuda:
        text += f"; {torch.cuda.get_device_name(policy.device)} ({policy.device})"
    return text


def faiss_gpu(policy: Optional[DevicePolicy] = None) -> Optional[int]:
    """The GPU number faiss indexes are placed on, or None for the CPU (no CUDA policy, or no faiss-gpu)."""
    import faiss

    policy = policy or current()
    if not policy.cuda or not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        return None
    return policy.device.index or 0


CPU_BATCH = 64  # inference batch on the CPU: larger only costs memory there


def batch_from_memory(free_bytes: int, peak_1: int, peak_8: int, fraction: float = 0.7, limit: int = 1024) -> int:
    """The largest power of two whose memory fits in ``fraction`` of ``free_bytes``, from the peak memory of one
    forward pass at batch 1 and at batch 8 (memory grows linearly with the batch: a fixed part for weights and
    workspace, a per-image part for activations)."""
    per_image = max((peak_8 - peak_1) / 7.0, 1.0)
    fixed = max(peak_1 - per_image, 0.0)
    fits = int((free_bytes * fraction - fixed) // per_image)
    if fits < 1:
        return 1
    return min(limit, 1 << (fits.bit_length() - 1))


def inference_batch_size(requested: Union[int, str], forward: Callable[[int], Any], limit: int = 1024) -> int:
    """Batch size for a no-grad forward pass over many images (pool embedding, teacher outputs).

    ``requested`` is the recipe's value: a number is used as it is; ``auto`` is ``CPU_BATCH`` on the CPU and, on
    CUDA, measured: ``forward(b)`` runs the network on a batch of ``b`` blank inputs at 1 and 8, and
    ``batch_from_memory`` fits the rest of the free GPU memory."""
    if requested != "auto":
        return int(requested)
    policy = current()
    if not policy.cuda:
        return CPU_BATCH
    device = policy.device

    def peak(b: int) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.no_grad(), inference_autocast():
            forward(b)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    peak_1, peak_8 = peak(1), peak(8)
    free, _ = torch.cuda.mem_get_info(device)
    return batch_from_memory(free, peak_1, peak_8, limit=limit)
