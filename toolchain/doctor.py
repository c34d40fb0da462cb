"""``toolchain doctor``: what this machine and environment offer for a build, one finding per line with the fix.

Each check is a function ``check(ctx) -> [Finding]`` registered with :func:`register_check`, in the order the
command prints them.  This floor checks Python, the packages the build needs (against ``constraints.txt`` in a
checkout), the CPU features that decide int8 and bf16 speed (read from ``/proc/cpuinfo``; what exists, never a
speed-up: ``benchmarks/export_bench.py`` measures that), threads, the GPU, free disk and the store's state (read
only: no verify, no gc).  The export floor adds its formats and runtimes (export/doctor_checks.py).

A finding's status: ``ok``; ``warn`` (a build runs, something is worth fixing); ``missing`` (an optional part is
absent: the formats and runtimes needing it are skipped); ``fail`` (a build cannot run: the command exits 1).
"""
from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import os
import platform
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["canonical_name", "Finding", "DoctorContext", "CHECKS", "register_check", "run_doctor", "cpu_findings", "LOW_DISK"]

STATUSES = ("ok", "warn", "missing", "fail")
DIST = "vfm-toolchain"
LOW_DISK = 10 << 30  # a store holds teacher checkpoints, pool embeddings and artifacts: several GB per build
CONSTRAINTS = Path(__file__).resolve().parent.parent / "constraints.txt"  # the checkout's; absent in a wheel
INSTALL = 'pip install -c constraints.txt -e ".[cpu,coreml,edge,dev,tracking]"'  # what make installs


@dataclass(frozen=True)
class Finding:
    status: str   # ok | warn | missing | fail
    what: str
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"finding status '{self.status}': use one of {', '.join(STATUSES)}")

    def as_dict(self) -> Dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class DoctorContext:
    store: Path
    out: Path
    store_given: bool = False   # --store (or the API's store=) named it, so fixes repeat it
    # what one check found and another reads, probed once a run (export/doctor_checks.py: each runtime's reason)
    shared: Dict[str, Any] = field(default_factory=dict, compare=False)


Check = Callable[[DoctorContext], Iterable[Finding]]
CHECKS: List[Check] = []


def register_check(fn: Check) -> Check:
    """Add a check; each area registers the checks for what it owns (as ``register_recipe_check``)."""
    if fn not in CHECKS:
        CHECKS.append(fn)
    return fn


def run_doctor(store: Optional[Path] = None, out: Optional[Path] = None) -> List[Finding]:
    """Every registered check's findings, in order.  A check that raises is a bug: reported as a ``warn``."""
    from vfm_toolchain.store import default_store_root

    found: List[Finding] = []
    try:  # the areas register their own checks; an install that cannot import them is the first finding
        from vfm_toolchain.plugins import load_plugins

        load_plugins()
    except Exception as exc:
        found.append(Finding("fail", "toolchain areas", f"do not import: {type(exc).__name__}: {exc}",
                             f"reinstall: {INSTALL}"))
    ctx = DoctorContext(Path(store) if store is not None else default_store_root(),
                        Path(out) if out is not None else Path("runs"), store is not None)
    for check in list(CHECKS):
        try:
            found.extend(check(ctx))
        except Exception as exc:
            found.append(Finding("warn", check.__name__.replace("_", " "), f"the check itself failed: "
                                 f"{type(exc).__name__}: {exc}", "a bug in vfm-toolchain: please report it"))
    return found


# ---- Python and packages

def _parse_requirement(text: str) -> Optional[Tuple[str, str]]:
    """(name, specifier) of a base requirement; None for one behind an extra."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging comes with matplotlib; without it, names only
        if "extra ==" in text:
            return None
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*([^;]*)", text)
        return (m.group(1), m.group(2).strip()) if m else None
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None
    return req.name, str(req.specifier)


def canonical_name(name: str) -> str:
    """A distribution's name as PyPI compares names (PEP 503): ``Open_Clip.torch`` is ``open-clip-torch``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    return version.split("+", 1)[0]  # torch 2.14.1+cpu is the 2.14.1 release


def _satisfies(version: str, spec: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
        return SpecifierSet(spec).contains(version, prereleases=True)
    except Exception:  # no packaging, or a version it cannot read: not ours to judge
        return True


def read_pins(path: Path) -> Dict[str, str]:
    """``{canonical name: version}`` of the ``name==version`` lines of a constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            pins[canonical_name(m.group(1))] = m.group(2)
    return pins


@register_check
def python(ctx: DoctorContext) -> List[Finding]:
    here = f"{platform.python_version()} ({sys.executable})"
    try:
        own = f"; {DIST} {metadata.version(DIST)} from {Path(__file__).resolve().parent}"
        needs = metadata.metadata(DIST).get("Requires-Python") or ""
    except metadata.PackageNotFoundError:
        own, needs = f"; {DIST} not installed, run from {Path(__file__).resolve().parent}", ">=3.10"
    if needs and not _satisfies(platform.python_version(), needs):
        return [Finding("fail", "python", f"{here}: {DIST} needs Python {needs}",
                        f"make a virtual environment with a Python {needs}, then {INSTALL}")]
    return [Finding("ok", "python", here + own)]


def _base_requirements() -> List[Tuple[str, str]]:
    try:
        reqs = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:  # run from a source tree without installing: the main ones
        reqs = ["torch", "torchvision", "timm", "open_clip_torch", "peft", "faiss-cpu", "onnx", "onnxslim",
                "safetensors", "pydantic"]
    return [r for r in map(_parse_requirement, reqs) if r is not None]


@register_check
def packages(ctx: DoctorContext) -> List[Finding]:
    pins = read_pins(CONSTRAINTS) if CONSTRAINTS.is_file() else {}
    found, seen = [], set()
    for name, spec in _base_requirements():
        seen.add(canonical_name(name))
        what = f"package {name}"
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            pin = pins.get(canonical_name(name))
            found.append(Finding("fail", what, f"not installed ({DIST} needs {name}{spec})",
                                 (f"pip install '{name}=={pin}'" if pin else f"pip install '{name}{spec}'")
                                 + f" (or the whole install: {INSTALL})"))
            continue
        pin = pins.get(canonical_name(name))
        if spec and not _satisfies(version, spec):
            found.append(Finding("warn", what, f"{version}, {DIST} needs {name}{spec}",
                                 f"pip install '{name}=={pin}'" if pin else f"pip install '{name}{spec}'"))
        elif pin and _public(version) != _public(pin):
            found.append(Finding("warn", what, f"{version}, constraints.txt pins {pin}",
                                 f"pip install '{name}=={pin}'"))
        else:
            found.append(Finding("ok", what, version + (" (the constraints.txt pin)" if pin else "")))
    if not pins:
        found.append(Finding("ok", "constraints.txt", f"not beside this install ({CONSTRAINTS.parent}): versions "
                                                      f"checked against {DIST}'s requirements only"))
        return found
    others = []
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") or ""
        key = canonical_name(name)
        if key in pins and key not in seen and key != canonical_name(DIST):
            seen.add(key)
            if _public(dist.version) != _public(pins[key]):
                others.append(f"{name} {dist.version} (pinned {pins[key]})")
    if others:
        found.append(Finding("warn", "constraints.txt", f"{len(others)} other installed packages differ from "
                             f"their pins: {', '.join(sorted(others, key=str.lower))}", INSTALL))
    else:
        found.append(Finding("ok", "constraints.txt", f"every other pinned package installed here matches "
                                                      f"{CONSTRAINTS}"))
    return found


# ---- CPU

# (flag, what it means); the bench that measures what they are worth: python -m benchmarks.export_bench
_X86_VECTORS = (("avx2", "AVX2"), ("fma", "FMA"), ("avx512f", "AVX-512"))
_X86_INT8 = (("avx512_vnni", "AVX-512 VNNI: int8 matmuls use 512-bit int8 dot products"),
             ("avx_vnni", "AVX-VNNI: int8 matmuls use 256-bit int8 dot products"),
             ("amx_int8", "AMX-INT8: int8 matmuls can use AMX tiles (oneDNN: PyTorch, OpenVINO)"))
_X86_BF16 = (("avx512_bf16", "AVX-512 BF16: bf16 dot products"),
             ("amx_bf16", "AMX-BF16: bf16 matmuls can use AMX tiles"))
_ARM_VECTORS = (("asimd", "NEON"), ("sve", "SVE"), ("sve2", "SVE2"))
_ARM_INT8 = (("asimddp", "dot product (SDOT/UDOT): int8 matmuls use int8 dot products (XNNPACK, ONNX Runtime)"),
             ("i8mm", "I8MM: int8 matrix-multiply instructions (SMMLA)"))
_ARM_BF16 = (("bf16", "BF16: bf16 dot products and matrix multiplies (BFDOT, BFMMLA)"),)
_MEASURE = "python -m benchmarks.export_bench times fp32 against int8 per runtime on this CPU"
_FP32_HERE = ("the toolchain's CPU work stays fp32 (train.amp is GPU-only; OpenVINO is held to f32); no benchmark "
              "here measures bf16")


def _cpuinfo_fields(text: str) -> Tuple[Dict[str, str], Set[str], str]:
    """(first value of each field, flags, 'x86' | 'arm' | ''): x86 Linux names its flags ``flags``, arm64
    ``Features``."""
    fields: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if "flags" in fields:
        return fields, set(fields["flags"].split()), "x86"
    if "features" in fields:
        return fields, set(fields["features"].split()), "arm"
    return fields, set(), ""


def cpu_findings(cpuinfo: Optional[str], machine: str = "") -> List[Finding]:
    """The CPU, its vector units, and what decides int8 and bf16 speed, from ``/proc/cpuinfo``'s text."""
    if not cpuinfo:
        return [Finding("ok", "cpu", f"{platform.processor() or machine or 'unknown'}: features not read (no "
                                     f"/proc/cpuinfo on this system); {_MEASURE}")]
    fields, flags, arch = _cpuinfo_fields(cpuinfo)
    model = fields.get("model name") or fields.get("hardware") or fields.get("processor", "")
    if arch == "arm" and (not model or model.isdigit()):  # arm64 Linux names no model; 'processor' is an index
        model = f"ARM implementer {fields.get('cpu implementer', '?')} part {fields.get('cpu part', '?')}"
    vectors, int8, bf16 = {"x86": (_X86_VECTORS, _X86_INT8, _X86_BF16),
                           "arm": (_ARM_VECTORS, _ARM_INT8, _ARM_BF16)}.get(arch, ((), (), ()))

    def have(table):
        return [text for flag, text in table if flag in flags], [flag for flag, _ in table if flag not in flags]

    vec, novec = have(vectors)
    head = f"{model or 'unknown'} ({machine or arch or '?'})" + (f": {', '.join(vec)}" if vec else "") + \
        (f"; no {', '.join(novec)}" if novec and arch else "")
    if not arch:
        return [Finding("ok", "cpu", f"{head}; flags not found in /proc/cpuinfo; {_MEASURE}")]
    out = [Finding("ok", "cpu", head)]
    yes, no = have(int8)
    if yes:
        out.append(Finding("ok", "cpu int8", "; ".join(yes) + f"; {_MEASURE}"))
    else:
        hint = (" (ONNX Runtime's AVX2 kernels saturate with 8-bit weights: export.options.onnx_int8.reduce_range)"
                if arch == "x86" else "")
        out.append(Finding("warn", "cpu int8", f"no int8 dot-product instructions (no {', '.join(no)}): int8 "
                           f"matmuls use wider multiply-adds{hint}, so int8 may gain little here",
                           f"measure before choosing int8 for this CPU: {_MEASURE}"))
    yes, no = have(bf16)
    out.append(Finding("ok", "cpu bf16", ("; ".join(yes) if yes else f"no bf16 instructions (no {', '.join(no)})")
                       + f"; {_FP32_HERE}"))
    return out


def _usable_cores() -> int:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@register_check
def cpu(ctx: DoctorContext) -> List[Finding]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = None
    return cpu_findings(text, platform.machine())


@register_check
def threads(ctx: DoctorContext) -> List[Finding]:
    usable, total = _usable_cores(), os.cpu_count() or 1
    try:
        import torch
    except Exception as exc:
        return [Finding("fail", "threads", f"{usable} of {total} cores usable; torch does not import: {exc}",
                        f"pip install -c constraints.txt torch torchvision (then {INSTALL})")]
    n, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    detail = f"torch uses {n} threads; {usable} of {total} cores usable here" + \
        (f"; OMP_NUM_THREADS={omp}" if omp else "")
    if n > usable:  # threads spinning on fewer cores slow each other many times over
        return [Finding("warn", "threads", detail, f"export OMP_NUM_THREADS={usable} (or the recipe's threads and "
                                                   f"bench.threads)")]
    return [Finding("ok", "threads", detail)]


# ---- GPU

@register_check
def gpu(ctx: DoctorContext) -> List[Finding]:
    try:
        import torch
    except Exception as exc:
        return [Finding("fail", "gpu", f"not checked: torch does not import ({type(exc).__name__}: {exc})",
                        "pip install -c constraints.txt torch torchvision")]
    built = f"torch {torch.__version__}, " + (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                                              else "a CPU-only build")
    from vfm_toolchain.devices import cuda_gpus

    gpus = cuda_gpus()
    if not gpus:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        return [Finding("ok", "gpu", f"no CUDA GPU visible to PyTorch ({built}"
                        + (f"; CUDA_VISIBLE_DEVICES={hidden!r}" if hidden is not None else "")
                        + "): builds run on the CPU (device: auto)")]
    out = []
    for i, p in enumerate(gpus):
        bf16 = "bf16 autocast native" if p.major >= 8 else "no native bf16 (compute capability < 8.0)"
        out.append(Finding("ok", f"gpu {i}", f"{p.name}, compute capability {p.major}.{p.minor}, "
                                             f"{p.total_memory / 2 ** 30:.0f} GiB; {built}; {bf16}"))
    return out


# ---- disk and store

def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def _existing(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists (where it would be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _store_flag(ctx: DoctorContext) -> str:
    return f" --store {ctx.store}" if ctx.store_given else ""


@register_check
def disk(ctx: DoctorContext) -> List[Finding]:
    out, devices = [], []
    for label, path in (("store", ctx.store), ("output", ctx.out)):
        at = _existing(path)
        usage = shutil.disk_usage(at)
        devices.append(at.stat().st_dev)
        where = f"at {path.absolute()}" + ("" if at == path.absolute() else f" (not there yet; {at} holds it)")
        detail = f"{_gib(usage.free)} free of {_gib(usage.total)} {where}"
        if usage.free >= LOW_DISK:
            out.append(Finding("ok", f"disk {label}", detail))
            continue
        gc = f"toolchain store --gc --older-than 30{_store_flag(ctx)} (entries no build used for 30 days)"
        if label == "store":
            fix = f"{gc}, or give --store on a disk with room"
        else:
            shared = devices[0] == devices[1]
            fix = f"delete build folders you no longer need under {path}" + (f", or {gc}: the store shares this "
                                                                                f"disk" if shared else "") + \
                ", or give --out on a disk with room"
        out.append(Finding("warn", f"disk {label}", f"{detail}: under {_gib(LOW_DISK)}", fix))
    return out


@register_check
def store(ctx: DoctorContext) -> List[Finding]:
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.store import ArtifactStore

    root = ctx.store
    named = "--store" if ctx.store_given else "VFM_TOOLCHAIN_CACHE" if os.environ.get("VFM_TOOLCHAIN_CACHE") \
        else "the default"
    if not root.exists():
        parent = _existing(root)
        if not os.access(parent, os.W_OK):
            return [Finding("fail", "store", f"{root} ({named}) does not exist and cannot be created: {parent} is "
                            f"not writable", "give a writable --store (or set VFM_TOOLCHAIN_CACHE)")]
        return [Finding("ok", "store", f"{root} ({named}): none yet; the first build creates it")]
    try:
        s = ArtifactStore(root, create=False)  # lists only: no verify, no gc
    except ToolchainError as exc:
        return [Finding("fail", "store", str(exc), "give a folder with --store (or set VFM_TOOLCHAIN_CACHE)")]
    entries = list(s.entries())
    states: Dict[str, int] = {}
    for e in entries:
        states[e.state] = states.get(e.state, 0) + 1
    size = sum(e.bytes for e in entries)
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    detail = f"{root} ({named}): " + (f"{len(entries)} entries, {_gib(size)} ({counts})" if entries else "no entries")
    if states.get("partial"):
        detail += "; partial: a build at work, or one stopped (the same command resumes it)"
    foreign = s.foreign()
    if foreign:
        detail += f"; {len(foreign)} folders that are not store entries (left alone)"
    bad = states.get("damaged", 0) + states.get("suspect", 0)
    found = []
    if bad:
        found.append(Finding("warn", "store", f"{detail}; {bad} damaged or suspect (a build that needs one "
                             f"rebuilds it)", f"toolchain store --gc{_store_flag(ctx)} deletes them"))
    else:
        found.append(Finding("ok", "store", detail + f"; not hashed here (toolchain store --verify{_store_flag(ctx)} "
                                                     f"does)"))
    if not s.writable:
        found.append(Finding("warn", "store writable", f"{root} is read-only: builds reuse its sealed stages but "
                             f"cannot build new ones", "give a writable --store (or set VFM_TOOLCHAIN_CACHE)"))
    return found
