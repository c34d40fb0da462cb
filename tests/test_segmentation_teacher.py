import pytest
import timm
import torch

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.teachers.segmentation import create_segmentation_teacher, set_patch_stride


def test_stride_8_grid_and_resampled_position_embeddings():
    vit = timm.create_model("vit_small_patch14_dinov2", img_size=56, num_classes=0, depth=1)
    assert tuple(vit.patch_embed.grid_size) == (4, 4) and vit.pos_embed.shape[1] == 1 + 16
    set_patch_stride(vit, 8)
    assert tuple(vit.patch_embed.grid_size) == (7, 7) and vit.pos_embed.shape[1] == 1 + 49  # 56 / 8
    tokens = vit.forward_features(torch.randn(1, 3, 56, 56))
    assert tokens.shape == (1, 1 + 49, 384)
    with pytest.raises(ToolchainError, match="larger than the patch size"):
        set_patch_stride(vit, 16)


@pytest.mark.parametrize("adapter", ["linear", "lora"])
def test_segmentation_teacher_outputs_full_resolution_logits(adapter):
    model = create_segmentation_teacher("timm:vit_tiny_patch16_224", "none", 32, 5, AdapterConfig(name=adapter)).eval()
    x = torch.randn(2, 3, 32, 32)
    assert model.forward_features(x).shape == (2, 192, 4, 4)  # output stride 8
    out = model(x)
    assert out.shape == (2, 5, 32, 32)
    loss = torch.nn.functional.cross_entropy(model.train()(x), torch.randint(0, 5, (2, 32, 32)))
    loss.backward()
    assert model.head[-1].weight.grad is not None


def test_embedding_adapters_are_refused_for_segmentation():
    with pytest.raises(ToolchainError, match="pooled embedding"):
        create_segmentation_teacher("timm:vit_tiny_patch16_224", "none", 32, 5, AdapterConfig(name="llu"))


def test_segmentation_teacher_lora_is_merged_at_export():
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.students.fold import fold_model
    from vfm_toolchain.teachers.segmentation import segmentation_teacher_spec

    torch.manual_seed(0)
    cfg = AdapterConfig(name="lora", r=4, alpha=8)
    model = create_segmentation_teacher("timm:vit_tiny_patch16_224", "none", 32, 5, cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        for name, p in model.named_parameters():  # B != 0: the adapter changes the output, so the merge means something
            if "lora_B" in name:
                p.normal_(std=0.05)
        adapted = model(x)
    assert (adapted - before).abs().max() > 1e-4
    spec = segmentation_teacher_spec("timm:vit_tiny_patch16_224", 32, list("abcde"), cfg, Preprocess(32))
    folded, records = fold_model(model, spec, x)
    merge = next(r for r in records if r["pass"] == "adapter_merge")
    assert merge["max_abs_diff"] < 1e-5 and not [n for n, _ in folded.named_modules() if "lora_" in n]


def test_dilation_matches_torchvision_replace_stride_with_dilation():
    """The generic atrous rewrite gives torchvision's own output-stride-8 ResNet-50, weight for weight."""
    import torchvision

    from vfm_toolchain.teachers.segmentation import dilate_to_output_stride

    torch.manual_seed(0)
    ours = torchvision.models.resnet50().eval()
    ref = torchvision.models.resnet50(replace_stride_with_dilation=[False, True, True]).eval()
    ref.load_state_dict(ours.state_dict())
    body = lambda m: torch.nn.Sequential(*list(m.children())[:-2])  # noqa: E731  (up to layer4)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert body(ours)(x).shape[-1] == 2  # stride 32 before
        dilate_to_output_stride(ours, body(ours), 8, probe_size=64)
        a, b = body(ours)(x), body(ref)(x)
    assert a.shape == b.shape == (1, 2048, 8, 8) and (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("name,stride,channels", [("torchvision:mobilenet_v2", 8, 1280),
                                                   ("torchvision:mobilenet_v2", 16, 1280),
                                                   ("timm:resnet10t", 8, 512),
                                                   ("open_clip:ViT-B-32", 8, 768)])
def test_every_teacher_family_has_a_segmentation_form(name, stride, channels):
    """ConvNets by dilation, OpenCLIP towers by patch stride: a grid of input / stride, a DeepLabV3 head,
    LoRA trains through it, and the model rebuilds from its spec."""
    from vfm_toolchain.checkpoint import MODEL_FAMILIES
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.teachers.segmentation import segmentation_teacher_spec

    torch.manual_seed(0)
    cfg = AdapterConfig(name="lora", r=2, alpha=4)
    model = create_segmentation_teacher(name, "none", 64, 3, cfg, stride).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, channels, 64 // stride, 64 // stride)
    assert model.forward_logits(x).shape == (2, 3, 64 // stride, 64 // stride) and model(x).shape == (2, 3, 64, 64)
    loss = torch.nn.functional.cross_entropy(model.train()(x), torch.randint(0, 3, (2, 64, 64)))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    spec = segmentation_teacher_spec(name, 64, list("abc"), cfg, Preprocess(64), stride)
    rebuilt = MODEL_FAMILIES.get("segmentation_teacher")(spec).eval()
    rebuilt.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (rebuilt(x) - model.eval()(x)).abs().max() < 1e-5


def test_saved_segmentation_teacher_loads_in_a_fresh_process(tmp_path):
    """A build whose teacher.finetune is cached never imports the module that built the teacher; loading
    the saved teacher (distillation resuming, curation) must still find its model family."""
    import subprocess
    import sys

    from vfm_toolchain.checkpoint import save_model
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.teachers.segmentation import segmentation_teacher_spec

    cfg = AdapterConfig(name="linear")
    model = create_segmentation_teacher("timm:vit_tiny_patch16_224", "none", 32, 3, cfg).eval()
    save_model(tmp_path / "model", model, segmentation_teacher_spec("timm:vit_tiny_patch16_224", 32, list("abc"),
                                                                    cfg, Preprocess(32)))
    code = ("import sys; from vfm_toolchain.plugins import load_plugins; load_plugins(); "
            "from vfm_toolchain.checkpoint import load_model; m = load_model(sys.argv[1]); print(type(m).__name__)")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "SegmentationTeacher"
