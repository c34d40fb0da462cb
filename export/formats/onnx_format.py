"""ONNX: dynamic batch, opset verified in the written file, onnxslim clean-up, metadata in the model."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

from export.formats.base import FORMATS, ExportResult
from toolchain.errors import ToolchainError
from toolchain.store import atomic_write


@FORMATS.register("onnx", suffix=".onnx", devices="cpu, gpu", options=["opset", "slim", "metadata"])
def export_onnx(model: torch.nn.Module, example: torch.Tensor, out_dir: Path, opts: Dict[str, Any]) -> ExportResult:
    import onnx

    opset = int(opts["opset"])
    path = Path(out_dir) / "model.onnx"
    t0 = time.time()

    def write(tmp: Path) -> None:
        # The TorchScript exporter writes exactly the opset asked for; the dynamo exporter may silently
        # write a newer one, which older runtimes on devices reject.
        torch.onnx.export(model, (example[:1],), str(tmp), opset_version=opset, input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                          dynamo=False)
        proto = onnx.load(str(tmp))
        if opts.get("slim", True):
            import onnxslim

            proto = onnxslim.slim(proto)
        for k, v in (opts.get("metadata") or {}).items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = k, v if isinstance(v, str) else json.dumps(v)
        onnx.checker.check_model(proto)
        onnx.save(proto, str(tmp))

    atomic_write(path, write)
    written = {o.domain or "ai.onnx": o.version for o in onnx.load(str(path), load_external_data=False).opset_import}
    if written.get("ai.onnx") != opset:
        raise ToolchainError(f"onnx: asked for opset {opset} but the file has {written}; pin the opset the "
                             f"exporter supports or update export.opset")

    def run(x: np.ndarray) -> np.ndarray:
        import onnxruntime as ort

        if not hasattr(run, "session"):
            run.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return run.session.run(None, {"input": x})[0]

    return ExportResult(path, {"opset_written": written.get("ai.onnx"), "opsets": written,
                               "seconds": round(time.time() - t0, 2), "dynamic": ["batch"]}, runner=run)
