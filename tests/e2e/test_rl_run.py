"""The RL run end to end on Ray: a short GRPO run of the tiny policy, co-located on two stand-in
devices, trainer dp2 x ep2 resharded into a tp1 vLLM engine every step; then the same run with its driver
killed and resumed from its checkpoint, and with engines and trainer ranks killed or hung. Asserts what a user
relies on: reward rises, every sync is checksum-verified, trainer and engine logprobs agree, W&B offline files
and the trace exist, and an interrupted run continues to the same results as the uninterrupted one."""

import json
import math
import os
from pathlib import Path

import pytest

from rlhf.config import load_run_config
from rlhf.driver import train

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]
STEPS = 16
# expert-load balancing planned every 4 steps, a layer migrating whenever its plan is no worse: the trainer's
# experts move between its EP ranks in the run, and every sync, resume and redo after that must stay exact
BALANCE = ("trainer.expert_balance.enabled=true", "trainer.expert_balance.every_steps=4",
           "trainer.expert_balance.min_cv_drop=0.0")
# engines that really sleep during the update (weights and KV cache handed back, docs/rollout.md), as the small
# run's do: the faults below then hit engines holding no weights (a trainer rank killed mid-update)
ASLEEP = ("rollout.sleep_level=2",)
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # Ray's per-node agents (process titles)


def _overrides(d: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]", f"data.heldout_files=[{d / 'heldout.jsonl'}]",
            f"output_dir={out}", f"tracking.dir={out}", f"checkpoint.dir={out / 'ckpt'}", *extra]


def _kill_driver_after_checkpoint(args: list[str], run: Path, step: int, log_path: Path) -> list:
    """`rlhf train` with `args` in a process of its own, killed (SIGKILL) half a second after its checkpoint of
    `step` is complete; returns the processes it had started, once every one that holds anything is gone."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf.cli", "train", str(REPO / "configs/tiny_cpu.yaml"), *args],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 600
        while not (run / "ckpt" / f"step_{step:06d}" / "COMPLETE").exists():
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)  # into the next step
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    # Ray's two agents see their raylet gone at once but then spend 60 s failing to report it to the dead GCS
    # (RAY_DASHBOARD_GCS_RPC_TIMEOUT_SECONDS); they hold no shared memory: the caller waits for them later
    _, alive = psutil.wait_procs([p for p in family if not p.name().startswith(RAY_AGENTS)], timeout=90)
    assert not alive, [p.name() for p in alive]
    return family


@pytest.fixture(scope="module")
def killed_families():
    """The processes each killed driver had started. Ray's two agents outlive the kill by up to a minute (they see
    their raylet gone at once, then spend RAY_DASHBOARD_GCS_RPC_TIMEOUT_SECONDS failing to tell the dead GCS) and
    hold nothing: once this module's other tests have run, every one of them must be gone on its own (no orphan)."""
    import psutil

    families: list = []
    yield families
    _, alive = psutil.wait_procs([p for family in families for p in family], timeout=90)
    assert not alive, [p.name() for p in alive]


ROLES = ("ray::TrainerWorker", "ray::PolicyWorker", "ray::VLLMEngine", "ray::RuleRewardWorker")
LISTENING: dict[int, set] = {}  # the short run's role processes: pid -> {(address, port)} seen listening
TITLES: dict[int, str] = {}  # pid -> its process title (ray::<role class>...)
MALLOC: dict[int, tuple[str | None, bool]] = {}  # pid -> (GLIBC_TUNABLES it started with, jemalloc mapped in it)


def _sample_listeners(stop) -> None:
    """While the short run goes: every role process's listening TCP sockets, as `ss -ltnp` shows them."""
    import psutil

    while not stop.wait(0.5):
        for p in psutil.process_iter(["pid", "name", "cmdline"]):
            title = " ".join(p.info["cmdline"] or [])
            if not title.startswith(ROLES):
                continue
            try:
                conns = p.net_connections(kind="tcp")
                if p.info["pid"] not in MALLOC:  # preloaded at exec: mapped from the process's start
                    MALLOC[p.info["pid"]] = (p.environ().get("GLIBC_TUNABLES"),
                                             any("libjemalloc" in m.path for m in p.memory_maps()))
            except (psutil.Error, OSError):
                continue
            TITLES[p.info["pid"]] = title
            LISTENING.setdefault(p.info["pid"], set()).update(
                (c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)


@pytest.fixture(scope="module")
def short_run(tiny, ray_session, tmp_path_factory):
    import threading

    d, _ = tiny
    out = tmp_path_factory.mktemp("run")
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, out, f"steps={STEPS}", "eval_every=8", "checkpoint.every_steps=8", "algorithm.kl_coef=0.001",
        "rollout.capture_routes=true", *BALANCE, *ASLEEP))
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_listeners, args=(stop,), daemon=True)
    sampler.start()
    try:
        return out, train(cfg)
    finally:
        stop.set()
        sampler.join(10)


def test_a_local_run_listens_on_loopback_but_for_rays_own_server(short_run):
    """docs/security.md: the groups our roles make (the trainer's, the reference's, the weight sync) listen on
    127.0.0.1 in a local run; the one listener of a role process on a wider address is Ray's core-worker server
    (one per Ray worker process, on every interface). torch's own store would add a second (rank 0 of each group)."""
    import ipaddress

    assert LISTENING, "no role process was seen while the run went"
    loop = {pid for pid, seen in LISTENING.items() if any(ipaddress.ip_address(ip).is_loopback for ip, _ in seen)}
    assert any(TITLES[pid].startswith("ray::TrainerWorker") for pid in loop)  # the groups were seen
    wider = {TITLES[pid]: sorted(a for a in seen if not ipaddress.ip_address(a[0]).is_loopback)
             for pid, seen in LISTENING.items()}
    assert all(len(a) <= 1 and all(ip in ("0.0.0.0", "::") for ip, _ in a) for a in wider.values()), wider


def test_trainer_processes_run_on_jemalloc_engines_on_huge_pages_and_rewards_as_they_are(short_run):
    """rlhf.host_memory.allocator_env: a trainer (and reference) rank on cpu runs on jemalloc (trainer.cpu_allocator
    auto, where a library is found: Ray's wheel carries one), keeping the pages an update frees, and hands them
    back at its offload (this run's engines sleep); a sleeping engine's glibc malloc takes huge pages for the
    weights and KV cache it refaults at every sync and wake; the reward workers are left as they are."""
    from rlhf.host_allocator import huge_page_env, jemalloc_library

    seen = [(TITLES[pid].split()[0], *MALLOC[pid]) for pid in MALLOC if pid in TITLES]
    policy = [s for s in seen if s[0].startswith(("ray::TrainerWorker", "ray::PolicyWorker"))]
    engines = [s for s in seen if s[0].startswith("ray::VLLMEngine")]
    rewards = [s for s in seen if s[0].startswith("ray::RuleRewardWorker")]
    assert policy and engines and rewards, seen
    huge = huge_page_env()["GLIBC_TUNABLES"]
    if jemalloc_library() is not None:
        assert all(jemalloc and t == huge for _, t, jemalloc in policy), seen  # glibc's tunable too, unused
    else:
        assert all(t == huge and not jemalloc for _, t, jemalloc in policy), seen
    assert all(t == huge and not jemalloc for _, t, jemalloc in engines), seen
    assert all(t == os.environ.get("GLIBC_TUNABLES") and not jemalloc for _, t, jemalloc in rewards), seen


def test_reward_rises_and_every_sync_is_exact(short_run):
    out, result = short_run
    assert result["steps_run"] == STEPS and result["syncs"] == STEPS  # a bad checksum would have raised
    assert result["reward_last_quarter"] > result["reward_first_quarter"]
    # fp32 on both sides, engine weights installed exactly: only kernel rounding differs (about 6e-7 on
    # average, 1e-5 at most). A router near-tie can flip one token's expert choice between the trainer's
    # and the engine's kernels (seen once in 250 steps, 7e-3), hence the looser bound on the maximum.
    assert result["parity_mean_abs_diff_max"] < 1e-5
    assert result["parity_max_abs_diff"] < 2e-2
    assert result["parity_p99_abs_diff_max"] < 1e-4 and result["parity_violations"] == 0  # judged on the p99
    assert len(result["heldout_accuracy_history"]) == 3  # start, step 8, step 16
    # the engine's captured expert choices are the trainer's own but at rare near-ties (fp32 both sides)
    assert result["route_mismatch_mean"] is not None and result["route_mismatch_mean"] < 1e-2
    # each engine rank received exactly the bytes its own shards hold, every step
    assert result["sync_bytes_per_engine_rank"] == result["sync_bytes_minimal_per_engine_rank"]
    assert 0 < result["sync_share"] < 1 and result["sync_link_gb_per_s"] > 0
    assert result["expert_balance_experts_moved"] > 0 and result["expert_balance_bytes_moved"] > 0


def test_engine_of_tp2_in_the_loop_receives_per_worker(tiny, ray_session, tmp_path, killed_families):
    """One engine of two TP workers, each a rank of the sync group receiving only its own slices. Killed in step
    2's generation and replaced: its processes' shared memory (the collectives' segments, and the message queues
    between its engine core and workers, which nobody unlinks once the actor is killed) goes when the new engine
    is up. Then the driver is killed in step 3, after its step-2 checkpoint: its engine's processes go with it and
    leave their shared memory, which the driver had recorded in the run's directory; the resumed run's engine
    removes it."""
    import os

    d, _ = tiny
    args = _overrides(d, tmp_path, "steps=3", "eval_every=100", "rollout.num_engines=1", "rollout.tp=2",
                      "checkpoint.every_steps=2", "checkpoint.export_hf=false", "rollout.capture_routes=true",
                      "chaos.kill_engines=[0@2]")
    shm_before = set(os.listdir("/dev/shm"))
    killed_families.append(_kill_driver_after_checkpoint(args, tmp_path, 2, tmp_path / "driver.log"))
    killed = {m["step"]: m for m in map(json.loads, (tmp_path / "steps.jsonl").read_text().splitlines())}
    assert killed[2]["faults/engine_restarts"] == 1 and killed[2]["sync/bytes_received"] > 0
    left, recorded = set(os.listdir("/dev/shm")) - shm_before, json.loads((tmp_path / "engine_shm.json").read_text())
    assert left and all(any(n == r or n.startswith(f"{r}-") for r in recorded) for n in left), (left, recorded)

    result = train(load_run_config(REPO / "configs/tiny_cpu.yaml", [*args, "checkpoint.resume=auto"]))
    assert result["steps_run"] == 1 and result["syncs"] == 1
    assert set(os.listdir("/dev/shm")) <= shm_before  # segments and semaphores alike
    assert not (tmp_path / "engine_shm.json").exists()  # a clean shutdown: nothing to record
    assert result["route_mismatch_mean"] < 1e-2  # routes captured in a TP-2 engine (its rank 0 worker)
    per_rank, minimal = result["sync_bytes_per_engine_rank"], result["sync_bytes_minimal_per_engine_rank"]
    assert per_rank == minimal and len(per_rank) == 2
    assert max(per_rank) < result["sync_bytes_per_step"]  # no worker receives the whole model
    assert result["parity_mean_abs_diff_max"] < 1e-5 and result["parity_max_abs_diff"] < 2e-2


def test_wandb_trace_checkpoint_and_export_exist(short_run):
    out, result = short_run
    assert Path(result["wandb_dir"]).is_dir() and list(Path(result["wandb_dir"]).glob("run-*.wandb"))
    events = json.loads(Path(result["trace"]).read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"rollout", "old logprobs", "reference logprobs", "update", "weight sync"} <= names
    assert any(e["ph"] == "M" and "device 0" in str(e["args"]) for e in events)  # per-device tracks
    assert (Path(result["hf_export"]) / "model.safetensors").is_file()
    assert (out / "ckpt" / f"step_{STEPS:06d}" / "COMPLETE").is_file()


def test_driver_killed_mid_step_resumes_equal_to_an_uninterrupted_run(short_run, tiny, tmp_path, killed_families):
    """kill -9 of the driver during step 9, after its step-8 checkpoint: its Ray processes (engines, trainer
    ranks, raylet) and shared memory go with it, wandb's temp directories stay in the run's output, and
    `checkpoint.resume=auto` (started at once) redoes the steps since the checkpoint with every metric of every
    step equal to the uninterrupted run of the same seed (`short_run`), timings aside. Its engines serve the
    checkpoint's weights (expert placement included): the held-out accuracy at the resume point is the one the
    first run measured at step 8."""
    import os

    out, first = short_run
    d, _ = tiny
    run = tmp_path / "killed"
    args = _overrides(d, run, f"steps={STEPS}", "eval_every=8", "checkpoint.every_steps=8", "algorithm.kl_coef=0.001",
                      "rollout.capture_routes=true", *BALANCE)
    shm_before, tmp_before = set(os.listdir("/dev/shm")), set(os.listdir("/tmp"))
    killed_families.append(_kill_driver_after_checkpoint(args, run, 8, tmp_path / "driver.log"))
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert not [n for n in set(os.listdir("/tmp")) - tmp_before if n.startswith("tmp") and n.endswith(
        ("wandb-media", "wandb-artifacts"))]  # wandb's temp directories: in the run's output instead

    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", [*args, "checkpoint.resume=auto"])
    result = train(cfg)  # (no orphan: the killed driver's processes are waited for at the module's end)
    assert result["steps_run"] == STEPS - 8
    assert result["heldout_accuracy_start"] == dict(first["heldout_accuracy_history"])[8]
    want = {m["step"]: m for m in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    got = {m["step"]: m for m in map(json.loads, (run / "steps.jsonl").read_text().splitlines())}  # redone: last
    timing = ("time/", "throughput/", "sync/seconds", "sync/gb_per_s", "sync/floor", "sync/link", "onload/", "offload/")
    for step in range(9, STEPS + 1):
        differ = [k for k in want[step] if not k.startswith(timing) and want[step][k] != got[step].get(k)]
        assert not differ, (step, [(k, want[step][k], got[step].get(k)) for k in differ[:5]])


def test_dead_engines_and_trainer_ranks_are_replaced_and_the_run_equals_an_uninterrupted_one(short_run, tiny,
                                                                                             tmp_path):
    """Rollout engines killed mid-generation (step 3), mid-sync (step 5) and mid-evaluation (step 8), and two
    hung (stopped: alive and never answering), mid-generation (step 6) and mid-sync (step 7), each found by its
    liveness probes within seconds (not the generation's or the sync group's timeout): each is replaced on its
    slot, the weight-sync group re-formed, the weights installed and checksummed, and the
    interrupted work redone with the same seeds. Then trainer rank 1 killed mid-update (step 10): every trainer
    and reference rank restarts, the step-8 checkpoint is restored and step 9 is redone; then trainer rank 0
    hung (stopped) in step 12's old-logprob pass, found by its probes: restarted the same way, steps 9-11
    redone. Every step
    trains on the same prompts and samples as the uninterrupted run of the same seed (`short_run`): every metric
    equal, timings aside. Nothing is left behind."""
    import os

    out, first = short_run
    d, _ = tiny
    shm_before = set(os.listdir("/dev/shm"))
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, tmp_path, f"steps={STEPS}", "eval_every=8", "checkpoint.every_steps=8", "algorithm.kl_coef=0.001",
        "rollout.capture_routes=true", "chaos.kill_engines=[1@3,0@5:sync,1@8:evaluate]", "chaos.stop_engines=[0@6,1@7:sync]",
        "rollout.liveness_probe_s=5", "rollout.max_restarts=5", "chaos.kill_trainer_ranks=[1@10]",
        "chaos.stop_trainer_ranks=[0@12:logprobs]", "trainer.liveness_probe_s=5", *BALANCE, *ASLEEP))
    said = []
    result = train(cfg, log=said.append)
    assert result["steps_run"] == STEPS and result["engine_restarts"] == 5
    assert result["trainer_restarts"] == 2 and result["steps_redone"] == 4  # 9 after 10's failure; 9-11 after 12's
    assert result["heldout_accuracy_history"] == first["heldout_accuracy_history"]
    want = {m["step"]: m for m in map(json.loads, (out / "steps.jsonl").read_text().splitlines())}
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [*range(1, 10), *range(9, 12), *range(9, STEPS + 1)]  # the last line counts
    got = {m["step"]: m for m in lines}
    timing = ("time/", "throughput/", "sync/seconds", "sync/gb_per_s", "sync/floor", "sync/link", "onload/", "offload/",
              "faults/")
    for step in range(1, STEPS + 1):
        differ = [k for k in want[step] if not k.startswith(timing) and want[step][k] != got[step].get(k)]
        assert not differ, (step, [(k, want[step][k], got[step].get(k)) for k in differ[:5]])
    assert [got[s]["faults/engine_restarts"] for s in (2, 3, 5, 6, 7, 8, 16)] == [0, 1, 2, 3, 4, 5, 5]
    hung = [line for line in said if "liveness probe" in line]
    assert any("step 6: rollout engine(s) [0] failed" in line for line in hung), hung
    assert any("step 7: rollout engine(s) [1] failed (rollout rank 1: receive_weights hung" in line for line in hung), hung
    restarts = [(got[s]["faults/trainer_restarts"], got[s]["faults/steps_redone"]) for s in (8, 9, 16)]
    assert restarts == [(0, 0), (2, 4), (2, 4)]
    assert any(line.startswith("step 12: trainer rank 0: ") and "hung: its process answered no liveness probe" in line
               for line in said), [line for line in said if "step 12" in line]
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_rollout_routing_replay_with_bf16_engines(tiny, ray_session, tmp_path):
    """R3 in the loop: bf16 engines (as on GPUs and NPUs), an fp32 trainer computing in bf16
    (trainer.compute_dtype), the engines' routes replayed in every trainer forward; the route metrics are logged
    every step. The sync sends the engines' dtype: each engine rank receives 2 bytes per parameter, the plan's
    minimum, cast from the fp32 shards as they are packed."""
    from rlhf.model.shapes import param_shapes

    d, _ = tiny
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, tmp_path, "steps=2", "eval_every=100", "checkpoint.export_hf=false", "rollout.dtype=bfloat16",
        "trainer.routing_replay=rollout", "trainer.compute_dtype=bfloat16",
        "trainer.allow_slow_cpu_bf16=true"))  # a tiny model: fast enough on a cpu without bf16 matmuls
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    elements = sum(math.prod(s) for s in param_shapes(cfg.model).values())
    for m in steps:
        assert m["sync/bytes_per_engine_rank_max"] == m["sync/bytes_minimal_per_engine_rank_max"] == 2 * elements
        assert m["route/token_layers"] > 0 and 0 <= m["route/mismatch"] <= m["route/tokens_any_mismatch"] <= 1
        # each trainer rank gets the routes of its DP index's samples only (dp2 x ep2, one stage)
        assert 0 < m["route/bytes_per_rank_max"] < m["route/bytes_sent"]
        assert m["parity/p99_abs_diff"] < 0.5  # bf16 rounding, not a broken sync


def test_pangu_architecture_in_the_loop(tiny, ray_session, tmp_path):
    """The DeepSeek-V3 / Pangu architecture through the whole loop (configs/tiny_cpu_pangu.yaml): MLA, sigmoid
    group-limited routing with a correction bias and a shared expert, trainer dp2 x ep2 resharded into two
    engines every step, exact syncs, trainer/engine parity as tight as Qwen3-MoE's, the engines' expert choices
    the trainer's while the auxiliary-loss-free update moves the correction bias every step (a bias the engines
    did not get would route otherwise). Random weights of the architecture (the task files are the tiny
    fixture's). The policy carries an MTP module: never sent to the engines (vLLM holds none without speculative
    decoding), kept unchanged in the exported model. The one engine is tp2 x ep2 and balancing runs every step:
    the trainer's experts migrate and the engine's follow the same predictions (issue 16), parity unchanged."""
    from dataclasses import replace

    import torch

    from rlhf.config import load_model_config
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import iter_safetensors, save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    d, _ = tiny
    policy = tmp_path / "pangu"
    m = Qwen3MoeForCausalLM(replace(load_model_config(REPO / "configs/model/pangu_moe_tiny.yaml"), num_mtp_layers=1))
    m.init_weights(seed=3, std=0.05, router_bias_std=0.1)
    save_tokenizer(build_tokenizer(m.config.vocab_size), policy)
    save_pretrained(m, policy)
    cfg = load_run_config(REPO / "configs/tiny_cpu_pangu.yaml", [
        *_overrides(d, tmp_path / "run", "steps=3", "eval_every=100", "model.num_mtp_layers=1",
                    "rollout.capture_routes=true", "trainer.router_bias_update_rate=0.05", "rollout.num_engines=1",
                    "rollout.tp=2", "rollout.ep=2", *BALANCE, "trainer.expert_balance.every_steps=1"),
        f"model.path={policy}"])
    result = train(cfg)
    assert result["steps_run"] == 3 and result["syncs"] == 3
    assert result["expert_balance_experts_moved"] > 0 and result["expert_balance_engine_layers_replaced"] > 0
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    moved = [m["expert_load/router_bias_abs_max"] for m in steps]
    assert all(0 < b for b in moved) and len(set(moved)) > 1, moved
    exported = dict(iter_safetensors(result["hf_export"]))
    mtp = [n for n in exported if n.startswith("model.layers.3.")]
    assert mtp and all(torch.equal(exported[n], m.state_dict()[n]) for n in mtp if n in m.state_dict())
    assert result["sync_bytes_per_engine_rank"] == result["sync_bytes_minimal_per_engine_rank"]
    assert result["parity_mean_abs_diff_max"] < 1e-5 and result["parity_max_abs_diff"] < 2e-2
    assert result["parity_p99_abs_diff_max"] < 1e-4 and result["parity_violations"] == 0
    assert result["route_mismatch_mean"] < 1e-2


def test_multi_turn_episodes_in_the_loop(tiny, ray_session, tmp_path):
    """Episodes through the whole loop (`agent.environment`: arithmetic with feedback, a wrong answer told so
    and tried again): the trainer scores every episode's sampled tokens in the context the engines sampled them
    in, observations included, as tightly as single turns (fp32 parity), no turn drifted from its episode's
    tokens, and the episodes' statuses and turns are logged every step."""
    d, _ = tiny
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, tmp_path, "steps=2", "eval_every=2", "checkpoint.export_hf=false", "agent.environment=rlhf.agents.retry:Retry",
        "agent.max_turns=3", "agent.turn_tokens=8", "agent.max_tokens=96", "algorithm.dynamic_sampling=false",
        "data.gen_prompts_per_step=0"))
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    for m in steps:
        assert m["agent/token_mismatch"] == 0 and m["agent/episodes_env_error"] == m["agent/episodes_timeout"] == 0
        assert abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_")) - 1) < 1e-9
        assert m["agent/observation_tokens"] > 0 and m["agent/turns_mean"] > 1  # wrong answers were tried again
        assert m["parity/p99_abs_diff"] < 1e-3 and m["parity/tokens"] == m["agent/sampled_tokens"]
    assert 0 <= result["heldout_accuracy_end"] <= 1 and len(result["heldout_accuracy_history"]) >= 2


def test_episodes_survive_hung_and_failing_environments_and_killed_workers(tiny, ray_session, tmp_path):
    """Chaos for episodes (docs/agents.md): environments that hang or raise now and then (`rlhf.agents.flaky`)
    on two environment workers, one of them killed while a round of steps is out, and an engine killed while the
    first step's turns generate. Every episode ends with a status (the shares add up to one), the hung and failing
    ones as timeout and env_error, the killed worker's episodes begin again on its replacement, the dead engine's
    turns are sampled again on its replacement from the episodes' own tokens (no turn drifted), and the run
    finishes."""
    d, _ = tiny
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, tmp_path, "steps=2", "eval_every=2", "checkpoint.export_hf=false", "agent.environment=rlhf.agents.flaky:Flaky",
        "agent.environment_args={environment: rlhf.agents.retry:Retry, hang: 0.02, fail: 0.02, hang_s: 600}",
        "agent.step_timeout_s=2", "agent.workers=2", "chaos.kill_environment_workers=[1@2]", "chaos.kill_engines=[1@1]",
        "agent.max_turns=3",
        "agent.turn_tokens=8", "agent.max_tokens=96", "algorithm.dynamic_sampling=false", "data.gen_prompts_per_step=0"))
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    for m in steps:
        assert abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_")) - 1) < 1e-9
        # parity over the trained episodes' sampled tokens: the broken ones' are out of the loss
        assert m["agent/token_mismatch"] == 0 and 0 < m["parity/tokens"] < m["agent/sampled_tokens"]
    assert sum(m["agent/episodes_timeout"] for m in steps) > 0 and sum(m["agent/episodes_env_error"] for m in steps) > 0
    assert steps[0]["agent/restarted"] == 0 and steps[1]["agent/restarted"] > 0  # worker 1 killed at step 2
    assert result["engine_restarts"] == 1 and steps[0]["faults/engine_restarts"] == 1


def test_episodes_replay_their_routes_with_the_prefix_cache_on(tiny, ray_session, tmp_path):
    """Routing replay for episodes (`trainer.routing_replay=rollout`): each episode trains with the routes of its
    last turn, which cover its whole context, the prefix cache's share included (routes kept by KV slot:
    `actors.vllm.route_capture`). A long feedback string makes later turns' contexts span whole 32-token
    blocks, so the cache serves them; fp32 engines and trainer: the replayed routes are the trainer's own
    choices but at near-ties, and its logprobs the engines'."""
    d, _ = tiny
    cfg = load_run_config(REPO / "configs/tiny_cpu_retry.yaml", _overrides(
        d, tmp_path, "steps=2", "eval_every=100", "checkpoint.export_hf=false", "trainer.routing_replay=rollout",
        "agent.environment_args={feedback: ' ? ? ? ? ? ? ? ? ? ? ? ? ? ? ? ? ? ? ? ?'}", "agent.max_tokens=120",
        "agent.turn_tokens=8", "rollout.block_size=32", "data.prompts_per_step=16"))
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert max(m["agent/prefix_cache_hit_rate"] for m in steps) > 0  # later turns read cached blocks
    for m in steps:
        assert m["agent/token_mismatch"] == 0 and m["route/token_layers"] > 0
        assert m["route/tokens_any_mismatch"] < 0.02  # near-ties only (fp32 on both sides)
        assert m["parity/p99_abs_diff"] < 1e-3 and m["parity/tokens"] == m["agent/sampled_tokens"]


def test_episodes_under_stalesync_with_partial_rollouts(tiny, ray_session, tmp_path):
    """Episodes under StaleSync (staleness 1, partial rollouts, the engines awake beside the trainer): the
    producer runs the next batch's episodes while the trainer updates, the episodes travel through DistQueue
    with their loss masks, an evaluation's episodes share the environment workers with the producer's, and
    weights installed between (or within) an episode's turns tag the tokens after them with the new version.
    Every episode has a status, no turn drifted from its episode's tokens, no sample is older than the bound,
    and on the samples of the weights each step starts from, trainer and engines agree."""
    d, _ = tiny
    out = tmp_path / "run"
    cfg = load_run_config(REPO / "configs/tiny_cpu_retry.yaml", _overrides(
        d, out, "steps=4", "eval_every=2", "checkpoint.export_hf=false", "stale_sync.max_staleness=1",
        "stale_sync.partial_rollout=true", "algorithm.tis_cap=2", "agent.workers=2", "data.prompts_per_step=16",
        "rollout.max_num_seqs=16"))
    result = train(cfg)
    assert result["steps_run"] == 4 and result["syncs"] == 4
    assert result["staleness_max"] == 1 and result["samples_dropped"] == 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    for m in steps:
        assert abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_")) - 1) < 1e-9
        assert m["agent/token_mismatch"] == 0 and m["agent/episodes_env_error"] == m["agent/episodes_timeout"] == 0
        assert m["agent/observation_tokens"] > 0 and m["parity/tokens"] <= m["agent/sampled_tokens"]
    assert min(m["stale/fresh_fraction"] for m in steps) < 1  # episodes of older weights were trained on
    # a sync landed between (or within) the turns of episodes in flight: their later tokens are the new version's
    # (231 of 256 episodes at two of the four steps in the first run here)
    assert sum(m["stale/mixed_version_samples"] for m in steps) > 0
    assert steps[0]["parity/tokens"] > 0  # the first batch is all of the first weights: checked token by token
    assert result["parity_max_abs_diff"] < 2e-2 and result["parity_p99_abs_diff_max"] < 1e-3
    assert len(result["heldout_accuracy_history"]) == 3  # evaluations ran beside the producer's episodes


def _shipped_task_two_steps(tmp_path: Path, task: str, sft_steps: int, config: str) -> tuple[dict, list[dict]]:
    """A shipped task's config run for two small steps on a policy warmed for `sft_steps` only (`make-tiny --task
    task`): the run's result and its steps' metrics."""
    import dataclasses

    from rlhf.config import load_model_config
    from rlhf.tiny import TinySpec, make_tiny

    d = tmp_path / task
    make_tiny(d, load_model_config(REPO / "configs/model/qwen3_moe_tiny.yaml"),
              dataclasses.replace(TinySpec(), task=task, max_sft_steps=sft_steps, eval_every=sft_steps, n_heldout=32,
                                  target_accuracy=1.0, min_accuracy=0.0), log=lambda m: None)
    cfg = load_run_config(REPO / config, _overrides(
        d, tmp_path, "steps=2", "eval_every=2", "checkpoint.export_hf=false", "data.prompts_per_step=8",
        "algorithm.group_size=8", "trainer.mini_batch_size=64"))
    result = train(cfg)
    assert result["steps_run"] == 2
    return result, [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]


def test_the_calculator_tool_task_runs_as_shipped(ray_session, tmp_path):
    """configs/tiny_cpu_tool.yaml for two steps on a briefly warmed tool policy (`make-tiny --task tool`, 50 SFT
    steps): episodes call `<calc>`, read the result and answer, on real engines and an environment worker; the
    tool-call rate and success given a call are logged, no turn drifted, parity over exactly the sampled tokens."""
    steps = _shipped_task_two_steps(tmp_path, "tool", 50, "configs/tiny_cpu_tool.yaml")[1]
    for m in steps:
        assert abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_")) - 1) < 1e-9
        assert m["agent/token_mismatch"] == 0 and m["parity/tokens"] == m["agent/sampled_tokens"]
        assert 0 < m["agent/tool_call_rate"] <= 1 and 0 <= m["agent/success_given_call"] <= 1
        assert m["agent/observation_tokens"] > 0  # the calculator answered calls


def test_the_code_task_with_feedback_runs_as_shipped(ray_session, tmp_path):
    """configs/tiny_cpu_code_feedback.yaml for two steps on a briefly warmed code policy (`make-tiny --task code`,
    30 SFT steps): each turn a program run in the sandbox of an environment worker, a failing one answered with
    what it printed and tried again; every episode has a status, no turn drifted, parity over exactly the
    sampled tokens, the sandbox's answers read as observations; the workers' box directories gone with them."""
    import tempfile

    def box_dirs() -> set[str]:
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(("rlhf-boxroot-", "rlhf-boxwork-"))}

    before = box_dirs()
    result, steps = _shipped_task_two_steps(tmp_path, "code", 30, "configs/tiny_cpu_code_feedback.yaml")
    assert box_dirs() <= before  # the workers released before they were killed (`Roles.shutdown`), the driver
    # (its held-out evaluation) as the run closed
    for m in steps:
        assert abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_")) - 1) < 1e-9
        assert m["agent/token_mismatch"] == 0 and m["agent/episodes_timeout"] == 0
        assert 0 < m["parity/tokens"] <= m["agent/sampled_tokens"] and m["parity/p99_abs_diff"] < 1e-3
        assert m["agent/env_steps"] >= 64 and m["agent/observation_tokens"] > 0  # failing programs answered
    assert 0 <= result["heldout_accuracy_end"] <= 1


def test_an_agent_program_on_the_chat_endpoint_trains_in_the_loop(tiny, ray_session, tmp_path):
    """`agent.function`: an agent program speaking the OpenAI chat API (`rlhf.agents.chat_agent:retry`, plain HTTP)
    is the episode: its sessions' tokens are what the trainer scores (parity over exactly the sampled tokens),
    no reward workers or environment workers start, and its reward is the episode's."""
    d, _ = tiny
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", _overrides(
        d, tmp_path, "steps=2", "eval_every=2", "checkpoint.export_hf=false",
        "agent.function=rlhf.agents.chat_agent:retry", "agent.max_turns=3", "agent.turn_tokens=8",
        "agent.max_tokens=96", "algorithm.dynamic_sampling=false", "data.gen_prompts_per_step=0"))
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    for m in steps:
        assert m["agent/token_mismatch"] == 0 and m["agent/episodes_done"] > 0.95
        assert m["parity/p99_abs_diff"] < 1e-3 and m["parity/tokens"] == m["agent/sampled_tokens"]
        assert m["agent/observation_tokens"] > 0 and m["agent/turns_mean"] > 1  # wrong answers were told so
