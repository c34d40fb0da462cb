"""Export formats, one file each, registered with their declaration (``base.register_format``).

Contract: ``export(model, example, out_dir, options, inputs) -> ExportResult`` where ``example`` are real
preprocessed inputs, ``options`` the format's validated schema (``export.options.<name>``) and ``inputs``
what the build supplies; the stage then runs the parity gate on the artifact.
"""
from vfm_toolchain.export.formats.base import (FORMATS, ExportInputs, ExportResult, FormatOptions, Skipped, export_chain,
                                 export_format, format_options)
from vfm_toolchain.export.formats import (onnx_format, onnx_quantized_format, coreml_format, tensorrt_format,  # noqa: F401
                            executorch_format, litert_format, openvino_format, ncnn_format)

__all__ = ["FORMATS", "ExportInputs", "ExportResult", "FormatOptions", "Skipped", "export_chain", "export_format",
           "format_options"]
