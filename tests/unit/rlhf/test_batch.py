"""TokenBatch: response masks and engine logprobs line up with token_logprobs' positions, and the
DP micro-batches cover every sample exactly once."""

import pytest
import torch

from rlhf.batch import TokenBatch


def test_mask_marks_positions_predicting_response_tokens():
    b = TokenBatch.from_samples([[1, 5, 6], [1, 7]], [[9, 2], [8, 8, 2]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]])
    assert b.input_ids_BT.tolist() == [[1, 5, 6, 9, 2], [1, 7, 8, 8, 2]]
    # position t predicts token t + 1: responses start at token 3 (row 0) and 2 (row 1)
    assert b.mask_BT.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert b.rollout_logp_BT[0, 2:].tolist() == [-0.5, -0.25]
    assert b.rollout_logp_BT[1, 1:].tolist() == [-1.0, -2.0, -3.0]
    assert b.response_tokens == 5 and b.lengths == [5, 5]


def test_micro_batches_cover_every_sample_once_across_dp_ranks():
    prompts = [[1] * (2 + i % 3) for i in range(10)]
    responses = [[4] * (1 + i % 4) for i in range(10)]
    b = TokenBatch.from_samples(prompts, responses).with_(advantages_B=torch.arange(10.0))
    seen = []
    for dp_index in range(2):
        for mb in b.micro_batches(range(10), 2, dp_index, max_tokens=12):
            rows = mb.extras["rows"].tolist()
            seen += rows
            T = mb.input_ids_BT.shape[1]
            assert T == max(b.lengths[r] for r in rows)  # trimmed to its longest sample
            assert mb.extras["mask"].shape == (len(rows), T - 1)
            assert mb.extras["advantages"].tolist() == [float(r) for r in rows]
    assert sorted(seen) == list(range(10))


def test_logprobs_score_the_tempered_distribution_the_rollout_sampled_from():
    from rlhf.parallel.trainer import token_logprobs

    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    logp, ent = token_logprobs(logits, ids, temperature=0.7)
    ref = torch.log_softmax(logits[:, :-1] / 0.7, -1)
    assert torch.allclose(logp, ref.gather(-1, ids[:, 1:, None]).squeeze(-1))
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1))
    assert torch.equal(token_logprobs(logits, ids)[0], token_logprobs(logits, ids, 1.0)[0])


def test_routes_line_up_with_tokens_and_each_dp_rank_gets_its_share():
    import numpy as np

    from rlhf.moe.routing import RouteFetch, RouteRef

    prompts = [[1] * (2 + i % 3) for i in range(10)]
    responses = [[4] * (1 + i % 4) for i in range(10)]
    # the engine routes every token it fed: the prompt and the response but its last token; 3 layers, top-2
    routes = [np.full((len(p) + len(r) - 1, 3, 2), i, dtype=np.uint8) for i, (p, r) in enumerate(zip(prompts, responses))]
    b = TokenBatch.from_samples(prompts, responses, routes=routes)
    assert b.routes_BTLk.dtype == torch.int16 and b.routes_BTLk.shape == (10, b.input_ids_BT.shape[1], 3, 2)
    for i, L in enumerate(b.lengths):
        assert (b.routes_BTLk[i, :L - 1] == i).all() and (b.routes_BTLk[i, L - 1:] == -1).all()
    # as an engine keeps them for a pp2 trainer whose second stage holds MoE layer 2: one block per stage
    starts = np.cumsum([0] + [len(r) for r in routes])
    blocks = {"stage0": np.concatenate(routes)[:, :2], "stage1": np.concatenate(routes)[:, 2:]}
    refs = [RouteRef(int(s), len(r), ("stage0", "stage1")) for s, r in zip(starts, routes)]
    calls = [range(10), [3, 1, 7, 0, 9], [2, 4, 5, 6, 8]]  # old logprobs over all, then two mini-batches
    shares = [b.dp_rows(calls, 2, d, max_tokens=12) for d in range(2)]
    for d, rows in enumerate(shares):  # exactly the rows the rank's micro-batches take
        want = {r for c in calls for mb in b.micro_batches(c, 2, d, 12) for r in mb.extras["rows"].tolist()}
        assert rows == sorted(want)
        fetch = RouteFetch(tuple(rows), tuple(refs[r] for r in rows), 1, (2,), 3, 2, b.input_ids_BT.shape[1])
        share = fetch.resolve(lambda names: [blocks[n] for n in names])  # what the trainer rank reads
        assert fetch.nbytes == sum(len(routes[r]) * 1 * 2 for r in rows)  # uint8 ids, one layer, top-2
        full = share.expand(len(b))
        assert torch.equal(full[rows][:, :, 2], b.routes_BTLk[rows][:, :, 2])
        assert (full[:, :, :2] == -1).all() and share.nbytes < b.routes_BTLk.numel() * 2 / 2
        # a trainer rank holding only the share gets the same routes in each of its micro-batches
        on_rank = b.with_(routes_BTLk=None, route_share=share)
        for c in calls:
            for dense, mine in zip(b.micro_batches(c, 2, d, 12), on_rank.micro_batches(c, 2, d, 12)):
                assert torch.equal(mine.routes_BTLk[:, :, 2], dense.routes_BTLk[:, :, 2])
                assert (mine.routes_BTLk[:, :, :2] == -1).all()


def test_response_rows_go_back_exactly_into_a_batch_padded_otherwise():
    """StaleSync computes reference logprobs when a batch is made and the step's batch may pad the same samples
    to another length: the values at each response token come back bit for bit, 0 elsewhere."""
    prompts, responses = [[1, 5, 6], [1, 7]], [[9, 2], [8, 8, 2]]
    made = TokenBatch.from_samples(prompts, responses)
    values = torch.randn(2, made.mask_BT.shape[1], dtype=torch.float32)
    rows = made.response_rows(values)
    assert [len(r) for r in rows] == [2, 3]
    longer = TokenBatch.from_samples(prompts + [[1]], responses + [[4, 4, 4, 4, 4, 2]])  # padded to 7 tokens
    back = longer.response_matrix(rows + [[0.5] * 6])
    m = made.mask_BT.bool()
    assert torch.equal(back[0][longer.mask_BT[0].bool()], values[0][m[0]])
    assert torch.equal(back[1][longer.mask_BT[1].bool()], values[1][m[1]])
    assert torch.equal(back[~longer.mask_BT.bool()], torch.zeros(int((~longer.mask_BT.bool()).sum())))
    with pytest.raises(ValueError, match="sample 2: 5 values for 6 response tokens"):
        longer.response_matrix(rows + [[0.5] * 5])
