"""StaleSync end to end on Ray with a real engine, trainer and DistQueue, on the disaggregated tiny config:
the asynchronous driver at staleness 0 is the synchronous loop (the same metrics for a seed); at staleness 1
the engines generate ahead, no sample is older than the bound, and a run resumed from a checkpoint trains on
the groups queued at that checkpoint, each once, in order; so does a run whose trainer rank dies (every rank
restarted from the last checkpoint, the queue and the producer rewound to it)."""

import json
from pathlib import Path

import pytest

from rlhf.config import load_run_config
from rlhf.driver import train
from rlhf.driver.stale_sync import ROUTE_BLOCKS, StaleSync

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/tiny_cpu_disaggregated.yaml"
COLOCATED = REPO / "configs/tiny_cpu.yaml"  # the main job: every role on both devices
# what a seed fixes; timings, and the staleness counters only the asynchronous driver logs, are left out
SAME = ("reward/mean", "reward/std", "accuracy/train", "response/length_mean", "rollout/groups_drawn",
        "rollout/generated_tokens", "actor/loss", "actor/grad_norm", "actor/clip_fraction", "actor/entropy_old",
        "parity/max_abs_diff", "parity/mean_abs_diff", "parity/tokens", "sync/bytes_received", "sync/version")


def _cfg(d: Path, out: Path, *extra: str, config: Path = CONFIG):
    return load_run_config(config, [
        f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]", f"data.heldout_files=[{d / 'heldout.jsonl'}]",
        f"output_dir={out}", f"tracking.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.export_hf=false",
        *extra])


def _steps(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _spans(out: Path):
    """The run's trace: name -> its complete events' (start, end) in microseconds."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    return lambda name: [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == name and e.get("ph") == "X"]


def test_staleness_zero_is_the_synchronous_loop(tiny, ray_session, tmp_path):
    """With a KL term to a reference model: the asynchronous driver's producer computes each batch's reference
    logprobs as soon as the batch is made, the synchronous loop in the step; the metrics are the same."""
    d, _ = tiny
    kl = "algorithm.kl_coef=0.01"
    sync = train(_cfg(d, tmp_path / "sync", "steps=3", "eval_every=3", kl))
    acfg = _cfg(d, tmp_path / "async", "steps=3", "eval_every=3", kl)
    asyn = train(acfg, log=lambda m: None, source=StaleSync(acfg))
    assert asyn["heldout_accuracy_history"] == sync["heldout_accuracy_history"]
    assert asyn["staleness_max"] == 0 and asyn["samples_dropped"] == 0
    a, s = _steps(tmp_path / "async"), _steps(tmp_path / "sync")
    assert [{k: m[k] for k in SAME + ("actor/kl",)} for m in a] == [{k: m[k] for k in SAME + ("actor/kl",)} for m in s]
    assert all(m["actor/kl"] > 0 for m in s[1:])  # the policy moved away from the reference
    events = json.loads((tmp_path / "async" / "trace.json").read_text())["traceEvents"]
    ahead = [e for e in events if e.get("name") == "reference logprobs" and e.get("ph") == "X"]
    assert len({e["args"]["step"] for e in ahead}) >= 3  # made with each batch, not in the step (below)
    assert all("time/reference_logprobs" not in m for m in a) and all("time/reference_logprobs" in m for m in s)
    assert all(m["stale/fresh_fraction"] == 1.0 for m in a)


def test_staleness_one_generates_ahead_and_resumes_each_group_once(tiny, ray_session, tmp_path):
    d, _ = tiny
    out = tmp_path / "run"
    replay = "trainer.routing_replay=rollout"  # the queued groups' routes go into the checkpoint too
    # expert-load balancing planned every step (migrating whenever a plan is no worse): the trainer's experts move
    # while the producer generates ahead, and the checkpoints, the resume and the restart carry the placement
    balance = ("trainer.expert_balance.enabled=true", "trainer.expert_balance.every_steps=1",
               "trainer.expert_balance.min_cv_drop=0.0")
    first = train(_cfg(d, out, "steps=4", "eval_every=100", "stale_sync.max_staleness=1", "checkpoint.every_steps=2",
                       replay, *balance))
    P = 32  # data.prompts_per_step of the config
    steps = _steps(out)
    assert first["steps_run"] == 4 and first["staleness_max"] <= 1 and first["samples_dropped"] == 0
    assert max(m["stale/staleness_max"] for m in steps) == 1  # the engines did generate ahead
    # every group made is trained on once, in the order it was made
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps] == [(i * P, i * P + P - 1) for i in range(4)]
    assert first["tokens_per_second"] > 0 and first["seconds_per_step"] > 0
    assert first["expert_balance_experts_moved"] > 0
    # the checkpoint at step 2 holds the groups generated ahead of it
    state = json.loads((out / "ckpt" / "step_000002" / "driver.json").read_text())["stale_sync"]
    assert len(state["queue"]["groups"]) >= P and state["next_seq"] == state["queue"]["groups"][-1]["seq"] + 1
    assert (out / "ckpt" / "step_000002" / ROUTE_BLOCKS).is_file()  # written by a task, not the driver

    # resumed from step 2; then trainer rank 1 dies in step 4's update: every trainer rank restarts from the
    # step-2 checkpoint, its queued groups loaded again and the producer rewound to its cursor
    again = tmp_path / "resumed"
    result = train(_cfg(d, again, "steps=4", "eval_every=100", "stale_sync.max_staleness=1",
                        f"checkpoint.resume={out / 'ckpt' / 'step_000002'}", replay, "chaos.kill_trainer_ranks=[1@4]",
                        *balance))
    assert result["trainer_restarts"] == 1 and result["steps_redone"] == 1 and result["samples_dropped"] == 0
    lines = _steps(again)
    assert [m["step"] for m in lines] == [3, 3, 4]  # step 3 redone after the restart: the later line counts
    resumed = [lines[0], lines[2]]
    assert lines[1]["stale/seq_first"] == lines[0]["stale/seq_first"] and lines[1]["actor/loss"] == lines[0]["actor/loss"]
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in resumed] == \
        [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps[2:]]
    # step 3 trains on the queued groups from the restored weights, replaying their restored routes: the same
    # update as the uninterrupted run
    for k in ("reward/mean", "accuracy/train", "rollout/generated_tokens", "actor/loss", "actor/grad_norm",
              "route/mismatch", "route/bytes_sent"):
        assert resumed[0][k] == steps[2][k], k


def test_a_dead_engine_is_replaced_under_stalesync_and_every_group_is_trained_once(tiny, ray_session, tmp_path):
    """The only engine killed while the producer generates batch 3 ahead of the trainer (partial rollouts on),
    then again during step 4's weight sync, then hung (stopped) during step 5's weight sync while the producer
    generates on it too: the driver's main thread replaces it where the trainer is idle (the hung one found by
    its liveness probes), the producer makes its batch again on the new engine, and every group is made and
    trained on once, in order, within the bound."""
    d, _ = tiny
    out = tmp_path / "run"
    result = train(_cfg(d, out, "steps=6", "eval_every=100", "stale_sync.max_staleness=1",
                        "stale_sync.partial_rollout=true", "chaos.kill_engines=[0@3,0@4:sync]",
                        "chaos.stop_engines=[0@5:sync]", "rollout.liveness_probe_s=5",
                        "rollout.stream_groups=true"))  # streamed draws: the kills land mid-stream
    P = 32
    steps = _steps(out)
    assert result["steps_run"] == 6 and result["engine_restarts"] == 3
    assert result["staleness_max"] <= 1 and result["samples_dropped"] == 0
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps] == [(i * P, i * P + P - 1) for i in range(6)]
    assert steps[-1]["faults/engine_restarts"] == 3 and result["parity_violations"] == 0


def test_co_located_engines_that_sleep_take_turns_with_the_trainer(tiny, ray_session, tmp_path):
    """The main job's co-located placement with sleeping engines at staleness 1: generation and the trainer's
    work take turns on the shared devices. Every trainer rank's old-logprob and update calls fall within a
    training turn and no rollout turn overlaps one, yet the engines still generate ahead (staleness 1); an
    engine killed during the producer's turn is replaced by the trainer's thread while it waits for its turn
    (no deadlock); a trainer rank killed in its turn's update (engines asleep) restarts every rank from the
    step-2 checkpoint; every group is trained on once, in order."""
    d, _ = tiny
    out = tmp_path / "turns"
    result = train(_cfg(d, out, "steps=5", "eval_every=100", "stale_sync.max_staleness=1", "algorithm.tis_cap=2",
                        "rollout.sleep_level=1", "chaos.kill_engines=[0@3]", "chaos.kill_trainer_ranks=[1@4]",
                        "checkpoint.every_steps=2", config=COLOCATED))
    P = 32
    lines = _steps(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 3, 4, 5]  # step 3 redone after the restart: the later line counts
    steps = [m for i, m in enumerate(lines) if i + 1 == len(lines) or lines[i + 1]["step"] != m["step"]]
    assert result["steps_run"] == 5 and result["samples_dropped"] == 0
    assert result["engine_restarts"] == 1 and result["trainer_restarts"] == 1
    assert max(m["stale/staleness_max"] for m in steps) == 1 and result["parity_violations"] == 0
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps] == [(i * P, i * P + P - 1) for i in range(5)]
    assert lines[2]["actor/loss"] == lines[3]["actor/loss"]  # the redone step: the same groups, the same update
    assert all("stale/turn_wait_seconds_training" in m for m in steps)
    spans = _spans(out)
    rollout, training, slack = spans("rollout turn"), spans("training turn"), 1e3  # µs: rounding, clocks
    assert len(training) >= 6 and len(rollout) >= 5  # six steps trained, one more turn cut short by the kill
    assert all(r1 <= t0 + slack or t1 <= r0 + slack for r0, r1 in rollout for t0, t1 in training)  # never both
    for name in ("old logprobs", "update"):
        calls = spans(name)
        assert len(calls) >= 6 * 2, name  # each step trained, each trainer rank
        assert all(any(t0 - slack <= c0 and c1 <= t1 + slack for t0, t1 in training) for c0, c1 in calls), name


def test_an_awake_co_located_engine_generates_beside_the_update(tiny, ray_session, tmp_path):
    """`configs/small_cpu.yaml`'s layout on the tiny model: staleness 1, one engine awake on device 1 beside the
    dp2 x ep2 trainer on both devices. No turns are taken: the engine generates the next batch while the trainer
    updates (a rollout span overlaps an update span in the trace), no sample is older than the bound, and every
    group is trained on once, in order."""
    d, _ = tiny
    out = tmp_path / "awake"
    result = train(_cfg(d, out, "steps=4", "eval_every=100", "stale_sync.max_staleness=1", "algorithm.tis_cap=2",
                        "rollout.sleep_level=0", "rollout.num_engines=1", "placement.rollout.devices=1",
                        "rollout.max_new_tokens=16", config=COLOCATED))
    P = 32
    steps = _steps(out)
    assert result["steps_run"] == 4 and result["samples_dropped"] == 0 and result["parity_violations"] == 0
    assert max(m["stale/staleness_max"] for m in steps) == 1
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps] == [(i * P, i * P + P - 1) for i in range(4)]
    assert not any("stale/turn_wait_seconds_training" in m for m in steps)
    spans = _spans(out)
    rollouts, updates = spans("rollout"), spans("update")
    assert not spans("rollout turn") and len(updates) >= 4 * 2
    assert any(min(r1, u1) > max(r0, u0) for r0, r1 in rollouts for u0, u1 in updates)


def test_a_dead_producer_is_reported_with_its_role_and_rank(tiny, ray_session, tmp_path):
    """The reward worker dies while the producer scores a batch ahead: the run stops at once with an error
    naming the role and rank, instead of the trainer waiting for a batch that never comes."""
    import threading
    import time

    import ray

    from rlhf.driver.stale_sync import ProducerError

    d, _ = tiny
    out = tmp_path / "run"

    def kill_reward_after_first_step():
        deadline = time.time() + 600
        while time.time() < deadline and not ((out / "steps.jsonl").is_file() and (out / "steps.jsonl").read_text()):
            time.sleep(0.2)
        ray.kill(ray.get_actor("reward-0"), no_restart=True)

    killer = threading.Thread(target=kill_reward_after_first_step, daemon=True)
    killer.start()
    t0 = time.time()
    with pytest.raises(ProducerError, match=r"the rollout producer failed: reward rank 0: score failed: the actor died"):
        train(_cfg(d, out, "steps=40", "eval_every=100", "stale_sync.max_staleness=1"))
    assert time.time() - t0 < 300  # the first steps and the start-up, not a timeout
    killer.join(5)


def test_greedy_generation_interrupted_by_an_install_of_the_same_weights_is_unchanged(tiny, ray_session):
    """Partial rollouts: an install landing mid-generation parks the generation between two decode steps;
    with the same weights installed, every sequence continues exactly as uninterrupted (tokens and
    logprobs), and each token records the version it was made by (both versions appear)."""
    import time

    from safetensors.torch import load_file

    from actors.remote import spawn
    from actors.vllm.engine import VLLMEngine
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.schema import DeviceType, RolloutConfig

    d, _ = tiny
    tok = load_tokenizer(str(d))
    prompts = [tok.encode(f"{a}+{b}=").ids for a in range(8) for b in range(8)]
    weights = sorted(load_file(str(d / "model.safetensors")).items())
    engine = spawn(VLLMEngine, "rollout", 0, str(d), RolloutConfig(cpu_kv_cache_gib=0.25), DeviceType.cpu, max_model_len=128,
                   interruptible=True, max_concurrency=3, resources={"rlhf_device": 1}, name_prefix="partial-")
    try:
        kw = dict(n=1, temperature=0.0, max_tokens=100, ignore_eos=True)
        plain = engine.call("generate", prompts, **kw, timeout_s=300)
        assert all(c.token_versions == (0,) * 100 for c in plain)
        landed = False
        # the install must land while the generation runs: tries with waits around a generation's length on
        # either side (too short: it lands before the first decode step; too long: after the last)
        seen = []
        for version, wait_s in enumerate((0.4, 0.15, 0.8, 0.05, 1.5), start=1):
            ref = engine.submit("generate", prompts, **kw)
            time.sleep(wait_s)
            engine.call("update_weights", weights, version, timeout_s=300)
            got = engine.wait("generate", ref, 300)
            assert [c.token_ids for c in got] == [c.token_ids for c in plain]
            assert all(abs(a - b) < 1e-5 for c, p in zip(got, plain) for a, b in zip(c.logp, p.logp))
            versions = {v for c in got for v in c.token_versions}
            seen.append((wait_s, sorted(versions)))
            if len(versions) == 2:  # some tokens before the install, the rest after it
                landed = True
                assert all(c.weight_version == min(c.token_versions) for c in got)
                assert all(list(c.token_versions) == sorted(c.token_versions) for c in got)
                break
        assert landed, f"no install landed mid-generation (wait, versions seen): {seen}"
    finally:
        engine.call("close", timeout_s=120)
        engine.kill()


def test_partial_rollouts_in_the_loop(tiny, ray_session, tmp_path):
    """Staleness 2 with partial rollouts: the engines generate without pause from the start, so the first
    syncs land mid-generation and those samples carry tokens of two versions; no sample is older than the
    bound (by its oldest token) and the engine never served a half-installed version (every sync checked)."""
    d, _ = tiny
    out = tmp_path / "run"
    result = train(_cfg(d, out, "eval_every=100", "stale_sync.max_staleness=2",
                        # 16 sequences at a time over 6 steps: a batch's 768 samples take many waves, so syncs land
                        # mid-generation whatever the machine's speed (at vLLM's default of 256 a batch could finish
                        # between two syncs; at 32 over 4 steps a fresh clone's CI once saw no mixed sample)
                        "stale_sync.partial_rollout=true", "rollout.max_num_seqs=16", "steps=6",
                        "rollout.stream_groups=true"))  # installs park streamed generations too
    steps = _steps(out)
    assert result["syncs"] == 6 and result["staleness_max"] <= 2 and result["samples_dropped"] == 0
    assert sum(m["stale/mixed_version_samples"] for m in steps) > 0
    assert result["parity_max_abs_diff"] < 2e-2  # on the samples of the weights each step starts from


def test_the_two_pool_config_runs_as_shipped(tiny, ray_session, tmp_path):
    """configs/tiny_cpu_async.yaml as shipped (staleness 1, a one-rank trainer on device 0, the engine and
    the reward on device 1): the engine generates ahead on its own device, no sample is older than the bound,
    every group is trained on once, in order, and every sync is exact."""
    d, _ = tiny
    out = tmp_path / "run"
    cfg = _cfg(d, out, "steps=4", "eval_every=100", config=REPO / "configs/tiny_cpu_async.yaml")
    from rlhf.placement.device_map import device_map

    dm = device_map(cfg)
    assert cfg.stale_sync.max_staleness == 1 and dm.devices_of("trainer") == (0,) and dm.devices_of("rollout") == (1,)
    assert not dm.shared("trainer", "rollout")
    result = train(cfg)
    steps = _steps(out)
    P = cfg.data.prompts_per_step
    assert result["steps_run"] == 4 and result["staleness_max"] == 1 and result["samples_dropped"] == 0
    assert [(m["stale/seq_first"], m["stale/seq_last"]) for m in steps] == [(i * P, i * P + P - 1) for i in range(4)]
    # each sync checksummed (a bad block raises), over the transport between the pools: no shared memory
    assert result["syncs"] == 4 and all(m["sync/checked_transfers"] > 0 and m["sync/bytes_shm"] == 0 for m in steps)
    assert result["parity_max_abs_diff"] < 2e-2
