"""``export.convert``: fold the trained model into plain weights and emit each requested format.

Every artifact passes the parity gate on real test images against the folded PyTorch model before it
is accepted; a failure fails the build.  Formats that cannot be produced on this machine (TensorRT
without a GPU) are recorded as skipped with the reason, and Core ML parity is skipped off macOS.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

from export.fold import fold_model
from export.formats import FORMATS, Skipped
from export.parity import check_parity
from toolchain import __version__
from toolchain.checkpoint import load_model
from toolchain.data import ImageListDataset, Preprocess, eval_transform
from toolchain.errors import ToolchainError
from toolchain.prepare import load_index
from toolchain.stage import Stage, StageContext, register_stage
from toolchain.store import hash_obj, sha256_file

__all__ = ["ExportConvert", "parity_inputs", "artifact_digest"]

_SOURCE = {"student": "student.finetune", "teacher": "teacher.finetune"}


def parity_inputs(items, pp: Preprocess, n: int) -> torch.Tensor:
    ds = ImageListDataset(items[:n], eval_transform(pp), cache_mb=0)
    return torch.stack([ds[i][0] for i in range(len(ds))])


def artifact_digest(path: Path) -> Dict[str, Any]:
    if path.is_dir():  # .mlpackage
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"sha256": hash_obj([(str(p.relative_to(path)), sha256_file(p)) for p in files]),
                "bytes": sum(p.stat().st_size for p in files)}
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


@register_stage
class ExportConvert(Stage):
    name = "export.convert"
    inputs = ("data.prepare", "student.finetune")
    optional_inputs = ("teacher.finetune",)

    def config(self, recipe) -> Dict[str, Any]:
        return {"export": recipe.export.model_dump(mode="json")}

    def skip_reason(self, recipe):
        return None if recipe.export.formats else "export.formats is empty"

    def _format_opts(self, fmt: str, recipe, onnx_path) -> Dict[str, Any]:
        e = recipe.export
        wanted = {"opset": e.opset, "slim": e.slim, "precision": "fp32", "onnx": onnx_path,
                  "metadata": None, "deployment_target": "iOS16", "max_batch": max(recipe.bench.batch_sizes)}
        allowed = FORMATS.meta(fmt)["options"]
        return {k: v for k, v in wanted.items() if k in allowed}

    def run(self, ctx: StageContext) -> Dict[str, Any]:
        r, e = ctx.recipe, ctx.recipe.export
        for fmt in e.formats:
            FORMATS.check(fmt)
        index = load_index(ctx.input("data.prepare"))
        artifacts: List[Dict[str, Any]] = []
        folds: Dict[str, Any] = {}
        warnings: List[str] = []
        for which in e.models:
            src = ctx.input(_SOURCE[which])
            folder = src.path("model")
            spec = json.loads((folder / "spec.json").read_text())
            model = load_model(folder)
            pp = Preprocess.from_dict(spec["preprocess"])
            x = parity_inputs(index["test"], pp, e.parity_images)
            try:
                folded, records = fold_model(model, spec, x)
            except ToolchainError as exc:  # an adapter that does not fold: export its extra ops as they are
                warnings.append(f"{which}: {exc}")
                folded, records = model, [{"pass": "adapter_merge", "skipped": str(exc)}]
            folds[which] = records
            with torch.no_grad():
                ref = folded(x).numpy()
            metadata = {"classes": spec["classes"], "preprocess": spec["preprocess"], "model": spec["name"],
                        "recipe_hash": hash_obj(r.model_dump(mode="json"))[:16], "toolchain": __version__}
            onnx_path = None
            for fmt in e.formats:
                out_dir = ctx.workdir / which / fmt
                out_dir.mkdir(parents=True, exist_ok=True)
                opts = self._format_opts(fmt, r, onnx_path)
                if "metadata" in opts:
                    opts["metadata"] = metadata
                entry: Dict[str, Any] = {"stage": self.name, "model": which, "kind": fmt}
                try:
                    res = FORMATS.get(fmt)(folded, x, out_dir, opts)
                except Skipped as why:
                    entry.update(status="skipped", reason=str(why))
                    artifacts.append(entry)
                    ctx.log.info("%s %s: skipped (%s)", which, fmt, why)
                    continue
                if fmt == "onnx":
                    onnx_path = res.path
                entry.update(status="ok", path=str(res.path.relative_to(ctx.workdir)), **artifact_digest(res.path),
                             **res.meta)
                if res.runner is not None:
                    diff = check_parity(f"{which} {fmt}", ref, np.asarray(res.runner(x.numpy())), e.parity_atol)
                    entry.update(parity_max_abs_diff=diff, parity_images=len(x))
                else:
                    entry.update(parity_max_abs_diff=None, parity_skipped=res.parity_skipped)
                    warnings.append(f"{which} {fmt}: parity not checked here ({res.parity_skipped})")
                artifacts.append(entry)
                ctx.log.info("%s %s: %s (%d bytes) parity %s", which, fmt, entry["path"], entry["bytes"],
                             entry.get("parity_max_abs_diff"))
        return {"artifacts": artifacts, "folds": folds, "warnings": warnings}
