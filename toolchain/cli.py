"""``toolchain``: build a recipe, list what is registered.

    toolchain build recipes/quickstart.yaml
    toolchain build my_task.yaml --set student.name=fastvit_s12 --out runs/exp1
    toolchain study my_task.yaml                    # label-efficiency table over budgets and seeds
    toolchain label-next my_task.yaml --n 50        # which pool images to label next (after a build)
    toolchain pseudo-label my_task.yaml             # the teacher's labels on the pool, for review
    toolchain bench runs/my_task --bundle bundle/   # artifacts + a runner for the target device
    toolchain report runs/my_task --device-results bundle/results.json --device-name pi5
    toolchain store [--verify] [--gc [--older-than DAYS]]   # what the artifact store holds
    toolchain doctor [--json]                       # what this machine offers for a build, with the fixes
    toolchain list teachers|adapters|strategies|students|formats|runtimes|stages|folds|tasks
"""
from __future__ import annotations

import contextlib
import errno
import logging
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.table import Table
from rich.text import Text

from vfm_toolchain.core.console import CONSOLE as console, setup_logging
from vfm_toolchain.core.errors import ToolchainError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Vision foundation model -> on-device model.")
log = logging.getLogger("toolchain")
VERBOSE = typer.Option(False, "--verbose", "-v", help="debug detail and tracebacks on screen")
TRACK = typer.Option(False, "--track", help="record an MLflow run: the recipe's tracking.mlflow settings, or a store "
                                            "in the output folder (docs/tracking.md; needs vfm-toolchain[tracking])")


def _error(message: str) -> None:
    # Text: brackets in messages are not markup; soft_wrap: paths are never broken across lines
    console.print(Text.assemble(("error: ", "bold red"), message), soft_wrap=True)


@contextlib.contextmanager
def _failures(verbose: bool, log_files: Optional[List[Path]] = None) -> Iterator[None]:
    """Every way a command can fail ends in one message and an exit code, never a bare traceback:
    2 bad input, 1 a stage or the toolchain failed, 130 interrupted.  ``log_files`` gets the build.log path
    once the command knows it, to point the message there."""
    def where() -> str:
        found = [p for p in log_files or () if p.is_file()]
        return f"\n  full log: {found[-1]}" if found else ""

    from vfm_toolchain.signals import EXIT_TERMINATED, Terminated, terminate_as_interrupt

    try:
        with terminate_as_interrupt():
            yield
    except typer.Exit:
        raise
    except ToolchainError as exc:
        from vfm_toolchain.failures import StageFailed

        _error(str(exc) + (where() if isinstance(exc, StageFailed) else ""))
        raise typer.Exit(2 if getattr(exc, "user_error", True) else 1)
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        _error(f"{how}; finished stages and checkpoints are kept: run the same command again to resume")
        raise typer.Exit(EXIT_TERMINATED if isinstance(exc, Terminated) else 130)
    except OSError as exc:
        from vfm_toolchain.failures import disk_full_text

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            _unexpected(exc, verbose, where())
        reason, fix = disk_full_text(Path(exc.filename).parent if exc.filename else None)
        _error(f"{reason}\n  fix: {fix}{where()}")
        raise typer.Exit(1)
    except Exception as exc:  # a bug: say so plainly; the traceback with -v
        _unexpected(exc, verbose, where())


def _unexpected(exc: Exception, verbose: bool, where: str) -> None:
    log.debug("unexpected error", exc_info=exc)
    _error(f"unexpected {type(exc).__name__}: {exc}. This is probably a bug in vfm-toolchain"
           + ("" if verbose else "; rerun with -v for the traceback") + where)
    if verbose:
        console.print_exception()
    raise typer.Exit(1)


@app.command()
def init(data: Path = typer.Argument(..., help="your folder: train/ (or labeled/), val/, test/, unlabeled/, or one "
                                     "labeled folder"),
         target: str = typer.Option("cpu", help="where the model will run: cpu, x86, android, ios or nvidia"),
         out: Optional[Path] = typer.Option(None, help="the recipe to write (default <folder name>.yaml here)"),
         task: Optional[str] = typer.Option(None, help="the task, when the folder could be read as more than one "
                                                       "(a COCO file as multilabel tags)"),
         teacher: Optional[str] = typer.Option(None, help="a timm:/open_clip:/torchvision: teacher (default: DINOv2 "
                                                          "ViT-B/14 where its weights are reachable)"),
         verbose: bool = VERBOSE) -> None:
    """Read a folder of images, say what it holds and what to fix, and write a short recipe for the target that
    `toolchain build` takes as written."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import api

        result = api.init(data, out=out, target=target, task=task, teacher=teacher)
    for line in result.found:
        console.print(line, markup=False, highlight=False)
    for p in result.problems:
        console.print(f"[yellow]![/] {p['what']}: {p['fix']}", highlight=False)
    console.print(f"recipe: {result.recipe}\nnext: toolchain build {result.recipe} --out runs/{result.recipe.stem}",
                  highlight=False)


@app.command()
def build(recipe: Path = typer.Argument(..., help="recipe YAML"),
          set_: List[str] = typer.Option([], "--set", help="override a field: --set student.name=fastvit_s12"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>)"),
          store: Optional[Path] = typer.Option(None, help="artifact store (default $VFM_TOOLCHAIN_CACHE or "
                                                          "~/.cache/vfm-toolchain)"),
          only: List[str] = typer.Option([], help="run only these stages (and what they need)"),
          track: bool = TRACK,
          verbose: bool = VERBOSE) -> None:
    """Run every stage of RECIPE; finished stages are reused from the store."""
    setup_logging(verbose)
    logs: List[Path] = []
    with _failures(verbose, logs):
        from vfm_toolchain import api

        r = api.load(recipe, set_)
        out_dir = out or Path("runs") / r.name
        logs.append(out_dir / "build.log")
        log.info("recipe %s: checking names, paths and data before the first stage", recipe)
        result = api.build(r, out=out_dir, store=store, only=only or None, argv=sys.argv, track=track)
    table = Table(title=f"build {r.name} -> {out_dir}")
    for col in ("stage", "status", "seconds", "note"):
        table.add_column(col)
    for s in result.stages:
        table.add_row(s["name"], s["status"], f"{s['seconds']:.1f}", s.get("reason") or s.get("rebuilt") or "")
    console.print(table)
    if result.metrics:
        console.print("test: " + ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items() if v is not None))
    if result.report is not None:
        console.print(f"report: {out_dir / 'report.md'}   log: {out_dir / 'build.log'}")
    else:  # --only: the report stage was skipped and no report.md written
        report = next((s for s in result.stages if s["name"] == "report"), {})
        console.print(f"no report.md this build (report {report.get('status')}: {report.get('reason')})   "
                      f"log: {out_dir / 'build.log'}")


@app.command()
def study(recipe: Path = typer.Argument(..., help="recipe YAML with a study section"),
          set_: List[str] = typer.Option([], "--set", help="override a field: --set study.seeds=[0]"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>_study)"),
          store: Optional[Path] = typer.Option(None, help="artifact store"),
          track: bool = TRACK,
          verbose: bool = VERBOSE) -> None:
    """Label-efficiency study: every study.method at every study.budget over study.seeds (seed 004 Tables 1-3)."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import api

        result = api.study(recipe, set_, out=out, store=store, track=track)
    # the file as written: its [..] are markdown, which rich would take for markup tags and drop
    console.print(result.markdown.read_text(), markup=False, highlight=False)


@app.command("label-next")
def label_next(recipe: Path = typer.Argument(..., help="recipe YAML (its build's stages come from the store)"),
               n: int = typer.Option(..., "--n", help="how many pool images to choose"),
               set_: List[str] = typer.Option([], "--set", help="override a field, as for build"),
               out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>_label_next)"),
               store: Optional[Path] = typer.Option(None, help="artifact store"),
               uncertainty: str = typer.Option("margin", help="the teacher's uncertainty: margin or entropy"),
               weights: str = typer.Option("0.25,0.25,0.5", help="score = a x uncertainty + b x disagreement + "
                                                                 "c x typicality: 'a,b,c' ('a,b': c = 0)"),
               candidates: int = typer.Option(10, min=1, help="the best candidates x N images by score compete "
                                                              "in the diverse, class-balanced choice"),
               box_threshold: float = typer.Option(0.3, help="detection: boxes at or above this score count in "
                                                             "teacher-student disagreement and the classes an "
                                                             "image shows"),
               typicality_k: int = typer.Option(20, help="typicality: the pool neighbours an image's density is "
                                                         "measured over"),
               min_share: float = typer.Option(0.02, help="segmentation: a class the teacher gives at least this "
                                                          "share of an image's pixels counts as shown (the class "
                                                          "balance)"),
               verbose: bool = VERBOSE) -> None:
    """Rank the pool by the teacher's uncertainty, teacher-student disagreement, typicality and diversity, and
    choose N images to label next: label_next.csv, contact_sheet.png and to_label/ (a folder for a labeling
    tool)."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import api

        try:
            w = [float(x) for x in weights.split(",")]
        except ValueError:
            w = []
        if len(w) not in (2, 3):
            raise ToolchainError(f"--weights '{weights}': three numbers 'a,b,c' (uncertainty, disagreement, "
                                 f"typicality), e.g. 0.25,0.25,0.5, or two 'a,b' for no typicality")
        summary = api.label_next(recipe, n, set_, out=out, store=store, uncertainty=uncertainty, w_uncertainty=w[0],
                                 w_disagreement=w[1], w_typicality=w[2] if len(w) == 3 else 0.0,
                                 candidates=candidates, box_threshold=box_threshold, typicality_k=typicality_k,
                                 min_share=min_share)
    console.print(f"chose {summary['chosen']} of {summary['scored']} pool images (per predicted class: "
                  f"{summary['per_class']}); {summary['near_duplicates']} near-duplicates passed over")
    console.print("images showing each class, labeled + chosen: " + ", ".join(
        f"{c} {a} + {b}" for c, (a, b) in summary["showing"].items()))
    console.print(f"ranking: {summary['csv']}\ncontact sheet: {summary['sheet']}\nto label: {summary['folder']}")


@app.command("pseudo-label")
def pseudo_label(recipe: Path = typer.Argument(..., help="recipe YAML (its build's teacher comes from the store)"),
                 set_: List[str] = typer.Option([], "--set", help="override a field, as for build"),
                 out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>"
                                                               "_pseudo_labels)"),
                 store: Optional[Path] = typer.Option(None, help="artifact store"),
                 threshold: float = typer.Option(0.5, help="confidence an image's labels must reach to be kept; "
                                                           "the rest are listed for review"),
                 copy: bool = typer.Option(False, "--copy", help="copy the images instead of linking them"),
                 verbose: bool = VERBOSE) -> None:
    """The finetuned teacher labels the pool: confident labels in the layout the data readers take, every image
    with its predictions for Label Studio and CVAT, and review.csv for the rest."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import api

        summary = api.pseudo_label(recipe, set_, out=out, store=store, threshold=threshold, copy=copy)
    console.print(f"{summary['images']} pool images: {summary['kept']} kept at confidence >= {summary['threshold']:g}, "
                  f"{summary['review']} for review; written to {summary['folder']}")


@app.command()
def bench(build_out: Path = typer.Argument(..., help="a build's output folder (its --out)"),
          bundle: Path = typer.Option(..., "--bundle", help="write a device bundle to this folder"),
          test_images: int = typer.Option(200, "--test-images", min=0,
                                          help="labeled test images that travel along, scored on the device"),
          verbose: bool = VERBOSE) -> None:
    """Write a device bundle: the build's deployable artifacts, a labeled test slice and a runner that needs only
    the runtime (latency, and top-1 / mIoU on the slice, for every artifact)."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain.bench.bundle import write_bundle

        out = write_bundle(build_out, bundle, test_images)
    console.print(f"bundle: {out}  (copy it to the device and run: python run_bench.py)")


@app.command()
def candidates(recipe: Path = typer.Argument(..., help="recipe YAML (its student section: candidates, image size, "
                                                       "target)"),
               set_: List[str] = typer.Option([], "--set", help="override a field: --set student.image_size=224"),
               bundle: Optional[Path] = typer.Option(None, "--bundle", help="write the candidates, exported, to this "
                                                     "folder for timing on a device"),
               format_: Optional[str] = typer.Option(None, "--format", help="bundle format (default: student.target "
                                                     "when it is a format, else onnx)"),
               store: Optional[Path] = typer.Option(None, help="artifact store (its latency cache)"),
               verbose: bool = VERBOSE) -> None:
    """The candidate students of student.name: auto: timed here on student.target (a table), or, with --bundle,
    exported for a device whose results.json then becomes student.target."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import devices
        from vfm_toolchain.plugins import load_plugins
        from vfm_toolchain.recipe import load_recipe
        from vfm_toolchain.store import ArtifactStore, default_store_root

        load_plugins()
        r = load_recipe(recipe, set_)
        shared = ArtifactStore(store or default_store_root()).shared_dir()
        if bundle is not None:
            from vfm_toolchain.bench.select import is_results_file, write_candidate_bundle

            target = r.student.target
            fmt = format_ or (target if not is_results_file(target) and target != "pytorch" else "onnx")
            out = write_candidate_bundle(r, bundle, fmt, shared, log)
            console.print(f"bundle: {out}  (on the device: python run_bench.py; then build with "
                          f"--set student.target=results.json)")
            return
        from vfm_toolchain.bench.select import candidate_names, check_target, device_candidates, is_results_file, \
            measure_candidates
        from vfm_toolchain.prepare import class_count

        check_target(r)  # a results file is read and checked whole here, as before a build's first stage
        where = f"{r.student.target} (this machine)"
        with devices.use(r.device, r.data.workers):
            if is_results_file(r.student.target):  # the device's timings, read as student.select reads them
                rows, device = device_candidates(r, candidate_names(r), class_count(r), r.data.task)
                where = f"the device ({device.get('system')} {device.get('machine')}) of {r.student.target}"
            else:
                rows = measure_candidates(r, candidate_names(r), class_count(r), r.data.task,
                                          shared / "candidate_latency" if shared else None, log)
    from vfm_toolchain.bench.select import CANDIDATE_COLUMNS, candidate_cells

    table = Table(title=f"candidates on {where} at {r.student.image_size}")
    for col in CANDIDATE_COLUMNS + ("note",):
        table.add_column(col)
    for x in sorted(rows, key=lambda x: x.get("p50_ms") or float("inf")):
        note = ("cached" if x.get("cached") else "") if x["status"] == "ok" else x["reason"]
        table.add_row(*candidate_cells(x), note)
    console.print(table)


@app.command()
def report(build_out: Path = typer.Argument(..., help="a build's output folder (its --out)"),
           device_results: Path = typer.Option(..., "--device-results", help="results.json from run_bench.py"),
           device_name: str = typer.Option("device", "--device-name"),
           verbose: bool = VERBOSE) -> None:
    """Merge a device's bundle results into the build's report.md and build.json."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain.bench.bundle import merge_device_results

        merge_device_results(build_out, device_results, device_name)
    console.print(f"merged {device_results} into {build_out / 'report.md'}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _age(seconds: float) -> str:
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= s:
            return f"{seconds / s:.0f}{unit}"
    return f"{seconds:.0f}s"


@app.command("store")
def store_(store: Optional[Path] = typer.Option(None, help="artifact store (default $VFM_TOOLCHAIN_CACHE or "
                                                           "~/.cache/vfm-toolchain)"),
           verify: bool = typer.Option(False, "--verify", help="check every sealed entry's files (sizes and sha256); "
                                       "set damaged ones aside (or mark them, while a build uses them)"),
           gc: bool = typer.Option(False, "--gc", help="delete damaged entries and unfinished working folders"),
           older_than: Optional[float] = typer.Option(None, "--older-than", help="with --gc: also sealed "
                                                      "entries no build used for this many days (>= 0)"),
           dry_run: bool = typer.Option(False, "--dry-run", help="with --gc: list what would be deleted"),
           verbose: bool = VERBOSE) -> None:
    """Show the store's entries (stage, key, state, size, age, recipe); verify them; garbage-collect."""
    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain.store import ArtifactStore, default_store_root

        s = ArtifactStore(store or default_store_root(), create=False)
        if older_than is not None and not gc:
            raise ToolchainError("--older-than goes with --gc (toolchain store --gc --older-than 30)")
        if gc:
            gone, held = s.gc(older_than, dry_run=dry_run)
            verb = "would delete" if dry_run else "deleted"
            for e in gone:
                console.print(f"{verb} {e.stage}/{e.path.name} ({e.state}, {_size(e.bytes)})")
            for e in held:
                console.print(f"kept {e.stage}/{e.path.name} ({e.state}): a running build uses it")
            console.print(f"{verb} {len(gone)} entries, {_size(sum(e.bytes for e in gone))}"
                          + (f"; kept {len(held)} in use by running builds" if held else ""))
            return
        now = time.time()
        table = Table(title=f"store {s.root}")
        for col in ("stage", "key", "state", "size", "age", "last used", "recipe") + (("verify",) if verify else ()):
            table.add_column(col)
        damaged = []
        entries = list(s.entries())
        for e in entries:
            check = ()
            if verify and e.state in ("sealed", "suspect"):
                problems = s.verify(e.stage, e.key, full=True)
                if problems:
                    damaged.append(f"{e.stage}/{e.key}: {'; '.join(problems[:3])}: {s.set_aside(e, problems)}")
                check = ("damaged" if problems else "ok",)
            elif verify:
                check = ("",)
            table.add_row(e.stage, e.key, e.state, _size(e.bytes), _age(now - e.modified), _age(now - e.last_used),
                          e.recipe or "", *check)
        console.print(table)
        bad = len(damaged)
        for line in damaged:  # whole lines, not table cells: the paths and reasons must not be cut
            console.print(f"damaged {line}", markup=False, highlight=False, soft_wrap=True)
        foreign = s.foreign()
        for f in foreign:
            console.print(f"not a store entry (left alone): {f}", markup=False, highlight=False)
        console.print(f"{len(entries)} entries, {_size(sum(e.bytes for e in entries))}"
                      + (f"; {bad} damaged: set aside or marked, so the next build that needs them rebuilds them "
                         f"and --gc deletes them" if verify and bad else "; all verified" if verify else ""))
        if verify and bad:
            raise typer.Exit(1)


_MARKS = {"ok": ("✓", "green"), "warn": ("!", "yellow"), "missing": ("○", "yellow"), "fail": ("✗", "bold red")}


@app.command()
def doctor(store: Optional[Path] = typer.Option(None, help="the artifact store to check (default $VFM_TOOLCHAIN_CACHE "
                                                           "or ~/.cache/vfm-toolchain)"),
           out: Optional[Path] = typer.Option(None, help="the output folder whose free disk to check (default runs)"),
           as_json: bool = typer.Option(False, "--json", help="the findings as a JSON list of {status, what, detail, "
                                                               "fix}"),
           verbose: bool = VERBOSE) -> None:
    """What this machine offers for a build: Python and packages, the CPU's int8 / bf16 features, the GPU, free
    disk, the store, every format and runtime (or why not); one line each with the fix.  Exit 1 when something a
    build cannot run without is missing."""
    import json

    setup_logging(verbose)
    with _failures(verbose):
        from vfm_toolchain import api

        findings = api.doctor(store=store, out=out)
    if as_json:
        typer.echo(json.dumps(findings, indent=1))
    else:
        from rich.console import Console

        screen = Console(highlight=False)
        for f in findings:
            mark, style = _MARKS[f["status"]]
            fix = ("  fix: " + f["fix"], "cyan") if f["fix"] else ""
            screen.print(Text.assemble((mark, style), f" {f['what']}: {f['detail']}", fix), soft_wrap=True)
        counts = {s: sum(f["status"] == s for f in findings) for s in _MARKS}
        screen.print(", ".join(f"{n} {s}" for s, n in counts.items() if n), soft_wrap=True)
    if any(f["status"] == "fail" for f in findings):
        raise typer.Exit(1)


_KINDS = {
    "teachers": ("vfm_toolchain.teachers", "BACKBONES"), "adapters": ("vfm_toolchain.teachers", "ADAPTERS"),
    "strategies": ("vfm_toolchain.teachers", "STRATEGIES"), "students": ("vfm_toolchain.students", "STUDENTS"),
    "formats": ("vfm_toolchain.export", "FORMATS"), "runtimes": ("vfm_toolchain.export.runtimes", "RUNTIMES"),
    "stages": ("vfm_toolchain.stage", "STAGES"), "folds": ("vfm_toolchain.students.fold", "FOLDS"),
    "tasks": ("vfm_toolchain.tasks", "TASKS"),
}


def _cell(value) -> str:
    """A registry declaration as text: a list joined, an options schema as its keys and defaults."""
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    fields = getattr(value, "model_fields", None)
    if isinstance(value, type) and fields is not None:
        return ", ".join(f"{k}={f.default}" for k, f in fields.items()) or "-"
    return str(value)


@app.command("list")
def list_(kind: str = typer.Argument(..., help=" | ".join(_KINDS)), pattern: str = typer.Argument("*")) -> None:
    """List what is registered of KIND (optionally filtered by a glob PATTERN)."""
    import importlib

    from vfm_toolchain.core.registry import did_you_mean
    from vfm_toolchain.plugins import load_plugins

    if kind not in _KINDS:
        console.print(f"[bold red]error:[/] unknown kind '{kind}'.{did_you_mean(kind, list(_KINDS))} "
                      f"Valid kinds: {', '.join(_KINDS)}.")
        raise typer.Exit(2)
    from rich.markup import escape

    load_plugins()
    module, attr = _KINDS[kind]
    reg = getattr(importlib.import_module(module), attr)
    table = Table(title=kind)
    names = reg.list(pattern)
    keys = sorted({k for n in names for k in reg.meta(n)} - {"install"})  # the error message carries install
    for col in ["name", *keys]:
        table.add_column(col, no_wrap=col == "name")
    for n in names:
        meta = reg.meta(n)
        table.add_row(n, *[escape(_cell(meta.get(k, ""))) for k in keys])  # '[edge]' is text, not rich markup
    from rich.console import Console

    out = Console()
    if not out.is_terminal:
        out.width = 200  # piped or captured: keep each entry's declaration whole
    out.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
