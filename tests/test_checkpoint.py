import pytest
import torch
from safetensors.torch import save_file

from vfm_toolchain.checkpoint import load_state_dict_safely
from vfm_toolchain.core.errors import ToolchainError


class _Evil:
    def __reduce__(self):
        return (print, ("this would run arbitrary code",))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(ToolchainError, match="does not exist"):
        load_state_dict_safely(tmp_path / "nope.pth")


def test_unsafe_pickle_is_refused(tmp_path):
    p = tmp_path / "evil.pth"
    torch.save({"w": torch.zeros(1), "x": _Evil()}, p)
    with pytest.raises(ToolchainError, match="not a safe format"):
        load_state_dict_safely(p)


def test_safetensors_and_wrapped_torch_files(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    assert torch.equal(load_state_dict_safely(tmp_path / "w.safetensors")["a"], torch.ones(2))
    torch.save({"state_dict": {"module.b": torch.arange(3)}}, tmp_path / "w.pth")
    assert torch.equal(load_state_dict_safely(tmp_path / "w.pth")["b"], torch.arange(3))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(ToolchainError, match="not a valid safetensors"):
        load_state_dict_safely(tmp_path / "bad.safetensors")
