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

from vfm_toolchain import __version__, devices, distributed, fingerprint, tracking
from vfm_toolchain import preflight  # noqa: F401  (registers the path and data checks)
from vfm_toolchain.core.console import build_log
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write_bytes, atomic_write_json
from vfm_toolchain.core.registry import did_you_mean
from vfm_toolchain.failures import explain
from vfm_toolchain.outdir import OutputFolder
from vfm_toolchain.plugins import load_plugins
from vfm_toolchain.recipe import Recipe, recipe_to_dict
from vfm_toolchain.signals import Terminated
from vfm_toolchain.stage import PIPELINE, RECIPE_CHECKS, STAGES, Stage, StageContext, StageOutput
from vfm_toolchain.store import ArtifactStore, hash_obj, is_writable_dir, permission_hint

__all__ = ["build", "environment", "stage_key"]

log = logging.getLogger("toolchain")


def environment() -> Dict[str, str]:
    """The parts of the environment that change numerical results; part of every stage key."""
    import torch

    return {"toolchain": __version__, "torch": torch.__version__.split("+")[0], "python": platform.python_version()}


def stage_key(stage: Stage, recipe: Recipe, input_keys: Dict[str, Optional[str]], env: Dict[str, str]) -> str:
    """The hash of the stage's config, its inputs' keys and the environment, and of the bytes of every local
    checkpoint its config names (a checkpoint overwritten in place reruns the stages that read it)."""
    config = stage.config(recipe)
    files = {p: fingerprint.file_sha256(p) for p in sorted(set(recipe.checkpoint_files())) if _names(config, p)}
    return hash_obj({"stage": stage.name, "version": stage.version, "config": config, "inputs": input_keys,
                     "env": env, **({"files": files} if files else {})})


def _names(config: Any, path: str) -> bool:
    """Whether ``path`` is one of the values of ``config`` (nested dicts and lists)."""
    if isinstance(config, dict):
        return any(_names(v, path) for v in config.values())
    if isinstance(config, (list, tuple)):
        return any(_names(v, path) for v in config)
    return config == path


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


def check_locations(out_dir: Path, store_root: Optional[Path] = None) -> None:
    """What can be said of ``--out`` and ``--store`` without creating either: neither is a file, and the output
    folder lies outside the store."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ToolchainError(f"--out '{out_dir}' is a file; give a folder for the build's outputs")
    if store_root is None:
        return
    if store_root.exists() and not store_root.is_dir():
        raise ToolchainError(f"--store '{store_root}' is a file, not a folder; give a folder for the artifact store "
                             f"(it is created when missing)")
    out_abs, store_abs = out_dir.resolve(), Path(store_root).resolve()
    if out_abs == store_abs or store_abs in out_abs.parents:
        # the store's clean-up (toolchain store --gc) owns every folder in it
        raise ToolchainError(f"--out '{out_dir}' is inside the artifact store '{store_root}', whose clean-up "
                             f"owns every folder there; give a --out outside the store (e.g. runs/<name>)")


def check_out_dir(out_dir: Path, store_root: Optional[Path] = None) -> None:
    """The output folder is a folder we can write, or can be created, and lies outside the store; said now,
    not after the build."""
    check_locations(out_dir, store_root)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolchainError(f"cannot create the output folder '{out_dir}' ({permission_hint(exc)}); give a --out "
                             f"in a folder you can write") from None
    if not is_writable_dir(out_dir):
        raise ToolchainError(f"the output folder '{out_dir}' is not writable; give a --out you can write")


def build(recipe: Recipe, out_dir: Path, store_root: Path, argv: Optional[List[str]] = None,
          only: Optional[List[str]] = None, parent_run: Optional[str] = None) -> Dict[str, Any]:
    """Run the build; returns the run record, also written to ``<out_dir>/builds/<id>/build.json``.

    Everything that can be checked without running a stage is checked first (names, paths, data rules, the
    output folder and the store).  The build writes a folder of its own under ``<out_dir>/builds/`` and the
    top of ``out_dir`` switches to it only once it is complete (:mod:`toolchain.outdir`); the whole log goes to
    ``<out_dir>/build.log``.  Every store entry the build reads is leased for as long as it runs, so
    ``toolchain store --gc`` leaves them alone.  With ``tracking.mlflow`` in the recipe the build is also an
    MLflow run (:mod:`toolchain.tracking`), nested under ``parent_run`` (a study's run id) when given.

    Raises:
        ToolchainError: bad input (before any stage runs), or :class:`StageFailed` naming the stage, the cause,
            the fix and where this build's own record is (recorded as ``failed`` in it).
        KeyboardInterrupt: Ctrl-C or SIGTERM (:class:`toolchain.signals.Terminated`), recorded ``interrupted``.
    """
    load_plugins()
    check_only(only)
    out_dir = Path(out_dir)
    check_locations(out_dir, Path(store_root))  # in a second, before the recipe checks that may take minutes
    for check in RECIPE_CHECKS:
        check(recipe)
    distributed.init(recipe.device)
    main = distributed.is_main()
    if main:
        check_out_dir(out_dir, store_root)
    store = ArtifactStore(store_root)
    if not store.writable:
        log.warning("the artifact store %s is read-only: stages already built there are used, any other stage "
                    "fails", store.root)
    with _out_lock(out_dir, main), build_log(out_dir / "build.log") if main else contextlib.nullcontext(), \
            devices.use(recipe.device, recipe.data.workers) as policy, fingerprint.memo_in(store), \
            contextlib.ExitStack() as leases, tracking.BuildTracker(recipe, out_dir, parent_run, main) as tracker:
        log.info("device: %s (recipe device: %s), %d decoding workers per loader", policy.device, recipe.device,
                 devices.loader_workers(policy))
        folder = OutputFolder(out_dir)
        attempt = folder.begin() if main else out_dir
        return _build(recipe, folder, attempt, store, argv, only, main, leases, tracker)


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


def _build(recipe: Recipe, folder: OutputFolder, attempt: Path, store: ArtifactStore, argv: Optional[List[str]],
           only: Optional[List[str]], main: bool, leases: contextlib.ExitStack,
           tracker: tracking.BuildTracker) -> Dict[str, Any]:
    if recipe.threads:
        import torch

        torch.set_num_threads(recipe.threads)
    env = environment()
    if main:  # under torchrun only rank 0 writes the output folder
        (attempt / "stages").mkdir(exist_ok=True)
        atomic_write_bytes(attempt / "recipe.resolved.yaml",
                           yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).encode())
        atomic_write_json(attempt / "argv.json", {"argv": argv or sys.argv, "cwd": os.getcwd(), "env": env,
                                                  "world": distributed.world()})
    write_record = _write_record if main else (lambda *a: None)
    log.info("build %s: %d stages, store %s, output %s (this build's folder: %s)", recipe.name, len(PIPELINE),
             store.root, folder.root, attempt)

    outputs: Dict[str, Optional[StageOutput]] = {}
    keys: Dict[str, Optional[str]] = {}
    record: Dict[str, Any] = {"name": recipe.name, "status": "running", "toolchain": __version__, "env": env,
                              "store": str(store.root), "stages": []}
    t_build = time.time()
    if main:  # a folder that shows no complete build yet shows this one from its start
        write_record(attempt, record, t_build)
        folder.settle(attempt, complete=False)
    tracker.begin(recipe, attempt, record)  # its run ends with the with block in build(), once the record is final
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
            write_record(attempt, record, t_build)
            tracker.stage(entry, None)
            continue

        input_keys = {i: keys.get(i) for i in stage.read_inputs(recipe)}
        key = stage_key(stage, recipe, input_keys, env)
        entry.update(key=key[:24], status="running")
        write_record(attempt, record, t_build)  # who looks at the record sees which stage is at work
        tag = f"[{i}/{len(PIPELINE)} {name}]"
        t0 = time.time()
        try:
            final = _run_or_reuse(stage, recipe, store, key, input_keys, env, entry, record, outputs, tag, main,
                                  leases)
        except KeyboardInterrupt as exc:
            how = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
            entry.update(status="interrupted", seconds=round(time.time() - t0, 3),
                         reason=f"interrupted ({how}); rerun the same command to resume")
            _close(folder, attempt, record, t_build, "interrupted", main)
            raise
        except Exception as exc:  # any failure: one clear message and a `failed` record, the traceback in build.log
            failure = explain(name, exc, where=store.partial_dir(name, key))
            entry.update(status="failed", seconds=round(time.time() - t0, 3), reason=failure.reason,
                         error=type(exc).__name__)
            logging.getLogger(f"toolchain.{name}").debug("%s failed", name, exc_info=exc)
            failure.where = _close(folder, attempt, record, t_build, "failed", main)
            raise failure from exc
        result = json.loads((final / "result.json").read_text())
        warned = result.get("warnings") if isinstance(result, dict) else None
        if entry["status"] == "cached" and warned:  # a reused stage's warnings still hold: said again, not lost
            log.warning("%s when it ran it warned %d time%s (also in the report):", tag, len(warned),
                        "s" * (len(warned) != 1))
            for line in warned:
                log.warning("%s %s", tag, line)
        outputs[name], keys[name] = StageOutput(name, key, final, result), key
        if main:
            _link(attempt / "stages" / name, final)
        write_record(attempt, record, t_build)
        tracker.stage(entry, outputs[name])

    report = outputs.get("report")
    try:
        if report is not None and main:
            _publish(report, attempt, record)
    except KeyboardInterrupt:
        _close(folder, attempt, record, t_build, "interrupted", main)
        raise
    except Exception as exc:  # a full disk while copying the artifacts: the folder still shows the last good build
        failure = explain("report", exc, where=attempt)
        for rel in report.result.get("publish", []):  # half a copy is of no use, and its room is needed
            target = attempt / rel
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
        record["stages"][-1].update(status="failed", reason=f"publishing: {failure.reason}")
        failure.where = _close(folder, attempt, record, t_build, "failed", main)
        raise failure from exc
    _close(folder, attempt, record, t_build, "complete", main)
    log.info("build %s finished in %.1fs: %s", recipe.name, time.time() - t_build,
             ", ".join(f"{s['name']} {s['status']}" for s in record["stages"]))
    return record


def _close(folder: OutputFolder, attempt: Path, record: Dict[str, Any], t_build: float, status: str,
           main: bool) -> Optional[str]:
    """Write the build's final record and switch the output folder to it when it completed (or when nothing
    complete is shown yet).  Returns, for a build that did not complete, where its record is."""
    if not main:
        return None
    record["status"] = status
    try:
        _write_record(attempt, record, t_build)
    except OSError as exc:  # a full disk: say what happened to the build rather than fail writing its record
        log.warning("could not write %s (%s)", attempt / "build.json", exc)
    try:
        switched = folder.settle(attempt, complete=status == "complete")
    except OSError as exc:  # cannot even write a link: the previous build is still shown as it was
        log.warning("could not switch %s to this build (%s); it stays in %s", folder.root, exc, attempt)
        switched = False
    if status == "complete":
        return None
    where = f"this build's record: {attempt / 'build.json'}"
    shown = folder.shown()
    if not switched and shown is not None:
        where += f"; {folder.root} still shows the last complete build ({shown.name})"
    log.info("%s", where)
    return where


def _run_or_reuse(stage: Stage, recipe: Recipe, store: ArtifactStore, key: str, input_keys: Dict[str, Optional[str]],
                  env: Dict[str, str], entry: Dict[str, Any], record: Dict[str, Any],
                  outputs: Dict[str, Optional[StageOutput]], tag: str, main: bool, leases: contextlib.ExitStack) -> Path:
    """Reuse the sealed entry of ``key`` when it verifies, else run the stage and seal it; under the key's lock,
    so a second build needing the same key waits and then reuses what the first sealed.  The entry is leased
    from here to the end of the build (``leases``): ``toolchain store --gc`` never deletes what a build reads."""
    name = stage.name
    final = store.final_dir(name, key)
    waiting = lambda: log.info("%s waiting: another build is working on this stage (%s)", tag, final)
    with store.lock(name, key, on_wait=waiting) if main else contextlib.nullcontext():
        leases.enter_context(store.lease(name, key))
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
                           inputs={i: outputs.get(i) for i in stage.read_inputs(recipe)},
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


def _publish(report: StageOutput, attempt: Path, record: Dict[str, Any]) -> None:
    """Copy what a person opens (report, plot, deployable artifacts) into this build's folder."""
    res = report.result
    for rel in res.get("publish", []):
        src = report.dir / rel
        dst = attempt / rel
        if src.is_dir():
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
