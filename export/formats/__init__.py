"""Export formats, one file each, registered with a capability table.

Contract: ``export(model, example, out_dir, opts) -> ExportResult`` where ``example`` are real
preprocessed inputs; the stage then runs ``parity`` on the artifact.  Each format declares its suffix,
the devices it runs on and the options it accepts; an option a format does not accept is an error.
"""
from export.formats.base import FORMATS, ExportResult, Skipped
from export.formats import onnx_format, onnx_quantized_format, coreml_format, tensorrt_format  # noqa: F401

__all__ = ["FORMATS", "ExportResult", "Skipped"]
