"""The wheel is what a user installs: one package, ``vfm_toolchain``, and it works away from this checkout.

CI builds the wheel, installs it into a fresh virtual environment in a temporary folder and runs ``toolchain list``
and a tiny build from another temporary folder, so a module the wheel leaves out, a bare ``import bench`` that only
a checkout satisfies, or a file read relative to the repository fails here.  The new environment borrows the
third-party packages of this one through a path entry (installing torch afresh would take minutes); a path entry
is not a site directory, so this checkout's editable install does not come with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import tiny_recipe

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (whl,) = out.glob("vfm_toolchain-*.whl")
    return whl


def test_the_wheel_holds_one_package_and_no_benchmarks_or_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"vfm_toolchain", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    assert not [n for n in names if "/benchmarks/" in n or "/tests/" in n or n.endswith("_bench.py")]
    for area in ("teachers", "students", "export", "bench"):  # every folder of the repository, under its one name
        assert f"vfm_toolchain/{area}/__init__.py" in names
    assert "vfm_toolchain/export/runtimes/onnxruntime_runtime.py" in names and "vfm_toolchain/api.py" in names


def test_the_installed_wheel_lists_and_builds_from_a_temporary_folder(wheel, tiny_task, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean["VFM_TOOLCHAIN_CACHE"] = str(tmp_path / "store")

    # found, not imported (an import of vfm_toolchain.bench is torch and timm, 8 s here): the build below imports it
    where = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('vfm_toolchain.bench').origin); "
                            "print(u.find_spec('bench'), u.find_spec('export'))"],
                           capture_output=True, text=True, cwd=work, env=clean)
    assert where.returncode == 0, where.stderr[-2000:]
    installed, generic = where.stdout.splitlines()
    assert Path(installed).is_relative_to(env_dir) and generic == "None None", where.stdout

    listed = subprocess.run([str(bin_dir / "toolchain"), "list", "runtimes"], capture_output=True, text=True,
                            cwd=work, env=clean, timeout=300)
    assert listed.returncode == 0 and "onnxruntime_cpu" in listed.stdout, listed.stderr[-2000:]

    recipe = tiny_recipe(tiny_task, **{"export.formats": ["onnx"], "bench.runtimes": ["onnxruntime"],
                                       "bench.batch_sizes": [1]})
    (work / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    built = subprocess.run([str(bin_dir / "toolchain"), "build", "tiny.yaml", "--out", "out"], capture_output=True,
                           text=True, cwd=work, env=clean, timeout=600)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    assert (work / "out" / "report.md").is_file() and (work / "out" / "artifacts").exists()
