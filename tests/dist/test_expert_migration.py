"""Expert migration (EDPB) in the parallel trainer is a permutation. In each rank process two trainers of the
same layout train the same batches in lockstep; one migrates every MoE layer's experts between EP ranks after
its first step (weights and both AdamW moments, ZeRO-1 moment slices or ZeRO-3 row shards), then both train on.
Logprobs, gradient norms and the parameters after two more AdamW steps are bit for bit the same. A checkpoint
of the migrated trainer keeps its placement: a fresh trainer that loads it holds the same experts and trains
the same step bit for bit, and its HF export (experts in logical order) equals the unmigrated trainer's
parameters. At most 4 gloo processes."""

import pytest
import torch
import torch.distributed as dist

from rlhf import checkpoint as ckpt
from rlhf.sharding.layout import Layout
from rlhf.model.hf_io import iter_safetensors, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.schema import TrainerConfig
from tests.dist.test_trainer import B, CFG, TCFG, loss_fn, make_batch, micro_batches

# one map per MoE layer (3): each moves experts differently, one layer of ep4 keeps two experts where they were
MAPS = {2: ((1, 0, 0, 1, 1, 0, 1, 0), (0, 1, 1, 0, 0, 1, 1, 0), (1, 1, 0, 0, 0, 0, 1, 1)),
        4: ((3, 2, 1, 0, 0, 1, 2, 3), (0, 1, 2, 3, 3, 2, 1, 0), (0, 1, 0, 1, 2, 2, 3, 3))}


def _logical(tr: ParallelTrainer) -> dict[str, torch.Tensor]:
    """This rank's parameters as boxes of the HF tensors (name, box start) -> values."""
    sharding, tensors = tr.export_shards()
    return {(p.param, p.box.start): tensors[p.buffer][p.buffer_slices()].clone() for p in sharding.pieces}


def worker(rank, layout, model_dir, zero_stage, ckpt_dir):
    tcfg = TrainerConfig(**(TCFG.__dict__ | {"zero_stage": zero_stage}))
    kept, moved = (ParallelTrainer(CFG, tcfg, layout, rank, model_dir) for _ in range(2))
    ids, attn, adv = make_batch()
    mbs = micro_batches(ids, attn, adv, range(layout.coords(rank).dp, B, layout.dp))
    out = {"norms": [], "logp_equal": []}
    for step in range(3):
        norms = [tr.train_step(mbs, loss_fn)["grad_norm"] for tr in (kept, moved)]
        out["norms"].append(norms)
        if step == 0:
            out["held_before"] = moved.sharding.local_shapes, [p.param for p in moved.sharding.pieces]
            out["migration"] = moved.migrate_experts(MAPS[layout.expert_shards])
            out["held_after"] = [p.param for p in moved.sharding.pieces]
        a, b = kept.logprobs(mbs), moved.logprobs(mbs)
        out["logp_equal"].append(all(torch.equal(x[0], y[0]) for x, y in zip(a, b)))
    out["kept"], out["moved"] = _logical(kept), _logical(moved)

    # the migrated placement survives a checkpoint: a fresh trainer resumes it and trains the same step
    ckpt.save_rank(ckpt_dir, rank, moved)
    dist.barrier()
    if rank == 0:
        ckpt.commit(ckpt_dir, {"step": 3})
    dist.barrier()
    resumed = ParallelTrainer(CFG, tcfg, layout, rank, model_dir)
    ckpt.load_rank(ckpt_dir, rank, resumed)
    out["resumed_maps"] = resumed.expert_maps
    a, b = moved.train_step(mbs, loss_fn), resumed.train_step(mbs, loss_fn)
    out["resumed_equal"] = a["grad_norm"] == b["grad_norm"] and _logical(moved).keys() == _logical(resumed).keys() \
        and all(torch.equal(x, _logical(resumed)[k]) for k, x in _logical(moved).items())
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("migration_model")
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=11, std=0.2)
    save_pretrained(m, d)
    return d


@pytest.mark.parametrize("layout,zero_stage", [(Layout(dp=2, ep=2), 1), (Layout(dp=4, ep=2), 3),
                                               (Layout(dp=4, ep=4), 1), (Layout(dp=4, ep=4), 3)],
                         ids=["ep2", "dp4xep2_zero3", "ep4", "ep4_zero3"])
def test_migration_is_a_permutation_and_its_checkpoint_keeps_the_placement(tmp_path, model_dir, layout, zero_stage):
    results = run_ranks(worker, layout.world_size, layout, str(model_dir), zero_stage, str(tmp_path / "step_3"),
                        timeout_s=300)
    maps = MAPS[layout.expert_shards]
    moved_experts = sum(a != b for m in maps for a, b in zip(m, [e * layout.expert_shards // 8 for e in range(8)]))
    for rank, res in enumerate(results):
        assert res["migration"]["experts_moved"] == moved_experts > 0
        assert res["held_after"] != res["held_before"][1]  # the rank holds other experts now
        assert all(a == b for a, b in res["norms"]), (rank, res["norms"])
        assert all(res["logp_equal"]), rank
        assert res["resumed_maps"] == maps and res["resumed_equal"], rank
    # bytes: each moving expert's weights and two moments, sent once by each of its expert replicas
    expert_bytes = 3 * 3 * CFG.moe_intermediate_size * CFG.hidden_size * 4
    assert sum(r["migration"]["bytes_sent"] for r in results) == moved_experts * expert_bytes * (
        layout.world_size // layout.expert_shards)
    kept, moved = {}, {}
    for res in results:
        kept |= res["kept"]
        moved |= res["moved"]
    assert kept.keys() == moved.keys() and all(torch.equal(kept[k], moved[k]) for k in kept)

    # the HF export of the migrated trainer's checkpoint: every expert in logical order
    out = ckpt.export_hf(tmp_path / "step_3", CFG, tmp_path / "hf")
    exported = dict(iter_safetensors(out))
    assert exported.keys() == {name for name, _ in kept}
    for (name, start), t in kept.items():  # the checkpoint was saved after the third step, as `kept` was taken
        assert torch.equal(exported[name][tuple(slice(s, s + n) for s, n in zip(start, t.shape))], t), name
