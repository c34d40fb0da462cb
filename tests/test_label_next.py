"""label-next's score and choice on hand-made pools (students/label_next.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vfm_toolchain.students.label_next import (choose, classification_parts, detection_parts, segmentation_parts,
                                               typicality)
from vfm_toolchain.students.tasks import student_task
from vfm_toolchain.teachers.vectors import PoolVectors


def _unit(*rows):
    x = np.asarray(rows, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _pool(*rows):
    """Pool embeddings as label-next reads them from the curation's shards."""
    return PoolVectors.from_array(_unit(*rows))


def test_the_teachers_uncertainty_and_the_students_disagreement_on_hand_made_probabilities():
    teacher = torch.tensor([[0.98, 0.01, 0.01], [0.4, 0.4, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    student = torch.tensor([[0.98, 0.01, 0.01], [0.4, 0.4, 0.2], [1.0, 0.0, 0.0]])
    u, d, pred = classification_parts(teacher, student, "margin")
    np.testing.assert_allclose(u, [1 - 0.97, 1.0, 1.0], atol=1e-6)
    assert d[0] == pytest.approx(0, abs=1e-6) and d[1] == pytest.approx(0, abs=1e-6) and 0.3 < d[2] < 1
    assert pred.tolist() == [0, 0, 0]
    u, _, _ = classification_parts(teacher, student, "entropy")
    assert u[0] < 0.2 < u[1] < u[2] == pytest.approx(1, abs=1e-6)
    one_hot = torch.eye(2)
    assert classification_parts(one_hot, one_hot.flip(0))[1] == pytest.approx([1, 1], abs=1e-6)  # JS base 2: at most 1


def test_segmentation_averages_over_pixels_and_predicts_the_teachers_largest_class():
    teacher = torch.zeros(1, 3, 4, 4)
    teacher[0, 2] = 1.0  # certain: class 2 everywhere ...
    teacher[0, :, :1] = torch.tensor([0.5, 0.5, 0.0])[:, None, None]  # ... but a row of coin flips
    student = torch.nn.functional.interpolate(teacher, size=(2, 2), mode="bilinear")  # another resolution
    u, d, pred = segmentation_parts(teacher, student)
    assert u[0] == pytest.approx(0.25, abs=1e-6) and pred.tolist() == [2] and 0 <= d[0] < 0.3


def test_detection_uncertainty_is_the_most_ambiguous_box_and_disagreement_is_one_minus_f1():
    box = lambda *b: torch.tensor([b], dtype=torch.float32)
    det = lambda boxes, scores, labels: {"boxes": boxes, "scores": torch.tensor(scores), "labels": torch.tensor(labels)}
    teacher = [det(torch.cat([box(0, 0, 10, 10), box(20, 20, 30, 30)]), [0.9, 0.5], [1, 2]),
               det(box(0, 0, 10, 10), [0.95], [1]), det(torch.zeros(0, 4), [], [])]
    student = [det(box(0, 0, 10, 10), [0.8], [1]),              # finds one of the teacher's two
               det(box(0, 0, 10, 10), [0.9], [0]),              # the right box, the wrong class
               det(torch.zeros(0, 4), [], [])]                  # both see nothing
    u, d, pred = detection_parts(teacher, student, box_threshold=0.3)
    assert u[0] == pytest.approx(1, abs=1e-4) and u[1] < 0.3 and u[2] == 0
    np.testing.assert_allclose(d, [1 - 2 * 1 / 3, 1.0, 0.0], atol=1e-6)
    assert pred.tolist() == [1, 1, -1]


def test_an_uncertain_image_is_chosen_before_a_certain_one_and_a_duplicate_never():
    """Four pool images: an uncertain one, its near-copy, a certain one, one near a labeled image."""
    emb = _pool([1, 0, 0], [1, 0.01, 0], [0, 1, 0], [0, 0, 1])
    labeled = _unit([0, 0.001, 1])
    value = np.array([0.9, 0.9, 0.2, 0.95])
    out = choose(value, np.zeros(4, dtype=np.int64), emb, labeled, n=3)
    assert out["rank"].tolist() == [1, 0, 2, 0]  # only two could be chosen: the rest are near-duplicates
    assert out["status"].tolist() == ["chosen", "near-duplicate", "chosen", "near-duplicate"]
    assert out["diversity"][0] == pytest.approx(np.linalg.norm(emb.take([0])[0] - labeled[0]) / 2, abs=1e-5)


def test_the_choice_is_balanced_over_predicted_classes_and_prefers_far_images():
    """Class 0 has the three best scores, class 1 two weaker ones: picks alternate between the classes; inside a
    class an image next to one already chosen loses to a farther one of slightly lower value."""
    emb = _pool([1, 0, 0, 0], [0.95, 0.3, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1], [0, 1, 0, 0])
    value = np.array([0.9, 0.88, 0.8, 0.5, 0.4])
    pred = np.array([0, 0, 0, 1, 1])
    out = choose(value, pred, emb, None, n=4, dedup_distance=0.01)
    assert out["rank"].tolist() == [1, 0, 3, 2, 4]
    assert choose(value, pred, emb, None, n=2, candidates=1)["rank"].tolist() == [1, 2, 0, 0, 0]  # 1 x 2 compete


def test_the_classes_an_image_shows_are_the_teachers_by_task():
    probs = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.2, 0.3]])
    classes_seen = lambda task, out, n, min_share=0.02, box_threshold=0.3: student_task(task).classes_seen(
        out, n, box_threshold, min_share)
    assert classes_seen("classification", probs, 3).tolist() == [[False, True, False], [True, False, False]]
    seg = torch.zeros(1, 3, 10, 10)
    seg[0, 0] = 1.0
    seg[0, 1, :1, :3] = 2.0  # 3 of 100 pixels: class 1 counts at a 2% share, not at 5%
    assert classes_seen("segmentation", seg, 3).tolist() == [[True, True, False]]
    assert classes_seen("segmentation", seg, 3, min_share=0.05).tolist() == [[True, False, False]]
    det = [{"boxes": torch.zeros(3, 4), "scores": torch.tensor([0.9, 0.2, 0.4]), "labels": torch.tensor([2, 0, 2])},
           {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.long)}]
    assert classes_seen("detection", det, 3, box_threshold=0.3).tolist() == [[False, False, True], [False] * 3]


def test_the_choice_goes_first_to_the_class_the_labeled_images_show_least_even_when_it_is_no_images_largest():
    """Scenes: every pool image shows class 0; two also show class 2, which is never an image's largest.  The
    labeled set shows class 0 and 1 often and class 2 once: the first pick is the best image showing class 2, then
    the other; balancing over the largest class alone picks by value only."""
    emb = _pool([1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1])
    value = np.array([0.9, 0.8, 0.5, 0.4])
    pred = np.zeros(4, dtype=np.int64)
    seen = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 1]], dtype=bool)
    have = np.array([10, 6, 1])
    assert choose(value, pred, emb, None, n=2, seen=seen, have=have)["rank"].tolist() == [0, 0, 1, 2]
    assert choose(value, pred, emb, None, n=2)["rank"].tolist() == [1, 2, 0, 0]
    # class 1 (6 labeled) is shown less than class 0 (10): after the two class-2 images, the class-1 one
    assert choose(value, pred, emb, None, n=3, seen=seen, have=have)["rank"].tolist() == [0, 3, 1, 2]
    # an image the teacher sees nothing in takes turns with the rarest class (here first: a tie, and its value is
    # the larger), not ahead of it; an unreadable image (value -inf) is never chosen, though it is a candidate of a
    # pool this small
    seen[1] = False
    assert choose(value, pred, emb, None, n=2, seen=seen, have=have)["rank"].tolist() == [0, 1, 2, 0]
    value[2] = -np.inf
    assert choose(value, pred, emb, None, n=4, seen=seen, have=have)["rank"].tolist() == [3, 1, 0, 2]


def test_typicality_ranks_an_image_in_a_crowd_above_an_outlier_and_never_counts_an_image_as_its_own_neighbour():
    """Five images around one point, one far away: the outlier is the sparsest (0), the crowd's centre the densest
    (1).  An image is not its own neighbour: with k = 1 two exact copies are as dense as can be, a lone image is
    not.  Against a random reference smaller than the pool, the order of the crowd and the outlier holds."""
    rng = np.random.default_rng(0)
    centre = np.zeros(8, dtype=np.float32)
    centre[0] = 1
    crowd = [centre] + [centre + 0.05 * rng.standard_normal(8).astype(np.float32) for _ in range(4)]
    far = np.zeros(8, dtype=np.float32)
    far[1] = 1
    emb = _pool(*crowd, far)
    t = typicality(emb, k=2)
    assert t[5] == 0 and t[0] == 1 and np.all((t >= 0) & (t <= 1))
    copies = _pool([1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0.8, 0.6])
    t = typicality(copies, k=1)
    assert t[0] > t[2] and t[1] > t[2] and t[0] >= 2 / 3
    big = _pool(*(crowd * 20), far)
    t = typicality(big, k=3, reference=30, seed=1)
    assert t[-1] == 0 and t[:-1].min() > 0


def test_a_min_share_outside_0_to_1_is_refused_before_anything_is_built(tmp_path):
    from vfm_toolchain.core.errors import ToolchainError
    from vfm_toolchain.students.label_next import label_next

    for bad in (0.0, 1.5):
        with pytest.raises(ToolchainError, match=r"--min-share .* is in \(0, 1\]"):
            label_next(None, 5, tmp_path, tmp_path, min_share=bad)  # no recipe is read: refused first
    assert not any(tmp_path.iterdir())
