"""The detector shared by the detection teacher and its students (issue 38), on the floor below both: an anchor-free
one-stage FCOS detector (Tian et al., "FCOS: Fully Convolutional One-Stage Object Detection") on three feature maps at
strides 8 / 16 / 32, a light FPN neck, and NMS that exports into the ONNX graph.

Why FCOS, not YOLOX's SimOTA or YOLOv8's task-aligned assignment
-----------------------------------------------------------------
- The assignment is static: a location is positive for a box because of where it is (inside the box's
  centre region, at the level whose size range holds the box), never because of what the network predicts.
  Teacher and student share the strides and the head layout, so the teacher's class scores, box distances
  and quality at *every location of every level* are dense targets at exactly the student's locations
  (:meth:`Detector.dense_outputs`), cached like segmentation's stride-8 logits.  A dynamic matcher would make
  the positives of the two models differ and the dense targets ambiguous.
- It is deterministic and small enough to check by hand (``tests/test_detection_model.py`` does).
- No per-batch cost matrix and Sinkhorn / top-k matching, which dominate a training step on 2 CPU cores.

What the parts are
------------------
- Backbone features at strides 8 / 16 / 32, read from whatever the backbone is built by
  (teachers/backbones/), *without* rebuilding it, so the weights, the preprocessing and any teacher
  adapter (LoRA, blocks, ...) apply exactly as for the classification teacher:

  - timm models through ``forward_intermediates`` at the last ``feature_info`` entry of each stride;
  - timm ViTs (DINOv2) and OpenCLIP ViT towers, which have one map at their patch stride, through a ViTDet
    simple feature pyramid (Li et al. 2022): transposed convolutions up, identity, max-pooling down; a patch
    that is not a power of two (DINOv2's 14) is first resized to the stride-16 grid;
  - torchvision CNNs through their ``.features`` stages (MobileNet, EfficientNet, ConvNeXt, VGG) or
    ``layer2..4`` (ResNets); OpenCLIP ModifiedResNet and timm towers through ``forward_intermediates``;
  - students (:mod:`students.detection`) through ``timm.create_model(features_only=True)``.
- Neck: FPN (lateral 1x1, nearest top-down x2, 3x3 smoothing) at ``neck_channels`` (96 by default).
- Head: FCOS's, shared across levels: two towers of 3x3 conv + GroupNorm + ReLU (or a BatchNorm per level,
  which folds away for int8: ``head_norm``), class logits (bias from the prior probability 0.01 so the focal
  loss starts small), box distances (l, t, r, b) = ``softplus(scale_level * raw) * stride`` in input pixels
  (softplus: positive, smooth, no exp overflow early in training), and a quality (centerness) logit on the box
  tower.
- Assignment (:func:`fcos_assign`): a location is a candidate for a box when it lies inside the box's centre
  region (1.5 strides around the box centre, clipped to the box: FCOS's centre sampling) and the largest of
  its distances (l, t, r, b) lies in its level's size range ([0, 64], [64, 128], [128, inf) pixels); among
  several candidate boxes the smallest (by area) wins.
- Loss (:meth:`Detector.loss`): sigmoid focal loss over every location and class, GIoU loss on positives
  weighted by the centerness target, BCE on the quality logit; each normalised by the number of positives.
- Scores: ``sqrt(sigmoid(class) * sigmoid(quality))``; decoding thresholds them, runs class-aware NMS per
  image and keeps the best ``max_det`` per image, the same in PyTorch and in the exported graph.

Input sides must be multiples of 32 (64 for MobileViT-V2, whose last stage pads an odd grid), so every level
is exactly input / stride and the locations of teacher and student coincide.

Detections leave :class:`DetectorWithNMS` (and :func:`select_detections`) as one float tensor ``[K, 7]``:
rows ``(batch_index, x1, y1, x2, y2, score, class)`` in input pixels, sorted by batch index, then by score
(best first).  Exported to ONNX, the NMS is the standard ``NonMaxSuppression`` op (boxes ``[B, N, 4]``,
scores ``[B, C, N]``, selected indices ``[K, 3]`` = (batch, class, box)).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval
from torchvision.ops import batched_nms, generalized_box_iou_loss, sigmoid_focal_loss

from vfm_toolchain.blocks.norm import keep_norm_frozen
from vfm_toolchain.core.errors import ToolchainError

__all__ = ["STRIDES", "FeatureReader", "SimpleFeaturePyramid", "FPN", "FCOSHead", "Detector", "DetectorWithNMS",
           "DetectorCandidates", "fcos_assign", "select_detections", "timm_feature_plan", "torchvision_feature_plan",
           "open_clip_feature_plan", "last_index_per_stride", "level_points", "size_ranges"]

STRIDES = (8, 16, 32)
SIZE_EDGES = (64.0, 128.0)  # FCOS's P3 / P4 / P5 size ranges: [0, 64], [64, 128], [128, inf) pixels


# --------------------------------------------------------------------------------------------------------------
# Backbone features at strides 8 / 16 / 32


@dataclass(frozen=True)
class FeatureReader:
    """How maps are read from a backbone module (not a module itself: the backbone stays where an adapter or a
    fold pass expects it, and the reader only says which of its outputs to take).

    ``kind``: ``timm`` (``forward_intermediates`` of a timm model), ``timm_trunk`` (of an OpenCLIP timm tower,
    ``visual.trunk``), ``open_clip`` (of an OpenCLIP tower), ``timm_features`` (a ``features_only`` model: its
    own outputs), ``torchvision_features`` (children of ``.features`` up to the given indices),
    ``torchvision_resnet`` (``layer2..4``).  ``indices``: which intermediates; ``norm``: apply the model's final
    norm to them (ViTs, whose last block is read)."""

    kind: str
    indices: Tuple[int, ...] = ()
    norm: bool = False

    def __call__(self, backbone: nn.Module, x: torch.Tensor) -> List[torch.Tensor]:
        net = _unwrap(backbone)
        if self.kind == "timm_features":
            return list(net(x))
        if self.kind in ("timm", "timm_trunk"):
            model = net.visual.trunk if self.kind == "timm_trunk" else net
            return list(model.forward_intermediates(x, indices=list(self.indices), norm=self.norm,
                                                    intermediates_only=True))
        if self.kind == "open_clip":
            out = net.visual.forward_intermediates(x, indices=list(self.indices), intermediates_only=True,
                                                   normalize_intermediates=self.norm)
            return list(out["image_intermediates"])
        if self.kind == "torchvision_features":
            maps = []
            for i, layer in enumerate(net.features):
                x = layer(x)
                if i in self.indices:
                    maps.append(x)
                if i == self.indices[-1]:
                    return maps
        if self.kind == "torchvision_resnet":
            x = net.maxpool(net.relu(net.bn1(net.conv1(x))))
            x = net.layer1(x)
            maps = []
            for layer in (net.layer2, net.layer3, net.layer4):
                x = layer(x)
                maps.append(x)
            return maps
        raise ToolchainError(f"unknown feature reader '{self.kind}'")


def _unwrap(backbone: nn.Module) -> nn.Module:
    """The network inside a teacher :class:`Backbone` (and inside PEFT's LoRA wrapper, which injects its layers
    into that network in place, so reading the network reads the adapted layers); a student body as it is."""
    net = backbone.model if getattr(backbone, "wraps_model", False) else backbone
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: no PEFT wrapper exists (lora.py imports it)
    return net.model if tuners is not None and isinstance(net, tuners.BaseTuner) else net


def last_index_per_stride(reductions: Sequence[int], strides: Sequence[int]) -> Optional[List[int]]:
    """The last feature entry at each stride (the deepest map there), or None when a stride is missing."""
    found = []
    for s in strides:
        at = [i for i, r in enumerate(reductions) if r == s]
        if not at:
            return None
        found.append(at[-1])
    return found


def timm_feature_plan(model: nn.Module, kind: str = "timm") -> Tuple[FeatureReader, List[int], Optional[int]]:
    """(reader, channels, plain stride) for a timm model from its ``feature_info``: a hierarchical model gives
    its maps at 8 / 16 / 32 (plain stride None); a plain one (ViT) its last map and that map's stride, which a
    :class:`SimpleFeaturePyramid` turns into three."""
    info = getattr(model, "feature_info", None)
    if not info or not hasattr(model, "forward_intermediates"):
        raise ToolchainError(f"timm model {type(model).__name__} exposes no feature_info / forward_intermediates, "
                             f"which detection reads its maps through; choose another timm model")
    reductions = [int(d["reduction"]) for d in info]
    channels = [int(d["num_chs"]) for d in info]
    picked = last_index_per_stride(reductions, STRIDES)
    if picked is not None:
        return FeatureReader(kind, tuple(picked)), [channels[i] for i in picked], None
    last = len(info) - 1
    return FeatureReader(kind, (last,), norm=True), [channels[last]], reductions[last]


def torchvision_feature_plan(net: nn.Module) -> Tuple[FeatureReader, List[int]]:
    if isinstance(getattr(net, "features", None), nn.Sequential):
        strides, channels = _probe_children(net.features)
        picked = last_index_per_stride(strides, STRIDES)
        if picked is None:
            raise ToolchainError(f"torchvision's {type(net).__name__}.features has no maps at strides 8, 16 and 32 "
                                 f"(it has {sorted(set(strides))})")
        return FeatureReader("torchvision_features", tuple(picked)), [channels[i] for i in picked]
    if all(hasattr(net, a) for a in ("conv1", "bn1", "maxpool", "layer1", "layer2", "layer3", "layer4")):
        _, channels = _probe_children(nn.Sequential(nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool),
                                                    net.layer1, net.layer2, net.layer3, net.layer4))
        return FeatureReader("torchvision_resnet"), channels[2:]
    raise ToolchainError(f"torchvision's {type(net).__name__} has neither a .features stack nor ResNet layers to "
                         f"read strides 8 / 16 / 32 from (torchvision models with one: mobilenet_v2, mobilenet_v3_*, "
                         f"efficientnet_*, convnext_*, vgg*, resnet*; or any timm model, e.g. timm:resnet50)")


@torch.no_grad()
def _probe_children(seq: nn.Sequential, size: int = 128) -> Tuple[List[int], List[int]]:
    """(stride, channels) of each child's output, from one forward of a zero image in eval mode."""
    was = seq.training
    seq.eval()
    strides, channels = [], []
    try:
        x = torch.zeros(1, 3, size, size)
        for layer in seq:
            x = layer(x)
            strides.append(int(round(size / x.shape[-1])))
            channels.append(int(x.shape[1]))
    finally:
        seq.train(was)
    return strides, channels


def open_clip_feature_plan(visual: nn.Module) -> Tuple[FeatureReader, List[int], Optional[int]]:
    if hasattr(visual, "trunk"):  # a timm tower inside open_clip
        return timm_feature_plan(visual.trunk, "timm_trunk")
    if hasattr(visual, "conv1") and hasattr(visual, "transformer"):  # open_clip's own ViT: the last block's tokens
        ph, pw = visual.patch_size if isinstance(visual.patch_size, (tuple, list)) else (visual.patch_size,) * 2
        if ph != pw:
            raise ToolchainError(f"open_clip tower with a non-square patch {ph}x{pw}: detection needs one stride")
        last = len(visual.transformer.resblocks) - 1
        return FeatureReader("open_clip", (last,), norm=True), [int(visual.conv1.out_channels)], int(ph)
    if hasattr(visual, "layer4") and hasattr(visual, "stem"):  # ModifiedResNet (RN50, ...): stem, layer1..4
        _, channels = _probe_children(nn.Sequential(_Call(visual.stem), visual.layer1, visual.layer2,
                                                    visual.layer3, visual.layer4), 128)
        return FeatureReader("open_clip", (2, 3, 4)), channels[2:], None
    raise ToolchainError(f"open_clip tower {type(visual).__name__}: no feature maps detection knows how to read "
                         f"(supported: ViT towers, ModifiedResNet, timm towers)")


class _Call(nn.Module):
    """A bound method as a module, so a probe can run it in a Sequential."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# --------------------------------------------------------------------------------------------------------------
# Neck and head


def _groups(channels: int) -> int:
    """GroupNorm groups: 32 as FCOS, fewer when the width does not divide."""
    return next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's pyramid from one map at ``stride``: 2x transposed convolutions (GroupNorm + GELU between two)
    for finer levels, identity at its own stride, max-pooling for coarser levels.  A stride that is not a power
    of two (DINOv2's patch 14) is first resized bilinearly to the stride-16 grid of the input."""

    def __init__(self, dim: int, stride: int, strides: Sequence[int] = STRIDES):
        super().__init__()
        self.resize = stride & (stride - 1) != 0  # not a power of two
        base = 16 if self.resize else stride
        self.base = base
        self.levels = nn.ModuleList()
        self.channels: List[int] = []
        for s in strides:
            if s < base:
                ups = int(math.log2(base // s))
                layers, ch = [], dim
                for k in range(ups):
                    out = max(dim // 2 ** (k + 1), 16)
                    if k:
                        layers += [nn.GroupNorm(_groups(ch), ch), nn.GELU()]
                    layers.append(nn.ConvTranspose2d(ch, out, 2, stride=2))
                    ch = out
                self.levels.append(nn.Sequential(*layers))
                self.channels.append(ch)
            elif s == base:
                self.levels.append(nn.Identity())
                self.channels.append(dim)
            else:
                self.levels.append(nn.MaxPool2d(s // base, s // base))
                self.channels.append(dim)

    def forward(self, x: torch.Tensor, image_hw: Tuple[int, int]) -> List[torch.Tensor]:
        if self.resize:
            x = F.interpolate(x, size=(image_hw[0] // self.base, image_hw[1] // self.base), mode="bilinear",
                              align_corners=False)
        return [level(x) for level in self.levels]


class FPN(nn.Module):
    """Lateral 1x1 convolutions to ``channels``, top-down nearest x2 upsampling added in, 3x3 smoothing."""

    def __init__(self, in_channels: Sequence[int], channels: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        self.smooth = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in in_channels)

    def forward(self, maps: List[torch.Tensor]) -> List[torch.Tensor]:
        laterals = [conv(m) for conv, m in zip(self.lateral, maps)]
        out = [laterals[-1]]
        for lat in reversed(laterals[:-1]):
            # a constant factor, not the lateral's size: nothing in the graph reads a shape (exact strides are
            # checked in Detector.forward)
            out.insert(0, lat + F.interpolate(out[0], scale_factor=2.0, mode="nearest"))
        return [conv(m) for conv, m in zip(self.smooth, out)]


class Scale(nn.Module):
    """FCOS's learnable per-level scale of the shared box regression: it holds the parameter, which
    :meth:`FCOSHead.distances` reads directly (a module call would scope the multiply inside the head, which int8
    quantizes)."""

    def __init__(self, value: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(value)))


class SharedTower(nn.Sequential):
    """FCOS's tower, one for all levels: 3x3 conv + GroupNorm + ReLU, ``num_convs`` times (GroupNorm normalises each
    image alone, so the levels share it too)."""

    def __init__(self, channels: int, num_convs: int):
        super().__init__(*[m for _ in range(num_convs) for m in (
            nn.Conv2d(channels, channels, 3, padding=1), nn.GroupNorm(_groups(channels), channels),
            nn.ReLU(inplace=True))])

    def forward(self, x: torch.Tensor, level: int = 0) -> torch.Tensor:
        return super().forward(x)


class LevelNormTower(nn.Module):
    """A tower whose 3x3 convolutions the levels share and whose BatchNorm each level has of its own (RTMDet's
    shared head): the levels' statistics differ, so one BatchNorm would mix them.  Unlike GroupNorm it folds away:
    :meth:`unshared` (the export floor's ``level_batchnorm`` pass) gives a plain conv + ReLU tower per level, which
    int8 runs without a float normalisation between its convolutions."""

    def __init__(self, channels: int, num_convs: int, num_levels: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(num_convs))
        self.norms = nn.ModuleList(nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(num_convs))
                                   for _ in range(num_levels))

    def forward(self, x: torch.Tensor, level: int = 0) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms[level]):
            x = F.relu(norm(conv(x)))
        return x

    def unshared(self) -> "LevelTowers":
        """The same function in eval mode: per level, each convolution with that level's BatchNorm folded in."""
        return LevelTowers([nn.Sequential(*[m for conv, bn in zip(self.convs, norms)
                                            for m in (fuse_conv_bn_eval(conv.eval(), bn.eval()), nn.ReLU())])
                            for norms in self.norms])


class LevelTowers(nn.Module):
    """A folded :class:`LevelNormTower`: one conv + ReLU tower per level."""

    def __init__(self, towers: Sequence[nn.Module]):
        super().__init__()
        self.towers = nn.ModuleList(towers)

    def forward(self, x: torch.Tensor, level: int = 0) -> torch.Tensor:
        return self.towers[level](x)


HEAD_NORMS = ("group", "batch")


class FCOSHead(nn.Module):
    """Shared across levels (FCOS): class tower -> class logits; box tower -> distances and quality logit.

    ``norm``: ``group`` (FCOS: GroupNorm, the towers whole shared) or ``batch`` (a BatchNorm per level, which the
    export folds into the convolutions: :class:`LevelNormTower`)."""

    def __init__(self, channels: int, num_classes: int, num_convs: int = 2, num_levels: int = 3,
                 prior_prob: float = 0.01, norm: str = "group"):
        super().__init__()
        if norm not in HEAD_NORMS:
            raise ToolchainError(f"head norm '{norm}': use one of {', '.join(HEAD_NORMS)}")

        def tower() -> nn.Module:
            return SharedTower(channels, num_convs) if norm == "group" else LevelNormTower(channels, num_convs,
                                                                                          num_levels)

        self.cls_tower, self.box_tower = tower(), tower()
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.box_pred = nn.Conv2d(channels, 4, 3, padding=1)
        self.quality = nn.Conv2d(channels, 1, 3, padding=1)
        self.scales = nn.ModuleList(Scale() for _ in range(num_levels))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                nn.init.zeros_(m.bias)
        # every location starts at probability prior_prob of each class: the focal loss of the many
        # background locations does not swamp the first steps (RetinaNet / FCOS)
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior_prob) / prior_prob))

    def forward(self, maps: List[torch.Tensor]) -> Dict[str, List[torch.Tensor]]:
        """Per level: ``cls`` logits, ``box`` raw distance logits (:meth:`distances` turns them into pixels) and
        ``quality`` logits."""
        cls, box, quality = [], [], []
        for level, m in enumerate(maps):
            c, b = self.cls_tower(m, level), self.box_tower(m, level)
            cls.append(self.cls_logits(c))
            box.append(self.box_pred(b))
            quality.append(self.quality(b))
        return {"cls": cls, "box": box, "quality": quality}

    def distances(self, raw: List[torch.Tensor], strides: Sequence[int]) -> List[torch.Tensor]:
        """The raw box outputs as distances in input pixels, ``softplus(scale * x) * stride`` per level.  Not part of
        :meth:`forward` (and no module call): the detector runs it in its own scope, with the rest of the decoding,
        which every int8 format keeps float; quantized to the head's int8 grid, pixel distances lost the Aquarium
        student most of its mAP50 on LiteRT (docs/results.md)."""
        return [F.softplus(r * scale.scale) * float(s) for r, scale, s in zip(raw, self.scales, strides)]


# --------------------------------------------------------------------------------------------------------------
# Assignment


def level_points(h: int, w: int, stride: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(h*w, 2) centres (x, y) in input pixels of a level's locations, row-major like ``flatten(2)``."""
    ys = (torch.arange(h, device=device, dtype=dtype) + 0.5) * stride
    xs = (torch.arange(w, device=device, dtype=dtype) + 0.5) * stride
    y, x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([x.reshape(-1), y.reshape(-1)], dim=1)


def size_ranges(num_levels: int, edges: Sequence[float] = SIZE_EDGES) -> List[Tuple[float, float]]:
    """[(lo, hi)] per level from the ``num_levels - 1`` edges between them; the last level is unbounded."""
    if len(edges) != num_levels - 1 or list(edges) != sorted(edges):
        raise ToolchainError(f"size edges {list(edges)}: need {num_levels - 1} increasing values, one between "
                             f"each pair of levels")
    bounds = [0.0, *[float(e) for e in edges], math.inf]
    return list(zip(bounds[:-1], bounds[1:]))


def fcos_assign(points: torch.Tensor, strides: torch.Tensor, ranges: torch.Tensor, boxes: torch.Tensor,
                labels: torch.Tensor, radius: float = 1.5) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FCOS targets of one image.

    Args:
        points: (N, 2) location centres (x, y) in input pixels; strides: (N,) their level's stride;
        ranges: (N, 2) their level's (lo, hi) size range; boxes: (M, 4) xyxy in input pixels; labels: (M,).
        radius: centre sampling radius in strides.

    Returns:
        labels (N,) long, -1 for background; the assigned box (N, 4) xyxy (zeros on background); the
        centerness target (N,) (zero on background).
    """
    n = points.shape[0]
    if boxes.numel() == 0:
        return (torch.full((n,), -1, dtype=torch.long, device=points.device), points.new_zeros(n, 4),
                points.new_zeros(n))
    x, y = points[:, 0:1], points[:, 1:2]                                        # (N, 1)
    x1, y1, x2, y2 = boxes.unbind(1)                                             # (M,)
    ltrb = torch.stack([x - x1, y - y1, x2 - x, y2 - y], dim=-1)                  # (N, M, 4)
    # centre sampling: the region radius * stride around the box centre, clipped to the box, so a location
    # inside it is inside the box too
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    r = strides[:, None] * radius
    inside = ((x > torch.maximum(cx - r, x1)) & (x < torch.minimum(cx + r, x2))
              & (y > torch.maximum(cy - r, y1)) & (y < torch.minimum(cy + r, y2)))
    reach = ltrb.max(dim=-1).values
    in_range = (reach >= ranges[:, 0:1]) & (reach <= ranges[:, 1:2])
    area = ((x2 - x1) * (y2 - y1))[None].expand(n, -1)
    area = torch.where(inside & in_range, area, torch.full_like(area, math.inf))
    smallest, gt = area.min(dim=1)                                               # the smallest box wins
    pos = torch.isfinite(smallest)
    assigned = torch.where(pos, labels[gt], torch.full_like(gt, -1))
    d = ltrb[torch.arange(n, device=points.device), gt]                          # (N, 4)
    lr, tb = d[:, [0, 2]], d[:, [1, 3]]
    ctr = ((lr.min(1).values / lr.max(1).values.clamp(min=1e-6)).clamp(min=0)
           * (tb.min(1).values / tb.max(1).values.clamp(min=1e-6)).clamp(min=0)).sqrt()
    return assigned, torch.where(pos[:, None], boxes[gt], torch.zeros_like(d)), torch.where(pos, ctr, 0.0)


# --------------------------------------------------------------------------------------------------------------
# NMS that exports as ONNX NonMaxSuppression


def _nms_eager(boxes: torch.Tensor, scores: torch.Tensor, max_per_class: int, iou: float,
               score_thresh: float) -> torch.Tensor:
    """ONNX ``NonMaxSuppression``'s semantics with torchvision: per (image, class), boxes scoring above
    ``score_thresh``, greedy NMS at ``iou`` (suppress IoU > iou), at most ``max_per_class`` kept; returns
    (K, 3) long (batch, class, box), ordered by batch, class, then score (best first), as ONNX Runtime does."""
    b_count, c_count, _ = scores.shape
    b, c, i = (scores > score_thresh).nonzero(as_tuple=True)  # none above: every step below takes empty tensors
    group = b * c_count + c
    keep = batched_nms(boxes[b, i].float(), scores[b, c, i].float(), group, iou)  # best first
    keep = keep[torch.sort(group[keep], stable=True).indices]                   # by group, best first inside
    g = group[keep]
    _, counts = torch.unique_consecutive(g, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    keep = keep[(torch.arange(g.numel(), device=g.device) - starts) < max_per_class]
    return torch.stack([b[keep], c[keep], i[keep]], dim=1)


class _NonMaxSuppression(torch.autograd.Function):
    """Eager: :func:`_nms_eager`; traced for ONNX: one standard ``NonMaxSuppression`` node."""

    @staticmethod
    def forward(ctx, boxes, scores, max_per_class: int, iou: float, score_thresh: float):  # noqa: D401
        return _nms_eager(boxes, scores, max_per_class, iou, score_thresh)

    @staticmethod
    def symbolic(g, boxes, scores, max_per_class: int, iou: float, score_thresh: float):
        # center_point_box=0 takes any two opposite corners; IoU does not care that ours are (x, y), not (y, x)
        return g.op("NonMaxSuppression", boxes, scores,
                    g.op("Constant", value_t=torch.tensor([max_per_class], dtype=torch.long)),
                    g.op("Constant", value_t=torch.tensor([iou], dtype=torch.float)),
                    g.op("Constant", value_t=torch.tensor([score_thresh], dtype=torch.float)),
                    center_point_box_i=0)


def select_detections(boxes: torch.Tensor, scores: torch.Tensor, score_thresh: float = 0.05, iou: float = 0.6,
                      max_det: int = 100) -> torch.Tensor:
    """Final detections from every location's box and class scores.

    Args:
        boxes: (B, N, 4) xyxy in input pixels; scores: (B, C, N) in [0, 1].
        score_thresh: keep scores above it; iou: class-aware NMS threshold; max_det: the most per image
        (and per class, which ONNX's NMS caps first).

    Returns:
        (K, 7) float: (batch_index, x1, y1, x2, y2, score, class), sorted by batch index, then score (best first).
    """
    b_count, n = boxes.shape[0], boxes.shape[1]
    c_count = scores.shape[1]
    sel = _NonMaxSuppression.apply(boxes, scores, int(max_det), float(iou), float(score_thresh))
    b, c, i = sel[:, 0], sel[:, 1], sel[:, 2]
    box = boxes.reshape(-1, 4)[b * n + i]
    score = scores.reshape(-1)[(b * c_count + c) * n + i]
    # one sort by (batch ascending, score descending): scores lie in [0, 1], so batch * 2 + (1 - score) keeps
    # the batches apart; float64 so that close scores stay ordered as they are
    order = torch.argsort(b.double() * 2 + (1 - score.double()))
    b, c, box, score = b[order], c[order], box[order], score[order]
    # rank inside each image without a data-dependent loop (ONNX-exportable): a running count per image
    hits = (b[:, None] == torch.arange(b_count, device=b.device)[None]).long()    # (K, B)
    rank = (hits.cumsum(0) * hits).sum(1) - 1
    keep = rank < max_det
    out = torch.cat([b[:, None].to(box.dtype), box, score[:, None], c[:, None].to(box.dtype)], dim=1)
    return out[keep]


# --------------------------------------------------------------------------------------------------------------
# The detector


class Detector(nn.Module):
    """Backbone maps at 8 / 16 / 32 -> FPN -> FCOS head.

    ``backbone``: a teacher :class:`Backbone` (with its adapter; ``backbone(x)`` still gives its pooled
    embedding, which curation with the finetuned teacher uses) or a student body; ``reader`` takes its maps;
    ``pyramid`` (plain backbones: ViTs) makes three maps of the one it reads.  ``in_channels``: the channels
    of the three maps the neck receives.  ``head_norm``: the head towers' normalisation (:class:`FCOSHead`).
    ``freeze_norm``: keep the backbone's BatchNorm statistics frozen in training (adapters that freeze the
    backbone, as the classification teacher does).

    ``forward`` returns the per-level dict (:meth:`forward_levels`); with ``dense_output`` set, the one tensor of
    :meth:`forward_dense`.  :meth:`loss`, :meth:`decode`, :meth:`flatten` and :meth:`dense_outputs` take the dict.
    """

    def __init__(self, backbone: nn.Module, reader: FeatureReader, in_channels: Sequence[int], num_classes: int,
                 pyramid: Optional[SimpleFeaturePyramid] = None, neck_channels: int = 96, head_convs: int = 2,
                 head_norm: str = "group", size_edges: Sequence[float] = SIZE_EDGES,
                 center_radius: float = 1.5, focal_alpha: float = 0.25, focal_gamma: float = 2.0,
                 freeze_norm: bool = False):
        super().__init__()
        if num_classes < 1:
            raise ToolchainError(f"a detector needs at least one class, got {num_classes}")
        if len(in_channels) != len(STRIDES):
            raise ToolchainError(f"{len(in_channels)} feature maps for the {len(STRIDES)} strides {list(STRIDES)}")
        self.backbone, self.reader, self.pyramid = backbone, reader, pyramid
        self.num_classes, self.strides = num_classes, STRIDES
        self.ranges = size_ranges(len(self.strides), size_edges)
        self.center_radius, self.focal_alpha, self.focal_gamma = center_radius, focal_alpha, focal_gamma
        self.freeze_norm = freeze_norm
        # when set, forward returns forward_dense's one tensor instead of the per-level dict: the export floor's
        # fold passes compare ``model(x)`` before and after each pass, and they run on the detector itself, so
        # the adapter merge finds ``.backbone`` where the classification teacher has it
        self.dense_output = False
        self.neck = FPN(in_channels, neck_channels)
        self.head = FCOSHead(neck_channels, num_classes, head_convs, len(self.strides), norm=head_norm)

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.freeze_norm:
            keep_norm_frozen(self.backbone)
        return self

    # -- forward -------------------------------------------------------------------------------------------
    def forward_features(self, images: torch.Tensor) -> List[torch.Tensor]:
        """The neck's input: three maps at ``strides``."""
        maps = self.reader(self.backbone, images)
        if self.pyramid is not None:
            maps = self.pyramid(maps[-1], tuple(images.shape[-2:]))
        return maps

    def shipped(self, score_thresh: float = 0.05, iou: float = 0.6, max_det: int = 100) -> "DetectorWithNMS":
        """What an artifact of this detector holds and the bench times: it wrapped with its NMS (students/fold.py
        ``deployable``; the settings are the recipe's ``export.detection``)."""
        return DetectorWithNMS(self, score_thresh, iou, max_det).eval()

    def forward(self, images: torch.Tensor):
        """:meth:`forward_levels`, or :meth:`forward_dense` while ``dense_output`` is set."""
        return self.forward_dense(images) if self.dense_output else self.forward_levels(images)

    def forward_levels(self, images: torch.Tensor) -> Dict[str, List[torch.Tensor]]:
        """Per-level outputs, one tensor per stride: ``cls`` (B, C, h, w) logits, ``box`` (B, 4, h, w) distances
        (l, t, r, b) from each location in input pixels, ``quality`` (B, 1, h, w) logits.  Images are normalised
        (B, 3, H, W) with H and W multiples of 32."""
        maps = self.forward_features(images)
        if not torch.jit.is_tracing():  # the traced graph keeps no shape checks
            self._check_grid(images, maps)
        out = self.head(self.neck(maps))
        return {**out, "box": self.head.distances(out["box"], self.strides)}

    def forward_dense(self, images: torch.Tensor) -> torch.Tensor:
        """(B, N, C + 5): the class logits, box distances and quality logit of every location (the rows of
        :meth:`flatten`) in one tensor."""
        return self.dense_rows(self.forward_levels(images))

    def dense_rows(self, outputs: Dict[str, List[torch.Tensor]]) -> torch.Tensor:
        """:meth:`forward_dense`'s (B, N, C + 5) rows of per-level outputs."""
        flat = self.flatten(outputs)
        return torch.cat([flat["cls"], flat["box"], flat["quality"][..., None]], dim=-1)

    def _check_grid(self, images: torch.Tensor, maps: List[torch.Tensor]) -> None:
        h, w = images.shape[-2:]
        for s, m in zip(self.strides, maps):
            if tuple(m.shape[-2:]) != (h / s, w / s):
                raise ToolchainError(f"input {h}x{w} (h x w) gives a {m.shape[-2]}x{m.shape[-1]} map at stride {s}, "
                                     f"not {h / s:g}x{w / s:g}: detection needs input sides that are multiples of 32 "
                                     f"(64 for MobileViT-V2, whose last stage pads an odd grid)")

    # -- dense outputs -------------------------------------------------------------------------------------
    def flatten(self, outputs: Dict[str, List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Every location of every level in one row, level after level, row-major inside a level: ``cls``
        (B, N, C) logits, ``box`` (B, N, 4) distances in pixels, ``quality`` (B, N) logits, ``points`` (N, 2)
        location centres (x, y) in pixels, ``strides`` (N,) their level's stride."""
        cls = torch.cat([o.flatten(2).transpose(1, 2) for o in outputs["cls"]], dim=1)
        box = torch.cat([o.flatten(2).transpose(1, 2) for o in outputs["box"]], dim=1)
        quality = torch.cat([o.flatten(1) for o in outputs["quality"]], dim=1)
        ref = outputs["cls"][0]
        points, strides = [], []
        for o, s in zip(outputs["cls"], self.strides):
            h, w = o.shape[-2:]
            points.append(level_points(h, w, s, ref.device, torch.float32))
            strides.append(torch.full((h * w,), float(s), device=ref.device))
        return {"cls": cls, "box": box, "quality": quality, "points": torch.cat(points), "strides": torch.cat(strides)}

    def dense_outputs(self, outputs: Dict[str, List[torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """What a teacher gives its student at every location (distillation targets): ``cls_prob`` (B, N, C)
        sigmoid class probabilities, ``box`` (B, N, 4) distances in pixels, ``quality`` (B, N) sigmoid quality,
        and the ``points`` (N, 2) and ``strides`` (N,) of :meth:`flatten`."""
        flat = self.flatten(outputs)
        return {"cls_prob": flat["cls"].sigmoid(), "box": flat["box"], "quality": flat["quality"].sigmoid(),
                "points": flat["points"], "strides": flat["strides"]}

    # -- training ------------------------------------------------------------------------------------------
    def assign(self, flat: Dict[str, torch.Tensor], targets: Sequence[Dict[str, torch.Tensor]]
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FCOS targets of a batch: labels (B, N) (-1 background), boxes (B, N, 4), centerness (B, N)."""
        points, strides = flat["points"], flat["strides"]
        # each location's level (strides ascend), then that level's size range
        per_point = torch.tensor(self.ranges, device=points.device)[
            torch.searchsorted(torch.tensor(self.strides, device=points.device, dtype=strides.dtype), strides)]
        out = []
        for k, t in enumerate(targets):
            boxes, labels = self._target(t, k, points.device)
            out.append(fcos_assign(points, strides, per_point, boxes, labels, self.center_radius))
        labels, boxes, ctr = (torch.stack(parts) for parts in zip(*out))
        return labels, boxes, ctr

    def _target(self, t: Dict[str, torch.Tensor], k: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        boxes = torch.as_tensor(t["boxes"], dtype=torch.float32, device=device).reshape(-1, 4) \
            if "boxes" in t else None
        labels = torch.as_tensor(t["labels"], dtype=torch.long, device=device).reshape(-1) if "labels" in t else None
        if boxes is None or labels is None or boxes.shape[0] != labels.shape[0]:
            raise ToolchainError(f"target {k}: needs 'boxes' (N, 4) and 'labels' (N,) of the same length, got keys "
                                 f"{sorted(t)}" + ("" if boxes is None or labels is None else
                                                   f" with {boxes.shape[0]} boxes and {labels.shape[0]} labels"))
        if labels.numel() and (labels.min() < 0 or labels.max() >= self.num_classes):
            raise ToolchainError(f"target {k}: labels {sorted(set(labels.tolist()))} outside 0..{self.num_classes - 1}"
                                 f" ({self.num_classes} classes)")
        return boxes, labels

    def loss(self, outputs: Dict[str, List[torch.Tensor]], targets: Sequence[Dict[str, torch.Tensor]]
             ) -> Dict[str, torch.Tensor]:
        """``cls`` (focal), ``box`` (GIoU, weighted by centerness), ``quality`` (BCE) and their sum ``total``.

        ``targets``: one dict per image with ``boxes`` (N, 4) xyxy in input pixels and ``labels`` (N,) in
        0..C-1 (other keys are ignored)."""
        flat = self.flatten(outputs)
        if len(targets) != flat["cls"].shape[0]:
            raise ToolchainError(f"{len(targets)} targets for a batch of {flat['cls'].shape[0]} images")
        labels, boxes_t, ctr_t = self.assign(flat, targets)
        cls, box, quality = flat["cls"].float(), flat["box"].float(), flat["quality"].float()
        pos = labels >= 0
        num_pos = pos.sum().clamp(min=1).float()
        onehot = F.one_hot(labels.clamp(min=0), self.num_classes).to(cls.dtype) * pos[..., None]
        cls_loss = sigmoid_focal_loss(cls, onehot, self.focal_alpha, self.focal_gamma, reduction="sum") / num_pos
        if pos.any():
            pts = flat["points"][None].expand(pos.shape[0], -1, -1)[pos]
            d = box[pos]
            pred = torch.cat([pts - d[:, :2], pts + d[:, 2:]], dim=1)
            weight = ctr_t[pos]
            giou = generalized_box_iou_loss(pred, boxes_t[pos], reduction="none")
            box_loss = (giou * weight).sum() / weight.sum().clamp(min=1e-6)
            quality_loss = F.binary_cross_entropy_with_logits(quality[pos], weight, reduction="sum") / num_pos
        else:  # no object in the batch: only the class loss teaches (zeros keep every output in the graph)
            box_loss, quality_loss = box.sum() * 0, quality.sum() * 0
        return {"cls": cls_loss, "box": box_loss, "quality": quality_loss,
                "total": cls_loss + box_loss + quality_loss}

    # -- inference -----------------------------------------------------------------------------------------
    def boxes_and_scores(self, outputs: Dict[str, List[torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every location's box (B, N, 4) xyxy clipped to the input, and its class scores (B, C, N),
        ``sqrt(sigmoid(cls) * sigmoid(quality))``: the inputs of :func:`select_detections`."""
        flat = self.flatten(outputs)
        first = outputs["cls"][0]
        h, w = first.shape[-2] * self.strides[0], first.shape[-1] * self.strides[0]
        pts, d = flat["points"][None], flat["box"]
        x1 = (pts[..., 0] - d[..., 0]).clamp(min=0, max=w)
        y1 = (pts[..., 1] - d[..., 1]).clamp(min=0, max=h)
        x2 = (pts[..., 0] + d[..., 2]).clamp(min=0, max=w)
        y2 = (pts[..., 1] + d[..., 3]).clamp(min=0, max=h)
        boxes = torch.stack([x1, y1, x2, y2], dim=-1)
        scores = (flat["cls"].sigmoid() * flat["quality"].sigmoid()[..., None]).sqrt()
        return boxes, scores.transpose(1, 2)

    @torch.no_grad()
    def decode(self, outputs: Dict[str, List[torch.Tensor]], score_thresh: float = 0.05, nms_iou: float = 0.6,
               max_det: int = 100) -> List[Dict[str, torch.Tensor]]:
        """Per image: ``boxes`` (K, 4) xyxy in input pixels, ``scores`` (K,), ``labels`` (K,) long; best first.
        The same detections as :class:`DetectorWithNMS` (one code path)."""
        boxes, scores = self.boxes_and_scores(outputs)
        det = select_detections(boxes.float(), scores.float(), score_thresh, nms_iou, max_det)
        out = []
        for k in range(boxes.shape[0]):
            d = det[det[:, 0] == k]
            out.append({"boxes": d[:, 1:5], "scores": d[:, 5], "labels": d[:, 6].long()})
        return out


class DetectorCandidates(nn.Module):
    """``forward(images) -> (B, N, 4 + C)`` float: every location's decoded box (x1, y1, x2, y2 in input pixels) and
    its C class scores, what :class:`DetectorWithNMS` selects from.  The artifact of a format whose graph cannot
    hold an NMS (ExecuTorch, LiteRT, Core ML before its NMS model): export/runtimes/nms.py finishes it with the same
    selection, so its rows are :class:`DetectorWithNMS`'s."""

    def __init__(self, detector: Detector):
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        boxes, scores = self.detector.boxes_and_scores(self.detector.forward_levels(images))
        return torch.cat([boxes, scores.transpose(1, 2)], dim=-1)


class DetectorWithNMS(nn.Module):
    """``forward(images) -> (K, 7)`` float: ``(batch_index, x1, y1, x2, y2, score, class)`` in input pixels,
    sorted by batch index then score, at most ``max_det`` per image.  Exported to ONNX the NMS is one standard
    ``NonMaxSuppression`` node, and ONNX Runtime returns the detections PyTorch does."""

    def __init__(self, detector: Detector, score_thresh: float = 0.05, iou: float = 0.6, max_det: int = 100):
        super().__init__()
        if not 0 <= score_thresh < 1 or not 0 < iou <= 1 or max_det < 1:
            raise ToolchainError(f"DetectorWithNMS: score_thresh {score_thresh} must be in [0, 1), iou {iou} in "
                                 f"(0, 1] and max_det {max_det} at least 1")
        self.detector = detector
        self.score_thresh, self.iou, self.max_det = float(score_thresh), float(iou), int(max_det)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        boxes, scores = self.detector.boxes_and_scores(self.detector.forward_levels(images))
        return select_detections(boxes, scores, self.score_thresh, self.iou, self.max_det)
