import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.config import ConfigError, load_run_config
from rlhf.schema import (
    AlgorithmConfig, DeviceType, PlacementConfig, RewardConfig, RewardKind, RolePlacement, RolloutConfig, RunConfig,
    TrainerConfig,
)
from rlhf.placement import (
    ActorSlot, actor_options, device_map, engine_cpu_cores, format_devices, memory_estimate, parse_devices,
    placement_bundles,
    transfer_devices, transfer_topology,
)

ROOT = Path(__file__).resolve().parents[4]
GIB = 1 << 30


def run(trainer=None, rollout=None, placement=None, kl_coef=0.0, reward=None, **roles) -> RunConfig:
    """A tiny-model run; `roles` are device strings, e.g. trainer_devices="0-1"."""
    p = placement or PlacementConfig()
    p = dataclasses.replace(p, **{k[:-len("_devices")]: RolePlacement(v) for k, v in roles.items()})
    return RunConfig(trainer=trainer or TrainerConfig(dp=2, ep=2), rollout=rollout or RolloutConfig(),
                     placement=p, algorithm=AlgorithmConfig(kl_coef=kl_coef), reward=reward or RewardConfig())


def roles(dm):
    return {role: devices for role, devices in dm.roles}


# --- device lists ---

@pytest.mark.parametrize("text, devices", [
    ("0-3", (0, 1, 2, 3)), ("0,2", (0, 2)), ("0-1,4-5", (0, 1, 4, 5)), ("", ()), (" 3 ", (3,)),
    ("5,1-2", (5, 1, 2)),  # rank order is kept
])
def test_parse_devices(text, devices):
    assert parse_devices(text) == devices
    if devices:
        assert parse_devices(format_devices(devices)) == devices


@pytest.mark.parametrize("text, says", [
    ("a", "cannot read 'a'"), ("-1", "cannot read '-1'"), ("0-", "cannot read '0-'"), ("1,,2", "cannot read ''"),
    ("3-1", "runs backwards"),
])
def test_parse_devices_errors_name_key_and_syntax(text, says):
    with pytest.raises(ConfigError) as e:
        parse_devices(text, "placement.trainer.devices")
    msg = str(e.value)
    assert "placement.trainer.devices" in msg and repr(text.strip()) in msg and says in msg and '"0-1,4-5"' in msg


# --- default policies ---

def test_colocated_defaults_start_every_role_at_device_0():
    dm = device_map(run())
    assert roles(dm) == {"trainer": (0, 1), "rollout": (0,), "reward": (0,)}
    assert dm.residents(0) == [("trainer", 0), ("rollout", 0), ("reward", 0)]
    assert dm.residents(1) == [("trainer", 1)]
    assert dm.colocated("trainer", "rollout") and dm.num_devices == 2
    dm = device_map(run(kl_coef=0.1, rollout=RolloutConfig(num_engines=2)))
    assert roles(dm) == {"trainer": (0, 1), "reference": (0, 1), "rollout": (0, 1), "reward": (0,)}


def test_cpu_engines_bind_to_their_devices_cores():
    """Several engines on cpu: each binds its OpenMP threads to its devices' cores (vLLM's auto binding
    would put them all on core 0); one engine keeps vLLM's own binding."""
    assert engine_cpu_cores(device_map(run()), 0, 2) is None
    dm = device_map(run(rollout=RolloutConfig(num_engines=2), rollout_devices="0-1"))
    assert [engine_cpu_cores(dm, k, 2) for k in range(2)] == [[0], [1]]
    p = PlacementConfig(nodes=2, devices_per_node=2)
    dm = device_map(run(placement=p, rollout=RolloutConfig(num_engines=2, tp=2), rollout_devices="0-3"))
    assert [engine_cpu_cores(dm, k, 2) for k in range(2)] == [[0, 1], [0, 1]]  # one engine per node
    cuda = dataclasses.replace(p, device_type=DeviceType.cuda)
    assert engine_cpu_cores(device_map(run(placement=cuda, rollout=RolloutConfig(num_engines=2), rollout_devices="0-1")),
                            1, 2) is None


def test_reference_only_with_kl_and_on_the_trainers_devices():
    assert "reference" not in device_map(run()).role_names
    dm = device_map(run(kl_coef=0.1, trainer_devices="2-3", placement=PlacementConfig(devices_per_node=4)))
    assert dm.devices_of("reference") == dm.devices_of("trainer") == (2, 3)


def test_disaggregated_defaults_trainer_first_then_engines_reward_with_engines():
    p = PlacementConfig(devices_per_node=5, colocate=False)
    dm = device_map(run(placement=p, kl_coef=0.1, rollout=RolloutConfig(num_engines=3), reward=RewardConfig(workers=2)))
    assert roles(dm) == {"trainer": (0, 1), "reference": (0, 1), "rollout": (2, 3, 4), "reward": (2, 3)}
    assert not dm.colocated("trainer", "rollout") and dm.colocated("rollout", "reward")


def test_shipped_tiny_runs_validate():
    dm = device_map(load_run_config(ROOT / "configs/tiny_cpu.yaml"))
    assert roles(dm) == {"trainer": (0, 1), "rollout": (0, 1), "reward": (1,)}  # one engine per device
    dm = device_map(load_run_config(ROOT / "configs/tiny_cpu_disaggregated.yaml"))
    assert roles(dm) == {"trainer": (0, 1), "rollout": (2,), "reward": (3,)}


def test_rule_reward_needs_no_accelerator():
    gpu = PlacementConfig(device_type=DeviceType.cuda, devices_per_node=2)
    dm = device_map(run(placement=gpu))
    assert "reward" not in roles(dm) and dm.unplaced == (("reward", 1),) and dm.devices_of("reward") == ()
    assert roles(device_map(run(placement=gpu, reward_devices="1")))["reward"] == (1,)
    model = RewardConfig(kind=RewardKind.model, model_path="rm")
    assert roles(device_map(run(placement=gpu, reward=model)))["reward"] == (0,)


def test_node_and_fabric_of_a_device():
    p = PlacementConfig(nodes=4, devices_per_node=2, nodes_per_fabric=2)
    dm = device_map(run(placement=p))
    assert [dm.node_of(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dm.fabric_of(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="outside"):
        dm.node_of(8)


# --- errors: key, value, fix ---

@pytest.mark.parametrize("cfg, key, value, fix", [
    (run(rollout_devices="5"), "placement.rollout.devices", "'5'", "outside the cluster, whose devices are 0-1"),
    (run(trainer_devices="0"), "placement.trainer.devices", "'0'",
     "the trainer needs 2, one per rank (trainer.pp * dp * tp = 1 * 2 * 1 = 2)"),
    (run(trainer_devices="1,1"), "placement.trainer.devices", "'1,1'", "listed twice"),
    (run(placement=PlacementConfig(nodes=2, devices_per_node=2), rollout=RolloutConfig(tp=2), rollout_devices="1-2"),
     "placement.rollout.devices", "'1-2'", "nodes [0, 1]; tensor parallelism stays inside one node"),
    (run(placement=PlacementConfig(nodes=3, nodes_per_fabric=2)), "placement.nodes_per_fabric", "2",
     "must divide placement.nodes = 3"),
    (run(placement=PlacementConfig(device_resource="GPU")), "placement.device_resource", "'GPU'", "Ray reserves"),
    (run(placement=PlacementConfig(device_resource="NPU")), "placement.device_resource", "'NPU'", "rlhf_device"),
    (run(placement=PlacementConfig(device_resource="CPU")), "placement.device_resource", "'CPU'", "Ray reserves"),
    (run(reward_devices="x"), "placement.reward.devices", "'x'", "cannot read"),
    (run(placement=PlacementConfig(colocate=False)), "placement.rollout.devices", "''",
     "the default policy (colocate: false) gives devices 2"),
    (run(rollout=RolloutConfig(tp=2, ep=3)), "rollout.ep", "3", "ep must be 1 or a multiple of tp"),
    (run(reward=RewardConfig(workers=0)), "reward.workers", "0", "must be >= 1"),
])
def test_every_error_names_key_value_and_fix(cfg, key, value, fix):
    with pytest.raises(ConfigError) as e:
        device_map(cfg)
    assert f"{key} = {value}: " in str(e.value) and fix in str(e.value)


def test_all_placement_problems_at_once_and_at_load_time(tmp_path):
    with pytest.raises(ConfigError, match="3 problems"):  # count, twice, outside
        device_map(run(trainer_devices="0,0,0", rollout_devices="9"))
    (tmp_path / "run.yaml").write_text("trainer:\n  dp: 2\n  ep: 2\nplacement:\n  rollout:\n    devices: '7'\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "run.yaml")
    assert "placement.rollout.devices = '7'" in str(e.value)


# --- Ray mapping ---

@pytest.mark.parametrize("device_type, bundle", [
    (DeviceType.cpu, {"CPU": 2.0, "rlhf_device": 1}),
    (DeviceType.cuda, {"CPU": 2.0, "GPU": 1}),
    (DeviceType.npu, {"CPU": 2.0, "NPU": 1}),
])
def test_bundles_one_per_device_per_node(device_type, bundle):
    p = PlacementConfig(device_type=device_type, nodes=2, devices_per_node=3, cpus_per_device=2)
    bundles = placement_bundles(p)
    assert bundles == [[bundle] * 3] * 2


COLOCATED = run(kl_coef=0.1, placement=PlacementConfig(cpus_per_device=2.0))  # device 0: 4 ranks, device 1: 2


@pytest.mark.parametrize("device_type, role, rank, slot", [
    (DeviceType.cpu, "trainer", 0, ActorSlot(0, 0, 0.5, 0.0, {"rlhf_device": 0.25})),
    (DeviceType.cpu, "reference", 1, ActorSlot(0, 1, 1.0, 0.0, {"rlhf_device": 0.5})),
    (DeviceType.cpu, "rollout", 0, ActorSlot(0, 0, 0.5, 0.0, {"rlhf_device": 0.25})),
    (DeviceType.cuda, "trainer", 1, ActorSlot(0, 1, 1.0, 0.5, {})),
    (DeviceType.cuda, "reward", 0, ActorSlot(None, None, 1.0, 0.0, {})),  # rule verifier: no GPU
    (DeviceType.npu, "rollout", 0, ActorSlot(0, 0, 0.6666, 0.0, {"NPU": 0.3333})),
])
def test_actor_options_share_a_device_between_its_residents(device_type, role, rank, slot):
    cfg = dataclasses.replace(COLOCATED, placement=dataclasses.replace(COLOCATED.placement, device_type=device_type))
    dm = device_map(cfg)
    assert actor_options(dm, cfg.placement, role, rank) == slot


def test_actor_shares_fit_their_bundle():
    cfg = run(kl_coef=0.1, rollout=RolloutConfig(num_engines=2), placement=PlacementConfig(nodes=2, devices_per_node=1),
              reward_devices="1")
    dm = device_map(cfg)
    bundles = placement_bundles(cfg.placement)
    for d in range(dm.num_devices):
        slots = [actor_options(dm, cfg.placement, role, rank) for role, rank in dm.residents(d)]
        assert {(s.node, s.bundle) for s in slots} == {(d, 0)}
        bundle = bundles[d][0]
        assert sum(s.num_cpus for s in slots) <= bundle["CPU"]
        assert sum(s.resources["rlhf_device"] for s in slots) <= bundle["rlhf_device"]
    assert actor_options(dm, cfg.placement, "reward", 0).spawn_kwargs(["pg0", "pg1"]) == {
        "num_cpus": 0.25, "num_gpus": 0.0, "resources": {"rlhf_device": 0.25}, "placement_group": "pg1",
        "bundle_index": 0}
    with pytest.raises(ValueError, match="rank 2 does not exist"):
        actor_options(dm, cfg.placement, "trainer", 2)


# --- transfer topology ---

def test_transfer_topology_numbers_trainer_then_engine_ranks():
    p = PlacementConfig(nodes=2, devices_per_node=2, colocate=False, fabric_gbytes_per_s=25.0)
    cfg = run(placement=p, rollout=RolloutConfig(num_engines=2))
    dm = device_map(cfg)
    assert transfer_devices(dm) == (0, 1, 2, 3)
    topo = transfer_topology(cfg, dm)
    assert topo.nodes == (0, 0, 1, 1) and topo.link_bytes_per_s == 25e9
    colocated = device_map(run(rollout=RolloutConfig(tp=2)))
    assert transfer_devices(colocated) == (0, 1, 0, 1)


# --- memory estimate ---

def _trainer_bytes(cfg):
    return max(roles.get("trainer", 0) for roles in memory_estimate(cfg, device_map(cfg)).values())


def test_trainer_memory_shrinks_as_tp_grows():
    p = PlacementConfig(devices_per_node=4)
    tp1, tp2, tp4 = (_trainer_bytes(run(trainer=TrainerConfig(tp=tp), placement=p)) for tp in (1, 2, 4))
    assert tp1 > tp2 > tp4 > 0


def test_memory_estimate_roles():
    cfg = run(kl_coef=0.1, rollout=RolloutConfig(cpu_kv_cache_gib=2))
    mem = memory_estimate(cfg, device_map(cfg))
    assert set(mem) == {0, 1}
    d0 = mem[0]
    assert set(d0) == {"trainer", "reference", "rollout", "reward"}
    assert 0 < d0["reference"] < d0["trainer"]  # params only vs params + grads + AdamW
    assert 2 * GIB < d0["rollout"] < 2 * GIB + 64 << 20  # KV cache + the tiny model's weights
    assert d0["reward"] == 0
    gpu = run(placement=PlacementConfig(device_type=DeviceType.cuda, device_memory_gib=10),
              rollout=RolloutConfig(gpu_memory_utilization=0.5))
    assert memory_estimate(gpu, device_map(gpu))[0]["rollout"] == 5 * GIB  # vLLM's share of the device


# --- rlhf plan ---

def test_cli_plan_prints_the_map_and_ends_with_json(capsys):
    assert main(["plan", str(ROOT / "configs/tiny_cpu.yaml")]) == 0
    out, err = capsys.readouterr()
    assert "device 0 (node 0): trainer r0 (pp0 dp0 tp0, experts 0-3) | rollout e0 r0 (tp0)" in err
    assert "trainer r1 (pp0 dp1 tp0, experts 4-7)" in err and "memory per device (an estimate)" in err
    assert "weight sync plan" in err and "floor" in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 2 and result["roles"] == {"trainer": 2, "rollout": 2, "reward": 1}
    assert result["memory_max_bytes"] > GIB / 4  # the engine's 0.25 GiB KV cache (tiny_cpu.yaml)
    assert result["bytes_minimal"] > 0 and result["bytes_network"] > 0 and result["floor_seconds"] > 0
    assert "plan_seconds" in result
    # the memory model on the hardware file: the state above, plus activations and the KV cache
    assert "memory per role on hardware cpu_2core" in err
    sim, state = result["memory_simulated_gib_per_device"]["roles"], result["memory_state_max_bytes"]
    assert sim["trainer"]["state"] * GIB == pytest.approx(state["trainer"], rel=1e-9)
    assert sim["trainer"]["total"] > sim["trainer"]["state"]
    assert sim["rollout"]["state"] * GIB == pytest.approx(state["rollout"], rel=1e-9)
    assert sim["rollout"]["kv_cache"] == 0.25 and sim["rollout"]["total"] > 0.25  # rollout.cpu_kv_cache_gib


def test_cli_plan_refuses_a_bad_placement(capsys):
    assert main(["plan", str(ROOT / "configs/tiny_cpu.yaml"), "placement.rollout.devices=7"]) == 2
    assert "placement.rollout.devices = '7'" in capsys.readouterr().err


def test_cli_plan_starts_nothing():
    code = ("import sys; from rlhf.cli import main; rc = main(['plan', 'configs/tiny_cpu.yaml']); "
            "assert rc == 0 and 'ray' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_cli_plan_cm384_is_condensed(capsys):
    assert main(["plan", str(ROOT / "configs/cm384_pangu718b.yaml")]) == 0
    out, err = capsys.readouterr()
    assert len(err.splitlines()) < 60 and "trainer + rollout: 384 devices 0-383" in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["devices"] == 384 and result["roles"]["trainer"] == 384 and result["roles"]["rollout"] == 384


@pytest.mark.slow
def test_cli_plan_cm384_async_has_separate_pools(capsys):
    """The 718B StaleSync variant: accepted, trainer and engines on disjoint NPUs, every synced byte between them."""
    assert main(["plan", str(ROOT / "configs/cm384_pangu718b_async.yaml")]) == 0
    out, err = capsys.readouterr()
    assert "loop: StaleSync" in err and "at most 1 version(s) stale, partial rollouts on" in err
    assert "trainer: 256 devices 0-255" in err and "rollout: 128 devices 256-383" in err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["roles"] == {"trainer": 256, "rollout": 128, "reward": 1}
    assert result["bytes_same_device"] == 0 and result["bytes_network"] == result["bytes_minimal"]


def test_cli_plan_says_how_co_located_stalesync_runs(capsys):
    """Co-located at staleness 1: sleeping engines take turns with the trainer, awake ones compute beside it."""
    base = [str(ROOT / "configs/tiny_cpu.yaml"), "stale_sync.max_staleness=1", "algorithm.tis_cap=2"]
    assert main(["plan", *base, "rollout.sleep_level=1"]) == 0
    assert "generation and training take turns on devices 0-1, host work overlaps" in capsys.readouterr().err
    assert main(["plan", *base]) == 0  # the main job's engines stay awake (rollout.sleep_level 0)
    assert "co-located, engines awake: both compute at once on devices 0-1" in capsys.readouterr().err
