"""Fold passes: pure model-to-model functions that return plain weights computing the same outputs.  On the
students' floor: export folds every model before converting it, and quantization-aware training (student.qat)
trains the folded network.

Each pass deep-copies by default (timm's ``reparameterize_model`` habit) and is safe to run twice.
``fold_model`` runs the passes that apply and records the max deviation each one introduced on real
inputs, so the build shows exactly where any numerical drift came from.
"""
from __future__ import annotations

import copy
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from vfm_toolchain.checkpoint import MODEL_FAMILIES
from vfm_toolchain.core.registry import Registry

__all__ = ["FOLDS", "fold_model", "fuse_batchnorm", "reparameterize", "merge_adapter", "remove_gramian_heads",
           "broadcast_attention", "same_avg_pool", "channel_multiplier", "level_batchnorm", "ships_wrapped",
           "deployable", "folded_spec"]

FOLDS = Registry("fold pass")


# Every model family whose spec carries a teacher adapter: the classifier, the segmentation and the detection form.
ADAPTED_FAMILIES = ("teacher", "segmentation_teacher", "detection_teacher")


@FOLDS.register("adapter_merge", applies_to="teachers (classifier, segmentation or detection form) with a foldable "
                                            "adapter (LoRA merge)")
def merge_adapter(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    if spec.get("family") not in ADAPTED_FAMILIES or not spec.get("adapter"):
        return model
    from vfm_toolchain.teachers.model import fold_teacher  # teachers only when a teacher is exported

    model = model if inplace else copy.deepcopy(model)
    return fold_teacher(model, spec)


@FOLDS.register("gramian_heads", applies_to="students trained with extra Gramian heads: keep the deployed path")
def remove_gramian_heads(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    from vfm_toolchain.students.gramian import DeployedStudent, GramianStudent

    if not isinstance(model, GramianStudent):
        return model
    model = model if inplace else copy.deepcopy(model)
    return model.model if model.deploy == "none" else DeployedStudent(model.model, model.heads[0])


@FOLDS.register("reparameterize", applies_to="FastViT / MobileOne blocks (structural reparameterization)")
def reparameterize(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    from timm.utils.model import reparameterize_model

    return reparameterize_model(model, inplace=inplace)


def _bn_replacement(bn: nn.Module) -> nn.Module:
    # timm's BatchNormAct2d carries drop + activation after the normalisation; keep those
    act, drop = getattr(bn, "act", None), getattr(bn, "drop", None)
    parts = [m for m in (drop, act) if m is not None and not isinstance(m, nn.Identity)]
    return nn.Sequential(*parts) if parts else nn.Identity()


def _fuse_in(module: nn.Module) -> int:
    fused = 0
    # pattern 1: Sequential(..., Conv2d, BatchNorm2d, ...) (torchvision Conv2dNormActivation and friends)
    if isinstance(module, nn.Sequential):
        names = list(module._modules)
        for a, b in zip(names, names[1:]):
            conv, bn = module._modules[a], module._modules[b]
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d) and bn.track_running_stats:
                module._modules[a] = fuse_conv_bn_eval(conv, bn)
                module._modules[b] = _bn_replacement(bn)
                fused += 1
    # pattern 2: timm ConvNormAct / ConvBnAct: attributes .conv and .bn
    conv, bn = getattr(module, "conv", None), getattr(module, "bn", None)
    if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d) and bn.track_running_stats:
        module.conv = fuse_conv_bn_eval(conv, bn)
        module.bn = _bn_replacement(bn)
        fused += 1
    return fused


@FOLDS.register("bn_fuse", applies_to="Conv2d followed by BatchNorm2d")
def fuse_batchnorm(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    model = model if inplace else copy.deepcopy(model)
    model.eval()
    for m in list(model.modules()):
        _fuse_in(m)
    return model


@FOLDS.register("level_batchnorm", applies_to="a detection head whose levels share convolutions and each have a "
                                           "BatchNorm (head_norm: batch): one folded conv + ReLU tower per level")
def level_batchnorm(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    # unshared() folds each level's running statistics (in eval mode), not a batch's
    return _replace_modules(model, lambda m: m.unshared() if callable(getattr(m, "unshared", None)) else None,
                            inplace)


def _replace_modules(model: nn.Module, replacement: Callable[[nn.Module], Optional[nn.Module]],
                     inplace: bool) -> nn.Module:
    """``model`` (a copy unless ``inplace``) with every submodule for which ``replacement`` gives a module swapped
    for it (``None``: kept)."""
    model = model if inplace else copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = replacement(child)
            if new is not None:
                setattr(parent, name, new)
    return model


class RepeatedDepthwise(nn.Module):
    """A convolution with one group per input channel and ``m`` outputs from each, as each input channel repeated
    ``m`` times (output channel ``o`` reads input channel ``o // m``, as the grouped convolution does) and then a
    depthwise convolution with the same weights: the same sums, and a kernel every runtime has a fast int8 form of.
    FastViT's strided 7x7 downsampling is this shape; OpenVINO and ONNX Runtime have no fast kernel for it."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.m = conv.out_channels // conv.in_channels
        self.conv = nn.Conv2d(conv.out_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                              conv.dilation, groups=conv.out_channels, bias=conv.bias is not None,
                              padding_mode=conv.padding_mode)
        with torch.no_grad():
            self.conv.weight.copy_(conv.weight)
            if conv.bias is not None:
                self.conv.bias.copy_(conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # m copies side by side, flattened channel-major: no shape read from x (Core ML's converter refuses an
        # expand to a traced shape)
        return self.conv(torch.cat([x.unsqueeze(2)] * self.m, dim=2).flatten(1, 2))


def _multiplies_channels(m: nn.Module) -> bool:
    return (isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1 and m.out_channels > m.in_channels
            and m.out_channels % m.in_channels == 0)


@FOLDS.register("channel_multiplier", applies_to="a convolution with one group per input channel and several outputs "
                                                 "from each (FastViT's downsampling): repeat, then depthwise")
def channel_multiplier(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    return _replace_modules(model, lambda m: RepeatedDepthwise(m) if _multiplies_channels(m) else None, inplace)


def _broadcast_self_attn(self, x: torch.Tensor) -> torch.Tensor:
    """timm's ``LinearSelfAttention._forward_self_attn`` with ``relu(value) * context`` broadcast instead of
    ``context.expand_as(value)``: the same numbers, and a graph LiteRT's converter accepts (it fails the expanded
    product with "'tfl.mul' op operands don't have broadcast-compatible shapes")."""
    query, key, value = self.qkv_proj(x).split([1, self.embed_dim, self.embed_dim], dim=1)
    context_scores = self.attn_drop(torch.softmax(query, dim=-1))
    context_vector = (key * context_scores).sum(dim=-1, keepdim=True)  # [B, d, P, 1]
    return self.out_drop(self.out_proj(torch.relu(value) * context_vector))


@FOLDS.register("broadcast_attention", applies_to="MobileViT-V2 linear self-attention (broadcast, not expand)")
def broadcast_attention(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    from timm.models.mobilevit import LinearSelfAttention

    model = model if inplace else copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, LinearSelfAttention):
            m._forward_self_attn = _broadcast_self_attn.__get__(m)  # this instance only; timm's class untouched
    return model


class SymmetricAvgPool(nn.Module):
    """timm's ``AvgPool2dSame`` at stride 1 (the average-pool shortcut of a dilated ResNet-D stage, resnet10t's at
    output stride 8 or 16) as one average pool with symmetric zero padding, cropped: the same sums over the same
    windows.  timm pads (0, k - 1) on the right and bottom with ``F.pad``; XNNPACK cannot build that int8 constant
    pad ("Failed to create StaticConstantPad ... xnn_status_invalid_parameter", ExecuTorch 1.5), and runs this."""

    def __init__(self, kernel: int):
        super().__init__()
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernel
        left = (k - 1) // 2  # pad_same's split of the k - 1 zero rows: left = total // 2, the rest on the right
        y = nn.functional.avg_pool2d(x, k, 1, padding=k // 2, count_include_pad=True)
        start = k // 2 - left
        return y[..., start:start + x.shape[-2], start:start + x.shape[-1]]


@FOLDS.register("same_avg_pool", applies_to="timm AvgPool2dSame at stride 1 (dilated ResNet-D shortcuts): a "
                                            "symmetric-padding pool, cropped")
def same_avg_pool(model: nn.Module, spec: Dict[str, Any], inplace: bool = False) -> nn.Module:
    from timm.layers import AvgPool2dSame

    def symmetric(child: nn.Module) -> Optional[nn.Module]:
        k = child.kernel_size if isinstance(child, AvgPool2dSame) else None
        # the explicit zero pad counts in the mean whatever count_include_pad says (the pool itself pads nothing)
        if k is not None and tuple(child.stride) == (1, 1) and k[0] == k[1] and tuple(child.padding) == (0, 0):
            return SymmetricAvgPool(int(k[0]))
        return None

    return _replace_modules(model, symmetric, inplace)


def ships_wrapped(model: nn.Module) -> bool:
    """A model whose artifacts hold it inside a wrapper of its own (its ``shipped``: a detector with its NMS)."""
    return callable(getattr(model, "shipped", None))


@torch.no_grad()
def fold_model(model: nn.Module, spec: Dict[str, Any], x: torch.Tensor,
               passes: Tuple[str, ...] = ("adapter_merge", "gramian_heads", "reparameterize", "bn_fuse",
                                          "level_batchnorm", "channel_multiplier", "broadcast_attention",
                                          "same_avg_pool")
               ) -> Tuple[nn.Module, List[Dict]]:
    """Run the fold passes in order on a copy; returns the folded model and one record per pass.

    A model with a dense form (``dense_output``: a detector) is compared on it: every location's class logits, box
    distances and quality, one tensor, not its per-level dict or its final boxes, whose count moves with a score at
    the threshold; the folded model is returned with ``dense_output`` off again, as the trained one is."""
    model = copy.deepcopy(model).eval()
    dense = hasattr(model, "dense_output")
    if dense:
        model.dense_output = True  # the copy only: the caller's model is untouched
    ref = model(x)
    records = []
    for name in passes:
        before = sum(p.numel() for p in model.parameters())
        model = FOLDS.get(name)(model, spec, inplace=True).eval()
        out = model(x)
        records.append({"pass": name, "max_abs_diff": float((out - ref).abs().max()),
                        "params_before": before, "params_after": sum(p.numel() for p in model.parameters())})
    if dense:
        model.dense_output = False
    return model, records


def folded_spec(spec: Dict[str, Any]) -> Dict[str, Any]:
    """The spec a folded network is saved with (student.qat trains one): the model's own spec under the family
    ``folded``, which rebuilds it and runs the fold passes before the weights are loaded."""
    return {**spec, "family": "folded", "folded_family": spec["family"]}


@MODEL_FAMILIES.register("folded")
def build_folded(spec: Dict[str, Any]) -> nn.Module:
    """The network of a :func:`folded_spec`: its model rebuilt from the spec and folded (the passes give the same
    modules every time), ready for the folded weights."""
    from vfm_toolchain.data.images import Preprocess

    inner = {**spec, "family": spec["folded_family"]}
    model = MODEL_FAMILIES.get(inner["family"])(inner).eval()
    return fold_model(model, inner, torch.zeros(1, 3, *Preprocess.from_dict(spec["preprocess"]).hw))[0]


def deployable(model: nn.Module, detection: Optional[Dict[str, Any]] = None) -> nn.Module:
    """The network an artifact holds: a detector wrapped with its NMS (``DetectorWithNMS``: one float tensor of
    final detections, ``(batch_index, x1, y1, x2, y2, score, class)`` rows; ``detection``: ``score_thresh``,
    ``iou``, ``max_det``, the recipe's ``export.detection``); any other model as it is."""
    return model.shipped(**(detection or {})) if ships_wrapped(model) else model


# What a candidates artifact returns, in its export record (and its metadata where the format keeps one)
CANDIDATES_OUTPUT = ("candidates [B, N, 4 + C] float32: per location (strides 8, 16, 32, row-major, finest first) its "
                     "box x1, y1, x2, y2 in input pixels and its C class scores in [0, 1]; finish with the NMS of "
                     "runtimes/nms.py (select_detections) at runtime_nms")


def holds_nms(model: nn.Module) -> bool:
    """A detector wrapped with its NMS (``DetectorWithNMS``): its output is the ``[K, 7]`` final detections."""
    detection = sys.modules.get("vfm_toolchain.blocks.detection")  # loaded with any detector
    return detection is not None and isinstance(model, detection.DetectorWithNMS)


def nms_outside(model: nn.Module) -> Tuple[nn.Module, Dict[str, Any]]:
    """For a format whose graph cannot hold an NMS (ExecuTorch, LiteRT): a detector with its NMS becomes its
    candidates (``DetectorCandidates``: ``[B, N, 4 + C]`` decoded boxes and class scores), and the record says so:
    ``{"output": CANDIDATES_OUTPUT, "runtime_nms": {score_thresh, iou, max_det}}``, the settings the runtime layer
    finishes it with (export/runtimes/nms.py, a runtime's ``runtime_nms`` option).  Any other model comes back as it
    is, with an empty record."""
    if not holds_nms(model):
        return model, {}
    detection = sys.modules["vfm_toolchain.blocks.detection"]
    nms = {"score_thresh": model.score_thresh, "iou": model.iou, "max_det": model.max_det}
    return detection.DetectorCandidates(model.detector).eval(), {"output": CANDIDATES_OUTPUT, "runtime_nms": nms}
