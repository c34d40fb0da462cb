"""TensorRT: a serialized engine (``export.formats.tensorrt``) run through its execution context on the GPU, tensors
in CUDA memory through PyTorch.  Engines are tied to the GPU model and TensorRT version that built them; inputs
beyond the optimisation profile's largest batch run in chunks, and a shape the engine refuses is an error."""
from __future__ import annotations

import numpy as np

import json

from .base import Unavailable, artifact, described
from .layers import RUNS, WARMUP, layer_row, layer_table, precision_of, timed_calls
from .nms import with_nms

ENTRIES = {"tensorrt": {"runs": "tensorrt", "devices": "nvidia gpu", "from_record": ("runtime_nms",)}}


def chunks(n: int, max_batch: int):
    """Slices of ``range(n)`` no longer than the profile allows (a caller may feed more than the profile's max)."""
    return [slice(i, min(n, i + max_batch)) for i in range(0, n, max(1, max_batch))]


def load(path, threads=None, runtime_nms=None):
    """``runtime_nms``: a detector's candidates engine is finished by the shared NMS (nms.py) with these settings."""
    run, _, _ = _runner(path, runtime_nms)
    return described(run, "tensorrt", None)


def _runner(path, runtime_nms=None):
    """``(run, engine, context)``."""
    path = artifact(path, "tensorrt")
    try:
        import tensorrt as trt
        import torch
    except ImportError as why:
        raise Unavailable(f"TensorRT is not installed ({why}); pip install 'vfm-toolchain[tensorrt]' "
                          f"--extra-index-url https://pypi.nvidia.com on a machine with an NVIDIA GPU") from None
    if not torch.cuda.is_available():
        raise Unavailable("TensorRT needs an NVIDIA GPU and none is visible to PyTorch")
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise Unavailable(f"tensorrt could not deserialise {path} (built for another GPU or TensorRT version?); "
                          f"rebuild the export stage on this machine")
    context = engine.create_execution_context()
    max_batch = int(engine.get_tensor_profile_shape("input", 0)[2][0])
    # "output", or "detections" for a detector with its NMS: the engine's one output tensor, whatever its name
    name = next(engine.get_tensor_name(i) for i in range(engine.num_io_tensors)
                if engine.get_tensor_mode(engine.get_tensor_name(i)) == trt.TensorIOMode.OUTPUT)
    grown = _allocator(trt, torch)  # for an output whose size the data decides (a detector's rows after NMS)

    def run_chunk(x: np.ndarray) -> np.ndarray:
        inp = torch.from_numpy(np.ascontiguousarray(x)).cuda().contiguous()
        if not context.set_input_shape("input", tuple(inp.shape)):
            raise ValueError(f"tensorrt: the engine refuses input shape {tuple(inp.shape)} (its profile spans "
                             f"{engine.get_tensor_profile_shape('input', 0)}); rebuild the export stage")
        shape = tuple(context.get_tensor_shape(name))
        context.set_tensor_address("input", inp.data_ptr())
        out = None
        if -1 in shape:  # known only after the run: TensorRT asks the allocator for memory, then says the shape
            context.set_output_allocator(name, grown)
        else:
            out = torch.empty(shape, device="cuda", dtype=torch.float32)
            context.set_tensor_address(name, out.data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("tensorrt: the engine failed to run (see the TensorRT log in build.log)")
        stream.synchronize()
        if out is None:
            n = int(np.prod(grown.shape))
            out = grown.buffer[:4 * n].view(torch.float32).reshape(grown.shape)
        return out.cpu().numpy()

    def run(x: np.ndarray) -> np.ndarray:
        if len(x) <= max_batch:
            return run_chunk(x)
        return np.concatenate([run_chunk(x[s]) for s in chunks(len(x), max_batch)])

    return (with_nms(run, runtime_nms) if runtime_nms else run), engine, context


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, runtime_nms=None):
    """The layer table (base.py) from the engine inspector (each layer's type, output precision and tactic; the
    export builds engines with ``ProfilingVerbosity.DETAILED``, without which the inspector names layers only) and
    an ``IProfiler`` on the execution context, which TensorRT calls with every layer's time after each run."""
    run, engine, context = _runner(path, runtime_nms)
    import tensorrt as trt

    spent = {}

    class Profiler(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)

        def report_layer_time(self, layer_name, ms):
            spent[layer_name] = spent.get(layer_name, 0.0) + float(ms)

    x = np.ascontiguousarray(x, dtype=np.float32)
    for _ in range(warmup):
        run(x)
    context.profiler = Profiler()
    calls = timed_calls(lambda: run(x), 0, runs)
    inspector = engine.create_engine_inspector()
    inspector.execution_context = context
    info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    described_layers = [layer if isinstance(layer, dict) else {"Name": layer} for layer in info.get("Layers", [])]
    rows = [_engine_row(layer, spent, runs) for layer in described_layers]
    named = {r["name"] for r in rows}
    rows += [layer_row(name, "?", "tensorrt", True, "unknown", ms / runs) for name, ms in spent.items()
             if name not in named]  # a layer the profiler names but the inspector does not (reformatting)
    return layer_table("tensorrt", "tensorrt", None, "tensorrt", rows, len(x), calls)


def _engine_row(layer, spent, runs):
    """A row from the inspector's JSON for one layer (``Name``, ``LayerType``, ``Outputs`` with
    ``Format/Datatype``, ``TacticName``; convolutions with ``Weights.Count`` and ``NbOutputMaps``)."""
    name = layer.get("Name", "?")
    outputs = layer.get("Outputs") or [{}]
    fmt = str(outputs[0].get("Format/Datatype", "")).lower()
    words = [w for w in fmt.replace("/", " ").split() if w in ("fp32", "float", "fp16", "half", "int8", "bf16")]
    macs = None
    dims, weights, maps = outputs[0].get("Dimensions"), layer.get("Weights") or {}, layer.get("NbOutputMaps")
    if dims and maps and weights.get("Count") and all(int(d) > 0 for d in dims):
        macs = int(np.prod([int(d) for d in dims], dtype=np.int64) * int(weights["Count"]) // int(maps))
    note = None if "LayerType" in layer else ("the engine was built without ProfilingVerbosity.DETAILED: its "
                                              "inspector names layers only")
    return layer_row(name, layer.get("LayerType", "?"), "tensorrt", True, precision_of(words[:1]) if words else
                     "unknown", spent.get(name, 0.0) / runs, macs, layer.get("TacticName"), note)


def _allocator(trt, torch):
    """A ``trt.IOutputAllocator`` keeping one growing CUDA buffer and the shape TensorRT reports after a run."""

    class Growing(trt.IOutputAllocator):
        def __init__(self):
            trt.IOutputAllocator.__init__(self)
            self.buffer, self.shape = torch.empty(0, dtype=torch.uint8, device="cuda"), (0,)

        def reallocate_output(self, tensor_name, memory, size, alignment):
            if self.buffer.numel() < max(int(size), 4):
                self.buffer = torch.empty(max(int(size), 4), dtype=torch.uint8, device="cuda")
            return self.buffer.data_ptr()

        def reallocate_output_async(self, tensor_name, memory, size, alignment, stream=None):
            return self.reallocate_output(tensor_name, memory, size, alignment)

        def notify_shape(self, tensor_name, shape):
            self.shape = tuple(shape)

    return Growing()
