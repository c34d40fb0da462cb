"""Run a recipe's stages in order through the artifact store, and record what happened.

``build`` is the one entry point.  For each stage it computes the key, reuses a finished output
(``cached``), skips with a reason, or runs the stage in its (resumable) working folder.  The run record
(``build.json``) and the resolved recipe are written into the output folder after every stage, so a
killed build still leaves an honest trail.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from toolchain import __version__, devices, distributed
from toolchain.console import build_log
from toolchain.errors import ToolchainError
from toolchain.failures import explain
from toolchain.plugins import load_plugins
from toolchain.recipe import Recipe, recipe_to_dict
from toolchain.stage import PIPELINE, RECIPE_CHECKS, STAGES, Stage, StageContext, StageOutput
from toolchain.registry import did_you_mean
from toolchain.store import (ArtifactStore, atomic_write_bytes, atomic_write_json, hash_obj, is_writable_dir,
                             permission_hint)
from toolchain import preflight  # noqa: F401  (registers the path and data checks)

__all__ = ["build", "environment", "stage_key"]

log = logging.getLogger("toolchain")


def environment() -> Dict[str, str]:
    """The parts of the environment that change numerical results; part of every stage key."""
    import torch

    return {"toolchain": __version__, "torch": torch.__version__.split("+")[0], "python": platform.python_version()}


def stage_key(stage: Stage, recipe: Recipe, input_keys: Dict[str, Optional[str]], env: Dict[str, str]) -> str:
    return hash_obj({"stage": stage.name, "version": stage.version, "config": stage.config(recipe),
                     "inputs": input_keys, "env": env})


def _link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target``, atomically (two builds writing one output folder never see a gap)."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.resolve(), target_is_directory=True)
    os.replace(tmp, link)


def check_only(only: Optional[List[str]]) -> None:
    unknown = [n for n in only or () if n not in STAGES]
    if unknown:
        raise ToolchainError(f"--only: unknown stage '{unknown[0]}'.{did_you_mean(unknown[0], PIPELINE)} "
                             f"Stages: {', '.join(PIPELINE)}")


def check_out_dir(out_dir: Path) -> None:
    """The output folder is a folder we can write, or can be created; said now, not after the build."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ToolchainError(f"--out '{out_dir}' is a file; give a folder for the build's outputs")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolchainError(f"cannot create the output folder '{out_dir}' ({permission_hint(exc)}); give a --out "
                             f"in a folder you can write") from None
    if not is_writable_dir(out_dir):
        raise ToolchainError(f"the output folder '{out_dir}' is not writable; give a --out you can write")


def build(recipe: Recipe, out_dir: Path, store_root: Path, argv: Optional[List[str]] = None,
          only: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the build; returns the run record that is also written to ``<out_dir>/build.json``.

    Everything that can be checked without running a stage is checked first (names, paths, data rules, the
    output folder and the store).  The whole log goes to ``<out_dir>/build.log``.

    Raises:
        ToolchainError: bad input (before any stage runs), or :class:`StageFailed` naming the stage, the cause
            and the fix (recorded as ``failed`` in ``build.json``).
    """
    load_plugins()
    check_only(only)
    out_dir = Path(out_dir)
    for check in RECIPE_CHECKS:
        check(recipe)
    distributed.init(recipe.device)
    main = distributed.is_main()
    if main:
        check_out_dir(out_dir)
    store = ArtifactStore(store_root)
    if not store.writable:
        log.warning("the artifact store %s is read-only: stages already built there are used, any other stage "
                    "fails", store.root)
    with build_log(out_dir / "build.log") if main else contextlib.nullcontext(), _out_lock(out_dir, main), \
            devices.use(recipe.device, recipe.data.workers) as policy:
        log.info("device: %s (recipe device: %s), %d decoding workers per loader", policy.device, recipe.device,
                 devices.loader_workers(policy))
        return _build(recipe, out_dir, store, argv, only, main)


@contextlib.contextmanager
def _out_lock(out_dir: Path, main: bool):
    """Two builds into one output folder would interleave their records: the second waits for the first."""
    if not main:
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(str(out_dir / ".build.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another build is writing to %s; waiting for it to finish", out_dir)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _build(recipe: Recipe, out_dir: Path, store: ArtifactStore, argv: Optional[List[str]], only: Optional[List[str]],
           main: bool) -> Dict[str, Any]:
    if recipe.threads:
        import torch

        torch.set_num_threads(recipe.threads)
    env = environment()
    if main:  # under torchrun only rank 0 writes the output folder
        (out_dir / "stages").mkdir(exist_ok=True)
        atomic_write_bytes(out_dir / "recipe.resolved.yaml",
                           yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).encode())
        atomic_write_json(out_dir / "argv.json", {"argv": argv or sys.argv, "cwd": os.getcwd(), "env": env,
                                                  "world": distributed.world()})
    write_record = _write_record if main else (lambda *a: None)
    log.info("build %s: %d stages, store %s, output %s", recipe.name, len(PIPELINE), store.root, out_dir)

    outputs: Dict[str, Optional[StageOutput]] = {}
    keys: Dict[str, Optional[str]] = {}
    record: Dict[str, Any] = {"name": recipe.name, "toolchain": __version__, "env": env, "store": str(store.root),
                              "stages": []}
    t_build = time.time()
    for i, name in enumerate(PIPELINE, start=1):
        stage: Stage = STAGES.get(name)()
        entry: Dict[str, Any] = {"name": name, "status": None, "seconds": 0.0, "reason": None, "key": None}
        record["stages"].append(entry)
        reason = stage.skip_reason(recipe)
        if reason is None:
            missing = [i for i in stage.inputs if outputs.get(i) is None]
            if missing:
                reason = f"needs {', '.join(missing)}, which did not run"
        if reason is None and only is not None and name not in only and not _needed_by(name, only):
            reason = "not requested (--only)"
        if reason is not None:
            entry.update(status="skipped", reason=reason)
            outputs[name], keys[name] = None, None
            log.info("[%d/%d %s] skipped: %s", i, len(PIPELINE), name, reason)
            write_record(out_dir, record, t_build)
            continue

        input_keys = {i: keys.get(i) for i in (*stage.inputs, *stage.optional_inputs)}
        key = stage_key(stage, recipe, input_keys, env)
        entry["key"] = key[:24]
        tag = f"[{i}/{len(PIPELINE)} {name}]"
        t0 = time.time()
        try:
            final = _run_or_reuse(stage, recipe, store, key, input_keys, env, entry, record, outputs, tag, main)
        except KeyboardInterrupt:
            entry.update(status="interrupted", seconds=round(time.time() - t0, 3),
                         reason="interrupted (Ctrl-C); rerun the same command to resume")
            write_record(out_dir, record, t_build)
            raise
        except Exception as exc:  # any failure: one clear message and a `failed` record, the traceback in build.log
            failure = explain(name, exc)
            entry.update(status="failed", seconds=round(time.time() - t0, 3), reason=failure.reason,
                         error=type(exc).__name__)
            logging.getLogger(f"toolchain.{name}").debug("%s failed", name, exc_info=exc)
            write_record(out_dir, record, t_build)
            raise failure from exc
        result = json.loads((final / "result.json").read_text())
        outputs[name], keys[name] = StageOutput(name, key, final, result), key
        if main:
            _link(out_dir / "stages" / name, final)
        write_record(out_dir, record, t_build)

    report = outputs.get("report")
    if report is not None and main:
        _publish(report, out_dir, record)
    write_record(out_dir, record, t_build)
    log.info("build %s finished in %.1fs: %s", recipe.name, time.time() - t_build,
             ", ".join(f"{s['name']} {s['status']}" for s in record["stages"]))
    return record


def _run_or_reuse(stage: Stage, recipe: Recipe, store: ArtifactStore, key: str, input_keys: Dict[str, Optional[str]],
                  env: Dict[str, str], entry: Dict[str, Any], record: Dict[str, Any],
                  outputs: Dict[str, Optional[StageOutput]], tag: str, main: bool) -> Path:
    """Reuse the sealed entry of ``key`` when it verifies, else run the stage and seal it; under the key's lock,
    so a second build needing the same key waits and then reuses what the first sealed."""
    name = stage.name
    final = store.final_dir(name, key)
    waiting = lambda: log.info("%s waiting: another build is working on this stage (%s)", tag, final)
    with store.lock(name, key, on_wait=waiting) if main else contextlib.nullcontext():
        if main and store.is_done(name, key):
            problems = store.verify(name, key, full=stage.verify_hashes)
            if problems:
                log.warning("%s the stored entry %s is damaged (%s); setting it aside and rebuilding the stage",
                            tag, final, "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else ""))
                store.quarantine(name, key, "; ".join(problems))
                entry["rebuilt"] = "damaged: " + "; ".join(problems[:3])
        if distributed.broadcast(store.is_done(name, key)):
            meta = store.read_meta(name, key) or {}
            entry.update(status="cached", seconds=0.0, ran_seconds=meta.get("seconds"))
            store.touch_used(name, key)
            log.info("%s cached (%s)", tag, final)
            return final
        workdir = store.begin(name, key)
        resumed = distributed.broadcast(any(workdir.iterdir()))
        log.info("%s %s in %s", tag, "resuming from its checkpoints" if resumed else "running", workdir)
        ctx = StageContext(recipe=recipe, workdir=workdir, log=logging.getLogger(f"toolchain.{name}"),
                           inputs={i: outputs.get(i) for i in (*stage.inputs, *stage.optional_inputs)},
                           history=record["stages"], rank=distributed.rank(), world=distributed.world(),
                           shared=store.shared_dir())
        t0 = time.time()
        result = None
        if main or stage.distributed:
            result = stage.run(ctx)
        seconds = round(time.time() - t0, 3)
        if main:
            atomic_write_json(workdir / "result.json", result)
            final = store.commit(name, key, {"stage": name, "key": key, "recipe": recipe.name, "seconds": seconds,
                                             "resumed": resumed, "config": stage.config(recipe), "inputs": input_keys,
                                             "env": env, "world": ctx.world})
        distributed.barrier()  # the others wait here until rank 0 has sealed the stage
        entry.update(status="ran", seconds=seconds, resumed=resumed)
        log.info("%s done in %.1fs", tag, seconds)
        return final


def _needed_by(name: str, only: List[str]) -> bool:
    """True when a requested stage depends (transitively) on ``name``."""
    todo, seen = list(only), set()
    while todo:
        n = todo.pop()
        if n in seen or n not in STAGES:
            continue
        seen.add(n)
        deps = (*STAGES.get(n).inputs, *STAGES.get(n).optional_inputs)
        if name in deps:
            return True
        todo.extend(deps)
    return False


def _publish(report: StageOutput, out_dir: Path, record: Dict[str, Any]) -> None:
    """Copy what a person opens (report, plot, deployable artifacts) to the top of the output folder."""
    res = report.result
    for rel in res.get("publish", []):
        src = report.dir / rel
        dst = out_dir / rel
        if src.is_dir():
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    for k in ("artifacts", "metrics", "bench", "warnings", "data", "teacher"):
        if k in res:
            record[k] = res[k]


def _write_record(out_dir: Path, record: Dict[str, Any], t0: float) -> None:
    record["seconds"] = round(time.time() - t0, 3)
    atomic_write_json(out_dir / "build.json", record)
