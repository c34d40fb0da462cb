"""Fold passes and formats: each adapter/fold first changes something, then folds exactly."""
import platform

import numpy as np
import pytest

from vfm_toolchain.core.errors import ToolchainError
import timm
import torch
import torchvision

from vfm_toolchain.export.formats import FORMATS, export_format
from vfm_toolchain.export.parity import ParityError, check_parity
from vfm_toolchain.recipe import AdapterConfig
from vfm_toolchain.students.fold import FOLDS, fold_model, fuse_batchnorm
from vfm_toolchain.teachers.model import create_teacher


def _perturb_bn(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
            if m.affine:
                m.weight.data.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.data.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model


def _perturb_lora(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = 0
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
            n += 1
    assert n > 0, "no LoRA weights found"


@pytest.mark.parametrize("teacher,size", [("timm:vit_tiny_patch16_224", 32), ("torchvision:mobilenet_v2", 32)])
def test_lora_changes_output_then_merges_exactly(teacher, size):
    torch.manual_seed(0)
    model = create_teacher(teacher, "none", size, 3, AdapterConfig(name="lora", r=4, alpha=8)).eval()
    _perturb_bn(model)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        base = model(x)
        _perturb_lora(model)
        adapted = model(x)
    assert (adapted - base).abs().max() > 1e-3, "the adapter must change the output before the merge test means anything"
    spec = {"family": "teacher", "adapter": {"name": "lora", "r": 4, "alpha": 8}}
    folded, records = fold_model(model, spec, x)
    with torch.no_grad():
        merged = folded(x)
    assert (merged - adapted).abs().max() < 1e-5
    assert not any("lora" in n for n, _ in folded.named_parameters())
    assert [r["pass"] for r in records] == ["adapter_merge", "gramian_heads", "reparameterize", "bn_fuse",
                                          "level_batchnorm", "channel_multiplier", "broadcast_attention",
                                          "same_avg_pool"]
    assert any("lora" in n for n, _ in model.named_parameters()), "folding must not modify the original"


@pytest.mark.parametrize("name,size", [("fastvit_t8", 64), ("mobilevitv2_050", 32)])
def test_students_fold_exactly_and_lose_batchnorm(name, size):
    torch.manual_seed(0)
    model = _perturb_bn(timm.create_model(name, num_classes=4)).eval()
    x = torch.randn(2, 3, size, size)
    folded, records = fold_model(model, {"family": "student"}, x)
    with torch.no_grad():
        assert (folded(x) - model(x)).abs().max() < 1e-4
    n_bn = lambda m: sum(isinstance(k, torch.nn.BatchNorm2d) for k in m.modules())
    assert n_bn(model) > 0 and n_bn(folded) < n_bn(model) / 2
    assert all(r["max_abs_diff"] < 1e-4 for r in records)
    if name.startswith("fastvit"):  # reparameterization removed the train-time branches
        rep = next(r for r in records if r["pass"] == "reparameterize")
        assert rep["params_after"] < rep["params_before"]


def test_a_dilated_resnet_d_shortcut_folds_to_a_symmetric_pool_with_the_same_output():
    """resnet10t at output stride 8 (the segmentation student): its dilated stages' shortcuts are timm's
    AvgPool2dSame at stride 1, an asymmetric F.pad that XNNPACK cannot run int8; same_avg_pool replaces them by a
    symmetric pool and a crop, output unchanged."""
    from timm.layers import AvgPool2dSame
    from vfm_toolchain.students.fold import SymmetricAvgPool
    from vfm_toolchain.students.models import create_student

    torch.manual_seed(0)
    model = create_student("timm:resnet10t", 3, task="segmentation").eval()
    count = lambda m, t: sum(isinstance(k, t) for k in m.modules())
    assert count(model, AvgPool2dSame) == 2
    x = torch.randn(2, 3, 48, 64)
    folded, records = fold_model(model, {"family": "student"}, x)
    assert count(folded, AvgPool2dSame) == 0 and count(folded, SymmetricAvgPool) == 2
    assert next(r for r in records if r["pass"] == "same_avg_pool")["max_abs_diff"] < 1e-5
    with torch.no_grad():
        assert (folded(x) - model(x)).abs().max() < 1e-4


def test_fastvit_downsampling_becomes_a_repeat_and_a_depthwise_convolution_with_the_same_output():
    """FastViT's strided 7x7 downsampling makes two outputs of each input channel (groups = input channels): after
    channel_multiplier it is each channel repeated, then a depthwise convolution, the output unchanged; a second run
    finds nothing left to rewrite."""
    from vfm_toolchain.students.fold import RepeatedDepthwise, channel_multiplier

    torch.manual_seed(0)
    model = _perturb_bn(timm.create_model("fastvit_t8", num_classes=4)).eval()
    x = torch.randn(2, 3, 64, 96)
    folded, records = fold_model(model, {"family": "student"}, x)
    grouped = [m for m in folded.modules() if isinstance(m, torch.nn.Conv2d) and 1 < m.groups < m.out_channels]
    rewritten = [n for n, m in folded.named_modules() if isinstance(m, RepeatedDepthwise)]
    assert not grouped and rewritten == [f"stages.{i}.downsample.proj.0.reparam_conv" for i in (1, 2, 3)] + [
        "final_conv.reparam_conv"]  # and the classifier's 3x3 expansion before its pooling
    assert next(r for r in records if r["pass"] == "channel_multiplier")["max_abs_diff"] < 1e-5
    with torch.no_grad():
        assert (folded(x) - model(x)).abs().max() < 1e-4
        again = channel_multiplier(folded, {})
        assert sum(isinstance(m, RepeatedDepthwise) for m in again.modules()) == len(rewritten)
        assert torch.equal(again(x), folded(x))


def test_fold_passes_are_idempotent():
    torch.manual_seed(0)
    model = _perturb_bn(torchvision.models.mobilenet_v2(num_classes=3)).eval()
    x = torch.randn(1, 3, 32, 32)
    once = fuse_batchnorm(model, {})
    twice = fuse_batchnorm(once, {})
    with torch.no_grad():
        assert torch.allclose(once(x), twice(x)) and torch.allclose(once(x), model(x), atol=1e-5)
    assert sorted(FOLDS.list()) == ["adapter_merge", "bn_fuse", "broadcast_attention", "channel_multiplier",
                                    "gramian_heads", "level_batchnorm", "reparameterize", "same_avg_pool"]


def test_onnx_export_parity_opset_metadata_dynamic_batch(tmp_path):
    import onnx

    torch.manual_seed(0)
    model = timm.create_model("fastvit_t8", num_classes=4).eval()
    x = torch.randn(3, 3, 64, 64)
    folded, _ = fold_model(model, {"family": "student"}, x)
    res = export_format("onnx", folded, x, tmp_path, {"opset": 17, "slim": True}, metadata={"classes": ["a", "b"]})
    assert res.meta["opset_written"] == 17
    with torch.no_grad():
        ref = model(x).numpy()
    diff = check_parity("onnx", ref, res.runner(x.numpy()), 1e-4)  # batch 3 through a model traced at batch 1
    assert diff < 1e-4
    props = {p.key: p.value for p in onnx.load(str(res.path)).metadata_props}
    assert props["classes"] == '["a", "b"]'


def test_onnx_dynamic_height_width_is_checked_at_a_second_size(tmp_path):
    """FastViT keeps its spatial size free in the graph; MobileViT-V2's unfold bakes it in, and the export
    says so at build time instead of on the device."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64)
    fast = timm.create_model("fastvit_t8", num_classes=3).eval()
    res = export_format("onnx", fast, x, tmp_path / "f", {"opset": 17, "dynamic_size": True})
    assert res.meta["dynamic"] == ["batch", "height", "width"]
    check = res.meta["dynamic_size_check"]
    assert check["image_size"] == [96, 96] and check["max_abs_diff"] < 1e-4
    with torch.no_grad():
        big = torch.randn(1, 3, 128, 128)
        assert np.abs(res.runner(big.numpy()) - fast(big).numpy()).max() < 1e-4
    mvit = timm.create_model("mobilevitv2_050", num_classes=3).eval()
    with pytest.raises(ToolchainError, match="onnx.dynamic_size: false"):
        export_format("onnx", mvit, x, tmp_path / "m", {"opset": 17, "dynamic_size": True})


def test_large_onnx_weights_go_to_external_data_that_travels_with_the_model(tmp_path):
    from vfm_toolchain.export.convert import artifact_digest, artifact_files

    torch.manual_seed(0)
    model = timm.create_model("fastvit_t8", num_classes=3).eval()
    x = torch.randn(2, 3, 64, 64)
    small = export_format("onnx", model, x, tmp_path / "inline", {"opset": 17})
    split = export_format("onnx", model, x, tmp_path / "split", {"opset": 17, "external_data_mb": 0})
    assert small.meta["external_data"] is None and len(artifact_files(small.path)) == 1
    files = artifact_files(split.path)
    assert split.meta["external_data"] == "model.onnx.data" and [f.name for f in files] == ["model.onnx",
                                                                                              "model.onnx.data"]
    assert split.path.stat().st_size < small.path.stat().st_size / 10  # the weights left the model file
    assert artifact_digest(split.path)["bytes"] == sum(f.stat().st_size for f in files)
    assert np.abs(split.runner(x.numpy()) - small.runner(x.numpy())).max() < 1e-5


def test_parity_gate_rejects_an_injected_deviation():
    ref = np.zeros((2, 4), dtype=np.float32)
    assert check_parity("x", ref, ref + 1e-6, 1e-4) <= 1e-6
    with pytest.raises(ParityError, match="exceeds the tolerance"):
        check_parity("x", ref, ref + 1e-2, 1e-4)
    with pytest.raises(ParityError, match="shape"):
        check_parity("x", ref, ref[:1], 1e-4)
    bad = ref.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ParityError, match="NaN"):
        check_parity("x", ref, bad, 1e-4)


@pytest.mark.parametrize("image_input,precision", [(True, "fp16"), (False, "fp32")])
def test_coreml_converts_to_mlpackage(tmp_path, image_input, precision):
    ct = pytest.importorskip("coremltools", reason="coremltools is not installed")
    torch.manual_seed(0)
    model = timm.create_model("mobilevitv2_050", num_classes=3).eval()
    pp = {"size": 32, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    res = export_format("coreml", model, torch.randn(1, 3, 32, 32), tmp_path,
                        {"image_input": image_input, "precision": precision, "compute_units": "CPU_AND_NE"},
                        metadata={"classes": "a,b,c"}, preprocess=pp, classes=["a", "b", "c"])
    assert res.path.suffix == ".mlpackage" and res.path.is_dir() and any(res.path.rglob("*.mlmodel"))
    assert res.meta["precision"] == precision and res.meta["compute_units"] == "CPU_AND_NE"
    spec = ct.models.MLModel(str(res.path), skip_model_load=True).get_spec()
    kind = spec.description.input[0].type.WhichOneof("Type")
    assert kind == ("imageType" if image_input else "multiArrayType")
    assert spec.description.predictedFeatureName == "classLabel"  # class labels travel with the model
    if platform.system() != "Darwin":
        assert res.runner is None and "macOS" in res.parity_skipped


@pytest.mark.parametrize("fmt,options,message", [
    ("coreml", {"compute_units": "GPU"}, "compute_units"),          # not one of its values
    ("coreml", {"compute_unit": "ALL"}, "compute_unit: Extra inputs"),  # a typo: unknown keys are errors
    ("onnx", {"opset": 9}, "opset"),                                 # below the schema's bound
    ("onnx_int8", {"precision": "int8"}, "onnx_int8 takes: parity_atol, fallback, per_channel"),
    ("tensorrt", {"precision": "int4"}, "precision"),
])
def test_format_options_are_checked_against_the_format_schema(tmp_path, fmt, options, message):
    from vfm_toolchain.core.errors import ToolchainError

    with pytest.raises(ToolchainError, match=message):
        export_format(fmt, torch.nn.Conv2d(3, 2, 1), torch.randn(1, 3, 8, 8), tmp_path, options)


def test_recipe_format_options_are_checked_before_any_stage(tiny_task, tmp_path):
    from tests.conftest import tiny_recipe
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    cases = [({"export.options": {"onnx": {"opset_version": 17}}}, "export.options.onnx: opset_version"),
             ({"export.options": {"onxx": {}}}, "unknown export format 'onxx'. Did you mean 'onnx'"),
             ({"export.formats": ["onnx_int8", "onnx"]}, "list 'onnx' before it")]
    for overrides, message in cases:
        with pytest.raises(ToolchainError, match=message):
            build(recipe_from_dict(tiny_recipe(tiny_task, **overrides)), tmp_path / "o", tmp_path / "s")
        assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


@pytest.mark.gpu
def test_tensorrt_engine_matches_pytorch_beyond_its_profile_and_shares_its_timing_cache(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it comes with the GPU image)")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs an NVIDIA GPU: run `pytest -m gpu` in the Docker image (docs/development.md, GPU / Docker)")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    x = torch.randn(4, 3, 16, 16)
    onnx = export_format("onnx", model, x, tmp_path / "onnx", {"opset": 17})
    res = export_format("tensorrt", model, x, tmp_path / "trt", {"precision": "fp32"}, onnx=onnx.path,
                        batches=[1, 4], cache_dir=tmp_path / "shared")
    big = torch.randn(9, 3, 16, 16)  # beyond the profile's 4: runs in chunks
    with torch.no_grad():
        assert np.abs(res.runner(big.numpy()) - model(big).numpy()).max() < 1e-3
    assert res.meta["max_batch"] == 4 and list((tmp_path / "shared" / "tensorrt").glob("*.cache"))


def _small_convnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                               torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(8, 5)).eval()


def test_tensorrt_int8_source_is_symmetric_qdq_that_still_computes_the_model(tmp_path):
    """The file TensorRT's explicit quantization builds from: every Q/DQ pair int8 with zero point 0 (TensorRT
    quantizes symmetrically only), unlike onnx_int8's uint8 activations, and it still computes the model."""
    import onnx
    from onnx import numpy_helper

    from vfm_toolchain.export.formats.onnx_quantized_format import quantize_qdq

    model, x = _small_convnet(), torch.randn(32, 3, 16, 16)
    src = export_format("onnx", model, x[:2], tmp_path / "onnx", {"opset": 17}).path
    calib = x.numpy()

    def zero_points(path):
        g = onnx.load(str(path)).graph
        inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        q = [n for n in g.node if n.op_type == "QuantizeLinear"]
        assert q, "no Q/DQ nodes were inserted"
        return [inits[n.input[2]] for n in q]

    quantize_qdq(src, tmp_path / "trt.qdq.onnx", calib, symmetric=True)
    quantize_qdq(src, tmp_path / "ort.qdq.onnx", calib, symmetric=False)
    trt_zp, ort_zp = zero_points(tmp_path / "trt.qdq.onnx"), zero_points(tmp_path / "ort.qdq.onnx")
    assert all(z.dtype == np.int8 and not z.any() for z in trt_zp)
    assert any(z.dtype == np.uint8 for z in ort_zp)  # the CPU form is different: the test could fail
    import onnxruntime as ort

    # graph optimisations off: Q and DQ run as written, then float kernels, as TensorRT's explicit quantization
    # means them; fused into ORT's CPU int8 kernels, s8 activations go through AVX2's u8s8 multiply, whose
    # 16-bit intermediate saturates on CPUs without VNNI (ORT's quantization docs: "reduce_range")
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    out = ort.InferenceSession(str(tmp_path / "trt.qdq.onnx"), opts, providers=["CPUExecutionProvider"]).run(
        None, {"input": calib})[0]
    with torch.no_grad():
        ref = model(x).numpy()
    assert np.abs(out - ref).max() < 0.05 * np.abs(ref).max()
    assert not list(tmp_path.glob("*.pre.onnx"))  # the intermediate is cleaned up


def test_onnx_int8_reduce_range_keeps_weights_to_7_bits(tmp_path):
    """reduce_range (for x86 CPUs without VNNI) quantizes every weight into [-64, 64]; without it the per-channel
    scales use the whole int8 range, so the check could fail."""
    import onnx
    from onnx import numpy_helper

    from vfm_toolchain.export.formats.onnx_quantized_format import quantize_qdq

    model, x = _small_convnet(), torch.randn(8, 3, 16, 16)
    src = export_format("onnx", model, x[:2], tmp_path / "onnx", {"opset": 17}).path

    def weight_range(reduce_range):
        dst = tmp_path / f"r{int(reduce_range)}.onnx"
        quantize_qdq(src, dst, x.numpy(), reduce_range=reduce_range)
        ints = [numpy_helper.to_array(i) for i in onnx.load(str(dst)).graph.initializer]
        q = np.concatenate([a.ravel().astype(np.int32) for a in ints if a.dtype == np.int8 and a.size > 8])
        return q.min(), q.max()

    lo, hi = weight_range(False)
    assert lo <= -100 or hi >= 100
    lo, hi = weight_range(True)
    assert -64 <= lo and hi <= 64  # ORT symmetric 7-bit: [-64, 64]


def test_tensorrt_int8_network_is_strongly_typed_and_fp16_is_not():
    from types import SimpleNamespace

    from vfm_toolchain.export.formats.tensorrt_format import network_flags

    trt = SimpleNamespace(NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=5))
    assert network_flags(trt, "int8") == 1 << 5
    assert network_flags(trt, "fp16") == network_flags(trt, "fp32") == 0


@pytest.mark.gpu
def test_tensorrt_int8_engine_from_qdq_keeps_the_argmax(tmp_path):
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (it comes with the GPU image)")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT needs an NVIDIA GPU: run `pytest -m gpu` in the Docker image (docs/development.md, GPU / Docker)")
    model, x = _small_convnet(), torch.randn(32, 3, 16, 16)
    onnx = export_format("onnx", model, x[:2], tmp_path / "onnx", {"opset": 17})
    res = export_format("tensorrt", model, x, tmp_path / "trt", {"precision": "int8"}, onnx=onnx.path,
                        batches=[1, 32], calibration=x.numpy(), cache_dir=tmp_path / "shared")
    with torch.no_grad():
        ref = model(x).numpy()
    out = res.runner(x.numpy())
    assert res.meta["quantization"].startswith("explicit") and (tmp_path / "trt" / "model.qdq.onnx").is_file()
    assert (out.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_every_format_declares_what_the_toolchain_reads():
    from vfm_toolchain.export.formats import FormatOptions
    from vfm_toolchain.export.runtimes import RUNTIMES

    families = {RUNTIMES.meta(r)["runs"] for r in RUNTIMES.list()}
    for name in FORMATS.list():
        meta = FORMATS.meta(name)
        assert meta["suffix"].startswith(".") and meta["devices"] and meta["source"] in ("model", "onnx")
        assert issubclass(meta["options"], FormatOptions) and meta["options"]().model_config["extra"] == "forbid"
        assert meta["runtime"] is None or meta["runtime"] in families, f"{name}: no runtime runs it"


@pytest.mark.parametrize("name", ["fastvit_t8", "mobilevitv2_050"])
def test_segmentation_students_fold_and_export_to_onnx(tmp_path, name):
    from vfm_toolchain.students.models import create_student

    torch.manual_seed(0)
    model = _perturb_bn(create_student(name, 3, task="segmentation")).eval()
    x = torch.randn(2, 3, 64, 64)
    folded, records = fold_model(model, {"family": "student"}, x)
    assert all(r["max_abs_diff"] < 1e-4 for r in records)
    res = export_format("onnx", folded, x, tmp_path, {"opset": 17, "slim": True})
    with torch.no_grad():
        ref = model(x).numpy()
    assert ref.shape == (2, 3, 64, 64)
    assert check_parity("onnx", ref, res.runner(x.numpy()), 1e-3) < 1e-3


def test_segmentation_student_converts_to_coreml(tmp_path):
    pytest.importorskip("coremltools", reason="coremltools is not installed")
    from vfm_toolchain.students.models import create_student

    torch.manual_seed(0)
    model = create_student("mobilevitv2_050", 3, task="segmentation").eval()
    res = export_format("coreml", model, torch.randn(1, 3, 64, 64), tmp_path)
    assert res.path.suffix == ".mlpackage" and res.path.is_dir()


def _finished_build(env, tmp_path):
    """A copy of the shared finished tiny build's store: the tests below run export (and bench) alone."""
    import shutil

    shutil.copytree(env.store, tmp_path / "s")
    return env.task


def test_reduced_precision_onnx_is_judged_by_test_accuracy(hostile_env, tmp_path):
    """fp16 and int8 artifacts of the student: accuracy against fp32 recorded; a tight bound refuses int8."""
    from conftest import tiny_recipe
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    # the bound is the next test's subject: a barely trained tiny student has near-tied logits that int8
    # may flip, so here any drop is accepted and only its bookkeeping is checked
    raw = tiny_recipe(_finished_build(hostile_env, tmp_path),
                      **{"export.formats": ["onnx", "onnx_fp16", "onnx_int8"], "export.calibration_images": 16,
                         # one int8 candidate: the layouts' race is test_edge_formats.py's
                         "export.options": {"onnx_int8": {"layout": "qdq", "fp32_slow_layers": False}},
                         "bench.runtimes": ["onnxruntime"], "export.max_accuracy_drop": 1.0})
    record = build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s")
    arts = {a["kind"]: a for a in record["artifacts"]}
    for kind, precision in (("onnx_fp16", "fp16"), ("onnx_int8", "int8")):
        a = arts[kind]
        assert a["status"] == "ok" and a["precision"] == precision and a["metric"] == "top1"
        assert a["accuracy_drop"] == pytest.approx(a["fp32_test_score"] - a["test_score"])
    assert arts["onnx_int8"]["calibration_images"] == 16
    assert any("calibrated on 16 images" in w for w in record["warnings"])
    assert {r["artifact"] for r in record["bench"]} >= {"student onnx_fp16", "student onnx_int8"}
    assert 0 <= arts["onnx_int8"]["test_score"] <= 1


def test_an_accuracy_drop_beyond_the_bound_fails_the_build(hostile_env, tmp_path, monkeypatch):
    """Inject the deviation: every int8 artifact scores 0.5 where fp32 scores 0.9.  One layout and no slow-layer
    candidates: the gate and its fallback are the subject here (the auto layout's choice, accuracy included, is
    judged in test_edge_formats.py), and each candidate is another quantization of the model."""
    import itertools

    import vfm_toolchain.export.convert as convert
    from conftest import tiny_recipe
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.recipe import recipe_from_dict
    from vfm_toolchain.runner import build

    scores = itertools.chain([0.9], itertools.repeat(0.5))
    monkeypatch.setattr(convert, "task_score", lambda *a, **k: next(scores))
    raw = tiny_recipe(_finished_build(hostile_env, tmp_path),
                      **{"export.formats": ["onnx", "onnx_int8"], "export.calibration_images": 4,
                         "export.options": {"onnx_int8": {"layout": "qdq", "fp32_slow_layers": False}},
                         "export.max_accuracy_drop": 0.1, "bench.runtimes": []})
    # the accuracy fallback tries putting layers back in float first (every try scores 0.5 here), and says so
    with pytest.raises(ToolchainError, match=r"0.4000 below fp32.*max_accuracy_drop 0.1 after the accuracy fallback: "
                                             r".* layers in float, test 50.00% -> 50.00%"):
        build(recipe_from_dict(raw), tmp_path / "o", tmp_path / "s")


def test_the_export_chain_makes_the_fp32_onnx_a_format_is_built_from(tmp_path):
    """One chain for the stage, selection, the benchmark and the API: int8 asked for alone gets its fp32 ONNX made
    first (into out/onnx), and a listed onnx is made once and reused, in the order asked."""
    from vfm_toolchain.export.formats import ExportInputs, export_chain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    x = torch.randn(2, 3, 16, 16)
    calls = []
    res = export_format("onnx_int8", model, x, tmp_path / "alone", {"fp32_slow_layers": False, "layout": "qdq"},
                        calibration=np.random.default_rng(0).standard_normal((4, 3, 16, 16)).astype(np.float32))
    assert res.path.parent == tmp_path / "alone" and (tmp_path / "alone" / "onnx" / "model.onnx").is_file()
    inputs = ExportInputs()
    made = list(export_chain(["onnx", "onnx_int8"], model, x, tmp_path / "both", {"onnx": {"opset": 17}},
                             inputs, calibrate=lambda: calls.append(1) or np.zeros((2, 3, 16, 16), np.float32)))
    assert [f for f, _ in made] == ["onnx", "onnx_int8"] and calls == [1]
    assert inputs.onnx == made[0][1].path == tmp_path / "both" / "onnx" / "model.onnx"


def test_tensorrt_profile_spans_every_batch_the_build_feeds(tiny_task):
    from vfm_toolchain.export.convert import ExportConvert, engine_batches
    from vfm_toolchain.export.formats.tensorrt_format import profile_shapes
    from vfm_toolchain.export.runtimes.tensorrt_runtime import chunks
    from tests.conftest import tiny_recipe
    from vfm_toolchain.recipe import recipe_from_dict

    r = recipe_from_dict(tiny_recipe(tiny_task, **{"export.formats": ["onnx", "tensorrt"], "export.parity_images": 16,
                                                   "bench.batch_sizes": [1, 8]}))
    feeds = engine_batches(r)
    assert feeds == [1, 8, 16, 32]  # bench, parity (16 at once), scoring (32)
    lo, opt, hi = profile_shapes(feeds, (3, 32, 32))
    assert lo == (1, 3, 32, 32) and hi == (32, 3, 32, 32) and lo[0] <= opt[0] <= hi[0]
    assert [(s.start, s.stop) for s in chunks(70, 32)] == [(0, 32), (32, 64), (64, 70)]
    # the key covers what the engine is built for: other bench batches, another engine
    stage = ExportConvert()
    other = recipe_from_dict(tiny_recipe(tiny_task, **{"export.formats": ["onnx", "tensorrt"],
                                                       "export.parity_images": 16, "bench.batch_sizes": [1, 64]}))
    assert stage.config(r) != stage.config(other)
    no_trt = [recipe_from_dict(tiny_recipe(tiny_task, **{"export.formats": ["onnx"], "bench.batch_sizes": b}))
              for b in ([1, 8], [1, 64])]
    assert stage.config(no_trt[0]) == stage.config(no_trt[1])  # without TensorRT the bench does not touch export


def test_store_shared_folder_is_not_an_entry(tmp_path):
    from vfm_toolchain.store import ArtifactStore

    s = ArtifactStore(tmp_path / "store")
    (s.shared_dir() / "tensorrt").mkdir(parents=True)
    (s.shared_dir() / "tensorrt" / "gpu-trt10.cache").write_bytes(b"x")
    assert list(s.entries()) == [] and s.gc() == ([], [])
    assert (s.shared_dir() / "tensorrt" / "gpu-trt10.cache").is_file()
