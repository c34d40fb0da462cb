"""What every runtime file shares.  Runtime files are copied verbatim into device bundles (``run_bench.py`` loads
them there), so this file, like them, imports nothing but the standard library and NumPy.

A runtime file ``<name>_runtime.py`` declares

- ``ENTRIES = {name: {"runs": family, "devices": "...", "options": {...}}}``: the names it registers, the
  runtime family whose artifacts each loads (matched against the ``runtime`` a format declares; ``None`` for a
  runtime of model objects), where it runs, and keyword arguments bound into ``load`` for that name (one file
  can register a pinned variant, as ``onnxruntime_cpu`` is ``onnxruntime`` with the CPU provider), and
  optionally ``from_record``: the keys of an artifact's export record passed to ``load`` (Core ML's compute
  units), and ``build_device``: ``load`` takes the build's ``device`` (PyTorch).  The entry named after its family is that family's default: ``bench.runtimes: [auto]`` and a device
  bundle use it.
- ``load(artifact, threads=None, **options) -> run``: ``run(batch: np.ndarray) -> np.ndarray``, with ``run.provider``
  (what executes it: an execution provider, a delegate, a device) and ``run.threads`` (the thread count it was
  given, ``None`` for the runtime's default).  It imports its runtime library inside ``load`` and raises
  :class:`Unavailable` with the reason when this machine cannot run it, and ``FileNotFoundError`` (through
  :func:`artifact`) when the artifact is not there.
- ``layers(artifact, x, threads=None, warmup=WARMUP, runs=RUNS, **options) -> table``: the artifact's layer table
  as its runtime reports it (layers.py holds the shared arithmetic), with the options of ``load`` and
  ``Unavailable`` / ``FileNotFoundError`` as ``load`` raises them.  It runs ``x`` (a batch-1 program takes its
  first image) ``warmup`` times, then ``runs`` times with the runtime's profiler on, and returns

  - ``runtime``, ``provider``, ``threads``: as ``load`` reports them; ``batch``: images per profiled call;
  - ``backend``: what ``delegated`` means for this runtime (the session's first execution provider, the XNNPACK
    delegate, the OpenVINO device plugin, the TensorRT engine, the Core ML compute units asked for);
  - ``runs`` and ``total_ms``: the profiled calls and their mean whole-call latency (the same call ``load``'s
    ``run`` makes, profiler included), so the rows can be checked against it;
  - ``timed``: whether the runtime timed each layer; ``why_untimed``: the reason when it did not (``None`` else);
    ``layer_ms_sum``: the sum of the rows' ``ms`` when timed (``None`` else);
  - ``rows``: one per layer as the runtime ran it (after its fusions: one row may stand for several model
    layers, which ``note`` names where the runtime says), in execution order, each with ``name`` (the runtime's),
    ``type`` (its op), ``where`` (what executed it: an execution provider, ``XnnpackBackend``, ``portable``, a
    plugin), ``delegated`` (``where`` is the ``backend``: ``False`` is a layer that fell back, ``None`` when the
    runtime does not say), ``precision`` (``fp32``, ``fp16``, ``bf16``, ``int8``, ``mixed`` for a conversion
    between them, ``unknown``, or the element type of an op on other data), ``kernel`` (the implementation the
    runtime picked, e.g. OpenVINO's ``jit_avx512_I8``, a TensorRT tactic; ``None`` where it does not say),
    ``ms`` (mean per profiled call; ``None`` when untimed), ``macs`` (multiply-accumulates per call of a
    convolution or matrix product; ``None`` for other ops or where shapes are unknown) and ``note`` (why a layer
    is not delegated or is kept in float, when the runtime says).  Time the runtime spends around its layers
    (a delegate's entry and exit, NMS outside the graph) is a row of its own, so ``layer_ms_sum`` and
    ``total_ms`` differ by what nothing accounts for.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["Unavailable", "artifact", "described", "per_image", "record_options", "runtime_modules", "entry_loader"]


def runtime_modules(folder, package: str) -> list:
    """Every ``*_runtime.py`` of ``folder`` imported as ``<package>.<stem>``, in name order: the one scan of runtime
    files, for the toolchain's package (export/runtimes/__init__.py), a device bundle's ``runtimes/`` copy
    (bench/bundle_runner.py) and the memory probe's light import of this folder (bench/memory_probe.py)."""
    import importlib

    return [importlib.import_module(f"{package}.{f.stem}") for f in sorted(Path(folder).glob("*_runtime.py"))]


def entry_loader(module, name: str):
    """``load`` of ``module`` with the options of its entry ``name`` bound."""
    import functools

    return functools.partial(module.load, **module.ENTRIES[name].get("options", {}))


class Unavailable(Exception):
    """The runtime cannot run on this machine (library or hardware missing, a provider that did not start); the
    message is the reason the bench records beside the artifact instead of a timing."""


def artifact(path, what: str) -> Path:
    """``path`` when it exists; else an error that names the file and what should have made it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what}: no artifact at {path} (export it first: the export stage, "
                                f"`toolchain export`, or copy the whole bundle folder)")
    return path


def described(run, provider, threads):
    """``run`` with the attributes every runtime reports: what executed it and with how many threads."""
    run.provider, run.threads = provider, int(threads) if threads else None
    return run


def record_options(entry, record) -> dict:
    """The keyword arguments an entry's ``load`` takes from an artifact's export record (``from_record``)."""
    return {k: record[k] for k in entry.get("from_record", ()) if record and record.get(k) is not None}


def per_image(call):
    """``run(batch)`` for programs exported at batch 1 (ExecuTorch, LiteRT): the images one after another."""
    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        return np.concatenate([call(x[i:i + 1]) for i in range(len(x))])
    return run
