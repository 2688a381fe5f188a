"""The run's weight-sync group: trainer ranks, then every engine rank; which pairs share a device (they
go through shared memory); and `rlhf plan` and `rlhf train` building the same sync."""

from pathlib import Path

import pytest
import torch

from rlhf.config import load_model_config, load_run_config
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.placement import device_map
from rlhf.report import plan_report
from rlhf.placement.transfer import sync_layout
from rlhf.sharding.sync import SyncLayout
from weight_sync.plan import Topology

ROOT = Path(__file__).resolve().parents[4]
TINY = ROOT / "configs" / "model" / "qwen3_moe_tiny.yaml"


def test_same_device_pairs_from_the_devices_of_every_rank():
    sync = SyncLayout(load_model_config(TINY), Layout(tp=2), InferenceLayout(tp=2), Topology.single_node(4))
    # trainer ranks 0, 1 on devices 0, 1; the engine's two workers (ranks 2, 3) on devices 1 and 5
    assert sync.same_device_pairs([0, 1, 1, 5]) == {(1, 2)}
    assert sync.same_device_pairs([0, 0, 0, 7]) == {(0, 2), (1, 2)}
    with pytest.raises(ValueError, match="3 devices given for 4 transfer ranks"):
        sync.same_device_pairs([0, 1, 2])


def test_every_engine_rank_is_a_transfer_rank():
    cfg = load_run_config(ROOT / "configs" / "tiny_cpu.yaml", ["rollout.num_engines=1", "rollout.tp=2"])
    sync = sync_layout(cfg, device_map(cfg))
    assert sync.world_size == 4 and list(sync.engine_ranks(0)) == [2, 3]
    assert sync.devices == (0, 1, 0, 1) and sync.same_device_pairs() == {(0, 2), (1, 3)}
    plan = sync.plan()
    per_rank = [plan.bytes_into(r) for r in sync.engine_ranks(0)]
    assert sum(per_rank) == plan.bytes_minimal and max(per_rank) < plan.bytes_minimal  # each its own half


@pytest.mark.parametrize("overrides", [[], ["rollout.num_engines=1", "rollout.tp=2"]])
def test_plan_reports_the_bytes_the_run_moves(overrides):
    cfg = load_run_config(ROOT / "configs" / "tiny_cpu.yaml", overrides)
    dm = device_map(cfg)
    _, summary = plan_report(cfg, dm)
    plan = sync_layout(cfg, dm).plan()  # what `rlhf train` builds (rlhf.driver.run.RunInputs)
    assert (summary["bytes_minimal"], summary["bytes_network"]) == (plan.bytes_minimal, plan.bytes_network)
    assert summary["roles"]["rollout"] == sync_layout(cfg, dm).engines.world_size


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="fp8_block is refused on a cpu without AMX tiles")
def test_plan_says_what_fp8_engines_keep_in_bf16_and_what_the_sync_moves():
    cfg = load_run_config(ROOT / "configs" / "small_cpu.yaml", ["rollout.quantization=fp8_block"])
    dm = device_map(cfg)
    lines, summary = plan_report(cfg, dm)
    q = summary["quantization"]
    assert q["kind"] == "fp8_block" and q["tensors"] == 8 * (4 + 3 * 32)  # attention and every expert, 8 layers
    assert q["kept_plain"] == ["embed_tokens", "input_layernorm", "lm_head", "mlp.gate", "norm",
                               "post_attention_layernorm", "self_attn.k_norm", "self_attn.q_norm"]
    plan = sync_layout(cfg, dm).plan()
    assert summary["bytes_minimal"] == plan.bytes_minimal < 0.65 * q["bytes_minimal_unquantized"]
    assert any(line.startswith("  kept bfloat16: embed_tokens") for line in lines)


def test_topology_size_must_match_the_ranks():
    with pytest.raises(ValueError, match="need 4"):
        SyncLayout(load_model_config(TINY), Layout(tp=2), InferenceLayout(tp=2), Topology.single_node(3))


def test_plan_shows_which_transfers_cross_nodes():
    # disaggregated over two nodes: the trainer (devices 0-1, node 0) sends everything to the engine on node 1
    cfg = load_run_config(ROOT / "configs" / "tiny_cpu_disaggregated.yaml",
                          ["placement.nodes=2", "placement.devices_per_node=2"])
    lines, summary = plan_report(cfg, device_map(cfg))
    assert summary["bytes_cross_node"] == summary["bytes_network"] > 0
    crossing = next(line for line in lines if "between nodes" in line)
    assert "0->2 (node 0->1)" in crossing and "1->2 (node 0->1)" in crossing
    # one node: nothing crosses
    _, one = plan_report(load_run_config(ROOT / "configs" / "tiny_cpu_disaggregated.yaml"))
    assert one["bytes_cross_node"] == 0


def test_plan_counts_the_routes_replay_sends():
    """Pangu Ultra MoE (58 MoE layers, top-8) with rollout routing replay: 6144 samples of up to 64 + 8192
    tokens, 2 bytes per id; without capture no route line and no bytes."""
    cfg = load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml", ["trainer.routing_replay=rollout"])
    lines, summary = plan_report(cfg, device_map(cfg))
    m = cfg.model
    tokens = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    samples = cfg.data.prompts_per_step * cfg.algorithm.group_size
    want = samples * tokens * (m.num_hidden_layers - m.first_k_dense_layers) * 8 * 2
    assert summary["route_bytes_per_step"] == want and any(line.startswith("routes:") for line in lines)
    _, off = plan_report(load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml"))
    assert off["route_bytes_per_step"] is None
