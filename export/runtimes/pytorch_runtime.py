"""PyTorch eager for a model object (no file: it does not travel to a device), on the device it is given: the CPU,
or a CUDA GPU, where each timed call includes the host-device copies an app pays and ends when the output is back
on the host.  The toolchain passes the build's device (toolchain/devices.py, its one device policy)."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, described

# runs=None: it times model objects; build_device: the toolchain passes the build's device (export/runtimes/__init__.py)
ENTRIES = {"pytorch": {"runs": None, "devices": "cpu, cuda", "build_device": True}}


def load(model, threads=None, device="cpu"):
    try:
        import torch
    except ImportError as why:
        raise Unavailable(f"torch is not installed ({why})") from None
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the pytorch runtime times a torch.nn.Module, not {type(model).__name__}; an exported "
                        f"file runs on the runtime of its format (toolchain list runtimes)")
    if threads:
        torch.set_num_threads(int(threads))
    device = torch.device(device)
    model = model.eval().to(device)

    @torch.inference_mode()
    def run(x: np.ndarray) -> np.ndarray:
        return model(torch.from_numpy(x).to(device)).cpu().numpy()  # .cpu() waits for the GPU

    return described(run, str(device), threads or torch.get_num_threads())
