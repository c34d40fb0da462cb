"""Core ML: an ``.mlpackage`` predicted through coremltools on macOS, fed what an app feeds it: an RGB image when the
model takes one (the export bakes the normalisation in; rounding to 0-255 costs about 1e-2 of parity), one image
per prediction, with the compute units asked for (the Neural Engine included with ``ALL``).  Returns the class
scores in the model's class order (from the metadata the export wrote).  Elsewhere it is unavailable."""
from __future__ import annotations

import json
import platform

import numpy as np

from .base import Unavailable, artifact, described

# the export record's compute_units (what the recipe exported for) is passed to load wherever it runs
ENTRIES = {"coreml": {"runs": "coreml", "devices": "macOS (cpu, gpu, neural engine)", "from_record": ["compute_units"]}}


def load(path, threads=None, compute_units: str = "ALL"):
    path = artifact(path, "coreml")
    try:
        import coremltools as ct
    except ImportError as why:
        raise Unavailable(f"coremltools is not installed ({why}); pip install coremltools") from None
    if platform.system() != "Darwin":
        raise Unavailable("Core ML prediction needs macOS")
    model = ct.models.MLModel(str(path), compute_units=getattr(ct.ComputeUnit, compute_units))
    md = dict(model.user_defined_metadata)
    image = model.get_spec().description.input[0].type.WhichOneof("Type") == "imageType"
    pp = json.loads(md["preprocess"]) if image else None
    classes = json.loads(md["classes"]) if md.get("class_labels") == "true" else None

    def one(x: np.ndarray) -> np.ndarray:
        feed = x
        if pp is not None:  # back to the 0-255 RGB image the app would pass
            from PIL import Image

            pix = (x[0] * np.asarray(pp["std"])[:, None, None] + np.asarray(pp["mean"])[:, None, None]) * 255.0
            feed = Image.fromarray(np.clip(pix.transpose(1, 2, 0).round(), 0, 255).astype(np.uint8))
        out = model.predict({"input": feed})
        if classes:
            return np.asarray([[out["classLabel_probs"][c] for c in classes]], dtype=np.float32)
        return np.asarray(next(iter(out.values())), dtype=np.float32)

    def run(x: np.ndarray) -> np.ndarray:
        return np.concatenate([one(x[i:i + 1]) for i in range(len(x))])

    return described(run, f"coreml ({compute_units} compute units, {md.get('precision', 'fp32')})", threads)
