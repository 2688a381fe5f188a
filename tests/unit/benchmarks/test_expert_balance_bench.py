"""benchmarks/expert_balance_bench.py's skewed model and its measures, in-process (no ranks started)."""

import pytest

from benchmarks import expert_balance_bench as bench


def loads_under(model, ranks: int):
    import torch

    b = bench.batch(ranks)
    with torch.no_grad():
        model(b.input_ids_BT, b.attention_mask_BT)
    return [layer.mlp.last_tokens_per_expert.double().tolist() for layer in model.model.layers]


@pytest.mark.parametrize("experts, floor", [(8, 1.4), (16, 1.1)])
def test_the_skewed_routers_put_twice_the_mean_on_ep_rank_0_and_the_plan_spreads_it(experts, floor):
    from rlhf.moe import balance as expert_balance
    from rlhf.sharding.layout import default_expert_map

    loads = loads_under(bench.skewed_model(1.0, experts), 4)
    contiguous = [default_expert_map(experts, 4)] * len(loads)
    before = bench.rank_load_ratio(loads, contiguous, 4)
    assert before >= 2.0  # the hot experts sit on EP rank 0
    after = bench.rank_load_ratio(loads, expert_balance.plan(loads, contiguous, 4).maps, 4)
    # two hot experts among 8 in slots of 2 leave one hot expert per rank; with 16 (slots of 4) the plan
    # spreads the hot ones over all four ranks
    assert after < floor


def test_busiest_cpu_seconds_takes_each_steps_busiest_rank():
    ranks = [{"cpu": [1.0, 0.2, 0.5]}, {"cpu": [0.3, 0.9, 0.5]}]
    assert bench.busiest_cpu_seconds(ranks, 3) == pytest.approx(1.0 + 0.9 + 0.5)


def test_an_unsupported_expert_count_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--experts", "12"])
