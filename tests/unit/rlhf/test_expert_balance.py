"""EDPB planning: the prediction, the greedy placement and the migrate-or-keep rule, as properties."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.expert_balance import (coefficient_of_variation, greedy_placement, plan, plan_layer, predict,
                                 rank_loads, relabel)
from rlhf.layout import default_expert_map


def test_prediction_is_an_exponential_moving_average():
    p = predict(None, [[10, 0], [4, 4]])
    assert p == [[10.0, 0.0], [4.0, 4.0]]
    p = predict(p, [[0, 10], [4, 4]], theta=0.9)
    assert [x for row in p for x in row] == pytest.approx([9.0, 1.0, 4.0, 4.0])
    with pytest.raises(ValueError, match="theta=1"):
        predict(p, p, theta=1)
    with pytest.raises(ValueError, match="shape differs"):
        predict(p, [[1, 2, 3], [1, 2, 3]])


def test_a_skewed_layer_migrates_a_balanced_one_stays():
    # 8 experts on 2 ranks; experts 0-3 (rank 0 today) take most tokens
    skewed = [40, 30, 20, 10, 1, 1, 1, 1]
    current = default_expert_map(8, 2)
    p = plan_layer(0, skewed, current, ep=2)
    assert p.migrate and p.cv_after < p.cv_before - 0.08
    assert rank_loads(skewed, p.new_map, 2) == [52.0, 52.0]
    assert sorted(p.new_map).count(0) == 4
    assert len(p.moved) == 4  # two experts each way: the relabelling keeps the rest in place
    flat = plan_layer(1, [5] * 8, current, ep=2)
    assert not flat.migrate and flat.new_map == current and flat.moved == ()
    bp = plan([skewed, [5] * 8], [current, current], ep=2)
    assert bp.maps == (p.new_map, current) and bp.experts_moved == 4
    m = bp.metrics()
    assert m["expert_balance/layers_migrated"] == 1 and m["expert_balance/layer1_cv_after"] == 0.0
    assert "MoE layer 0" in bp.describe() and "migrate 4 experts" in bp.describe()


loads_st = st.integers(1, 4).flatmap(lambda ep: st.tuples(
    st.just(ep), st.integers(1, 4).flatmap(lambda per: st.lists(st.floats(0, 1e4), min_size=ep * per,
                                                                 max_size=ep * per))))


@settings(max_examples=200, deadline=None)
@given(loads_st, st.randoms(use_true_random=False), st.floats(0, 0.5))
def test_planner_properties(ep_loads, rnd, min_drop):
    ep, load = ep_loads
    E = len(load)
    current = list(default_expert_map(E, ep))
    rnd.shuffle(current)
    current = tuple(current)
    p = plan_layer(0, load, current, ep, min_drop)
    for m in (p.proposed, p.new_map):
        assert all(m.count(r) == E // ep for r in range(ep))  # never exceeds a rank's slots
    cv = coefficient_of_variation
    assert cv(rank_loads(load, p.new_map, ep)) <= cv(rank_loads(load, current, ep)) + 1e-12  # never worse
    assert p.migrate == (p.cv_before - p.cv_after >= min_drop)
    assert plan_layer(0, load, current, ep, min_drop) == p  # deterministic
    # relabelling changes labels only: the same experts share a rank
    g = greedy_placement(load, ep)
    assert {frozenset(e for e in range(E) if g[e] == r) for r in range(ep)} == \
        {frozenset(e for e in range(E) if p.proposed[e] == r) for r in range(ep)}
    assert relabel(current, current, ep) == current
