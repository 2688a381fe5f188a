"""The RL loop (`rlhf train RUN.yaml`), one step top to bottom: each line is one phase.

    batch (the rollout source: generate n per prompt and score, or take them from StaleSync's queue)
    -> old logprobs (trainer) -> reference logprobs -> advantages -> policy update (mini-batches x epochs)
    -> weight sync (checksum verified) -> evaluation -> checkpoint -> the step's record

Co-located roles switch around the update: engines sleep and the trainer onloads before it; the trainer
offloads and the engines wake after the sync (`rollout.sleep_level`; on cpu, where vLLM has no sleep mode,
the engines hand back their pages themselves: docs/rollout.md). The driver moves references and small
tensors; weights move trainer -> engine directly (`weight_sync`). Where the batches come from is the rollout
source's (`rlhf.driver.sources`): the step's own generation, or StaleSync's producer
(`stale_sync.max_staleness` > 0). A dead trainer or reference rank restarts them all from the last
checkpoint, here, whatever the source.
"""

from __future__ import annotations

import sys
import time

from actors.remote import RoleError
from rlhf.driver.run import Run
from rlhf.driver.sources import Collect, RolloutSource
from rlhf.driver.stale_sync import StaleSync
from rlhf.driver.step import learn
from rlhf.schema import RunConfig


def train(cfg: RunConfig, log=lambda m: print(m, file=sys.stderr, flush=True),
          source: RolloutSource | None = None) -> dict:
    """The run `cfg` asks for; `source`: the rollout source (default: StaleSync where
    stale_sync.max_staleness > 0, else the synchronous one)."""
    if source is None:
        source = StaleSync(cfg) if cfg.stale_sync.max_staleness > 0 else Collect()
    try:
        return drive(Run.start(cfg, log, source), source)
    finally:
        source.close()


def drive(run: Run, source: RolloutSource) -> dict:
    """The steps from `run.step` + 1 to the last, their batches from `source`; the run's result."""
    try:
        acc_start = run.evaluate(run.step)
        source.start(run)
        step = run.step + 1
        while step <= run.cfg.steps:
            try:
                run_step(run, source, step)
            except RoleError as e:  # a dead trainer or reference rank: all restarted from the last checkpoint
                died = run.faults.dead_policy_rank(e)
                if died is None:
                    raise
                source.stop(run.roles.timeout_s, restarting=died)  # raises where it cannot stop in time
                run.faults.restart_policy(died)  # the weights, optimizer, data cursor and RNG of the checkpoint
                source.start(run)
                step = run.step + 1
                continue
            step += 1
        run.faults.close_recoveries()
        source.stop(run.roles.timeout_s)
        return run.finish(acc_start)
    except BaseException:
        run.faults.close_recoveries()
        source.stop(0)
        run.close(failed=True)
        raise


def run_step(run: Run, source: RolloutSource, step: int) -> None:
    cfg, t_step = run.cfg, time.time()
    run.begin(step)
    with run.phase(source.phase, step):
        ro = source.batch(run, step)
    with source.turn(run, step):
        learned = learn(run, ro, step, switch=source.switches)
        source.trained(run, step)
        acc = run.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.steps else None
    if run.checkpoint_due(step):
        with source.quiet():
            run.checkpoint(step)
    parity, extra = source.measure(run, step, ro, learned)
    run.record(step, ro, learned, parity, acc, time.time() - t_step, extra | learned.metrics)
