"""Checkpoints that carry their own model spec, and safe loading of users' weight files.

A saved model is a folder: ``spec.json`` (family, registry name, kwargs, adapter, preprocessing, class
names) beside ``weights.safetensors``.  Export and bench rebuild any model from that folder through the
model-family registry without importing training code.

User checkpoints are loaded only from safe formats: safetensors, or a torch file that
``torch.load(weights_only=True)`` accepts.  A pickle that needs arbitrary code is refused with a message.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
from safetensors.torch import load_file, save_file

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.files import atomic_write, atomic_write_json
from vfm_toolchain.core.registry import Registry

__all__ = ["MODEL_FAMILIES", "save_model", "load_model", "load_state_dict_safely", "load_matching",
           "save_training_state", "load_training_state"]

# "teacher" and "student" register a builder ``fn(spec) -> nn.Module`` here.
MODEL_FAMILIES = Registry("model family")


def load_state_dict_safely(path: str | Path) -> Dict[str, torch.Tensor]:
    """Read a weights file from disk without executing code from it.

    Accepts ``.safetensors`` and torch files loadable with ``weights_only=True``; unwraps the usual
    containers (``{"state_dict": ...}``, ``{"model": ...}``) and the ``module.`` prefix of DataParallel.

    Raises:
        ToolchainError: the file is missing, or is not a safe format.
    """
    path = Path(path)
    if not path.is_file():
        raise ToolchainError(f"checkpoint '{path}' does not exist; give a local .safetensors/.pth path, "
                             f"'pretrained' for the library's weights, or 'none'")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types
            raise ToolchainError(f"checkpoint '{path}' is not a valid safetensors file: {exc}") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ToolchainError(
            f"checkpoint '{path}' is not a safe format: it needs arbitrary code to load ({str(exc).splitlines()[0]}). "
            f"Re-save it as safetensors (safetensors.torch.save_file(model.state_dict(), 'model.safetensors')) "
            f"or as a plain state_dict with torch.save."
        ) from None
    except Exception as exc:
        raise ToolchainError(f"checkpoint '{path}' could not be read as a torch file: {exc}") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ToolchainError(f"checkpoint '{path}' does not hold a state_dict of tensors")
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in obj.items()}


def load_matching(model: torch.nn.Module, state: Dict[str, torch.Tensor], source: str, what: str) -> tuple:
    """``model.load_state_dict(state, strict=False)`` that first checks every shared tensor's shape, so a
    checkpoint of another model size is one clear error naming the tensors, not a wall of size mismatches.
    Returns (missing, unexpected) like ``load_state_dict``."""
    own = model.state_dict()
    wrong = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and v.shape != own[k].shape]
    if wrong:
        shown = "; ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in wrong[:3])
        raise ToolchainError(f"checkpoint '{source}' does not fit {what}: {len(wrong)} tensors have another shape "
                             f"({shown}{'; ...' if len(wrong) > 3 else ''}). Is it a checkpoint of another model "
                             f"or size? Give weights saved from the same architecture")
    return model.load_state_dict(state, strict=False)


def save_model(folder: Path, model: torch.nn.Module, spec: Dict[str, Any]) -> Path:
    """Write ``spec.json`` and ``weights.safetensors`` atomically; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    atomic_write(folder / "weights.safetensors", lambda p: save_file(state, str(p)))
    atomic_write_json(folder / "spec.json", spec)
    return folder


def load_model(folder: Path, builder: Optional[Callable[[Dict[str, Any]], torch.nn.Module]] = None) -> torch.nn.Module:
    """Rebuild a model from its folder with the builder its spec names; returns it in eval mode."""
    folder = Path(folder)
    spec_path = folder / "spec.json"
    if not spec_path.is_file():
        raise ToolchainError(f"'{folder}' is not a saved model (no spec.json)")
    spec = json.loads(spec_path.read_text())
    build = builder or MODEL_FAMILIES.get(spec["family"])
    model = build(spec)
    missing, unexpected = model.load_state_dict(load_file(str(folder / "weights.safetensors")), strict=False)
    if missing or unexpected:
        raise ToolchainError(f"saved model '{folder}' does not match its spec: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    return model.eval()


def save_training_state(path: Path, state: Dict[str, Any]) -> None:
    """Atomically write a resumable training state (model, optimizer, scheduler, RNG, position)."""
    atomic_write(Path(path), lambda p: torch.save(state, p))


def load_training_state(path: Path) -> Optional[Dict[str, Any]]:
    """On the CPU: load_state_dict copies into the model's device, the optimizer moves its state there."""
    path = Path(path)
    if not path.is_file():
        return None
    # Our own file, but still loaded with weights_only: optimizer states and RNG tensors are allowed types.
    return torch.load(path, map_location="cpu", weights_only=True)
