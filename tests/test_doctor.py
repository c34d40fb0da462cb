"""``toolchain doctor``: one finding per check on this machine, the fixes, and the parts read from fakes (a missing
module, another CPU's /proc/cpuinfo, a nearly full disk, a store with damaged entries)."""
import collections
import json
import shutil
import sys

import pytest
from typer.testing import CliRunner

from vfm_toolchain import doctor
from vfm_toolchain.cli import app
from vfm_toolchain.doctor import DoctorContext, Finding, cpu_findings
from vfm_toolchain.plugins import load_plugins

runner = CliRunner()

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


@pytest.fixture
def ctx(tmp_path):
    return DoctorContext(tmp_path / "store", tmp_path / "runs", store_given=True)


def _by_what(findings):
    return {f.what: f for f in findings}


def test_every_check_finds_something_here_and_each_problem_has_a_fix(ctx):
    load_plugins()  # the export floor registers its formats' and runtimes' checks
    names = [c.__name__ for c in doctor.CHECKS]
    assert {"python", "packages", "cpu", "threads", "gpu", "disk", "store", "export_formats",
            "export_runtimes"} <= set(names)
    findings = []
    for check in doctor.CHECKS:
        got = list(check(ctx))
        assert got and all(isinstance(f, Finding) for f in got), check.__name__
        findings += got
    whats = [f.what for f in findings]
    assert not [f for f in findings if f.status == "fail"], findings  # this machine builds
    for f in findings:
        assert f.what and f.detail
        if f.status != "ok":
            assert f.fix, f
    assert any(w.startswith("format onnx ") for w in whats) and any(w.startswith("runtime pytorch ") for w in whats)
    assert "package torch" in whats and ("gpu" in whats or "gpu 0" in whats)
    assert _by_what(findings)["store"].detail.endswith("the first build creates it")  # not made by looking at it
    assert not ctx.store.exists()


def test_the_command_prints_a_line_per_finding_and_json_parses(tmp_path):
    args = ["--store", str(tmp_path / "store"), "--out", str(tmp_path / "runs")]
    res = runner.invoke(app, ["doctor", "--json", *args])
    assert res.exit_code == 0, res.output
    found = json.loads(res.stdout)
    assert found and all(set(f) == {"status", "what", "detail", "fix"} for f in found)
    assert {f["status"] for f in found} <= {"ok", "warn", "missing"}
    res = runner.invoke(app, ["doctor", *args])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == len(found) + 1  # and the summary
    assert lines[0].startswith("✓ python: ")
    assert any(line.startswith("✓ runtime onnxruntime_cpu ") for line in lines)


def test_a_fail_exits_1_and_a_check_that_raises_is_reported(monkeypatch, tmp_path):
    def broken(ctx):
        raise KeyError("oops")

    monkeypatch.setattr(doctor, "CHECKS", [lambda ctx: [Finding("fail", "torch", "not installed", "pip install torch")],
                                           broken])
    res = runner.invoke(app, ["doctor", "--store", str(tmp_path / "s")])
    assert res.exit_code == 1
    assert "✗ torch: not installed  fix: pip install torch" in res.stdout
    assert "! broken: the check itself failed: KeyError" in res.stdout


def test_a_format_whose_module_is_missing_says_how_to_install_it(monkeypatch, ctx):
    from vfm_toolchain.export import doctor_checks
    from vfm_toolchain.export.formats import FORMATS

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails, find_spec finds nothing
    formats = _by_what(doctor_checks.export_formats(ctx))
    onnx = formats[f"format onnx ({FORMATS.meta('onnx')['devices']})"]
    assert onnx.status == "missing" and "needs onnxruntime" in onnx.detail
    assert onnx.fix == FORMATS.meta("onnx")["install"] and "pip install" in onnx.fix
    others = [n for n in FORMATS.list() if "onnxruntime" not in FORMATS.meta(n)["requires"]]
    assert all("onnxruntime" not in formats[f"format {n} ({FORMATS.meta(n)['devices']})"].detail for n in others)
    runtime = next(f for f in doctor_checks.export_runtimes(ctx) if f.what.startswith("runtime onnxruntime_cpu "))
    assert runtime.status == "missing" and "onnxruntime is not installed" in runtime.detail
    assert runtime.fix.startswith("pip install onnxruntime")


def test_cpu_flags_say_what_decides_int8_and_bf16():
    x86 = _by_what(cpu_findings(X86, "x86_64"))
    assert "Xeon" in x86["cpu"].detail and "AVX-512" in x86["cpu"].detail
    assert x86["cpu int8"].status == "ok"
    assert "AVX-512 VNNI" in x86["cpu int8"].detail and "AMX-INT8" in x86["cpu int8"].detail
    assert "benchmarks.export_bench" in x86["cpu int8"].detail  # measured there, never claimed here
    assert "AVX-512 BF16" in x86["cpu bf16"].detail and "AMX-BF16" in x86["cpu bf16"].detail

    arm = _by_what(cpu_findings(ARM, "aarch64"))
    assert "part 0xd0c" in arm["cpu"].detail and "NEON" in arm["cpu"].detail
    assert arm["cpu int8"].status == "ok" and "dot product" in arm["cpu int8"].detail
    assert "I8MM" not in arm["cpu int8"].detail and "no bf16 instructions" in arm["cpu bf16"].detail

    old = _by_what(cpu_findings(X86.replace(" avx512_vnni", "").replace(" amx_int8", ""), "x86_64"))
    assert old["cpu int8"].status == "warn" and "reduce_range" in old["cpu int8"].detail
    assert "benchmarks.export_bench" in old["cpu int8"].fix
    assert _by_what(cpu_findings(ARM.replace(" asimddp", ""), "aarch64"))["cpu int8"].status == "warn"
    assert cpu_findings(None, "arm64")[0].status == "ok"  # macOS: no /proc/cpuinfo


def test_low_disk_warns_with_the_gc_command(monkeypatch, ctx):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 98 << 30, 2 << 30))
    found = _by_what(doctor.disk(ctx))
    store, out = found["disk store"], found["disk output"]
    assert store.status == out.status == "warn" and "2.0 GiB free" in store.detail
    assert f"toolchain store --gc --older-than 30 --store {ctx.store}" in store.fix
    assert "--out" in out.fix and "toolchain store --gc" in out.fix  # the same disk here
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 50 << 30, 50 << 30))
    assert {f.status for f in doctor.disk(ctx)} == {"ok"}


def test_the_store_is_described_and_left_as_it_was(ctx):
    stage = ctx.store / "student.distill"
    (stage / ("a" * 24)).mkdir(parents=True)
    (stage / ("a" * 24) / "DONE").write_text(json.dumps({"key": "a" * 24, "files": {}}))
    (stage / ("b" * 24 + ".partial")).mkdir()
    (stage / ("c" * 24)).mkdir()  # sealed without DONE: damaged
    before = sorted(p.relative_to(ctx.store) for p in ctx.store.rglob("*"))
    (found,) = doctor.store(ctx)
    assert found.status == "warn"
    assert "3 entries" in found.detail and "1 damaged, 1 partial, 1 sealed" in found.detail
    assert found.fix == f"toolchain store --gc --store {ctx.store} deletes them"
    assert sorted(p.relative_to(ctx.store) for p in ctx.store.rglob("*")) == before

    (ctx.store / "file").write_text("")
    bad = doctor.store(DoctorContext(ctx.store / "file", ctx.out, True))[0]
    assert bad.status == "fail" and "is a file" in bad.detail


def test_a_pin_that_differs_warns_with_the_pip_command(monkeypatch, tmp_path):
    pins = tmp_path / "constraints.txt"
    pins.write_text("# header\ntorch==0.0.1\nnumpy==0.0.2 ; python_version >= '3'\n")
    monkeypatch.setattr(doctor, "CONSTRAINTS", pins)
    found = _by_what(doctor.packages(None))
    assert found["package torch"].status == "warn" and "constraints.txt pins 0.0.1" in found["package torch"].detail
    assert found["package torch"].fix == "pip install 'torch==0.0.1'"
    assert found["package numpy"].fix == "pip install 'numpy==0.0.2'"
    assert found["package timm"].status == "ok"  # not pinned in this file


def test_a_gpu_is_named_with_its_compute_capability_and_cuda(monkeypatch, ctx):
    import types

    import torch

    # CUDA faked for the report only: this machine has no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cards = [types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 << 30),
             types.SimpleNamespace(name="Tesla T4", major=7, minor=5, total_memory=15 << 30)]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: cards[i])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    h200, t4 = doctor.gpu(ctx)
    assert (h200.what, t4.what) == ("gpu 0", "gpu 1")
    assert "NVIDIA H200, compute capability 9.0, 141 GiB" in h200.detail and "CUDA 13.0" in h200.detail
    assert "bf16 autocast native" in h200.detail and "no native bf16" in t4.detail
