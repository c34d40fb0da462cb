"""A teacher ensemble (``teacher.ensemble``): several finetuned teachers whose outputs are averaged.

The student learns what its teacher outputs, so a better teacher is the surest way to a better student, and
averaging teachers that differ in what they were shown (another augmentation, another seed) is the cheapest better
teacher there is: it is paid for once, while the teacher trains and while it teaches, never at deployment.  On the
Aquarium detection set the mean of a light- and a strong-augmentation MobileNetV2 teacher scored test mAP50 34.3%
against 31.8% for the better one alone (35.5% flip-averaged, against 32.1%; docs/results.md has the command).

Every member is the recipe's teacher section with a few keys changed (:class:`~vfm_toolchain.recipe.TeacherMember`):
the same backbone at the same input size, so one preprocessed image feeds them all and their outputs line up
location for location.  What is averaged, per output, is what :mod:`~vfm_toolchain.students.teacher_flip` averages:
logits as logits (class, per-pixel, a detector's class and quality maps) and a detector's box distances in pixels.
A mean of logits is the normalised geometric mean of the members' probabilities: a class the members agree on
stays sharp.

The ensemble is one saved model (``family: teacher_ensemble``: the members' specs and one weights file), so
distillation, pseudo-labels and label-next read it as they read one teacher.  What is not an average is taken from
the first member (the recipe's own teacher): its backbone (preprocessing, the embeddings of ``curate.encoder:
teacher``) and a detector's decoding, which depends only on the strides the members share.  An ensemble is not
exported (``export.models: teacher`` refuses it): it would ship k networks where the student is the one to ship.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

import torch
from torch import nn

from vfm_toolchain.checkpoint import MODEL_FAMILIES
from vfm_toolchain.errors import ToolchainError

__all__ = ["TeacherEnsemble", "ensemble_spec", "mean_output", "teacher_members"]

Output = Union[torch.Tensor, Dict[str, List[torch.Tensor]]]


def mean_output(outputs: Sequence[Output]) -> Output:
    """The mean of several models' outputs: tensors, or a detector's levels (a dict of lists of tensors)."""
    k = len(outputs)
    if isinstance(outputs[0], dict):
        return {key: [sum(maps) / k for maps in zip(*(o[key] for o in outputs))] for key in outputs[0]}
    return sum(outputs) / k


# Outputs averaged over the members, and what is read from the first member (functions of outputs the members
# shape alike, or facts they share); each exists on the ensemble only when its members have it, so code that asks
# ``getattr(teacher, "forward_logits", teacher)`` of a classifier ensemble gets the classifier's answer.
AVERAGED = ("forward_logits", "forward_levels")
FROM_FIRST = ("dense_rows", "decode", "boxes_and_scores", "strides", "dense_output")


class TeacherEnsemble(nn.Module):
    """Members of one architecture whose every output is averaged (module docstring): ``forward`` (logits, a
    segmentation map, or a detector's levels) and, where the members have them, ``forward_logits`` (a
    segmentation teacher's logits at its stride), ``forward_levels`` and ``forward_dense`` (a detector's); the
    members' ``decode``, ``dense_rows`` and ``strides`` are the first member's."""

    def __init__(self, members: Sequence[nn.Module]):
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"an ensemble needs two members or more, got {len(members)}")
        self.members = nn.ModuleList(members)

    @property
    def backbone(self) -> nn.Module:
        """The first member's backbone: its preprocessing is every member's (they share name and input size)."""
        return self.members[0].backbone

    def forward(self, x: torch.Tensor) -> Output:
        return mean_output([m(x) for m in self.members])

    def __getattr__(self, name: str):
        members = self.__dict__.get("_modules", {}).get("members")  # absent until __init__ has run
        first = members[0] if members else None
        if name in AVERAGED and hasattr(first, name):
            return lambda x: mean_output([getattr(m, name)(x) for m in members])
        if name == "forward_dense" and hasattr(first, "forward_levels"):
            return lambda x: first.dense_rows(self.forward_levels(x))
        if name in FROM_FIRST and hasattr(first, name):
            return getattr(first, name)
        return super().__getattr__(name)


def ensemble_spec(member_specs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The saved ensemble's spec: the members' own specs, and the first member's preprocessing, classes and task
    at the top, where readers of one teacher's spec look for them."""
    first = member_specs[0]
    return {"family": "teacher_ensemble", "members": list(member_specs),
            **{k: first[k] for k in ("preprocess", "classes", "num_classes", "image_size", "name") if k in first}}


@MODEL_FAMILIES.register("teacher_ensemble")
def build_ensemble_from_spec(spec: Dict[str, Any]) -> TeacherEnsemble:
    return TeacherEnsemble([MODEL_FAMILIES.get(s["family"])(s) for s in spec["members"]])


def teacher_members(recipe) -> List[Any]:
    """One recipe per member: the first is the recipe itself (its teacher, its seed), the others its teacher
    section with each ``teacher.ensemble`` entry's keys changed, at the recipe's seed + the entry's ``seed_offset``
    (default: the member's number).  Every member's ``teacher.ensemble`` is empty, so a member is exactly the teacher a
    recipe of its own would train.

    Raises:
        ToolchainError: two members that would train the same model.
    """
    t = recipe.teacher
    base = recipe.model_copy(update={"teacher": t.model_copy(update={"ensemble": []})})
    members = [base]
    for i, entry in enumerate(t.ensemble, 1):
        changes = entry.changes()
        seed = recipe.seed + changes.pop("seed_offset", i)
        teacher = t.model_copy(update={**changes, "ensemble": []})
        members.append(recipe.model_copy(update={"teacher": teacher, "seed": seed}))
    seen: Dict[str, int] = {}
    for i, m in enumerate(members):
        key = m.teacher.model_dump_json() + f"/{m.seed}"
        if key in seen:
            what = "the recipe's teacher" if seen[key] == 0 else f"teacher.ensemble[{seen[key] - 1}]"
            raise ToolchainError(f"teacher.ensemble[{i - 1}] would train the same teacher as {what} (same keys, seed "
                                 f"{m.seed}); change what it is shown (augment), a training key or its seed_offset")
        seen[key] = i
    return members


def check_ensemble(recipe) -> None:
    """Before the first stage: each member's adapter, members that would be the same model, and the two uses an
    ensemble has no meaning for.

    Raises:
        ToolchainError: naming the entry or the key, and what to do instead.
    """
    from vfm_toolchain.teachers import adapters

    if not recipe.teacher.ensemble:
        return
    for i, entry in enumerate(recipe.teacher.ensemble):
        if entry.adapter is not None:
            try:
                adapters.ADAPTERS.check(entry.adapter.name)
                adapters.adapter_options(entry.adapter)
            except ToolchainError as exc:
                raise ToolchainError(f"teacher.ensemble[{i}].adapter: {exc}") from None
    teacher_members(recipe)
    if "teacher" in recipe.export.models:
        raise ToolchainError("export.models teacher: teacher.ensemble makes the teacher "
                             f"{1 + len(recipe.teacher.ensemble)} networks averaged, which teach the student but are "
                             "not a model to ship; export the student, or drop teacher.ensemble to export one teacher")
    if recipe.data.task == "detection" and recipe.distill.mode == "task_agnostic":
        raise ToolchainError("distill.mode task_agnostic imitates one teacher's neck features, and the features of "
                             "several teachers do not average into one teacher's; use distill.mode task_oriented "
                             "with teacher.ensemble, or drop teacher.ensemble")
