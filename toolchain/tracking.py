"""Experiment tracking with MLflow: one run per build, a parent run with a nested run per build for a study.

Off unless the recipe has a ``tracking.mlflow`` section or the build is given ``--track``
(``api.build(..., track=True)``).  What a build's run holds:

    params      the resolved recipe, flattened to dotted keys (``teacher.lr``); long values cut (the whole
                recipe is the artifact ``recipe.resolved.yaml``)
    metrics     each training stage's per-epoch history as step metrics (``teacher.finetune/epoch/loss``, step =
                epoch), each stage's final metrics (``student.finetune/test_top1``), the build's metrics
                (``student_distilled_top1``) and latency (``bench/<artifact>/<runtime>/batch<n>/p50_ms``)
    tags        ``stage.<name>.key`` and ``stage.<name>.status`` of every stage, ``build.status``
                (complete | failed | interrupted), ``toolchain.version``, ``mlflow.source.git.commit`` when the
                toolchain runs from a git checkout
    artifacts   build.json, recipe.resolved.yaml, argv.json, report.md, the plots and the exported models

Everything is read from the stage results (``result.json``) after each stage, so no training loop knows about
MLflow, a cached stage's curves are logged like a fresh one's, and a killed build's run holds the stages it
finished.  Tracking never costs a build: its first failure (a tracking server that is down, a full disk) is
one warning, after which the build goes on untracked.  Nothing here is part of a stage key.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

from vfm_toolchain import __version__
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import MlflowTracking, Recipe, TrackingConfig, recipe_to_dict
from vfm_toolchain.stage import StageOutput, register_recipe_check

__all__ = ["INSTALL", "STORE_DIR", "BuildTracker", "StudyTracker", "enable", "import_mlflow", "store_uri",
           "flatten_params", "git_commit"]

log = logging.getLogger("toolchain.tracking")

INSTALL = "pip install 'vfm-toolchain[tracking]'"
STORE_DIR = "mlflow"  # <out>/mlflow/: the default store, mlflow.db and the runs' artifacts/
# Older MLflow servers refuse param values over 500 characters (newer ones take 6000); what is cut is whole in
# the artifact recipe.resolved.yaml
MAX_PARAM_CHARS = 500
# A tracking server that is down must cost the build seconds, not MLflow's default of 7 retries with growing
# waits (minutes); set only where the user has not set them, and only around our own calls
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
_RUN_STATUS = {"complete": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def import_mlflow() -> Any:
    """The mlflow module.

    Raises:
        ToolchainError: MLflow is not installed, with the command that installs it.
    """
    try:
        import mlflow
        import mlflow.tracking  # the client: a broken install fails here, not mid-build
    except ImportError as exc:
        raise ToolchainError(f"experiment tracking is on (tracking.mlflow in the recipe, or --track) but MLflow "
                             f"cannot be imported ({exc}); install it with {INSTALL}, or remove tracking.mlflow "
                             f"and --track") from None
    return mlflow


@register_recipe_check
def check_tracking(recipe: Recipe) -> None:
    """Before the first stage: MLflow is importable and the URI names a store MLflow 3 opens by itself."""
    cfg = recipe.tracking.mlflow
    if cfg is None:
        return
    import_mlflow()
    if cfg.uri is not None and _is_file_store(cfg.uri) and not os.environ.get("MLFLOW_ALLOW_FILE_STORE"):
        # MLflow 3 refuses its folder store unless this variable is set; said now, not as a warning mid-build
        raise ToolchainError(f"tracking.mlflow.uri '{cfg.uri}' is a folder (MLflow's file store, which MLflow 3 "
                             f"opens only with MLFLOW_ALLOW_FILE_STORE=true); give sqlite:///<path>/mlflow.db, "
                             f"the http(s):// address of a tracking server, or leave uri out for "
                             f"sqlite:///<out>/{STORE_DIR}/mlflow.db")


def _is_file_store(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a Windows drive letter reads as a scheme


def enable(recipe: Recipe) -> Recipe:
    """``--track``: the recipe with tracking on; its own tracking.mlflow settings when it has them, else the
    defaults.  A copy: the caller's recipe is left as it was."""
    if recipe.tracking.mlflow is not None:
        return recipe
    return recipe.model_copy(update={"tracking": TrackingConfig(mlflow=MlflowTracking())})


def store_uri(cfg: MlflowTracking, out_dir: Path) -> str:
    """The tracking URI: the recipe's, or an SQLite store in the output folder (MLflow opens it with nothing
    started; ``mlflow ui --backend-store-uri`` this URI shows it)."""
    if cfg.uri is not None:
        return cfg.uri
    return f"sqlite:///{(Path(out_dir) / STORE_DIR / 'mlflow.db').resolve()}"


def _artifact_location(uri: str) -> Optional[str]:
    """Where a new experiment keeps its artifacts: beside an SQLite store (MLflow's default would be ./mlruns in
    whatever folder the build was started from); a server decides for itself."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):])
    return (db.resolve().parent / "artifacts").as_uri()


def flatten_params(tree: Dict[str, Any], prefix: str = "") -> Dict[str, str]:
    """A nested mapping as ``{"a.b.c": "value"}``: strings as they are, lists and other values as JSON, each
    cut to ``MAX_PARAM_CHARS``."""
    out: Dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten_params(value, dotted + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        out[dotted] = text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS - 3] + "..."
    return out


def git_commit() -> Optional[str]:
    """The commit of the toolchain's own checkout, or None when it is not one (an installed wheel, no git)."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():  # installed into a folder that may lie inside some other repository
        return None
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = res.stdout.strip()
    return sha if res.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", sha) else None


@contextlib.contextmanager
def _patient_http() -> Iterator[None]:
    """MLflow reads its HTTP settings on every request: ours hold for our calls only."""
    added = {k: v for k, v in _HTTP_DEFAULTS.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _number(value: Any) -> Optional[float]:
    """A metric value, or None for what is not a number (None, a bool, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _metric_key(*parts: Any) -> str:
    # MLflow takes letters, digits, _ - . space : / in a metric name; anything else (a '+' in a label) becomes _
    return "/".join(re.sub(r"[^\w\-. :]", "_", str(p)) for p in parts)


class _Run:
    """One MLflow run.  Off (no tracking.mlflow, or not the process that writes) every method does nothing;
    the first failure warns once and turns it off."""

    def __init__(self, recipe: Recipe, out_dir: Path, parent_run_id: Optional[str] = None, enabled: bool = True):
        self.cfg = recipe.tracking.mlflow if enabled else None
        self.uri = store_uri(self.cfg, out_dir) if self.cfg is not None else None
        self.experiment = (self.cfg.experiment or recipe.name) if self.cfg is not None else None
        self.parent_run_id = parent_run_id
        self.client: Any = None
        self.run_id: Optional[str] = None
        self.failed = False

    @property
    def active(self) -> bool:
        return self.cfg is not None and not self.failed

    def _call(self, doing: str, fn: Callable[[], Any], needs_run: bool = True) -> Any:
        if not self.active or (needs_run and self.run_id is None):
            return None
        try:
            with _patient_http():
                return fn()
        except Exception as exc:  # tracking is a record of the build, never a reason for it to fail
            self.failed = True
            first_line = (str(exc).splitlines() or [""])[0]
            log.warning("experiment tracking stopped: MLflow at %s failed while %s (%s: %s); going on without "
                        "tracking", self.uri, doing, type(exc).__name__, first_line)
            log.debug("MLflow failure", exc_info=exc)
            return None

    def _start(self, recipe: Recipe, run_name: str, tags: Dict[str, str]) -> None:
        def start() -> None:
            import_mlflow()
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient

            if self.cfg.uri is None:
                (Path(self.uri[len("sqlite:///"):]).parent).mkdir(parents=True, exist_ok=True)
            # MLflow announces creating a new SQLite store's tables on the console, in a format of its own
            logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
            client = MlflowClient(tracking_uri=self.uri)
            experiment_id = self._experiment(client)
            all_tags = {"toolchain.version": __version__, **tags}
            commit = git_commit()
            if commit:
                all_tags["mlflow.source.git.commit"] = commit
            if self.parent_run_id:
                all_tags["mlflow.parentRunId"] = self.parent_run_id
            run = client.create_run(experiment_id, tags=all_tags, run_name=run_name)
            params = flatten_params(recipe_to_dict(recipe))
            client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in params.items()])
            self.client, self.run_id = client, run.info.run_id
            log.info("tracking: MLflow run %s in experiment '%s' at %s", self.run_id, self.experiment, self.uri)

        self._call("starting the run", start, needs_run=False)

    def _experiment(self, client: Any) -> str:
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(self.experiment, artifact_location=_artifact_location(self.uri))
        except MlflowException:  # a build beside this one created it first
            found = client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _metrics(self, values: List[Tuple[str, float, int]], doing: str) -> None:
        now_ms = int(time.time() * 1000)

        def log_them() -> None:
            from mlflow.entities import Metric

            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now_ms, step) for k, v, step in values])

        if values:
            self._call(doing, log_them)

    def _tags(self, tags: Dict[str, str], doing: str) -> None:
        def set_them() -> None:
            from mlflow.entities import RunTag

            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

        if tags:
            self._call(doing, set_them)

    def _files(self, folder: Path, names: List[str], doing: str) -> None:
        """Log the files and folders among ``names`` in ``folder`` that exist, each under its own name."""
        def upload() -> None:
            for name in names:
                path = folder / name
                if path.is_dir():
                    self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
                elif path.is_file():
                    self.client.log_artifact(self.run_id, str(path))

        self._call(doing, upload)

    def _end(self, status: str) -> None:
        self._call("ending the run", lambda: self.client.set_terminated(self.run_id, status))


class BuildTracker(_Run):
    """A build's run: ``begin`` once the build's folder and record exist, ``stage`` after each stage, and the
    end of the ``with`` block (the build's record is final by then) logs the results and closes the run."""

    def __init__(self, recipe: Recipe, out_dir: Path, parent_run_id: Optional[str] = None, enabled: bool = True):
        super().__init__(recipe, out_dir, parent_run_id, enabled)
        self.record: Optional[Dict[str, Any]] = None  # the build's record, final when the with block ends
        self.attempt: Optional[Path] = None  # the build's own folder

    def begin(self, recipe: Recipe, attempt: Path, record: Dict[str, Any]) -> None:
        if not self.active:
            return
        self.record, self.attempt = record, attempt
        self._start(recipe, recipe.name, {"build.status": "running", "build.folder": str(attempt)})

    def stage(self, entry: Dict[str, Any], output: Optional[StageOutput]) -> None:
        """A stage finished (ran, cached or skipped): its key and status, its per-epoch history and metrics."""
        name = entry["name"]
        self._tags(_stage_tags(entry), f"tagging {name}")
        if output is None or name == "report":  # the report's metrics are the build's, logged as such at the end
            return
        values: List[Tuple[str, float, int]] = []
        for row in output.result.get("history") or []:
            step = row.get("epoch")
            if not isinstance(step, int):
                continue
            values += [(_metric_key(name, "epoch", k), x, step) for k, v in row.items()
                       if k != "epoch" and (x := _number(v)) is not None]
        values += [(_metric_key(name, k), x, 0) for k, v in (output.result.get("metrics") or {}).items()
                   if (x := _number(v)) is not None]
        self._metrics(values, f"logging the metrics of {name}")

    def __enter__(self) -> "BuildTracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active or self.record is None:
            return
        record = self.record
        # a build that ended in an error before its record was closed (a bug) is a failed one
        status = record.get("status") if record.get("status") in _RUN_STATUS else "failed"
        tags = {"build.status": status}
        for entry in record.get("stages", []):  # the stage that failed or was interrupted has no stage() call
            tags.update(_stage_tags(entry))
        self._tags(tags, "tagging the build")
        values = [(k, x, 0) for k, v in (record.get("metrics") or {}).items() if (x := _number(v)) is not None]
        if _number(record.get("seconds")) is not None:
            values.append(("build_seconds", float(record["seconds"]), 0))
        for row in record.get("bench") or []:
            for stat in ("p50_ms", "p90_ms"):
                if (v := _number(row.get(stat))) is not None:
                    values.append((_metric_key("bench", row.get("artifact"), row.get("runtime"),
                                               f"batch{row.get('batch')}", stat), v, 0))
        self._metrics(values, "logging the build's metrics")
        if self.attempt is not None:
            plots = sorted(p.name for p in self.attempt.glob("*.png"))
            self._files(self.attempt, ["build.json", "recipe.resolved.yaml", "argv.json", "report.md", *plots,
                                       "artifacts"], "logging the build's files")
        self._end(_RUN_STATUS[status])


def _stage_tags(entry: Dict[str, Any]) -> Dict[str, str]:
    tags = {f"stage.{entry['name']}.status": str(entry.get("status"))}
    if entry.get("key"):
        tags[f"stage.{entry['name']}.key"] = entry["key"]
    return tags


class StudyTracker(_Run):
    """A study's parent run: the study's recipe as params, each member build a nested run in the same store and
    experiment, the summary as metrics and study.md / study.png / study.json as artifacts."""

    def __init__(self, recipe: Recipe, out_dir: Path):
        super().__init__(recipe, out_dir)
        self.recipe, self.out_dir = recipe, Path(out_dir)

    def __enter__(self) -> "StudyTracker":
        check_tracking(self.recipe)  # before the first member build, as a build checks it before its first stage
        if self.active:
            self._start(self.recipe, f"{self.recipe.name} study", {"study": "true"})
        return self

    def member_fields(self) -> Dict[str, Any]:
        """Recipe fields for a member build: the parent's store and experiment, or tracking off when the parent
        run could not be started (each build would only fail again)."""
        if self.cfg is None:
            return {}
        if self.run_id is None:
            return {"tracking": {}}
        return {"tracking.mlflow.uri": self.uri, "tracking.mlflow.experiment": self.experiment}

    def summary(self, table: Dict[str, Dict[int, Dict[str, float]]]) -> None:
        values = []
        for method, by_budget in table.items():
            for budget, cell in by_budget.items():
                values += [(_metric_key(method, f"b{budget}", f"test_{k}"), float(cell[k]), 0) for k in ("mean", "std")]
        self._metrics(values, "logging the study's summary")

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.active:
            return
        status = "complete" if exc_type is None else "interrupted" if issubclass(exc_type, KeyboardInterrupt) \
            else "failed"
        self._tags({"study.status": status}, "tagging the study")
        self._files(self.out_dir, ["study.md", "study.png", "study.json"], "logging the study's files")
        self._end(_RUN_STATUS[status])
