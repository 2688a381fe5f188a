"""Run checkpoints of the parallel trainer (at most 4 gloo processes): train 1 step, save, train 2 more;
fresh processes that resume from the checkpoint and train the same 2 steps end with the same
parameters and optimizer state bit for bit, in fp32 and with bf16 compute. The checkpoint exports to an HF
directory equal to the shards put together by their spec, and refuses a trainer of another layout with an error
naming both."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlhf import checkpoint as ckpt
from rlhf.schema import DType, ModelConfig, TrainerConfig
from rlhf.model.hf_io import iter_safetensors, load_pretrained, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.shapes import param_shapes
from rlhf.parallel.launch import run_ranks
from rlhf.batch import MicroBatch
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.sharding.layout import Layout

CFG = ModelConfig(vocab_size=40, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  first_k_dense_layers=1, intermediate_size=48, rope_theta=10000.0)
TCFG = TrainerConfig(lr=1e-3, adam_eps=1e-6, grad_clip=0.5, collective_timeout_s=60)
B, T, MB = 8, 12, 2


def loss_fn(logp, ent, mb):
    mask = mb.attention_mask_BT[:, 1:].float()
    return (-(mb.extras["adv"][:, None] * logp * mask).sum() - 0.01 * (ent * mask).sum()) / mb.extras["n_tokens"]


def micro_batches(step, layout, rank):
    """The micro-batches of `rank`'s DP index at `step` (another batch each step)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, CFG.vocab_size, (B, T), generator=g)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    attn = (torch.arange(T)[None] < lens[:, None]).long()
    ids, adv, n = ids * attn, torch.randn(B, generator=g), float(attn[:, 1:].sum())
    rows = list(range(layout.coords(rank).dp, B, layout.dp))
    return [MicroBatch(ids[rows[i:i + MB]], attn[rows[i:i + MB]], {"adv": adv[rows[i:i + MB]], "n_tokens": n})
            for i in range(0, len(rows), MB)]


def state_copy(tr):
    return {k: t.clone() for k, t in tr.state_dict().items()}


def save_worker(rank, layout, model_dir, kw, root):
    kw = dict(kw)
    tr = ParallelTrainer(CFG, kw.pop("tcfg", TCFG), layout, rank, model_dir, **kw)
    tr.train_step(micro_batches(0, layout, rank), loss_fn)
    d = ckpt.step_dir(root, 1)
    ckpt.save_rank(d, rank, tr)
    sharding, tensors = tr.export_shards()
    saved = {n: t.clone() for n, t in tensors.items()}
    dist.barrier()  # the driver commits once every rank's save returned
    if rank == 0:
        ckpt.commit(d, {"step": 1, "rng": ckpt.rng_state()})
    for step in (1, 2):
        tr.train_step(micro_batches(step, layout, rank), loss_fn)
    return {"sharding": sharding, "saved": saved, "state": state_copy(tr)}


def resume_worker(rank, layout, model_dir, kw, root, wrong_layout):
    errors = {}
    d = ckpt.resolve_resume(root, "auto")
    if wrong_layout is not None:
        wrong = ParallelTrainer(CFG, TCFG, wrong_layout, rank, model_dir)
        for what, load in (("load_rank", lambda: ckpt.load_rank(d, rank, wrong)),
                           ("load_state_dict", lambda: wrong.load_state_dict(
                               load_file(str(d / f"rank_{rank:05d}.safetensors"))))):
            try:
                load()
            except ValueError as e:
                errors[what] = str(e)
    kw = dict(kw)
    tr = ParallelTrainer(CFG, kw.pop("tcfg", TCFG), layout, rank, model_dir, **kw)
    ckpt.load_rank(d, rank, tr)
    for step in (1, 2):
        tr.train_step(micro_batches(step, layout, rank), loss_fn)
    return {"state": state_copy(tr), "errors": errors, "driver": ckpt.load_driver_state(d)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt_model")
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=11, std=0.2)
    save_pretrained(m, d)
    return d


LAYOUTS = {
    "dp2xep2": (Layout(dp=2, ep=2), {}, Layout(dp=2)),
    "pp2xtp2": (Layout(pp=2, tp=2), {"stage_split": [1, 3]}, None),
    # bf16 compute over fp32 masters: the step's bf16 working copies are made anew after a resume
    "dp2xep2_bf16": (Layout(dp=2, ep=2), {"tcfg": replace(TCFG, compute_dtype=DType.bfloat16)}, None),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_resume_is_bit_exact_and_exports(name, model_dir, tmp_path):
    layout, kw, wrong_layout = LAYOUTS[name]
    root = tmp_path / "ckpts"
    first = run_ranks(save_worker, layout.world_size, layout, str(model_dir), kw, root, timeout_s=240)
    resumed = run_ranks(resume_worker, layout.world_size, layout, str(model_dir), kw, root, wrong_layout,
                        timeout_s=240)
    for rank, (a, b) in enumerate(zip(first, resumed)):
        assert set(a["state"]) == set(b["state"])
        assert any(k.startswith("optim/") and k.endswith("/exp_avg") for k in a["state"])
        for k, t in a["state"].items():
            assert torch.equal(t, b["state"][k]), (rank, k)
        assert b["driver"]["step"] == 1

    # the export equals the trainer's shards at save time, put together by their own spec
    full = {}
    for res in first:
        for p in res["sharding"].pieces:
            full.setdefault(p.param, torch.full(param_shapes(CFG)[p.param], float("nan")))
            full[p.param][p.box.slices()] = res["saved"][p.buffer][p.buffer_slices()]
    out = ckpt.export_hf(ckpt.latest(root), CFG, tmp_path / "hf")
    got = dict(iter_safetensors(out))
    assert set(got) == set(full)
    for n, t in full.items():
        assert torch.equal(got[n], t), n
    load_pretrained(out)

    if wrong_layout is not None:
        errors = resumed[0]["errors"]
        assert "saved by trainer layout dp2xep2" in errors["load_rank"]
        assert "this run uses layout dp2 " in errors["load_rank"]
        assert "does not fit this trainer (layout dp2, rank 0)" in errors["load_state_dict"]
        assert "mlp.experts" in errors["load_state_dict"]

