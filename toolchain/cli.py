"""``toolchain``: build a recipe, list what is registered.

    toolchain build recipes/quickstart.yaml
    toolchain build my_task.yaml --set student.name=fastvit_s12 --out runs/exp1
    toolchain study my_task.yaml                    # label-efficiency table over budgets and seeds
    toolchain bench runs/my_task --bundle bundle/   # artifacts + a runner for the target device
    toolchain report runs/my_task --device-results bundle/results.json --device-name pi5
    toolchain list teachers|adapters|strategies|students|formats|runtimes|stages
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from toolchain.errors import ToolchainError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Vision foundation model -> on-device model.")
console = Console(stderr=True)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s", datefmt="%H:%M:%S",
                        handlers=[RichHandler(console=console, show_path=False, markup=False)], force=True)
    for noisy in ("PIL", "matplotlib", "coremltools", "onnxslim", "root"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def build(recipe: Path = typer.Argument(..., help="recipe YAML"),
          set_: List[str] = typer.Option([], "--set", help="override a field: --set student.name=fastvit_s12"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>)"),
          store: Optional[Path] = typer.Option(None, help="artifact store (default $VFM_TOOLCHAIN_CACHE or "
                                                          "~/.cache/vfm-toolchain)"),
          only: List[str] = typer.Option([], help="run only these stages (and what they need)"),
          verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Run every stage of RECIPE; finished stages are reused from the store."""
    _setup_logging(verbose)
    from toolchain.recipe import load_recipe
    from toolchain.runner import build as run_build
    from toolchain.store import default_store_root

    try:
        r = load_recipe(recipe, set_)
        out_dir = out or Path("runs") / r.name
        record = run_build(r, out_dir, store or default_store_root(), argv=sys.argv, only=only or None)
    except ToolchainError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    table = Table(title=f"build {r.name} -> {out_dir}")
    for col in ("stage", "status", "seconds", "note"):
        table.add_column(col)
    for s in record["stages"]:
        table.add_row(s["name"], s["status"], f"{s['seconds']:.1f}", s.get("reason") or "")
    console.print(table)
    m = record.get("metrics") or {}
    if m:
        console.print("test: " + ", ".join(f"{k} {v:.4f}" for k, v in m.items() if v is not None))
    console.print(f"report: {out_dir / 'report.md'}")


@app.command()
def study(recipe: Path = typer.Argument(..., help="recipe YAML with a study section"),
          set_: List[str] = typer.Option([], "--set", help="override a field: --set study.seeds=[0]"),
          out: Optional[Path] = typer.Option(None, help="output folder (default runs/<recipe name>_study)"),
          store: Optional[Path] = typer.Option(None, help="artifact store"),
          verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """Label-efficiency study: every study.method at every study.budget over study.seeds (seed 004 Tables 1-3)."""
    _setup_logging(verbose)
    from toolchain.recipe import load_recipe
    from toolchain.store import default_store_root
    from toolchain.study import run_study

    try:
        r = load_recipe(recipe, set_)
        out_dir = out or Path("runs") / f"{r.name}_study"
        run_study(r, out_dir, store or default_store_root())
    except ToolchainError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    console.print((out_dir / "study.md").read_text())


@app.command()
def bench(build_out: Path = typer.Argument(..., help="a build's output folder (its --out)"),
          bundle: Path = typer.Option(..., "--bundle", help="write a device bundle to this folder")) -> None:
    """Write a device bundle: the build's ONNX / Core ML artifacts and a runner that needs only the runtime."""
    from bench.bundle import write_bundle

    try:
        out = write_bundle(build_out, bundle)
    except ToolchainError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    console.print(f"bundle: {out}  (copy it to the device and run: python run_bench.py)")


@app.command()
def report(build_out: Path = typer.Argument(..., help="a build's output folder (its --out)"),
           device_results: Path = typer.Option(..., "--device-results", help="results.json from run_bench.py"),
           device_name: str = typer.Option("device", "--device-name")) -> None:
    """Merge a device's bundle results into the build's report.md and build.json."""
    from bench.bundle import merge_device_results

    try:
        merge_device_results(build_out, device_results, device_name)
    except ToolchainError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2)
    console.print(f"merged {device_results} into {build_out / 'report.md'}")


_KINDS = {
    "teachers": ("teachers", "BACKBONES"), "adapters": ("teachers", "ADAPTERS"),
    "strategies": ("teachers", "STRATEGIES"), "students": ("students", "STUDENTS"),
    "formats": ("export", "FORMATS"), "runtimes": ("bench", "RUNTIMES"), "stages": ("toolchain.stage", "STAGES"),
    "folds": ("export", "FOLDS"),
}


@app.command("list")
def list_(kind: str = typer.Argument(..., help=" | ".join(_KINDS)), pattern: str = typer.Argument("*")) -> None:
    """List what is registered of KIND (optionally filtered by a glob PATTERN)."""
    import importlib

    from toolchain.plugins import load_plugins
    from toolchain.registry import did_you_mean

    if kind not in _KINDS:
        console.print(f"[bold red]error:[/] unknown kind '{kind}'.{did_you_mean(kind, list(_KINDS))} "
                      f"Valid kinds: {', '.join(_KINDS)}.")
        raise typer.Exit(2)
    load_plugins()
    module, attr = _KINDS[kind]
    reg = getattr(importlib.import_module(module), attr)
    table = Table(title=kind)
    names = reg.list(pattern)
    keys = sorted({k for n in names for k in reg.meta(n)})
    for col in ["name", *keys]:
        table.add_column(col)
    for n in names:
        meta = reg.meta(n)
        table.add_row(n, *[", ".join(map(str, meta[k])) if isinstance(meta.get(k), list) else str(meta.get(k, ""))
                           for k in keys])
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
