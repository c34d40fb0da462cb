import pytest

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import Registry


def test_register_get_list_natural_sort():
    reg = Registry("thing")
    for name in ("vit_s104", "vit_s14", "abc"):
        reg.register(name, foldable=name == "abc")(lambda n=name: n)
    assert reg.list() == ["abc", "vit_s14", "vit_s104"]
    assert reg.list("vit*") == ["vit_s14", "vit_s104"]
    assert reg.get("abc")() == "abc"
    assert reg.meta("abc") == {"foldable": True}


def test_unknown_name_suggests_and_lists():
    reg = Registry("student")
    reg.register("fastvit_s12")(object)
    reg.register("mobilevitv2_100")(object)
    with pytest.raises(ToolchainError) as err:
        reg.get("fastvit_s21")
    msg = str(err.value)
    assert "unknown student 'fastvit_s21'" in msg and "Did you mean 'fastvit_s12'" in msg and "mobilevitv2_100" in msg


def test_prefix_namespace_and_duplicates():
    reg = Registry("teacher", prefix_sep=":")
    reg.register("timm:")(lambda: "timm")
    assert reg.get("timm:vit_small_patch14_dinov2")() == "timm"
    assert "timm:anything" in reg and "hf:x" not in reg
    with pytest.raises(ValueError):
        reg.register("timm:")(object)


def test_every_module_that_registers_is_loaded_by_the_plugins():
    """A registration in a module its package does not import exists only once some other code imported
    it, so a cached stage (which imports nothing) leaves its names unknown. Checked in a fresh process."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    from vfm_toolchain.plugins import area_module

    root = Path(__file__).resolve().parents[1]
    modules = []
    for area in ("toolchain", "teachers", "students", "export", "bench"):
        for path in sorted((root / area).rglob("*.py")):
            if re.search(r"^\s*@?[A-Z_]+\.register\(", path.read_text(), re.M):
                parts = path.relative_to(root / area).with_suffix("").parts
                modules.append(".".join([area_module(area), *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    assert "vfm_toolchain.teachers.segmentation" in modules  # the scan finds decorated registrations
    code = ("import sys; from vfm_toolchain.plugins import load_plugins; load_plugins(); "
            "print('\\n'.join(m for m in sys.argv[1:] if m not in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [], f"registering modules that load_plugins() never imports: {run.stdout.split()}"
