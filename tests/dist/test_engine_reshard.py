"""A vLLM engine updated through the resharding path, from a trainer layout (tp2) other than its own
(tp1, vLLM's fused buffers), runs exactly the trainer's weights."""

import os

import pytest
import torch
import torch.distributed as dist

from rlhf.config import load_model_config
from rlhf.schema import RolloutConfig
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.sharding import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.trainer import token_logprobs
from rlhf.parity import logprob_parity
from rlhf.model.engine_sharding import engine_shard_spec
from rlhf.layout import InferenceLayout, Layout
from weight_sync.p2p import run_plan
from weight_sync.plan import Topology, plan_reshard

pytestmark = pytest.mark.vllm
TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model", "qwen3_moe_tiny.yaml")


def _model(seed):
    m = Qwen3MoeForCausalLM(load_model_config(TINY)).eval()
    m.init_weights(seed, std=0.1)
    return m


def worker(rank, start_dir):
    cfg = load_model_config(TINY)
    trainer = Layout(tp=2)
    src_spec = trainer_shard_spec(cfg, trainer)
    dst_spec = engine_shard_spec(cfg, InferenceLayout(tp=1), rank_offset=2)
    plan = plan_reshard(src_spec, dst_spec, Topology.single_node(3))
    new = dict(to_hf_tensors(_model(2).state_dict(), cfg))
    seqs = torch.randint(3, cfg.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
    seqs[:, 0] = 1
    if rank < 2:
        src = local_tensors(new, rank_sharding(cfg, trainer, rank))
        dist.barrier()  # the engine is up
        stats = run_plan(plan, rank, src, None, torch.float32)
        return {"sent": stats.bytes_sent}
    from actors.vllm_engine import VLLMEngine

    engine = VLLMEngine(start_dir, RolloutConfig(), max_model_len=64)
    dist.barrier()
    mine = dst_spec.ranks[0]
    buffers = {n: torch.full(s, float("nan")) for n, s in mine.buffers}
    stats = run_plan(plan, rank, None, buffers, torch.float32)
    info = engine.update_from_pieces(buffers, mine.pieces, dst_spec.shapes(), version=1)
    engine_lp = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    with torch.no_grad():
        ours = token_logprobs(_model(2)(seqs), seqs)[0]
    parity = logprob_parity(ours, engine_lp, torch.ones_like(ours))
    out = {"received": stats.bytes_received, "parity": parity, "info": info, "minimal": plan.bytes_minimal,
           "sleep": engine.sleep(), "wake": engine.wake_up()}
    engine.close()
    return out


def test_engine_runs_the_trainers_weights_after_a_resharded_update(tmp_path):
    m1 = _model(1)
    save_tokenizer(build_tokenizer(m1.config.vocab_size), tmp_path)
    save_pretrained(m1, tmp_path)
    results = run_ranks(worker, 3, str(tmp_path), timeout_s=600, collective_timeout_s=300)
    engine = results[2]
    assert engine["parity"].max_abs_diff <= 1e-5 and engine["parity"].tokens == 8 * 11
    assert engine["received"] == engine["minimal"] == results[0]["sent"] + results[1]["sent"]
    assert engine["info"]["version"] == 1
    assert engine["sleep"]["slept"] is False and "no sleep mode" in engine["sleep"]["reason"]  # explicit no-op
