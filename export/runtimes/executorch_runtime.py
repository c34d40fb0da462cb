"""ExecuTorch: a ``.pte`` program run by ``executorch.runtime`` (the portable runtime with the XNNPACK backend, the
CPU path of a phone), with XNNPACK's thread pool set to the given thread count.  Programs are exported at batch
1, as a phone app runs them; a larger batch runs one image after another."""
from __future__ import annotations

from .base import Unavailable, artifact, described, per_image
from .nms import with_nms

ENTRIES = {"executorch": {"runs": "executorch", "devices": "cpu (xnnpack)", "from_record": ("runtime_nms",)}}


def load(path, threads=None, runtime_nms=None):
    """``runtime_nms``: a detector's candidates program is finished by the shared NMS (nms.py) with these settings."""
    path = artifact(path, "executorch")
    try:
        import torch
        from executorch.runtime import Runtime
    except ImportError as why:
        raise Unavailable(f"executorch is not installed ({why}); pip install executorch") from None
    try:  # the kernels of quantize / dequantize ops left outside XNNPACK (an int8 detector's decoding), which
        import executorch.kernels.quantized  # noqa: F401  # apps link as quantized_ops_lib
    except ImportError:
        pass
    if threads:
        # one process-wide pool (the last load sets it), the way a phone app configures it
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

        _unsafe_reset_threadpool(int(threads))
    try:
        method = Runtime.get().load_program(str(path)).load_method("forward")
    except RuntimeError as why:  # a backend this build of the runtime lacks (Core ML, Vulkan, QNN subgraphs)
        raise Unavailable(f"executorch could not load {path}: {why}") from None

    run = per_image(lambda x: method.execute([torch.from_numpy(x)])[0].numpy())
    return described(with_nms(run, runtime_nms) if runtime_nms else run, f"xnnpack ({threads or 'default'} threads)",
                     threads)
