"""PyTorch eager for a model object, on the build's device (toolchain/devices.py): the CPU, or a CUDA GPU, where
each timed call includes the host-device copies an app pays and ends when the output is back on the host."""
from __future__ import annotations

import numpy as np
import torch

from bench.runtimes.base import RUNTIMES
from toolchain.devices import current


@RUNTIMES.register("pytorch", runs=None, devices="cpu, cuda")  # times model objects, no file
def load_pytorch(model: torch.nn.Module, threads=None):
    if threads:
        torch.set_num_threads(threads)
    device = current().device
    model = model.eval().to(device)

    @torch.inference_mode()
    def run(x: np.ndarray) -> np.ndarray:
        return model(torch.from_numpy(x).to(device)).cpu().numpy()  # .cpu() waits for the GPU

    run.provider = str(device) if device.type == "cuda" else None
    return run
