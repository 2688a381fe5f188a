import pytest

from rlhf.sharding.layout import Coords, Layout


@pytest.mark.parametrize("layout", [Layout(), Layout(pp=2, dp=2, tp=2), Layout(pp=3, dp=2, tp=4, ep=8),
                                    Layout(pp=12, dp=4, tp=8, ep=4, experts_over_tp_ep=True)], ids=str)
def test_rank_coordinates_round_trip_and_groups_partition(layout):
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(c.pp, c.dp, c.tp) == r
        for axis in ("pp", "dp", "tp"):
            assert r in layout.group(r, axis)
        assert r in layout.ep_group(r) and r in layout.expert_replica_group(r)
    for axis in ("pp", "dp", "tp", "ep", "expert_replica", "stage"):
        groups = layout.groups(axis)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size)), axis


def test_table():
    l = Layout(pp=2, dp=2, tp=2, ep=2)
    assert l.world_size == 8
    assert l.coords(5) == Coords(pp=1, dp=0, tp=1)
    assert l.group(5, "tp") == (4, 5) and l.group(5, "dp") == (5, 7) and l.group(5, "pp") == (1, 5)
    assert l.ep_group(5) == (4, 5) and l.expert_replica_group(5) == (5, 7)
    big = Layout(pp=12, dp=4, tp=8, ep=4, experts_over_tp_ep=True)
    assert big.world_size == 384 and big.expert_shards == 32 and big.ep_group(40) == tuple(range(32, 64))
    assert big.experts(40, 256) == tuple(range(64, 72))


def test_clashes_say_which_degrees():
    with pytest.raises(ValueError, match=r"ep = 3 = 3 ranks per expert group must divide the dp \* tp = 2 \* 1"):
        Layout(dp=2, ep=3)
    with pytest.raises(ValueError, match="ep \\* tp = 4 \\* 8 = 32"):
        Layout(pp=16, dp=3, tp=8, ep=4, experts_over_tp_ep=True)
    with pytest.raises(ValueError, match=">= 1"):
        Layout(tp=0)


def test_uneven_pipeline_split():
    l = Layout(pp=3)
    assert l.stage_layers(7) == (range(0, 3), range(3, 5), range(5, 7))
    assert l.stage_layers(7, [1, 4, 2]) == (range(0, 1), range(1, 5), range(5, 7))
    with pytest.raises(ValueError, match="3 stages"):
        l.stage_layers(7, [3, 4])


def test_expert_maps():
    l = Layout(dp=2, ep=2)
    assert l.experts(1, 4) == (2, 3)
    assert l.experts(1, 4, [1, 0, 1, 0]) == (0, 2)
    with pytest.raises(ValueError, match="unequal"):
        l.experts(0, 4, [0, 0, 0, 1])
