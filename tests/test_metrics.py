import numpy as np
import pytest

from vfm_toolchain.teachers.metrics import retrieval_metrics


def test_map_at_r_and_r_precision_on_a_hand_example():
    # 1-D points without distance ties; class a at 0, 0.9, 5; class b at 2.2, 3
    y = np.array(["a", "a", "a", "b", "b"])
    x = np.array([[0.0], [0.9], [5.0], [2.2], [3.0]])
    # q0: 1(a) 0.9, 3(b) 2.2 -> [1,0]: MAP 0.5, RP 0.5
    # q1: 0(a) 0.9, 3(b) 1.3 -> [1,0]: MAP 0.5, RP 0.5
    # q2: 4(b) 2.0, 3(b) 2.8 -> [0,0]: 0, 0
    # q3: 4(b) 0.8 -> [1]: 1, 1
    # q4: 3(b) 0.8 -> [1]: 1, 1
    m = retrieval_metrics(x, y)
    assert m["map_at_r"] == pytest.approx((0.5 + 0.5 + 0 + 1 + 1) / 5)
    assert m["r_precision"] == pytest.approx((0.5 + 0.5 + 0 + 1 + 1) / 5)


def test_map_at_r_rewards_order_where_r_precision_does_not():
    x = np.array([[0.0], [1.0], [1.7], [2.5], [9.0]])
    y = np.array(["a", "b", "a", "a", "b"])
    # q0 (a, R=2): 1(b) 1.0, 2(a) 1.7 -> rel [0,1]: MAP 0.25, RP 0.5
    # q1 (b, R=1): 2(a) 0.7 -> 0, 0
    # q2 (a, R=2): 1(b) 0.7, 3(a) 0.8 -> [0,1]: MAP 0.25, RP 0.5
    # q3 (a, R=2): 2(a) 0.8, 1(b) 1.5 -> [1,0]: MAP 0.5, RP 0.5  (same RP as q0, twice the MAP@R)
    # q4 (b, R=1): 3(a) 6.5 -> 0, 0
    m = retrieval_metrics(x, y)
    assert m["map_at_r"] == pytest.approx((0.25 + 0 + 0.25 + 0.5 + 0) / 5)
    assert m["r_precision"] == pytest.approx((0.5 + 0 + 0.5 + 0.5 + 0) / 5)
    assert m["queries"] == 5


def test_classes_with_a_single_item_are_skipped():
    m = retrieval_metrics(np.array([[0.0], [1.0], [10.0]]), np.array(["a", "b", "a"]))
    assert m == {"map_at_r": 0.0, "r_precision": 0.0, "queries": 2}
