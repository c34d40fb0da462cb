"""The task contract and its registry (see the package docstring)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from vfm_toolchain.core.registry import Registry

__all__ = ["TASKS", "Task", "Splits", "register_task", "task_of", "task_part", "per_split_lines", "save_slice",
           "LEGACY_TASK", "artifact_outputs", "slice_images"]

TASKS = Registry("task")

# What a data index, a result or a spec written before they named their task holds: classification was the only
# task then.  The one place that default lives; anything that names a task names a registered one.
LEGACY_TASK = "classification"


@dataclass
class Splits:
    """A task's labeled splits as data.prepare indexes them: ``index`` holds ``classes``, ``train``, ``val``,
    ``test`` (lists of samples), ``corrupt`` (split -> {path: why it was skipped}) and whatever else the task's
    readers keep; ``extra`` joins the stage's result, ``notes`` its warnings."""

    index: Dict[str, Any]
    extra: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


class Task:
    """One task's answers.  A subclass sets the attributes and implements the methods; the stages ask it."""

    name: str = ""
    reads: str = ""  # what its data folders hold, as a message says it: "ImageFolder splits"
    metric: str = ""  # the main metric's key in a stage's metrics (``test_<metric>``): top1, miou, map50
    metric_label: str = ""  # the main metric as a reader knows it: top-1, mIoU, mAP50
    budget_unit: str = "labels per class"  # what data.labeled_per_class counts, as the study's table says it
    # recipe fields only this task reads ("data.format"): another task's recipe may not set them
    owns: FrozenSet[str] = frozenset()
    # what it can take that not every task can: label_smoothing (a cross-entropy to smooth), label_mixing (mixup /
    # cutmix of whole-image labels), random_erasing (an erased rectangle keeps its image's target: image-level
    # targets only), gramian_heads (extra classifiers, seed 003), linear_probe (a logistic regression fits its head),
    # zero_shot_head (a linear head that starts from the text tower's class-name embeddings)
    supports: FrozenSet[str] = frozenset()

    def foreign(self, section: str) -> Set[str]:
        """The fields of recipe ``section`` that only other tasks read: left out of this task's stage keys."""
        theirs = {f for name in TASKS.list() if name != self.name for f in TASKS.get(name).owns}
        return {f.split(".", 1)[1] for f in theirs - self.owns if f.startswith(section + ".")}

    # ---- data: generated, read, keyed and described (data.prepare)

    # the procedural task's generator (module, function, version constant): what ``source: synthetic`` writes
    generator: Tuple[str, str, str] = ("", "", "")

    def generator_version(self) -> str:
        """The version of the procedural task's generator: part of the key of a ``source: synthetic`` build."""
        module, _, version = self.generator
        return getattr(importlib.import_module(module), version)

    def generate(self, folder: Any, s: Any) -> Dict[str, Any]:
        """Write the procedural task (``data.synthetic``) under ``folder``: {"train", "val", "test": folder,
        "pools": [folders]} in the layout :meth:`read_splits` reads."""
        module, function, _ = self.generator
        return getattr(importlib.import_module(module), function)(
            folder, s.classes, s.labeled_per_class, s.val_per_class, s.test_per_class, s.pool_size, s.distractor_size,
            s.image_size, s.seed)

    def read_splits(self, ctx: Any, train: str, val: Optional[str], test: str) -> Splits:
        """Read and check the labeled splits, every image decoded once (a corrupt one skipped with why), the label
        budget applied, and without a val folder the validation set taken from train."""
        raise NotImplementedError

    def data_key(self, data: Any) -> Dict[str, Any]:
        """What else decides data.prepare's output besides the folders' bytes (files read from outside them)."""
        return {}

    def named_files(self, data: Any) -> List[str]:
        """The files the task's annotation files name, wherever they are (fingerprinted when outside the data
        folders)."""
        return []

    def describe_data(self, result: Dict[str, Any], section: Any) -> None:
        """Add the task's own lines to data.prepare's report section (boxes per class, ...)."""

    def fit(self, model: Any, groups: Any, index: Dict[str, Any], preprocess: Any, cfg: Any, state: Any, log: Any,
            seed: int, name: str, extra_loss: Any = None, criterion: Any = None) -> List[Dict[str, float]]:
        """Train ``model`` on ``index["train"]`` with its val metric on ``index["val"]`` (toolchain/training.py):
        the cross-entropy of :meth:`train_dataset`'s targets (``criterion`` replaces it), ``extra_loss()`` added."""
        from vfm_toolchain.training import fit_classifier

        return fit_classifier(model, groups, index["train"], preprocess, cfg, state, log, seed, name,
                              val_items=index["val"], extra_loss=extra_loss, criterion=criterion, task=self.name,
                              num_classes=len(index["classes"]))

    def scores(self, model: Any, index: Dict[str, Any], preprocess: Any,
               splits: Sequence[str] = ("val", "test")) -> Dict[str, Any]:
        """A model's ``<split>_<metric>`` on the splits of a data index, as a stage's ``metrics``."""
        return {f"{s}_{self.metric}": self.evaluate(model, index[s], preprocess, len(index["classes"]),
                                                    index["classes"]) for s in splits}

    def describe(self, metrics: Dict[str, Any], splits: Sequence[str] = ("val", "test")) -> str:
        """A model's scores as the log says them: ``val top-1 0.9440, test top-1 0.9310``."""
        return ", ".join(f"{s} {self.metric_label} {metrics[f'{s}_{self.metric}']:.4f}" for s in splits)

    def summary(self, metrics: Dict[str, Any], split: str = "test") -> str:
        """A model's scores on a split as the report's summary says them: ``test top-1 77.8%``."""
        return f"{split} {self.metric_label} {self.score_text(metrics.get(f'{split}_{self.metric}'))}"

    def score_text(self, value: Optional[float]) -> str:
        """A main-metric score as the report writes it: ``41.7%``, or ``n/a`` when it was not measured."""
        return "n/a" if value is None or value != value else f"{100 * value:.1f}%"

    def train_dataset(self, items: Sequence[Any], preprocess: Any, augment: str) -> Any:
        """The augmented training dataset of a split's samples, ``(image, target)`` pairs for the task's loss
        (toolchain/training.py fit_classifier)."""
        raise NotImplementedError

    def predict(self, model: Any, x: Any, preprocess: Any, sizes: Sequence[Any], score_thresh: float) -> Any:
        """A model's predictions on a batch ``x`` of pool images whose own (h, w) are ``sizes``, in the form
        label-next and pseudo-label read (toolchain/pool_predict.py); by default class probabilities over the
        model's output, ``[B, C]`` or per pixel ``[B, C, h, w]``."""
        import torch

        return torch.softmax(model(x).float(), dim=1).cpu()

    # ---- pseudo-labels (students/pseudo_label.py): the teacher's labels on the pool, for a person to correct

    pseudo_folder: str = ""  # the kept images, in the layout the task's reader takes
    label_studio_control: Tuple[str, str] = ("", "")  # Label Studio's control tag and its item tag
    label_studio_options: Mapping[str, str] = {}  # the control tag's attributes ({"choice": "multiple"})
    cvat_kind: str = ""  # the annotation type of CVAT for images 1.1

    def pseudo_predictions(self, outs: Any, sizes: Sequence[Any], threshold: float,
                           classes: Sequence[str]) -> List[Dict[str, Any]]:
        """One batch of :meth:`predict` as per-image predictions, each with a ``confidence`` (kept at the
        threshold, else for review), a ``summary`` for the csv files, and ``doubtful`` when it must be reviewed
        whatever its confidence."""
        raise NotImplementedError

    def pseudo_annotations(self, prediction: Dict[str, Any], w: int, h: int, classes: Sequence[str],
                           threshold: float) -> Tuple[List[Dict[str, Any]], List[str]]:
        """A prediction as Label Studio results (``type``, ``value``, ``score``) and CVAT annotation lines."""
        raise NotImplementedError

    def keep_pseudo_label(self, writer: Any, path: str, name: str, prediction: Dict[str, Any], w: int,
                          h: int) -> None:
        """Write a kept image and its label into ``writer.out / pseudo_folder`` (or onto ``writer.kept``)."""
        raise NotImplementedError

    def finish_pseudo_labels(self, writer: Any) -> None:
        """What the kept folder needs once every image is in (a class list, an annotation file)."""

    # ---- what an artifact is (export, bench)

    # the declaration a format needs to export this task's model besides a plain network (``register_format(...,
    # detection=)``), and what it means as the refusal says it; "": every format takes it
    artifact_capability: str = ""
    artifact_words: str = ""

    def score_artifact(self, run: Any, items: Sequence[Any], preprocess: Any, num_classes: int,
                       batch_size: int) -> float:
        """The main metric of an exported artifact, ``run(images: ndarray) -> outputs``, over a split, scored as
        :meth:`evaluate` scores a PyTorch model."""
        raise NotImplementedError

    def unlabeled_samples(self, paths: Sequence[str]) -> List[Any]:
        """Unlabeled images (int8 calibration) as the task's samples, so they are preprocessed as its models see
        them: (path, 0) pairs by default."""
        return [(p, 0) for p in paths]

    def test_slice(self, items: Sequence[Any], preprocess: Any, num_classes: int, path: Any) -> None:
        """Write ``path`` (.npz): test samples at the model's input size (uint8, as the build's eval transform
        resizes them) with their targets, which the device bundle's runner scores with the task's metric
        (bench/bundle.py; bench/bundle_runner.py reads it)."""
        raise NotImplementedError

    def classifier_labels(self, classes: Sequence[str]) -> Optional[List[str]]:
        """The class names when the model's output is one softmax over them (Core ML's ClassifierConfig makes
        such a model a classifier), else None."""
        return None

    def artifact_settings(self, recipe: Any) -> Optional[Dict[str, Any]]:
        """What the artifacts ship with besides the network and change what they return (a detector's NMS
        settings); None when there is nothing."""
        return None

    # ---- the study's simulated labeler (toolchain/oracle.py)

    def oracle(self, source: str, classes: Sequence[str], data_roots: Sequence[str] = ()) -> Any:
        """The withheld labels ``study.oracle`` holds, as an :class:`vfm_toolchain.oracle.Oracle`."""
        from vfm_toolchain.core.errors import ToolchainError

        raise ToolchainError(f"study.selection simulates labeling with a csv of class labels (classification) or a "
                             f"folder of masks (segmentation); {self.name} has no oracle: remove study.selection "
                             f"for this recipe")

    def budget_images(self, delta: int, num_classes: int) -> int:
        """Images a label budget ``delta`` larger brings (the budget counts labeled images unless a task says
        otherwise)."""
        return delta

    # ---- a folder a person points ``toolchain init`` at (toolchain/init.py)

    # the settings of the task's shipped real-data recipe that init starts from: ``recipe`` names it, ``labeled`` and
    # ``transfer`` are its label and transfer-set counts (init scales epochs by them); the sections hold its values
    # (tests/test_init.py holds them equal to the recipe)
    starter: Dict[str, Any] = {}

    def recognize(self, folder: Any, asked: bool = False) -> Optional[str]:
        """The layout of a split folder if it is one in this task's layout ("ImageFolder", "COCO JSON"), else None.
        ``asked``: the person named this task, so a layout another task claims first (COCO: detection) counts."""
        raise NotImplementedError

    def label_counts(self, samples: Sequence[Any], num_classes: int) -> List[int]:
        """Per class, the samples of a split that show it (images; a detector's images with a box of it)."""
        raise NotImplementedError

    def write_split(self, samples: Sequence[Any], classes: Sequence[str], folder: Any) -> None:
        """A split folder in this task's layout holding ``samples`` (their images linked, not copied), so a split
        init proposes reads as the person's own would."""
        raise NotImplementedError

    def validate(self, recipe: Any) -> None:
        """The task's rules on a whole recipe, checked when it loads (ValueError says what to change): the input
        sizes its heads need, say."""

    def class_count(self, recipe: Any) -> int:
        """The recipe's number of classes, without running data.prepare (a model's head is sized by it)."""
        raise NotImplementedError

    def check_data(self, recipe: Any) -> None:
        """What the recipe's data folders must hold, from listings and annotation files alone (the recipe checks
        before the first stage; images are decoded in data.prepare).  Synthetic data is not checked here."""

    def evaluate(self, model: Any, items: Sequence[Any], preprocess: Any, num_classes: Optional[int] = None,
                 classes: Optional[Sequence[str]] = None) -> float:
        """The main metric of ``model`` over a split's samples."""
        raise NotImplementedError


def task_part(registry: Registry, name: str, what: str, folder: str) -> Any:
    """The ``what`` part of task ``name`` from its floor's ``registry`` (teachers/tasks/, students/tasks/).

    Raises:
        ToolchainError: a task without one, naming the tasks that have one.
    """
    if name not in registry:
        from vfm_toolchain.core.errors import ToolchainError

        raise ToolchainError(f"data.task {name} has no {what} part ({folder}); the tasks with one: "
                             f"{', '.join(registry.list())}")
    return registry.get(name)()


def register_task(cls: type) -> type:
    """Class decorator: register a task under its ``name``, declaring what ``toolchain list tasks`` shows."""
    TASKS.register(cls.name, reads=cls.reads, metric=cls.metric, label_budget=cls.budget_unit)(cls)
    return cls


def task_of(source: Any) -> Task:
    """The task of a recipe, a data index or stage result (a mapping with ``task``), or a task name.

    Raises:
        ToolchainError: a name no task registers, with the registered names.
    """
    if isinstance(source, str):
        name = source
    elif isinstance(source, Mapping):
        name = source.get("task", LEGACY_TASK)
    else:
        name = source.data.task
    return TASKS.get(name)()


def per_split_lines(bad_by_split: Dict[str, Dict[str, str]], noun: str, plural: str, what: str, item: str,
                    shown: int = 5) -> List[str]:
    """One line per split with something skipped or dropped: how many, and the first ``shown`` with why."""
    lines = []
    for split, bad in bad_by_split.items():
        if bad:
            first = "; ".join(f"{item.format(where)}: {why}" for where, why in list(bad.items())[:shown])
            more = f"; and {len(bad) - shown} more (every one with its reason in the data.prepare index.json)" \
                if len(bad) > shown else ""
            lines.append(f"{split}: {len(bad)} {noun}{plural * (len(bad) != 1)} {what}: {first}{more}")
    return lines


def artifact_outputs(run: Any, paths: Sequence[str], preprocess: Any, batch_size: int) -> Any:
    """``run(images) -> outputs`` over images as the eval transform makes them, stacked in order: how an
    image-level task scores an exported artifact."""
    import numpy as np
    import torch

    from vfm_toolchain.core.console import track
    from vfm_toolchain.data.images import ImageListDataset, eval_transform

    ds = ImageListDataset([(p, 0) for p in paths], eval_transform(preprocess), cache_mb=0)
    outs = [np.asarray(run(xb.numpy())) for xb, _ in track(
        torch.utils.data.DataLoader(ds, batch_size=batch_size), -(-len(ds) // batch_size),
        f"scoring the artifact on {len(ds)} images", unit="batch")]
    return np.concatenate(outs) if outs else np.zeros((0,))


def slice_images(paths: Sequence[str], preprocess: Any) -> List[Any]:
    """A test slice's images: uint8 at the model's input size, resized as the eval transforms resize the PIL image
    (an unreadable one black)."""
    import numpy as np
    from PIL import Image

    from vfm_toolchain.data.images import load_image
    from vfm_toolchain.data.segmentation import seg_eval_transform

    h, w = preprocess.hw
    resize = seg_eval_transform(preprocess)  # the resize both eval transforms start with
    return [np.asarray(resize(load_image(p) or Image.new("RGB", (w, h))), dtype=np.uint8) for p in paths]


def save_slice(path: Any, images: Sequence[Any], labels: Sequence[Any], preprocess: Any, num_classes: int) -> None:
    """A device bundle's test slice of images and per-image targets (class ids or masks): what
    :meth:`Task.test_slice` writes for image-level and pixel-level tasks."""
    import numpy as np

    np.savez_compressed(path, images=np.stack(images), labels=np.asarray(labels),
                        mean=np.asarray(preprocess.mean, np.float32), std=np.asarray(preprocess.std, np.float32),
                        num_classes=np.asarray(num_classes))
