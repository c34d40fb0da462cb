"""Run a recipe's stages in order through the artifact store, and record what happened.

``build`` is the one entry point.  For each stage it computes the key, reuses a finished output
(``cached``), skips with a reason, or runs the stage in its (resumable) working folder.  The run record
(``build.json``) and the resolved recipe are written into the output folder after every stage, so a
killed build still leaves an honest trail.
"""
from __future__ import annotations

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

from toolchain import __version__, distributed
from toolchain.errors import ToolchainError
from toolchain.plugins import load_plugins
from toolchain.recipe import Recipe, recipe_to_dict
from toolchain.stage import PIPELINE, RECIPE_CHECKS, STAGES, Stage, StageContext, StageOutput
from toolchain.store import ArtifactStore, atomic_write_bytes, atomic_write_json, hash_obj

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
    if link.is_symlink() or link.exists():
        if link.is_dir() and not link.is_symlink():
            shutil.rmtree(link)
        else:
            link.unlink()
    link.symlink_to(target.resolve(), target_is_directory=True)


def build(recipe: Recipe, out_dir: Path, store_root: Path, argv: Optional[List[str]] = None,
          only: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the build; returns the run record that is also written to ``<out_dir>/build.json``."""
    load_plugins()
    distributed.init()
    main = distributed.is_main()
    for check in RECIPE_CHECKS:
        check(recipe)
    if recipe.threads:
        import torch

        torch.set_num_threads(recipe.threads)
    out_dir = Path(out_dir)
    store = ArtifactStore(store_root)
    env = environment()
    if main:  # under torchrun only rank 0 writes the output folder
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "stages").mkdir(exist_ok=True)
        atomic_write_bytes(out_dir / "recipe.resolved.yaml",
                           yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False).encode())
        atomic_write_json(out_dir / "argv.json", {"argv": argv or sys.argv, "cwd": os.getcwd(), "env": env,
                                                  "world": distributed.world()})
    write_record = _write_record if main else (lambda *a: None)

    outputs: Dict[str, Optional[StageOutput]] = {}
    keys: Dict[str, Optional[str]] = {}
    record: Dict[str, Any] = {"name": recipe.name, "toolchain": __version__, "env": env, "store": str(store.root),
                              "stages": []}
    t_build = time.time()
    for name in PIPELINE:
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
            log.info("[%s] skipped: %s", name, reason)
            write_record(out_dir, record, t_build)
            continue

        input_keys = {i: keys.get(i) for i in (*stage.inputs, *stage.optional_inputs)}
        key = stage_key(stage, recipe, input_keys, env)
        entry["key"] = key[:24]
        final = store.final_dir(name, key)
        if store.is_done(name, key):
            meta = store.read_meta(name, key) or {}
            entry.update(status="cached", seconds=0.0, ran_seconds=meta.get("seconds"))
            log.info("[%s] cached (%s)", name, final)
        else:
            workdir = store.begin(name, key)
            resumed = distributed.broadcast(any(workdir.iterdir()))
            log.info("[%s] %s in %s", name, "resuming" if resumed else "running", workdir)
            ctx = StageContext(recipe=recipe, workdir=workdir, log=logging.getLogger(f"toolchain.{name}"),
                               inputs={i: outputs.get(i) for i in (*stage.inputs, *stage.optional_inputs)},
                               history=record["stages"], rank=distributed.rank(), world=distributed.world())
            t0 = time.time()
            result = None
            if main or stage.distributed:
                try:
                    result = stage.run(ctx)
                except ToolchainError as exc:
                    entry.update(status="failed", seconds=round(time.time() - t0, 3), reason=str(exc))
                    write_record(out_dir, record, t_build)
                    raise ToolchainError(f"stage '{name}' failed: {exc}") from exc
            seconds = round(time.time() - t0, 3)
            if main:
                atomic_write_json(workdir / "result.json", result)
                final = store.commit(name, key, {"stage": name, "key": key, "seconds": seconds, "resumed": resumed,
                                                 "config": stage.config(recipe), "inputs": input_keys, "env": env,
                                                 "world": ctx.world})
            distributed.barrier()  # the others wait here until rank 0 has sealed the stage
            entry.update(status="ran", seconds=seconds, resumed=resumed)
            log.info("[%s] done in %.1fs", name, seconds)
        result = json.loads((final / "result.json").read_text())
        outputs[name], keys[name] = StageOutput(name, key, final, result), key
        if main:
            _link(out_dir / "stages" / name, final)
        write_record(out_dir, record, t_build)

    report = outputs.get("report")
    if report is not None and main:
        _publish(report, out_dir, record)
    write_record(out_dir, record, t_build)
    return record


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
