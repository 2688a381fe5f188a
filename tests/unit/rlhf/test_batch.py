"""TokenBatch: response masks and engine logprobs line up with token_logprobs' positions, and the
DP micro-batches cover every sample exactly once."""

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
