"""One clear message for any way a stage can fail.

A :class:`ToolchainError` already says what was wrong and how to fix it.  Everything else (out of memory,
a full disk, a permission, a missing package, TensorRT's own errors, a bug) is turned here into
"stage X failed: <cause>. Fix: <what to do>", so the person watching the build never has to read a
traceback to know what to do next; the traceback itself goes to ``build.log`` (and the console with ``-v``).
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Optional, Tuple

from vfm_toolchain.core.errors import ToolchainError

__all__ = ["StageFailed", "explain", "disk_full", "disk_full_text", "free_bytes"]

# Where each stage's batch size lives in the recipe, for memory advice.
_BATCH_KEY = {"teacher.finetune": "teacher.batch_size", "teacher.curate": "curate.batch_size",
              "student.distill": "distill.batch_size", "student.finetune": "finetune.batch_size",
              "student.baseline": "finetune.batch_size", "bench.latency": "bench.batch_sizes",
              "export.convert": "export.parity_images"}


class StageFailed(ToolchainError):
    """A stage stopped; ``reason`` is what ``build.json`` records, ``str()`` what the user reads."""

    def __init__(self, stage: str, reason: str, fix: Optional[str], user_error: bool = False):
        # user_error: the input was wrong (a ToolchainError from the stage), not the machine or the code
        self.stage, self.reason, self.fix, self.user_error = stage, reason, fix, user_error
        self.where: Optional[str] = None  # where the failed build's own record is (set by the runner)
        super().__init__(f"stage '{stage}' failed: {reason}" + (f"\n  fix: {fix}" if fix else ""))

    def __str__(self) -> str:
        return super().__str__() + (f"\n  {self.where}" if self.where else "")


def _oom_fix(stage: str, where: str) -> str:
    key = _BATCH_KEY.get(stage)
    lower = f"lower {key} (--set {key}=...)" if key else "lower the batch size"
    return (f"{lower} or the image size; for training stages, the same effective batch with less memory is "
            f"`accumulate`; {where}")


# How libraries report a write the disk had no room for without an errno: torch.save's zip writer
# ("[enforce fail at inline_container.cc:...] . PytorchStreamWriter failed writing file ..."), sqlite,
# safetensors' Rust writer ("IoError(Os { code: 28, kind: StorageFull ...")
_WRITE_FAILED = ("PytorchStreamWriter failed writing", "inline_container.cc", "No space left on device",
                 "database or disk is full", "Disk quota exceeded", "StorageFull", "os error 28")
# Below this much free space a failed write is taken for a full disk
_NEARLY_FULL = 64 << 20


def free_bytes(path: Optional[Path]) -> Optional[int]:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), or None."""
    p = Path(path) if path is not None else None
    while p is not None and not p.exists():
        p = p.parent if p.parent != p else None
    if p is None:
        return None
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def disk_full_text(where: Optional[Path], writing: str = "") -> Tuple[str, str]:
    """("disk full: N MB free at <where>", the fix)."""
    free = free_bytes(where)
    at = f" at {where}" if where is not None else ""
    amount = f"{free / 1e6:.0f} MB free" if free is not None else "no space left"
    return (f"disk full: {amount}{at}{writing}",
            "free disk space (`toolchain store --gc` deletes damaged and unfinished entries) or point --store / "
            "--out at a larger disk; rerun the same command to resume")


def disk_full(stage: str, where: Optional[Path], writing: str = "") -> StageFailed:
    return StageFailed(stage, *disk_full_text(where, writing))


def explain(stage: str, exc: BaseException, where: Optional[Path] = None) -> StageFailed:
    """The cause and the fix of ``exc`` raised inside ``stage``; ``where`` is the folder the stage was writing
    (to tell a full disk from other failures and say how much room is left)."""
    if isinstance(exc, StageFailed):
        return exc
    if isinstance(exc, ToolchainError):
        return StageFailed(stage, str(exc), None, user_error=True)
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fname = getattr(exc, "filename", None)
        return disk_full(stage, where or (Path(fname).parent if fname else None),
                         f" (writing '{fname}')" if fname else "")
    if any(m in str(exc) for m in _WRITE_FAILED):
        free = free_bytes(where)
        if free is not None and free < _NEARLY_FULL:
            return disk_full(stage, where)
    if name == "OutOfMemoryError" or "CUDA out of memory" in str(exc):
        return StageFailed(stage, f"the GPU ran out of memory ({text[:200]})",
                           _oom_fix(stage, "or run this stage on another GPU (device settings)"))
    if isinstance(exc, MemoryError) or "DefaultCPUAllocator: can't allocate" in str(exc):
        return StageFailed(stage, f"the machine ran out of memory ({name})",
                           _oom_fix(stage, "lower distill.cache_mb and data.workers, or close other programs"))
    if isinstance(exc, OSError):
        where = f" '{exc.filename}'" if getattr(exc, "filename", None) else ""
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return StageFailed(stage, f"permission denied on{where} ({exc.strerror})",
                               "give a --store and --out you can write, or fix the folder's permissions")
        if exc.errno == errno.ENOENT:
            return StageFailed(stage, f"file not found:{where or ' ' + text}",
                               "check the paths in the recipe; a file that disappeared from the store is rebuilt "
                               "when you rerun")
        return StageFailed(stage, f"could not read or write{where}: {exc.strerror or text}",
                           "check the disk and the path; rerun to resume")
    if isinstance(exc, ImportError):
        missing = getattr(exc, "name", None) or text
        return StageFailed(stage, f"a package this stage needs is not installed ({missing})",
                           f"install it (pip install {missing.split('.')[0]}) or remove the option that needs it "
                           f"from the recipe")
    module = type(exc).__module__ or ""
    if "tensorrt" in module or "tensorrt" in text.lower():
        return StageFailed(stage, f"TensorRT failed: {text[:300]}",
                           "try export.options.tensorrt.precision=fp32, or drop 'tensorrt' from export.formats; the full "
                           "TensorRT log is in build.log")
    if "onnxruntime" in module:
        return StageFailed(stage, f"ONNX Runtime failed: {text[:300]}",
                           "the exported graph uses something this ONNX Runtime cannot run; try another "
                           "export.opset, or report it with build.log")
    return StageFailed(stage, f"unexpected {name}: {text[:300]}",
                       "this is probably a bug in vfm-toolchain; the traceback is in build.log (and on screen "
                       "with -v). Please report it with that file")
