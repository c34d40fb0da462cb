"""ExecuTorch: a ``.pte`` program run by ``executorch.runtime`` (the portable runtime with the XNNPACK backend, the
CPU path of a phone), with XNNPACK's thread pool set to the given thread count.  Programs are exported at batch
1, as a phone app runs them; a larger batch runs one image after another."""
from __future__ import annotations

import os
import re
import tempfile

import numpy as np

from .base import Unavailable, artifact, described, per_image
from .layers import RUNS, WARMUP, conv_macs, layer_row, layer_table, matmul_macs, nms_row, precision_of, timed_calls
from .nms import with_nms

ENTRIES = {"executorch": {"runs": "executorch", "devices": "cpu (xnnpack)", "from_record": ("runtime_nms",)}}


def load(path, threads=None, runtime_nms=None):
    """``runtime_nms``: a detector's candidates program is finished by the shared NMS (nms.py) with these settings."""
    _, method, torch = _method(path, threads)
    run = per_image(lambda x: method.execute([torch.from_numpy(x)])[0].numpy())
    return described(with_nms(run, runtime_nms) if runtime_nms else run, f"xnnpack ({threads or 'default'} threads)",
                     threads)


def _method(path, threads=None, etdump: bool = False):
    """``(program, forward method, torch)``; ``etdump``: the program records an ETDump of every execution."""
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
        program = Runtime.get().load_program(str(path), enable_etdump=etdump)
        method = program.load_method("forward")
    except RuntimeError as why:  # a backend this build of the runtime lacks (Core ML, Vulkan, QNN subgraphs)
        raise Unavailable(f"executorch could not load {path}: {why}") from None
    return program, method, torch


def layers(path, x, threads=None, warmup=WARMUP, runs=RUNS, runtime_nms=None):
    """The layer table (base.py) from the program's execution plan and an ETDump of the profiled calls: each
    instruction is a delegate call (the XNNPACK ops inside it, timed by the delegate's own profiler, then the
    call's time outside them) or a kernel call that no delegate took (ExecuTorch's portable kernels).  MACs are
    counted for the kernel calls from the plan's tensor sizes; ops inside a delegate count ``None`` (its payload
    is the backend's own format)."""
    program, method, torch = _method(path, threads, etdump=True)
    one = np.ascontiguousarray(x[:1], dtype=np.float32)
    run = per_image(lambda b: method.execute([torch.from_numpy(b)])[0].numpy())
    run = with_nms(run, runtime_nms) if runtime_nms else run
    calls = timed_calls(lambda: run(one), warmup, runs)
    why = None
    try:
        from executorch.devtools.etdump.serialize import deserialize_from_etdump_flatcc

        with tempfile.TemporaryDirectory() as tmp:
            dump = os.path.join(tmp, "run.etdp")
            program.write_etdump_result_to_file(dump, os.path.join(tmp, "debug.bin"))
            with open(dump, "rb") as fh:
                executions = [r for r in deserialize_from_etdump_flatcc(fh.read()).run_data
                              if any(e.profile_event and e.profile_event.name == "Method::execute" for e in r.events)]
    except (ImportError, RuntimeError) as exc:  # a runtime built without its event tracer
        executions, why = [], f"this executorch cannot write or read an ETDump ({exc})"
    if not why and len(executions) < runs:
        executions, why = [], f"the ETDump holds {len(executions)} of the {runs} profiled executions"
    plan = _plan(path)
    rows = _rows(executions[-runs:], plan, runs)
    extra = nms_row(run, runs)
    rows += [extra] if extra else []
    backends = sorted({d for kind, d, _ in plan.values() if kind == "delegate"}) or ["XnnpackBackend"]
    return layer_table("executorch", f"xnnpack ({threads or 'default'} threads)", threads, ", ".join(backends),
                       rows, 1, calls, why)


_NS = 1e-6  # ETDump ticks are nanoseconds on Linux, macOS, Android and iOS (the PAL's default tick)


def _rows(executions, plan, runs):
    """Rows in execution order from the profiled executions' events, each op's time averaged over them."""
    rows, index = [], {}

    def add(key, make, ms):
        if key not in index:
            index[key] = len(rows)
            rows.append(make())
        rows[index[key]]["ms"] += ms / runs

    for execution in executions:
        inner = {}  # instruction -> its delegate's op time in this execution
        for event in execution.events:
            e = event.profile_event
            if e is None or e.chain_index != 0:
                continue
            ms, i = (e.end_time - e.start_time) * _NS, e.instruction_id
            kind, backend, op = plan.get(i, ("delegate" if e.name == "DELEGATE_CALL" else "kernel", "delegate", None))
            if e.name is None and e.delegate_debug_id_str:  # an op inside a delegate, as the backend names it
                key = (i, e.delegate_debug_id_str)
                inner[i] = inner.get(i, 0.0) + ms
                add(key, lambda: _delegated_row(e.delegate_debug_id_str, backend, i), ms)
            elif e.name == "DELEGATE_CALL":
                add((i, "call"), lambda: layer_row(f"{backend} call {i}", "delegate call", backend, True, "unknown", 0.0,
                                                   note="the delegate's time outside its ops (inputs in, outputs "
                                                        "out)"), ms - inner.get(i, 0.0))
            elif e.name == "OPERATOR_CALL":
                add((i, "op"), lambda: _portable_row(op, i), ms)
    return rows


def _delegated_row(text, backend, instruction):
    """A row for an op inside a delegate; XNNPACK names it ``Convolution (NHWC, QC8) IGEMM #1``: its operator, its
    layout and data types, its kernel."""
    m = re.match(r"(.*?) \((.*?)\)\s*(.*?)\s*(#\d+)?$", text)
    op, types, kernel = (m.group(1), m.group(2).split(", ")[1:], m.group(3) or None) if m else (text, [], None)
    precision = precision_of([t.lower().rstrip("w") for t in types]) if types else (
        "mixed" if op.startswith("Convert") else "unknown")
    return layer_row(f"{backend} call {instruction}: {text}", op, backend, True, precision, 0.0, kernel=kernel)


def _portable_row(op, instruction):
    name, args = (op or ("?", []))
    precision, macs = _portable_facts(name, args)
    return layer_row(f"{name} (instruction {instruction})", name, "portable", False, precision, 0.0, macs,
                     note="no delegate took it: it runs in ExecuTorch's portable kernels")


def _portable_facts(name, args):
    """``(precision, macs)`` of a kernel call from its tensors' types and sizes in the plan."""
    tensors = [a for a in args if a is not None]
    types = [t[0] for t in tensors]
    if "quantize" in name:
        precision = "mixed"
    else:
        precision = precision_of(types[-1:])  # what its output holds
    shape = [t[1] for t in tensors]
    macs = None
    if name.startswith("aten::convolution") and len(shape) > 2:
        macs = conv_macs(shape[-1], shape[1])
    elif name.startswith(("aten::linear", "aten::mm", "aten::bmm", "aten::matmul")) and len(shape) > 1:
        macs = matmul_macs(shape[0], shape[-1])
    elif name.startswith("aten::addmm") and len(shape) > 2:
        macs = matmul_macs(shape[1], shape[-1])
    return precision, macs


_SCALAR = {"FLOAT": "fp32", "HALF": "fp16", "BFLOAT16": "bf16", "CHAR": "int8", "BYTE": "int8", "LONG": "int64",
           "INT": "int32", "BOOL": "bool"}


def _plan(path):
    """``{instruction: ("delegate", backend, None) | ("kernel", None, (op, [(precision, sizes) or None]))}`` from
    the program's execution plan; ``{}`` where ExecuTorch's program reader (executorch.exir) is not installed."""
    try:
        from executorch.exir._serialize._program import deserialize_pte_binary
    except ImportError:
        return {}
    with open(path, "rb") as fh:
        pte = deserialize_pte_binary(fh.read())
    plan = getattr(pte, "program", pte).execution_plan[0]
    found = {}
    for i, instruction in enumerate(plan.chains[0].instructions):
        call = instruction.instr_args
        if hasattr(call, "delegate_index"):
            found[i] = ("delegate", plan.delegates[call.delegate_index].id, None)
        elif hasattr(call, "op_index"):
            op = plan.operators[call.op_index]
            args = []
            for a in call.args:
                val = plan.values[a].val
                args.append((_SCALAR.get(val.scalar_type.name, val.scalar_type.name.lower()), list(val.sizes))
                            if type(val).__name__ == "Tensor" else None)
            found[i] = ("kernel", None, (f"{op.name}.{op.overload}" if op.overload else op.name, args))
    return found
