"""``toolchain doctor``'s checks of the export floor: every registered format and runtime, here or why not.

A format is ready when the modules it declares (``requires``) are found, as the recipe check before the first
stage decides; else it is ``missing`` with its ``install`` line.  A runtime is asked itself: its ``load`` is
given an empty placeholder file, so it raises :class:`Unavailable` with its own reason where this machine lacks
its library, platform or hardware (Core ML prediction off macOS, TensorRT without an NVIDIA GPU, an ONNX Runtime
provider not present), and gets as far as reading the placeholder where it would run a real artifact.
"""
from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

from vfm_toolchain.doctor import DoctorContext, Finding, canonical_name, register_check
from vfm_toolchain.export.formats import FORMATS
from vfm_toolchain.export.runtimes import RUNTIMES, Unavailable

__all__ = ["runtime_unavailable"]


def _distributions() -> Dict[str, List[str]]:
    try:
        return metadata.packages_distributions()
    except Exception:  # an odd environment's metadata: names without versions
        return {}


def _version_of(module: str, dists: Dict[str, List[str]]) -> str:
    names = dists.get(module.split(".")[0]) or []
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{module} {metadata.version(name)}" + ("" if canonical_name(name) == canonical_name(module) else f" ({name})")
    return module


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The runtimes' native logs about the placeholder (TensorRT, ExecuTorch print to fd 2) are not the user's."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = []
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
            os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:  # no real file descriptors (an embedding host): the logs may show
        pass
    try:
        yield
    finally:
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)


@contextlib.contextmanager
def _placeholder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="vfm-doctor-") as tmp:
        path = Path(tmp) / "placeholder.bin"
        path.write_bytes(b"")
        yield path


def runtime_unavailable(name: str, placeholder: Path) -> Optional[str]:
    """Why runtime ``name`` cannot run here, or None when it can (it got to reading ``placeholder``)."""
    try:
        with _quiet():
            RUNTIMES.get(name)(placeholder)
    except Unavailable as exc:
        # a reason that names the placeholder is about the file: library, platform and hardware passed
        return None if str(placeholder) in str(exc) else str(exc)
    except Exception:  # its library tried to read the empty file (or, PyTorch, wants a module): it is here
        return None
    return None


def _split_fix(reason: str) -> tuple:
    """A runtime's reason ends in ``; pip install ...`` when that is the fix: (reason, fix)."""
    head, sep, tail = reason.rpartition("; pip install")
    return (head, "pip install" + tail) if sep else (reason, "")


def _runtime_reasons(ctx: DoctorContext) -> Dict[str, Optional[str]]:
    """Why each runtime cannot run here (None: it can), probed once a doctor run: loading Core ML or TensorRT takes
    seconds."""
    if "runtimes" not in ctx.shared:
        with _placeholder() as placeholder:
            ctx.shared["runtimes"] = {name: runtime_unavailable(name, placeholder) for name in RUNTIMES.list()}
    return ctx.shared["runtimes"]


@register_check
def export_formats(ctx: DoctorContext) -> List[Finding]:
    dists, out = _distributions(), []
    undeclared = {FORMATS.meta(f)["runtime"] for f in FORMATS.list() if not FORMATS.meta(f)["requires"]}
    probed = {r: why for r, why in _runtime_reasons(ctx).items() if r in undeclared}
    for name in FORMATS.list():
        meta = FORMATS.meta(name)
        what = f"format {name} ({meta['devices']})"
        needs = meta["requires"]
        if not needs:  # its export checks for itself (a build records why it skipped it); its runtime says more
            runtime, here = meta["runtime"], ""
            if runtime in probed:
                here = f"; its runtime {runtime} " + (f"here: {_split_fix(probed[runtime])[0]}" if probed[runtime]
                                                      else "runs here")
            out.append(Finding("ok", what, f"nothing declared to import: its export checks when it runs, and a "
                                           f"build records why it skipped it{here}"))
            continue
        missing = [m for m in needs if importlib.util.find_spec(m) is None]
        if missing:
            out.append(Finding("missing", what, f"needs {', '.join(missing)}, not installed",
                               meta["install"] or f"pip install {' '.join(missing)}"))
        else:
            out.append(Finding("ok", what, ", ".join(_version_of(m, dists) for m in needs)))
    return out


@register_check
def export_runtimes(ctx: DoctorContext) -> List[Finding]:
    bundled = {FORMATS.meta(f)["runtime"] for f in FORMATS.list() if FORMATS.meta(f)["bundle"]}
    why = _runtime_reasons(ctx)
    out = []
    for name, reason in why.items():
        meta = RUNTIMES.meta(name)
        what = f"runtime {name} ({meta['devices']})"
        if reason is None:
            out.append(Finding("ok", what, "available here" + (f" (loads {meta['runs']} artifacts)" if meta["runs"]
                                                               else " (PyTorch models)")))
            continue
        reason, fix = _split_fix(reason)
        out.append(Finding("missing", what, reason, fix or _elsewhere(meta, why, bundled)))
    return out


def _elsewhere(meta: dict, why: Dict[str, Optional[str]], bundled: set) -> str:
    """The fix for a runtime this machine cannot have (a platform, a GPU, a provider)."""
    family = meta["runs"]
    if meta["default"] and family in bundled:  # what a device bundle runs there
        return "time it on a device that has it: toolchain bench <build out> --bundle <folder>, then python " \
               "run_bench.py there"
    if not meta["default"] and family in why and why[family] is None:  # a pinned variant of one that runs here
        return f"bench.runtimes: [{family}] runs the same artifacts here with what is present"
    return f"run it on a machine with {meta['devices']}"
