"""Several processes under ``torchrun``: who this process is, and waiting for the others.

``torchrun --nproc_per_node N -m vfm_toolchain.cli build recipe.yaml`` starts N copies of the build.  Every
copy walks the pipeline and computes the same stage keys; a stage marked ``distributed`` runs on every
process (each does its share, rank 0 writes the output), any other stage runs on rank 0 while the others
wait.  NCCL on GPU, gloo on CPU.  Several machines need a store on a shared filesystem.
"""
from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init", "shutdown", "rank", "world", "is_main", "barrier", "broadcast", "device"]


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def init(device: str = "auto") -> None:
    """Join the process group torchrun describes in the environment; nothing to do for one process.
    ``device`` is the recipe's: NCCL when it resolves to CUDA, gloo otherwise."""
    if world() <= 1 or dist.is_initialized():
        return
    from vfm_toolchain.devices import resolve

    target = resolve(device)
    cuda = target.type == "cuda"
    if cuda:
        torch.cuda.set_device(target)
    # ranks wait at barriers while rank 0 trains a teacher: the default 30 minutes is too short
    hours = float(os.environ.get("VFM_DIST_TIMEOUT_HOURS", "24"))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=hours))
    # a group left to the interpreter's teardown can abort the process ("terminate called without an active
    # exception" from gloo's threads), turning a finished build into a failed torchrun
    atexit.register(shutdown)


def shutdown() -> None:
    """Leave the process group (every rank, at exit)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def device() -> torch.device:
    """This process's device under the build's policy (toolchain/devices.py)."""
    from vfm_toolchain.devices import current

    return current().device
