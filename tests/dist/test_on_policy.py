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
