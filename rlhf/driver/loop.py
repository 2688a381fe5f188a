"""The RL loop (`rlhf train RUN.yaml`), one step top to bottom: each line is one phase.

    rollouts (generate n per prompt, rewards) -> old logprobs (trainer) -> reference logprobs
    -> advantages -> policy update (mini-batches x epochs) -> weight sync (checksum verified)

Co-located roles switch around the update: engines sleep and the trainer onloads before it; the
trainer offloads and the engines wake after the sync (`rollout.sleep_level`; on cpu, where vLLM has no
sleep mode, the engines hand back their pages themselves: docs/rollout.md). The driver moves references
and small tensors; weights move trainer -> engine directly (`weight_sync`). With `stale_sync.max_staleness`
> 0 the run goes to `async_loop` instead.
"""

from __future__ import annotations

import sys
import time

from rlhf.driver.async_loop import train_async
from rlhf.driver.rollout import collect
from actors.remote import RoleError
from rlhf.driver.run import Run
from rlhf.driver.step import learn
from rlhf.parity import logprob_parity
from rlhf.schema import RunConfig


def train(cfg: RunConfig, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    if cfg.stale_sync.max_staleness > 0:  # generation runs ahead of the trainer: a driver of its own
        return train_async(cfg, log)
    run = Run.start(cfg, log)
    try:
        acc_start = run.evaluate(run.step)
        step = run.step + 1
        while step <= cfg.steps:
            try:
                run_step(run, step)
            except RoleError as e:  # a dead trainer or reference rank: all restarted from the last checkpoint
                died = run.dead_policy_rank(e)
                if died is None:
                    raise
                run.restart_policy(died)
                step = run.step + 1
                continue
            step += 1
        return run.finish(acc_start)
    except BaseException:
        run.close(failed=True)
        raise


def run_step(run: Run, step: int) -> None:
    cfg, t_step, run.at_step = run.cfg, time.time(), step
    with run.phase("rollout", step):
        ro = collect(cfg, run.roles, run.inputs.sampler, run.inputs.tokenizer, step, run.route_stages)
    learned = learn(run, ro, step)
    acc = run.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.steps else None
    run.checkpoint(step)
    parity = logprob_parity(learned.old_logp, learned.batch.rollout_logp_BT, learned.batch.mask_BT)
    run.record(step, ro, learned.batch, learned.entropy, parity, learned.updates, learned.sync, acc,
               time.time() - t_step, learned.metrics)
