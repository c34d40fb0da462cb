import pytest

from toolchain.errors import ToolchainError
from toolchain.registry import Registry


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
