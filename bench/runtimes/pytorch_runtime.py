"""PyTorch eager on the CPU (or the current CUDA device), for a model object."""
from __future__ import annotations

import numpy as np
import torch

from bench.runtimes.base import RUNTIMES


@RUNTIMES.register("pytorch", artifact=[], devices="cpu, cuda")  # times model objects, no file
def load_pytorch(model: torch.nn.Module, threads=None):
    if threads:
        torch.set_num_threads(threads)
    model = model.eval()

    @torch.inference_mode()
    def run(x: np.ndarray) -> np.ndarray:
        return model(torch.from_numpy(x)).numpy()

    return run
