"""NCNN (export/formats/ncnn_format.py, export/runtimes/ncnn_runtime.py) beyond what every format and runtime is held
to (tests/test_edge_formats.py, tests/test_runtimes.py): the fp16 file is half the weights and close to fp32, the
runtime takes the precision from the artifact's record, the ``.param`` travels with its ``.bin`` into a device bundle,
a detector goes through the export stage's box-by-box parity and accuracy gate, and what pnnx cannot map is refused
with the ops it left."""
from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest
import timm
import torch

from tests.test_detection_export import NMS, _export, _recipe, build  # noqa: F401 (the module's tiny detector)
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.export.formats import FORMATS, export_format
from vfm_toolchain.export.formats.base import missing_modules
from vfm_toolchain.export.runtimes import Unavailable, options_for

SIZE = 32


def _present():
    missing = missing_modules("ncnn")
    if missing:
        pytest.skip(f"ncnn needs {', '.join(missing)}: {FORMATS.meta('ncnn')['install']}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_edge_formats' FastViT with one block per stage, folded, in both precisions."""
    _present()
    from vfm_toolchain.students.fold import fold_model

    torch.manual_seed(0)
    model = timm.create_model("fastvit_t8", layers=(1, 1, 1, 1), embed_dims=(16, 32, 64, 128), num_classes=3).eval()
    x = torch.randn(4, 3, SIZE, SIZE)
    folded, _ = fold_model(model, {"family": "student"}, x)
    out = tmp_path_factory.mktemp("ncnn")
    return folded, x, {fmt: export_format(fmt, folded, x, out / fmt) for fmt in ("ncnn", "ncnn_fp16")}


def test_a_missing_ncnn_or_bin_file_says_what_to_do(tmp_path, monkeypatch):
    from vfm_toolchain.export.runtimes.ncnn_runtime import load

    param = tmp_path / "model.ncnn.param"
    param.write_text("7767517\n0 0\n")
    with pytest.raises(FileNotFoundError, match=r"no artifact at .*model\.ncnn\.bin"):
        load(param, 1)
    (tmp_path / "model.ncnn.bin").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "ncnn", None)  # import ncnn raises ImportError
    with pytest.raises(Unavailable, match="ncnn is not installed .*pip install ncnn"):
        load(param, 1)


@pytest.mark.edge
def test_fp16_is_half_the_weights_close_to_fp32_and_run_as_its_record_says(tiny):
    from vfm_toolchain.export.convert import artifact_digest, artifact_files
    from vfm_toolchain.export.runtimes.ncnn_runtime import load

    folded, x, made = tiny
    with torch.no_grad():
        ref = folded(x).numpy()
    fp32, fp16 = made["ncnn"], made["ncnn_fp16"]
    assert (fp32.meta["precision"], fp16.meta["precision"]) == ("fp32", "fp16")
    files32, files16 = artifact_files(fp32.path), artifact_files(fp16.path)
    assert [f.name for f in files32] == ["model.ncnn.param", "model.ncnn.bin"]
    assert [f.name for f in files16] == ["model.fp16.ncnn.param", "model.fp16.ncnn.bin"]
    assert artifact_digest(fp32.path)["bytes"] == sum(f.stat().st_size for f in files32)
    assert 0.45 < files16[1].stat().st_size / files32[1].stat().st_size < 0.55  # fp16 weights
    got32, got16 = fp32.runner(x.numpy()), fp16.runner(x.numpy())
    assert np.abs(got32 - ref).max() < 1e-5
    assert 0 < np.abs(got16 - ref).max() < 1e-2 * (np.abs(ref).max() + 1e-3)
    assert fp32.runner.provider == "ncnn cpu (fp32)" and "fp16" in fp16.runner.provider
    again = load(fp16.path, 1, **options_for("ncnn", fp16.meta))  # as the bench and a device bundle load it
    assert again.provider == fp16.runner.provider and again.threads == 1
    np.testing.assert_array_equal(again(x.numpy()), got16)


@pytest.mark.edge
def test_the_param_travels_with_its_bin_into_a_device_bundle(tiny, tmp_path):
    from vfm_toolchain.bench.bundle import copy_artifact
    from vfm_toolchain.export.runtimes.ncnn_runtime import load

    folded, x, made = tiny
    res = made["ncnn_fp16"]
    rel = copy_artifact(res.path, tmp_path, "student_ncnn_fp16")
    assert rel == "student_ncnn_fp16/model.fp16.ncnn.param"
    assert {p.name for p in (tmp_path / "student_ncnn_fp16").iterdir()} == {"model.fp16.ncnn.param",
                                                                            "model.fp16.ncnn.bin"}
    run = load(tmp_path / rel, 1, **options_for("ncnn", res.meta))
    np.testing.assert_array_equal(run(x[:2].numpy()), res.runner(x[:2].numpy()))


@pytest.mark.edge
def test_an_op_pnnx_leaves_unmapped_is_refused_naming_it(tmp_path):
    _present()

    class SixAxes(torch.nn.Module):  # a 6-axis reshape and permute (MobileViT's unfold): ncnn's blobs have 4 at most
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x).reshape(1, 8, 2, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(1, 8, 16, 4)
            return y.mean((2, 3))

    with pytest.raises(ToolchainError, match="ops ncnn has no layer for: Tensor.reshape"):
        export_format("ncnn", SixAxes().eval(), torch.randn(1, 3, 8, 8), tmp_path)
    assert not list(tmp_path.glob("*.param")) and not list(tmp_path.glob(".pnnx_*"))


@pytest.mark.edge
def test_a_detector_exports_to_ncnn_with_its_boxes_checked_and_fp16_judged_by_map(build, tmp_path):  # noqa: F811
    """Candidates in the file, the runtime layer's NMS after it (as LiteRT and ExecuTorch): the fp32 file's boxes are
    matched to PyTorch's by the export stage, the fp16 file is judged by its test mAP50 against fp32, and the bench
    times both with the NMS inside the call."""
    _present()
    formats = ["onnx", "ncnn", "ncnn_fp16"]
    result = _export(build, tmp_path / "export", _recipe(formats=formats, max_accuracy_drop=1.0))
    by_kind = {a["kind"]: a for a in result["artifacts"]}
    assert all(by_kind[f]["status"] == "ok" for f in formats)
    a = by_kind["ncnn"]
    assert a["parity"] == "detections" and a["parity_matched"] == a["parity_reference_detections"] > 8
    assert a["test_map50"] == pytest.approx(a["pytorch_test_map50"], abs=0.003)
    assert a["runtime_nms"] == NMS and "candidates [B, N, 4 + C]" in a["output"]
    q = by_kind["ncnn_fp16"]
    assert q["metric"] == "map50" and q["accuracy_drop"] == pytest.approx(0.0, abs=0.02) and q["runtime_nms"] == NMS
    from vfm_toolchain.bench.latency import BenchLatency
    from vfm_toolchain.stage import StageContext, StageOutput

    inputs = {**build["inputs"], "export.convert": StageOutput("export.convert", "k", tmp_path / "export",
                                                               json.loads(json.dumps(result)))}
    (tmp_path / "bench").mkdir()
    rows = BenchLatency().run(StageContext(recipe=_recipe(formats=formats), workdir=tmp_path / "bench", inputs=inputs,
                                           log=logging.getLogger("t")))["bench"]
    by_artifact = {r["artifact"]: r for r in rows}
    for kind in ("ncnn", "ncnn_fp16"):
        timed = by_artifact[f"student {kind}"]
        assert timed["runtime"] == "ncnn" and 0 < timed["nms_ms"] < timed["p99_ms"]
    assert "fp16" in by_artifact["student ncnn_fp16"]["provider"]
