"""The on-policy shortcut (one mini-batch, one epoch: no separate forward for the old logprobs, the ratio's
denominator being the update's own logprob, detached) gives the same update as the full computation:
parameters after the step within 1e-6, on the parallel trainer (dp2 x ep2, two gloo processes)."""

import torch

from rlhf.algorithms.objective import LossRecord, loss_normaliser, on_policy, policy_loss
from rlhf.batch import TokenBatch
from rlhf.sharding.layout import Layout
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.schema import AlgorithmConfig, ModelConfig, TrainerConfig

CFG = ModelConfig(vocab_size=40, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=10000.0)
TCFG = TrainerConfig(dp=2, ep=2, lr=1e-3, adam_eps=1e-6, collective_timeout_s=60, micro_batch_tokens=48)
ALGO = AlgorithmConfig(clip_eps_high=0.28, entropy_coef=0.01, tis_cap=2.0)


def _batch() -> TokenBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, CFG.vocab_size, (3,), generator=g).tolist() for _ in range(8)]
    responses = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist()
                 for n in torch.randint(2, 9, (8,), generator=g)]
    rollout = [(-torch.rand(len(r), generator=g)).tolist() for r in responses]
    batch = TokenBatch.from_samples(prompts, responses, rollout)
    return batch.with_(advantages_B=torch.randn(8, generator=g))


def worker(rank, model_dir):
    layout = Layout(dp=2, ep=2)
    batch, rows = _batch(), list(range(8))
    normaliser = loss_normaliser(ALGO, batch.mask_BT)
    out = {}
    for mode in ("full", "on_policy"):
        trainer = ParallelTrainer(CFG, TCFG, layout, rank, model_dir)
        out.setdefault("start", {n: p.detach().clone() for n, p in trainer.params.items()})
        dp_index = layout.coords(rank).dp
        b = batch
        if mode == "full":  # the separate forward: this rank's rows of the old logprobs
            old = torch.zeros_like(batch.mask_BT)
            mbs = batch.micro_batches(rows, layout.dp, dp_index, TCFG.micro_batch_tokens)
            for mb, (lp, _) in zip(mbs, trainer.logprobs(mbs)):
                old[mb.extras["rows"], :lp.shape[1]] = lp
            b = batch.with_(old_logp_BT=old)
        mbs = b.micro_batches(rows, layout.dp, dp_index, TCFG.micro_batch_tokens)
        record = LossRecord()
        trainer.train_step(mbs, lambda logp, ent, mb: policy_loss(ALGO, logp, ent, mb.extras, normaliser, record))
        out[mode] = {n: p.detach().clone() for n, p in trainer.params.items()}
        out[mode + "_ratio"] = record.ratio / max(record.tokens, 1.0)
    return out


def test_on_policy_update_equals_the_full_computation(tmp_path):
    assert on_policy(ALGO, epochs=1, mini_batches=1)
    assert not on_policy(ALGO, epochs=2, mini_batches=1) and not on_policy(ALGO, epochs=1, mini_batches=4)
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(0, std=0.1)
    save_pretrained(m, tmp_path)
    for res in run_ranks(worker, 2, str(tmp_path), timeout_s=300):
        assert res["on_policy_ratio"] == 1.0 and abs(res["full_ratio"] - 1.0) < 1e-6
        moved = max((p - res["start"][n]).abs().max().item() for n, p in res["full"].items())
        diff = max((res["on_policy"][n] - res["full"][n]).abs().max().item() for n in res["full"])
        assert moved > 1e-4  # the step did change the weights
        assert diff <= 1e-6, diff


def head_worker(rank, model_dir):
    """One rank: the same update with the head on the response positions alone (the micro-batches carry the loss's
    mask, as the trainer's always do) and on every position (the mask hidden from the trainer under another key)."""
    import dataclasses

    tcfg = dataclasses.replace(TCFG, dp=1, ep=1)
    batch = _batch()
    normaliser = loss_normaliser(ALGO, batch.mask_BT)
    out = {}
    for mode in ("response_only", "every_position"):
        trainer = ParallelTrainer(CFG, tcfg, Layout(), rank, model_dir)
        mbs = batch.micro_batches(list(range(8)), 1, 0, tcfg.micro_batch_tokens)
        if mode == "every_position":
            mbs = [dataclasses.replace(mb, extras={k: v for k, v in mb.extras.items() if k != "mask"}
                                       | {"loss_mask": mb.extras["mask"]}) for mb in mbs]
        seen = []

        def loss(logp, ent, mb):
            seen.append((logp.detach(), ent.detach()))
            extras = dict(mb.extras)
            extras.setdefault("mask", extras.get("loss_mask"))
            return policy_loss(ALGO, logp, ent, extras, normaliser, LossRecord())

        trainer.train_step(mbs, loss, first=True)
        masks = [mb.extras.get("mask", mb.extras.get("loss_mask")) for mb in mbs]
        out[mode] = {"params": {n: p.detach().clone() for n, p in trainer.params.items()}, "seen": seen,
                     "masks": masks}
    return out


def test_the_head_on_the_response_positions_alone_gives_the_same_update(tmp_path):
    """The trainer runs the LM head on the positions the loss reads (responses; not the prompt, not padding): the
    logprobs and entropies there within fp32 rounding of the head over every position, 0 elsewhere, and the
    parameters after the step within 1e-6."""
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(0, std=0.1)
    save_pretrained(m, tmp_path)
    (res,) = run_ranks(head_worker, 1, str(tmp_path), timeout_s=300)
    a, b = res["response_only"], res["every_position"]
    for (lp_a, ent_a), (lp_b, ent_b), mask in zip(a["seen"], b["seen"], a["masks"]):
        keep = mask > 0
        assert 0 < int(keep.sum()) < keep.numel()  # prompts and padding left out
        assert torch.allclose(lp_a[keep], lp_b[keep], atol=1e-6) and torch.allclose(ent_a[keep], ent_b[keep], atol=1e-6)
        assert not lp_a[~keep].any() and not ent_a[~keep].any() and lp_b[~keep].any()
    diff = max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])
    assert diff <= 1e-6, diff
