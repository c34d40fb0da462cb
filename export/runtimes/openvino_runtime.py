"""OpenVINO: an IR (``model.xml`` + ``model.bin``) compiled for the CPU with the given thread count, latency
mode and fp32 inference precision (OpenVINO would otherwise run an fp32 IR in bf16 on CPUs with AMX,
which is a different model from the one the parity gate checked)."""
from __future__ import annotations

import numpy as np

from .base import Unavailable, artifact, described

ENTRIES = {"openvino": {"runs": "openvino", "devices": "cpu"}}


def no_telemetry():
    """OpenVINO (on import and on each conversion) and NNCF send usage telemetry from a forked process unless the user
    opted out in ``~/intel/openvino_telemetry``. A build must not phone home, and forking a process that runs JAX,
    XNNPACK and ONNX Runtime threads is unsafe (the child inherits locks held by threads that do not exist in it), so
    the toolchain declines consent for its own calls only, leaving the user's global setting as it is."""
    import contextlib
    from unittest import mock

    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:  # openvino without its telemetry package sends nothing
        return contextlib.nullcontext()
    return mock.patch.object(OptInChecker, "check", lambda self, *a, **k: ConsentCheckResult.DECLINED)


def import_openvino():
    with no_telemetry():
        import openvino

    return openvino


def load(path, threads=None, device: str = "CPU"):
    path = artifact(path, "openvino")
    try:
        ov = import_openvino()
    except ImportError as why:
        raise Unavailable(f"openvino is not installed ({why}); pip install openvino") from None
    core = ov.Core()
    if device not in core.available_devices:
        raise Unavailable(f"OpenVINO here has {core.available_devices}, not {device}")
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    compiled = core.compile_model(str(path), device, config)
    request = compiled.create_infer_request()

    def run(x: np.ndarray) -> np.ndarray:
        return np.array(request.infer([np.ascontiguousarray(x, dtype=np.float32)])[0])

    return described(run, f"openvino {device}", threads)
