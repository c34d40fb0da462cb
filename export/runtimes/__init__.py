"""The runtime layer: one file per runtime family, ``<family>_runtime.py`` in this folder, each loading an artifact
and running batches with nothing but NumPy and its own runtime library (see ``base.py`` for the contract).  The same
files check parity in the export stage, time artifacts in ``bench.latency``, student selection and the export
benchmark, and travel verbatim into a device bundle, where ``run_bench.py`` loads them: a number measured on a
device comes from the code path checked here.

A new runtime is one new file: every ``*_runtime.py`` here is registered on import, and
:func:`register_runtime_file` registers one from anywhere else (a device bundle then carries it too).
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import List

from vfm_toolchain.core.registry import Registry
from vfm_toolchain.export.runtimes.base import Unavailable, per_image, record_options, runtime_modules

__all__ = ["RUNTIMES", "Unavailable", "per_image", "options_for", "layers_for", "register_runtime_file", "runtime_files",
           "default_loaders"]

HERE = Path(__file__).resolve().parent

# each entry's meta: ``runs`` (the runtime family whose artifacts it loads, matched against the ``runtime`` a format
# declares in export/formats/base.py, so a new format of an existing family touches no runtime file), ``devices``,
# ``file`` (the runtime file, which a device bundle copies) and ``layers`` (whether the file has a layer table)
RUNTIMES = Registry("runtime")
_LAYERS = {}  # name -> its file's ``layers`` with the entry's options bound (None: the file has none)


def _bound(load, entry):
    """``load`` with the entry's options bound.  An entry that declares ``build_device`` (PyTorch) gets the build's
    device from the one device policy (toolchain/devices.py) unless the caller names one."""
    options = entry.get("options", {})

    @functools.wraps(load)
    def loader(artifact, threads=None, **kw):
        if entry.get("build_device") and "device" not in kw:
            from vfm_toolchain.devices import current

            kw["device"] = current().device
        return load(artifact, threads, **{**options, **kw})

    return loader


def _bound_layers(layers, entry):
    """A runtime file's ``layers`` with the entry's options bound, as :func:`_bound` binds ``load``; ``None`` for a
    file without one."""
    if not callable(layers):
        return None
    options = entry.get("options", {})

    @functools.wraps(layers)
    def table(artifact, x, threads=None, **kw):
        return layers(artifact, x, threads, **{**options, **kw})

    return table


def register_module(module: ModuleType) -> List[str]:
    """Register every name a runtime module declares in its ``ENTRIES``; returns those names."""
    entries = getattr(module, "ENTRIES", None)
    if not isinstance(entries, dict) or not callable(getattr(module, "load", None)):
        raise ValueError(f"{module.__file__} is not a runtime file: it needs ENTRIES = {{name: {{'runs': family, "
                         f"'devices': '...'}}}} and load(artifact, threads=None, **options) (export/runtimes/base.py)")
    for name, entry in entries.items():
        RUNTIMES.register(name, runs=entry["runs"], devices=entry["devices"], file=Path(module.__file__).resolve(),
                          default=name == entry["runs"], entry=dict(entry),
                          layers=callable(getattr(module, "layers", None)))(_bound(module.load, entry))
        _LAYERS[name] = _bound_layers(getattr(module, "layers", None), entry)
    return list(entries)


def register_runtime_file(path) -> List[str]:
    """Import a runtime file from anywhere (a plug-in, a test) as part of this package, so its ``from .base import``
    resolves, and register what it declares."""
    path = Path(path).resolve()
    if not path.name.endswith("_runtime.py"):
        raise ValueError(f"{path.name}: runtime files are named <name>_runtime.py (a device bundle finds them so)")
    name = f"{__name__}.{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return register_module(module)


def runtime_files() -> List[Path]:
    """What a device bundle carries: the shared base and timing code, and the file of every registered runtime."""
    files = {HERE / "base.py", HERE / "layers.py", HERE / "measure.py", HERE / "nms.py"}
    files |= {RUNTIMES.meta(name)["file"] for name in RUNTIMES.list()}
    return sorted(files)


def layers_for(name: str):
    """``layers(artifact, x, threads=None, **options)`` of runtime ``name`` with its entry's options bound, as
    ``RUNTIMES.get(name)`` binds ``load`` (base.py's contract); ``None`` when its file has no layer table."""
    RUNTIMES.check(name)
    return _LAYERS.get(name)


def options_for(name: str, record) -> dict:
    """What runtime ``name`` takes from an artifact's export record (its entry's ``from_record``)."""
    return record_options(RUNTIMES.meta(name)["entry"], record)


def default_loaders():
    """``{family: load}``: each family's default runtime (the entry named after it), what a device bundle runs."""
    return {name: RUNTIMES.get(name) for name in RUNTIMES.list()
            if RUNTIMES.meta(name)["default"] and RUNTIMES.meta(name)["runs"]}


for _module in runtime_modules(HERE, __name__):
    register_module(_module)
