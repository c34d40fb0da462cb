"""The recipe: one YAML file is the whole build.

Each section owns its defaults (minGPT style).  Every model rejects unknown keys, so a typo is an error
that names the key and suggests the closest valid one.  ``--set a.b=c`` overrides are applied to the raw
mapping before validation, so they are checked by exactly the same rules as the file.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, ValidationError, create_model,
                      field_validator, model_serializer, model_validator)

from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.core.registry import did_you_mean
from vfm_toolchain.core.sizes import canonical_size
from vfm_toolchain.core.yamlfile import load_yaml
from vfm_toolchain.tasks import LEGACY_TASK, TASKS, task_of

__all__ = ["Recipe", "load_recipe", "parse_overrides", "apply_overrides", "recipe_to_dict", "validate_options"]


def _image_size(value: Any) -> Any:
    """One side (square) or [height, width]; a square pair is stored as its side, so square recipes keep
    their store keys whichever way they spell the size."""
    sides = value if isinstance(value, (list, tuple)) else [value]
    if len(sides) not in (1, 2) or not all(isinstance(x, int) and not isinstance(x, bool) for x in sides):
        raise ValueError("an image size is one side (e.g. 256) or [height, width] (e.g. [192, 256] for a 4:3 "
                         "landscape camera)")
    if min(sides) < 16:
        raise ValueError("each side of an image size must be at least 16 px")
    return canonical_size(value if len(sides) == 2 else sides[0])


ImageSizeField = Annotated[Union[int, Tuple[int, int]], PlainValidator(_image_size),
                           PlainSerializer(lambda v: list(v) if isinstance(v, tuple) else v)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def changed_from_default(self, names, prefix: str) -> List[str]:
        """``prefix.name`` of each of ``names`` this section sets to something else than its default (a
        task-only option a recipe of another task must not set)."""
        defaults = type(self)()
        return [f"{prefix}.{k}" for k in sorted(names) if getattr(self, k) != getattr(defaults, k)]


class SyntheticData(Section):
    """The procedural shapes task the toolchain generates itself (used by the quickstart), in the form of
    ``data.task``: one shape per image (classification), a label map (segmentation: ``labeled_per_class``,
    ``val_per_class`` and ``test_per_class`` count images), or boxes (detection: each class appears in at least
    that many images of the split, with up to four shapes per image and a tenth as many images with none)."""

    classes: int = Field(6, ge=2, le=10)
    labeled_per_class: int = Field(10, ge=1)
    val_per_class: int = Field(20, ge=1)
    test_per_class: int = Field(60, ge=1)
    pool_size: int = Field(3000, ge=1, description="task-related unlabeled images")
    distractor_size: int = Field(1000, ge=0, description="out-of-domain unlabeled images")
    image_size: int = Field(64, ge=16)
    seed: int = 0


class DataConfig(Section):
    source: Literal["folders", "synthetic"] = "folders"
    task: str = Field(LEGACY_TASK, description="a registered task (toolchain/tasks/, `toolchain list tasks`). "
                      "classification: ImageFolder splits; segmentation: <split>/images + <split>/masks (PNG class "
                      "ids, 255 = ignore) and train/classes.txt; detection: <split>/images with COCO JSON or YOLO "
                      "txt boxes (data.format)")
    format: Literal["auto", "coco", "yolo"] = Field(
        "auto", description="detection only: how each split's boxes are written. coco: <split>/images + "
                            "<split>/annotations.json; yolo: <split>/images + <split>/labels/<name>.txt ('class cx "
                            "cy w h', normalised) with classes.txt or data.yaml; auto: whichever the folder has")
    train: Optional[str] = Field(None, description="ImageFolder with the few labels")
    val: Optional[str] = None
    test: Optional[str] = None
    pools: List[str] = Field(default_factory=list, description="unlabeled image folders (recursive)")
    roots: List[str] = Field(default_factory=list, description="more folders that data files may name files in "
                             "(a COCO file_name, a pool list's line, a symlink in a split or pool folder, a "
                             "study.oracle mask); without them each data file reads only inside its own folder "
                             "(core/roots.py). Every file read there is fingerprinted into data.prepare's key")
    labeled_per_class: Optional[int] = Field(
        None, ge=1, description="take a deterministic subset of this many labels per class from train "
                                "(segmentation: this many labeled images; detection: whole images, chosen so each "
                                "class appears in at least this many where train has them)"
    )
    val_fraction: float = Field(0.2, gt=0, lt=1, description="split of train used for val when val is not given "
                                "(with labeled_per_class, the labels outside the budget are the val set instead)")
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    max_image_pixels: Optional[int] = Field(
        None, ge=1, description="an image with more pixels is skipped and counted, with the reason (a guard "
                                "against decompression bombs: a small file that decodes to gigabytes); None: "
                                "Pillow's limit, 178956970 (about 13400 x 13400). Raise it for large images you "
                                "mean to use, e.g. 400000000 for 20000 x 20000 aerial tiles")
    workers: Union[Annotated[int, Field(ge=0)], Literal["auto"]] = Field(
        "auto", description="image decoding worker processes per data loader; auto: 0 on the CPU (decoding would "
                            "take cores from compute), up to 8 per process on CUDA (toolchain/devices.py)")

    @model_validator(mode="after")
    def _folders_need_train(self) -> "DataConfig":
        if self.source == "folders":
            if not self.train:
                raise ValueError("data.train is required when data.source is 'folders' (an ImageFolder directory)")
            if not self.test:
                raise ValueError("data.test is required when data.source is 'folders' (an ImageFolder directory)")
            if not self.pools:
                raise ValueError("data.pools needs at least one unlabeled image folder for the transfer set")
        return self

    @model_validator(mode="after")
    def _synthetic_reads_no_folders(self) -> "DataConfig":
        if self.source == "synthetic":
            given = [f"data.{k}" for k in ("train", "val", "test", "pools", "roots") if getattr(self, k)]
            if given:
                raise ValueError(f"{', '.join(given)} name{'s' * (len(given) == 1)} folders of yours, which "
                                 f"data.source: synthetic does not read (it generates the procedural task): remove "
                                 f"{'it' if len(given) == 1 else 'them'}, or set data.source: folders")
        return self

    @field_validator("task")
    @classmethod
    def _registered_task(cls, v: str) -> str:
        if v not in TASKS:
            raise ValueError(f"'{v}' is not a task.{did_you_mean(v, TASKS.list())} Tasks: {', '.join(TASKS.list())}")
        return v

    @model_validator(mode="after")
    def _format_is_for_detection(self) -> "DataConfig":
        if self.format == "auto":
            return self
        task = task_of(self.task)
        if "data.format" not in task.owns:
            raise ValueError(f"data.format {self.format} says how detection boxes are written; data.task "
                             f"{self.task} reads {task.reads}: remove data.format or set data.task: detection")
        if self.source == "synthetic":
            raise ValueError(f"data.format {self.format} says how your folders' boxes are written; the synthetic "
                             f"task writes its own (COCO): remove data.format or set data.source: folders")
        return self


class AdapterConfig(BaseModel):
    """``name`` picks a registered adapter; the other keys are that adapter's options, validated by the
    adapter's own config class (``toolchain list adapters``), which rejects unknown keys."""

    model_config = ConfigDict(extra="allow")
    name: str = "lora"

    def options(self) -> Dict[str, Any]:
        return dict(self.model_extra or {})


class TrainConfig(Section):
    epochs: int = Field(10, ge=0)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.05, ge=0)
    batch_size: int = Field(32, ge=1)
    warmup_epochs: int = Field(0, ge=0)
    accumulate: int = Field(1, ge=1, description="batches per optimizer step (gradient accumulation)")
    amp: bool = Field(True, description="bfloat16 autocast on GPU (no effect on CPU)")
    checkpoint_steps: Optional[int] = Field(None, ge=1, description="also checkpoint every N batches inside an "
                                                                    "epoch (long epochs on large transfer sets)")
    ema: float = Field(0.0, ge=0, lt=1, description="decay of an exponential moving average of the weights, which is "
                                                    "validated and kept (timm's ModelEmaV3 with warm-up; ~0.99 for a "
                                                    "few hundred steps, 0.999+ for long runs; the warm-up reaches "
                                                    "only 1 - steps^(-2/3), 0.9971 in 6,400 steps, and a higher "
                                                    "value acts as that, with a warning); 0: off")


class LabelTrainConfig(TrainConfig):
    """Training on the labels (the teacher, the student's finetune and its label-only baseline)."""

    label_smoothing: float = Field(0.0, ge=0, lt=1, description="cross-entropy label smoothing (classification "
                                   "and segmentation; mixup targets are smoothed by it too)")


_AUGMENT_HELP = ("light: random resized crop (60-100%), flip, mild colour jitter; strong: crop (25-100%), flip, "
                 "RandAugment (2 ops, magnitude 9) and random erasing (0.25) (segmentation: the light geometry with "
                 "photometric RandAugment on the image only)")
Augment = Literal["light", "strong"]


class TeacherConfig(LabelTrainConfig):
    name: str = "timm:vit_small_patch14_dinov2"
    weights: str = Field(
        "pretrained",
        description="'pretrained' (library tag), 'none' (random init), a local checkpoint path, "
        "or 'package:<module>/<file>' for weights shipped inside an installed package",
    )
    image_size: Optional[ImageSizeField] = Field(None, description="one side, or [height, width]; None keeps the "
                                                                   "model's own input size")
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    head_lr: Optional[float] = Field(None, gt=0, description="learning rate of the new head (default: lr)")
    head_init: Literal["random", "zero_shot"] = Field(
        "random", description="zero_shot (open_clip teachers): the head starts as the text embeddings of the "
                              "class names in the prompt templates, on L2-normalised image features")
    prompts: Optional[List[str]] = Field(None, description="templates with '{}' for the class name; "
                                                           "None: open_clip's OpenAI ImageNet templates")
    augment: Augment = Field("light", description="label training. " + _AUGMENT_HELP)
    lp_ft: bool = Field(False, description="LP-FT (Kumar et al. 2022): fit the head on the frozen backbone first "
                        "(classification: a logistic-regression probe, L2 chosen on val; segmentation: probe_epochs "
                        "of head-only training), then train head and adapter from it at lr; the teacher kept is "
                        "whichever of the probe and the finetuned model scores higher on val")
    probe_epochs: int = Field(10, ge=1, description="lp_ft, segmentation: epochs of head-only training")
    output_stride: Literal[8, 16] = Field(8, description="segmentation: the teacher's feature grid is input / 8 "
                                                         "(seed 004 A.1) or / 16 (ViT patch stride, or ConvNet "
                                                         "dilation)")

    @model_validator(mode="after")
    def _one_head_start(self):
        if self.lp_ft and self.head_init == "zero_shot":
            raise ValueError("teacher.lp_ft fits the head as a probe, which would replace the zero-shot head; "
                             "use one of teacher.lp_ft: true or teacher.head_init: zero_shot")
        return self


class CurateConfig(Section):
    strategy: str = "query_balanced_image"
    budget: int = Field(5000, ge=1, description="number of pool images in the transfer set")
    batch_size: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(
        "auto", description="embedding batch; auto: 64 on the CPU, on CUDA the largest that fits the free GPU "
                            "memory (measured)")
    seed: int = 0
    index: str = Field("auto", description="'flat' (exact), 'auto' (exact up to exact_max images; beyond, IVF-Flat "
                                           "when the vectors fit index_memory_gb, else IVF-PQ re-ranked exactly from "
                                           "the memory-mapped pool; teachers/search.py) or a faiss index-factory "
                                           "string such as 'HNSW32'")
    exact_max: int = Field(200_000, ge=1)
    hnsw_max: int = Field(0, ge=0, description="auto builds HNSW32 for pools between exact_max and this size "
                                               "(0: never; HNSW searches faster but builds for minutes per million)")
    index_memory_gb: Optional[float] = Field(None, gt=0, description="memory an auto index may hold; None: half "
                                                                     "of this machine's")
    nprobe: Optional[int] = Field(None, ge=1, description="IVF lists searched per query; None: the fewest that "
                                                          "reach min_recall (tuned on a sample of the queries)")
    recall_sample: int = Field(200, ge=1, description="queries on which an approximate index is tuned and checked")
    min_recall: Optional[float] = Field(0.95, gt=0, le=1, description="recall@100 against exact search that an "
                                        "approximate index is tuned to, and fails without; None: nprobe (or 16) "
                                        "as given, recall only reported")
    dedup_distance: Optional[float] = Field(0.05, ge=0, description="drop pool images within this distance "
                                            "(unit embeddings) of an earlier one; None keeps duplicates")
    leakage_distance: Optional[float] = Field(0.05, ge=0, description="drop pool images within this distance "
                                              "of a val/test image (near-copies); None disables the guard")
    shard_size: int = Field(4096, ge=1, description="pool images per embedding shard (the resume unit)")
    encoder: str = Field("auto", description="the retrieval encoder. auto: the teacher's own pretrained foundation "
                         "model, unadapted (teacher.name, teacher.weights): its image tower embeds queries and pool, "
                         "its text tower the prompts of query_balanced_text, so both are in one space; teacher: the "
                         "finetuned teacher (adapter and all); or a teacher registry name, e.g. "
                         "open_clip:ViT-L-14/datacomp_xl_s13b_b90k (seed 004 retrieves with OpenCLIP ViT-L/14)")
    encoder_weights: str = Field("pretrained", description="weights of a named encoder (auto uses teacher.weights)")
    encoder_image_size: Optional[ImageSizeField] = Field(None, description="one side, or [height, width]; None: "
                                                                           "teacher.image_size for auto, else the "
                                                                           "encoder's own")
    prompts: Optional[List[str]] = Field(None, description="templates with '{}' for query_balanced_text; "
                                                           "None: open_clip's OpenAI ImageNet templates")
    map: Literal["pca", "tsne", "umap"] = Field("pca", description="2D map of queries, pool sample and selection "
                                                                  "(umap needs the 'umap' extra)")
    # detection only (teachers/object_queries.py); part of the curate key only for detection builds
    object_share: float = Field(0.5, ge=0, le=1, description="detection, image queries: the share of the budget "
                                "brought in by object crops (each class an equal part, split over its objects), the "
                                "rest by the whole labeled images; 0: whole images only, 1: crops only")
    crop_context: float = Field(0.15, ge=0, le=2, description="detection: context around each box in its crop "
                                "query, as a fraction of the box's size on each side")


class GramianConfig(Section):
    """Extra heads while the student trains on labels (seed 003's regime; the head design is this project's own,
    students/gramian.py); 0 heads = off."""

    heads: int = Field(0, ge=0, le=16)
    dim: int = Field(32, ge=2, description="channels each head reduces to before second-order pooling")
    decorrelation: float = Field(0.1, ge=0, description="weight of the head decorrelation loss")
    deploy: Literal["none", "one"] = Field("none", description="ship the backbone with its own head only, or "
                                                               "with one Gramian head as well")

    @model_validator(mode="after")
    def _deploy_needs_a_head(self):
        if self.deploy == "one" and self.heads == 0:
            raise ValueError("student.gramian.deploy: one ships a Gramian head, but student.gramian.heads is 0 (off), "
                             "so there is none to ship: set heads to at least 1, or deploy: none")
        return self


# the student fields that only steer ``name: auto`` (bench/select.py): the select stage's key covers them,
# and the stages after it see the chosen name, so these stay out of their keys
SELECTION_FIELDS = {"candidates", "budget_ms", "budget_stat", "target"}
# the student fields one task's form of the model reads (students/tasks/), with their defaults
FORM_FIELDS = {"head_norm": "group"}


class StudentConfig(Section):
    name: str = Field("mobilevitv2_100", description="a registered student, timm:<name>, or auto: the candidate "
                                                     "expected to be most accurate within student.budget_ms")
    image_size: ImageSizeField = Field(256, description="one side, or [height, width] for 4:3 / 16:9 cameras")
    weights: str = Field("none", description="'none', 'pretrained' (timm tag) or a local checkpoint path")
    gramian: GramianConfig = Field(default_factory=GramianConfig)
    candidates: List[str] = Field(default_factory=list, description="name: auto: the students to choose among "
                                  "(default: every registered MobileViT-V2, FastViT, MobileNetV4, RepViT and "
                                  "EfficientViT size)")
    budget_ms: Optional[float] = Field(None, gt=0, description="name: auto: batch-1 latency budget on the target")
    budget_stat: Literal["p50", "p90"] = Field("p50", description="name: auto: which latency must fit the budget")
    target: str = Field("onnx", description="name: auto: where candidates are timed: an export format timed here "
                        "through its runtime (onnx, openvino, executorch, litert, ...), pytorch (the folded eager "
                        "model), or a device's results.json from `toolchain candidates --bundle` + run_bench.py")
    head_norm: Literal["group", "batch"] = Field(
        "group", description="detection: the FCOS head's normalisation: group (GroupNorm, FCOS's), or batch (a "
                             "BatchNorm per level, folded into the convolutions on export, so an int8 head runs no "
                             "float normalisation between its convolutions)")

    @model_validator(mode="after")
    def _auto_needs_budget(self):
        if self.name == "auto" and self.budget_ms is None:
            raise ValueError("student.name: auto needs student.budget_ms (the batch-1 latency budget in ms on "
                             "student.target), e.g. --set student.budget_ms=5")
        if self.name == "auto" and self.weights not in ("none", "pretrained"):
            raise ValueError(f"student.weights '{self.weights}' is a checkpoint of one architecture; with student.name: "
                             f"auto use 'none' or 'pretrained'")
        if self.name != "auto" and (self.budget_ms is not None or self.candidates):
            raise ValueError(f"student.budget_ms / student.candidates choose a student only with student.name: auto "
                             f"(student.name is '{self.name}')")
        return self

    def arch_dump(self) -> Dict[str, Any]:
        """What decides the student's weights, without the selection fields (see SELECTION_FIELDS); the task form's
        options only where set (the key of every store made before them)."""
        return self.model_dump(mode="json", exclude=SELECTION_FIELDS | (set(FORM_FIELDS) - set(self.form())))

    def form(self) -> Dict[str, Any]:
        """The options of the student's task form this recipe sets (detection: ``head_norm``), for
        ``create_student`` and the task's spec; empty at their defaults."""
        return {k: getattr(self, k) for k, default in FORM_FIELDS.items() if getattr(self, k) != default}


class StudentAugment(Section):
    """Augmentation drawn afresh every time the student sees a view, on top of the view the teacher saw.

    Only photometric ops: they leave every pixel where it was, so the teacher's cached targets (logits,
    features, per-pixel maps) still describe the student's input; a flip or crop would not (a flipped image's
    teacher features are not the flipped features).  RandAugment's colour ops (brightness, colour, contrast,
    sharpness, posterize, solarize, autocontrast, equalize), ``ops`` per image at ``magnitude`` out of 30,
    and random erasing for classification (an occluded image keeps its clean image's target)."""

    ops: int = Field(2, ge=0, le=8, description="photometric RandAugment ops per image (0 = off)")
    magnitude: int = Field(9, ge=0, le=30, description="RandAugment magnitude bin (of 31)")
    erasing: float = Field(0.25, ge=0, le=1, description="classification only: probability of erasing a random "
                                                         "rectangle")


class DistillConfig(TrainConfig):
    mode: Literal["task_oriented", "task_agnostic"] = Field(
        "task_oriented", description="task_oriented: match the finetuned teacher's predictions (KL); "
                                     "task_agnostic: match the frozen pretrained teacher's features")
    features: Literal["global", "patch"] = Field("global", description="task_agnostic: the frozen teacher's global "
                                                 "(CLS / pooled) features, or its patch grid")
    feature_loss: Literal["auto", "contrastive", "cosine", "smooth_l1"] = Field(
        "auto", description="task_agnostic: contrastive (global only, seed 004's choice for global features), or "
                            "regression of the features through a projection with cosine or smooth-L1; auto: "
                            "contrastive for global, cosine for patch (seed 004 sec. 3.1)")
    negatives: int = Field(4096, ge=0, description="contrastive: teacher features of earlier batches kept as further "
                                                   "negatives (a memory; 0 = the batch only)")
    projection: Literal["auto", "student", "both"] = Field(
        "auto", description="global features: linear projections on both models, or on the student only; "
                            "auto: student only for open_clip teachers, both otherwise (seed 004 sec. 3.1)")
    projection_dim: int = Field(256, ge=1, description="contrastive space width when both models are projected")
    teacher_outputs: Literal["cached", "online"] = Field(
        "cached", description="cached: the teacher runs once per (image, seeded view); online: on every "
                              "step, on a fresh augmented view")
    temperature: float = Field(4.0, gt=0)
    views: int = Field(2, ge=1, description="seeded augmented views per transfer image whose teacher outputs are cached")
    labeled_images: bool = Field(False, description="also pass the labeled training images through the teacher "
                                 "and distill on them with the transfer set (their labels stay unused until "
                                 "student.finetune): more of what the task looks like for a small pool")
    teacher_batch_size: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = Field(
        "auto", description="batch of the teacher while its outputs are cached; auto: 64 on the CPU, on CUDA the "
                            "largest that fits the free GPU memory (measured)")
    lr: float = Field(2e-3, gt=0)
    cache_mb: int = Field(2048, ge=0, description="memory for the student-size pixels of the fixed views")
    student_augment: StudentAugment = Field(default_factory=StudentAugment,
                                            description="fresh photometric augmentation of the student's input")
    # detection only (students/detection_distill.py); part of the distill key only for detection builds
    detection_targets: Literal["dense", "both"] = Field(
        "dense", description="detection, task_oriented: dense: the teacher's class probabilities, boxes and quality "
                             "at every location; both: those and its post-NMS boxes above pseudo_threshold, trained "
                             "with the detector's own loss (the sum of the two losses)")
    pseudo_threshold: Optional[float] = Field(None, gt=0, lt=1, description="detection, both: the "
                                              "teacher's score a pseudo box needs; None: the one with the best F1 "
                                              "against the val boxes (IoU 0.5)")

    @model_validator(mode="after")
    def _loss_fits_features(self):
        if self.features == "patch" and self.feature_loss == "contrastive":
            raise ValueError("distill.feature_loss: contrastive applies to global features; patch features are "
                             "regressed (cosine or smooth_l1)")
        return self

    def feature_objective(self) -> Tuple[str, str]:
        """task_agnostic: (objective name, loss) with ``auto`` resolved as seed 004 sec. 3.1 does: global
        features contrastive, patch features cosine."""
        if self.features == "patch":
            return "patch_regression", "cosine" if self.feature_loss == "auto" else self.feature_loss
        if self.feature_loss in ("auto", "contrastive"):
            return "global_contrastive", "contrastive"
        return "global_regression", self.feature_loss


class FinetuneConfig(LabelTrainConfig):
    head_only: bool = Field(False, description="train only the classifier on frozen distilled features "
                                               "(seed 004 Table 1 marks cases where this wins)")
    head_start: Literal["auto", "probe", "keep"] = Field(
        "auto", description="probe: fit the classifier as a linear probe on the frozen distilled features "
                            "before finetuning (a random head would spend the few label steps undoing its "
                            "gradients through the body); keep: start from the distilled head; auto: probe "
                            "when distillation did not train the head (task_agnostic), keep otherwise")
    augment: Augment = Field("light", description="label training (the baseline too). "
                                                                     + _AUGMENT_HELP)
    lr_sweep: Optional[List[float]] = Field(None, description="train once per learning rate from the same start "
                                                              "and keep the best on val (seed 004 A.2); "
                                                              "replaces lr")
    mixup: float = Field(0.0, ge=0, description="mixup alpha for label training (classification; timm's Mixup, "
                                                "targets smoothed by label_smoothing); 0: off")
    cutmix: float = Field(0.0, ge=0, description="cutmix alpha, likewise; with both set each batch uses one of "
                                                 "the two at random")
    mix_off_epochs: int = Field(0, ge=0, description="the last N epochs train on unmixed images (timm's "
                                                     "mixup_off_epoch): the weights kept, and their average, end "
                                                     "fitted to images like the ones they will see; 0: mix to the end")
    # student.finetune only: which weights ship (students/finetune.py, keep_best)
    keep_best: bool = Field(True, description="ship the distilled weights when no finetuned run (no lr_sweep entry) "
                                              "beats them on val; val decides only when it is independent of the "
                                              "transfer set (val_overlap_*); false: always the finetuned")
    val_overlap_distance: float = Field(0.3, gt=0, description="a val image with a transfer image this close (unit "
                                        "embeddings of the retrieval encoder, the leakage guard's measure; 0.3 is "
                                        "cosine similarity 0.955) was half-seen by distillation")
    val_overlap_max: float = Field(0.1, ge=0, le=1, description="above this share of half-seen val images, val is "
                                   "not independent of the transfer set and does not choose between distilled and "
                                   "finetuned weights (the finetuned ship, with a warning)")

    @field_validator("lr_sweep")
    @classmethod
    def _positive(cls, v):
        if v is not None and (not v or any(x <= 0 for x in v)):
            raise ValueError("finetune.lr_sweep needs one or more positive learning rates")
        return v


# what the label-only baseline may set differently from finetune: a network from random weights on a few hundred
# labels overfits long before a distilled one does, so it gets its own schedule and regularisation, and a strong
# label-only reference does not change the distilled finetune (the values: recipes/cifar10_fewshot.yaml)
BASELINE_OVERRIDES = ("epochs", "lr", "batch_size", "augment", "mixup", "cutmix", "mix_off_epochs", "label_smoothing",
                      "ema")


def _overrides(source: type, names: Sequence[str], where: str) -> Dict[str, Any]:
    """Fields of ``source`` as optional overrides (the same type and limits, default None: the source's value),
    declared once where they are defined."""
    out = {}
    for name in names:
        f = source.model_fields[name]
        ann = Annotated[(f.annotation, *f.metadata)] if f.metadata else f.annotation
        out[name] = (Optional[ann], Field(None, description=f"default: {where}.{name}"))
    return out


class _Baseline(Section):
    """The same student trained on the labels only, so the report shows what the teacher bought."""

    enabled: bool = True

    def train_config(self, finetune: "FinetuneConfig") -> "FinetuneConfig":
        """The finetune settings with this section's own where it sets them, all weights trained; ``lr``
        replaces a learning-rate sweep."""
        update = {k: getattr(self, k) for k in BASELINE_OVERRIDES if getattr(self, k) is not None}
        update.update(head_only=False)  # every weight trained on the labels: what the teacher is measured against
        if self.lr is not None:
            update.update(lr=self.lr, lr_sweep=None)
        return finetune.model_copy(update=update)


BaselineConfig = create_model("BaselineConfig", __base__=_Baseline, __module__=__name__,
                              **_overrides(FinetuneConfig, BASELINE_OVERRIDES, "finetune"))


class DetectionExportConfig(Section):
    """What the exported detection graph keeps: the NMS inside it (``DetectorWithNMS``, ONNX ``NonMaxSuppression``)
    runs with these, and the parity check and the artifact's test mAP see the detections they let through."""

    score_thresh: float = Field(0.05, ge=0, lt=1, description="detections scoring at or below this are dropped")
    iou: float = Field(0.6, gt=0, le=1, description="class-aware NMS: a box overlapping a better one of its class "
                                                    "by more than this IoU is suppressed")
    max_det: int = Field(100, ge=1, description="the most detections kept per image (COCO scores 100)")


class QATConfig(TrainConfig):
    """export.models student_qat: quantization-aware training of the folded student against the teacher's cached
    outputs, or the fp32 student's own (students/qat.py).  A few epochs at a small learning rate: the student is
    already trained."""

    target: Literal["teacher", "student"] = Field(
        "student", description="what the fake-quantized student learns to reproduce on the transfer set: the fp32 "
                               "student's own outputs (keeps what finetuning on the labels added), or the finetuned "
                               "teacher's outputs student.distill cached (on Aquarium 0.7-1.7 mAP50 points lower per "
                               "int8 format; docs/results.md)")
    epochs: int = Field(2, ge=0)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(16, ge=1)


class ExportConfig(Section):
    """Which formats, and the checks every artifact passes.  Each format's own settings go under
    ``options.<format>`` and are validated by that format's schema (``toolchain list formats``)."""

    formats: List[str] = Field(default_factory=lambda: ["onnx", "coreml", "tensorrt"])
    options: Dict[str, Dict[str, Any]] = Field(
        default_factory=dict, description="per-format options, e.g. {onnx: {opset: 17}, tensorrt: {precision: "
                                          "int8}}; unknown formats or options are errors")
    models: List[Literal["student", "teacher", "student_qat"]] = Field(
        default_factory=lambda: ["student"], description="student_qat: the student after quantization-aware "
        "training against the teacher (export.qat), exported to the int8 formats beside the plain student")
    qat: QATConfig = Field(default_factory=QATConfig, description="export.models student_qat: its training")
    parity_atol: float = Field(1e-4, gt=0, description="max |pytorch - artifact| on real inputs (fp32)")
    parity_images: int = Field(16, ge=1)
    calibration_images: int = Field(256, ge=1, description="transfer-set images that calibrate int8 artifacts "
                                                           "(fewer than 200 gives a warning)")
    max_accuracy_drop: float = Field(0.02, ge=0, le=1, description="reduced-precision artifacts (fp16, int8) whose "
                                     "test top-1 / mIoU falls further below fp32 are refused")
    detection: DetectionExportConfig = Field(default_factory=DetectionExportConfig,
                                             description="data.task detection: the NMS inside the exported graph")


class BenchConfig(Section):
    runtimes: List[str] = Field(default_factory=lambda: ["auto"],
                                description="runtimes to time; auto: pytorch plus, for every exported artifact, "
                                            "the runtime its format declares (onnxruntime, executorch, litert, ...)")
    batch_sizes: List[int] = Field(default_factory=lambda: [1, 8])
    warmup: int = Field(5, ge=0)
    iters: int = Field(30, ge=1)
    threads: Optional[int] = Field(None, ge=1, description="intra-op threads; None keeps the runtime default")
    memory: bool = Field(True, description="peak memory per artifact and batch, each in a fresh process "
                                           "(a few seconds per artifact)")
    repeats: int = Field(3, ge=1, description="rounds a row is measured at most until it is stable; an unstable "
                                              "row is reported as 'unstable: machine busy' (export/runtimes/measure.py)")
    max_cv: float = Field(0.3, gt=0, description="stable: std/mean of the timed iterations at most this")
    max_tail: float = Field(2.5, gt=1, description="stable: p99/p50 at most this")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: List[int]) -> List[int]:
        if not v or any(b < 1 for b in v):
            raise ValueError("bench.batch_sizes must be a non-empty list of positive integers")
        return v


class StudyConfig(Section):
    """The label-efficiency study (``toolchain study``): every method at every label budget, over seeds,
    in the shape of seed 004 Tables 1-3."""

    budgets: List[int] = Field(default_factory=list, description="labels per class, e.g. [5, 10, 25, 50]; "
                                                                  "segmentation: labeled images, e.g. [10, 20, 40]")
    seeds: List[int] = Field(default_factory=lambda: [0, 1, 2])
    methods: List[Literal["label_only", "imagenet", "task_agnostic", "task_agnostic_contrastive",
                          "task_agnostic_regression", "task_oriented"]] = Field(
        default_factory=lambda: ["label_only", "imagenet", "task_agnostic_contrastive", "task_agnostic_regression",
                                 "task_oriented"])
    imagenet_weights: str = Field("pretrained", description="student weights for the 'imagenet' method: "
                                                            "'pretrained' (timm tag) or a local checkpoint")
    selection: List[Literal["random", "active"]] = Field(
        default_factory=list, description="grow the labels from the first budget to each next one by choosing pool "
        "images at random or with label-next (active), their labels read from study.oracle; empty: every budget is "
        "a subset of data.train")
    oracle: Optional[str] = Field(None, description="the pool's withheld labels, read only to simulate labeling the "
                                  "chosen images: a csv of file,label (classification; file as a path ending of the "
                                  "pool image) or a folder of <image stem>.png masks (segmentation)")

    @field_validator("budgets", "seeds", "methods", "selection")
    @classmethod
    def _unique(cls, v):
        if len(set(v)) != len(v):
            raise ValueError(f"repeated entries in {v}")
        return v


class MlflowTracking(Section):
    """Where a build's MLflow run goes (toolchain/tracking.py, docs/tracking.md)."""

    uri: Optional[str] = Field(None, min_length=1, description="tracking URI: sqlite:///path/mlflow.db, the "
                               "http(s):// address of a tracking server, databricks, ...; None: an SQLite store in "
                               "the build's output folder, sqlite:///<out>/mlflow/mlflow.db")
    experiment: Optional[str] = Field(None, min_length=1, description="experiment name; None: the recipe's name")


class TrackingConfig(Section):
    """Experiment tracking.  Part of no stage's key: turning it on, off or elsewhere reuses every cached stage."""

    mlflow: Optional[MlflowTracking] = Field(None, description="one MLflow run per build (a study: a parent run with "
                                             "a nested run per build); absent: off, unless the build is given "
                                             "--track (or api.build(track=True)), which turns it on with defaults")

    @field_validator("mlflow", mode="before")
    @classmethod
    def _empty_section_is_on(cls, v: Any) -> Any:
        # `mlflow:` with nothing under it reads as null in YAML; whoever wrote the section wants tracking on
        return {} if v is None else v

    @model_serializer(mode="wrap")
    def _off_is_absent(self, handler) -> Dict[str, Any]:
        # off is written as no mlflow key (not null, which reads back as on), so a dumped recipe validates to
        # the same recipe: recipe.resolved.yaml and the study's variants
        data = handler(self)
        if self.mlflow is None:
            data.pop("mlflow", None)
        return data


DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
# where a shipped model runs; each export format declares the targets it serves (export/formats/base.py)
TARGETS = ("cpu", "x86", "android", "ios", "nvidia")
Target = Literal["cpu", "x86", "android", "ios", "nvidia"]


class Recipe(Section):
    name: str = "build"
    seed: int = 0
    device: str = Field("auto", pattern=DEVICE_PATTERN, description="where every network runs (toolchain/devices.py): "
                        "auto (CUDA when present), cpu, cuda, or cuda:N")
    threads: Optional[int] = Field(None, ge=1, description="torch intra-op threads for training")
    target: Optional[Target] = Field(None, description="where the model will run: cpu (any CPU, ONNX Runtime), x86 "
                                     "(ONNX Runtime and OpenVINO), android, ios or nvidia. The report's first screen "
                                     "names the artifact to ship for it; None: one per target exported")
    data: DataConfig
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    curate: CurateConfig = Field(default_factory=CurateConfig)
    student: StudentConfig = Field(default_factory=StudentConfig)
    distill: DistillConfig = Field(default_factory=lambda: DistillConfig(epochs=10))
    finetune: FinetuneConfig = Field(default_factory=lambda: FinetuneConfig(epochs=10, lr=5e-4))
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    study: StudyConfig = Field(default_factory=StudyConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def checkpoint_files(self) -> List[str]:
        """The local checkpoint files the recipe names: their bytes are part of the key of every stage whose config
        names them (toolchain/runner.py).  Library tags are keyed by name, ``package:`` weights by the installed
        package's pinned version."""
        return [w for w in (self.teacher.weights, self.student.weights, self.curate.encoder_weights)
                if w not in ("pretrained", "none") and not w.startswith("package:")]

    @model_validator(mode="after")
    def _fields_of_other_tasks(self) -> "Recipe":
        """A field only another task reads (curate.object_share: detection's object crops), set on this task's
        recipe, would be ignored without a word: refused, naming the task that reads it."""
        task = task_of(self.data.task)
        for section in ("curate", "student", "distill", "export"):
            changed = getattr(self, section).changed_from_default(task.foreign(section), section)
            if changed:
                owners = sorted({t for t in TASKS.list() for f in changed if f in TASKS.get(t).owns})
                them = "it" if len(changed) == 1 else "them"
                raise ValueError(f"{', '.join(changed)}: {' / '.join(owners)} only; data.task {task.name} does not "
                                 f"read {them}: remove {them}, or set data.task: {owners[0]}")
        return self

    @model_validator(mode="after")
    def _task_rules(self) -> "Recipe":
        """The task's own rules on the recipe (its input sizes), said at load (toolchain/tasks/)."""
        task_of(self.data.task).validate(self)
        return self

    @model_validator(mode="after")
    def _label_smoothing(self) -> "Recipe":
        """A detector's loss (focal, GIoU, quality) has no cross-entropy to smooth: said at load, not ignored."""
        if "label_smoothing" in task_of(self.data.task).supports:
            return self
        for section in ("teacher", "finetune", "baseline"):
            if getattr(self, section).label_smoothing:
                raise ValueError(f"{section}.label_smoothing smooths a cross-entropy, which data.task "
                                 f"{self.data.task}'s loss does not have: remove it")
        return self

    @model_validator(mode="after")
    def _label_mixing(self) -> "Recipe":
        """mixup/cutmix blend the labels of whole images through the plain cross-entropy: said at load, not
        when the finetune stage starts after hours of distillation."""
        for field in ("finetune.mixup", "finetune.cutmix", "baseline.mixup", "baseline.cutmix"):
            section, name = field.split(".")
            if not getattr(getattr(self, section), name):  # 0 or unset: off
                continue
            if "label_mixing" not in task_of(self.data.task).supports:
                raise ValueError(f"{field} blends the labels of whole images: classification only; set it to 0 "
                                 f"for {self.data.task}")
            if self.student.gramian.heads:
                raise ValueError(f"{field} needs the plain cross-entropy; it cannot combine with student.gramian "
                                 f"heads (set student.gramian.heads: 0 or {field}: 0)")
        return self

    @model_validator(mode="after")
    def _mix_off_within_epochs(self) -> "Recipe":
        """Mixing switched off for every epoch is a recipe that never mixes: said, not trained."""
        for section, cfg in (("finetune", self.finetune), ("baseline", self.baseline.train_config(self.finetune))):
            off, epochs = cfg.mix_off_epochs, cfg.epochs
            if (cfg.mixup or cfg.cutmix) and off and off >= epochs:
                raise ValueError(f"{section}.mix_off_epochs {off} leaves none of its {epochs} epochs mixed; set it "
                                 f"below {epochs} (e.g. {max(1, epochs // 10)}), or set mixup and cutmix to 0")
        return self


# ---------------------------------------------------------------------------------------------------
# loading, overrides, and turning pydantic's errors into ones that suggest the fix


def _section_type(ann: Any) -> Optional[type]:
    """The section class a field holds, also when the section is optional (``tracking.mlflow``); None for a
    value."""
    if get_origin(ann) is Union:
        inner = [a for a in get_args(ann) if a is not type(None)]
        ann = inner[0] if len(inner) == 1 else None
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _section_at(model: type, path: Sequence[Any]) -> type:
    cls = model
    for part in path:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            break
        section = _section_type(field.annotation)
        if section is None:
            break
        cls = section
    return cls


def _fields_at(model: type, path: Sequence[Any]) -> List[str]:
    """The valid field names of the section that ``path`` points into."""
    return list(getattr(_section_at(model, path), "model_fields", {}))


def _explain(err: ValidationError, source: str) -> ToolchainError:
    lines = []
    for e in err.errors():
        loc = [p for p in e["loc"] if not isinstance(p, int)]
        dotted = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            valid = _fields_at(Recipe, loc[:-1])
            lines.append(
                f"unknown key '{dotted}'.{did_you_mean(str(loc[-1]), valid)} "
                f"Valid keys here: {', '.join(valid)}."
            )
        elif not dotted:  # a check across sections: its message names the fields; the input is the whole recipe
            lines.append(e["msg"].removeprefix("Value error, "))
        else:
            lines.append(f"'{dotted}': {e['msg']} (got {e.get('input')!r})")
    return ToolchainError(f"invalid recipe {source}:\n  " + "\n  ".join(lines))


def validate_options(cls: type, data: Dict[str, Any], where: str) -> Any:
    """Validate ``data`` against a registered thing's own config class, with errors that suggest the fix."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        valid = list(cls.model_fields)
        lines = []
        for e in err.errors():
            key = ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                lines.append(f"unknown key '{where}.{key}'.{did_you_mean(key, valid)} Valid keys: {', '.join(valid)}.")
            else:
                lines.append(f"'{where}.{key}': {e['msg']} (got {e.get('input')!r})")
        raise ToolchainError("\n  ".join(lines)) from None


def parse_overrides(items: Sequence[str]) -> List[tuple]:
    """``--set KEY=VALUE`` items as (key, value), each value read as YAML.

    Raises:
        ToolchainError: an item without ``=``, a value that is not YAML or repeats a key, or a key given twice
            (also as a section and a key inside it: ``teacher={lr: 1}`` and ``teacher.lr=2``).
    """
    out = []
    for item in items:
        if "=" not in item:
            raise ToolchainError(f"--set expects KEY=VALUE (e.g. student.name=fastvit_s12), got '{item}'")
        key, raw = item.split("=", 1)
        try:
            value = load_yaml(raw, f"--set {item}") if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ToolchainError(f"--set {item}: the value is not valid YAML ({problem}). Quote the whole option "
                                 f"and close brackets, e.g. --set \"export.formats=[onnx, coreml]\"") from None
        out.append((key.strip(), value))
    for i, (a, _) in enumerate(out):
        for j in range(i + 1, len(out)):
            b = out[j][0]
            if a == b or b.startswith(a + ".") or a.startswith(b + "."):
                what = f"{a} twice" if a == b else f"{min(a, b, key=len)} and {max(a, b, key=len)}, a key inside it"
                raise ToolchainError(f"--set gives {what} (--set {items[i]} is option {i + 1}, --set {items[j]} "
                                     f"option {j + 1}); only the last would count: give each key once")
    return out


def _check_override_key(key: str, parts: Sequence[str]) -> None:
    """The dotted ``key`` walks recipe fields until it reaches a value, or a free mapping whose keys belong to
    a registered thing that validates them itself: ``export.options.<format>.<option>`` (the format's schema)
    and ``teacher.adapter.<option>`` (the adapter's).  Below such a mapping ``--set`` writes exactly what the
    dict form writes, so both forms meet the same check with the same message.

    Raises:
        ToolchainError: a part that is no field of its section, or a part below a plain value.
    """
    cls: Any = Recipe
    for i, part in enumerate(parts):
        fields = cls.model_fields
        if part not in fields:
            if cls.model_config.get("extra") == "allow":  # a registered thing's own options (teacher.adapter)
                return
            valid = list(fields)
            raise ToolchainError(f"--set {key}: unknown key '{'.'.join(parts[: i + 1])}'.{did_you_mean(part, valid)} "
                                 f"Valid keys here: {', '.join(valid)}.")
        ann = fields[part].annotation
        if _section_type(ann) is not None:
            cls = _section_type(ann)
        elif get_origin(ann) is dict:  # keys are registered names (export formats), checked by their owner
            return
        elif i < len(parts) - 1:
            here = ".".join(parts[: i + 1])
            raise ToolchainError(f"--set {key}: '{here}' is a single value, not a section with keys; set it as "
                                 f"--set {here}=VALUE")


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[tuple]) -> Dict[str, Any]:
    raw = copy.deepcopy(raw)
    for key, value in overrides:
        parts = key.split(".")
        _check_override_key(key, parts)
        node = raw
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):  # absent, or empty in the file (``onnx_int8:``)
                nxt = {}
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return raw


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override and validate a recipe.  Relative data paths are resolved against the recipe's folder.

    Raises:
        ToolchainError: the file is missing or not YAML, a key is unknown, or a value is out of range.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
        if not found:
            raise ToolchainError(f"recipe '{path}' is a folder with no .yaml file in it; a recipe is one YAML "
                                 f"file: give its path (e.g. recipes/quickstart.yaml)")
        shown = ", ".join(found[:10]) + (f", ... ({len(found)} in all)" if len(found) > 10 else "")
        raise ToolchainError(f"recipe '{path}' is a folder; a recipe is one YAML file: give its path, e.g. "
                             f"'{path / found[0]}' (the .yaml files in it: {shown})")
    if not path.is_file():
        raise ToolchainError(f"recipe '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # an image, an archive, a checkpoint given as the recipe
        raise ToolchainError(f"recipe '{path}' is not a text YAML file (byte {exc.start} is not UTF-8 text: "
                             f"{path.stat().st_size} bytes starting {_head(path)}); give the recipe's .yaml "
                             f"file") from None
    try:
        raw = load_yaml(text, f"recipe '{path}'") or {}
    except yaml.YAMLError as exc:
        raise ToolchainError(f"recipe '{path}' is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ToolchainError(f"recipe '{path}' must be a mapping of sections (data, teacher, student, ...)")
    raw = apply_overrides(raw, parse_overrides(overrides))
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as err:
        raise _explain(err, f"'{path}'") from None
    return _resolve_paths(recipe, path.parent)


def recipe_from_dict(raw: Dict[str, Any], base_dir: Path | None = None) -> Recipe:
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as err:
        raise _explain(err, "(mapping)") from None
    return _resolve_paths(recipe, base_dir or Path.cwd())


def _resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    def fix(p: Optional[str]) -> Optional[str]:
        if p is None:
            return None
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())

    d = recipe.data
    d.train, d.val, d.test = fix(d.train), fix(d.val), fix(d.test)
    d.pools = [fix(p) for p in d.pools]
    d.roots = [fix(p) for p in d.roots]
    recipe.study.oracle = fix(recipe.study.oracle)
    for section, field in ((recipe.teacher, "weights"), (recipe.student, "weights"),
                           (recipe.curate, "encoder_weights")):
        w = getattr(section, field)
        if w not in ("pretrained", "none") and not w.startswith("package:"):
            setattr(section, field, fix(w))
    return recipe


def _head(path: Path) -> str:
    """The first bytes of a file, as Python writes bytes: a PNG or zip header says what the file is."""
    with open(path, "rb") as fh:
        return repr(fh.read(8))


def recipe_to_dict(recipe: Recipe) -> Dict[str, Any]:
    return recipe.model_dump(mode="json")
