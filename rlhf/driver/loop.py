"""The RL loop (`rlhf train RUN.yaml`), one step top to bottom: each line is one phase.

    rollouts (generate n per prompt, rewards) -> old logprobs (trainer) -> reference logprobs
    -> advantages -> policy update (mini-batches x epochs) -> weight sync (checksum verified)

Co-located roles switch around the update: engines sleep and the trainer onloads before it; the
trainer offloads and the engines wake after the sync (on cpu vLLM has no sleep: a logged no-op with
the same protocol). The driver moves references and small tensors; weights move trainer -> engine
directly (`weight_sync`).
"""

from __future__ import annotations

import sys
import time

from actors.roles import batch_logprobs
from rlhf.algorithms.objective import advantages, kl_reward_penalty, on_policy
from rlhf.driver.rollout import collect
from rlhf.driver.run import Run
from rlhf.parity import logprob_parity
from rlhf.schema import RunConfig


def train(cfg: RunConfig, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    run = Run.start(cfg, log)
    try:
        roles, acc_start = run.roles, run.evaluate(run.step)
        for step in range(run.step + 1, cfg.steps + 1):
            t_step = time.time()
            with run.phase("rollout", step):
                ro = collect(cfg, roles, run.inputs.sampler, run.inputs.tokenizer, step)
            batch = run.token_batch(ro)
            mini_batches = run.mini_batches(len(batch), step)
            with run.phase("switch to training", step):
                run.switch("sleep", "onload")
            old_logp = entropy = None  # on-policy: the update's own forward gives them (rlhf.algorithms.objective)
            if not on_policy(cfg.algorithm, cfg.trainer.epochs, len(mini_batches)):
                with run.phase("old logprobs", step):
                    old_logp, entropy, replies = roles.logprobs(roles.trainer, run.put(batch))
                run.trace_ranks("old logprobs", roles.trainer, replies, step)
            ref_logp = run.reference_logprobs(batch, step)
            rewards_PG = ro.rewards_PG
            if cfg.algorithm.kl_in_reward and ref_logp is not None:
                rewards_PG = rewards_PG - kl_reward_penalty(cfg.algorithm, old_logp, ref_logp, batch.mask_BT).view_as(rewards_PG)
            batch = batch.with_(advantages_B=advantages(cfg.algorithm, rewards_PG), old_logp_BT=old_logp,
                                ref_logp_BT=ref_logp)
            with run.phase("update", step):
                updates = roles.all(roles.trainer, "update", run.put(batch), mini_batches)
            run.trace_ranks("update", roles.trainer, updates, step)
            if old_logp is None:
                old_logp, entropy = batch_logprobs([u.logprobs for u in updates])
            with run.phase("weight sync", step):
                sync = roles.sync_weights(run.inputs.sync, step, run.inputs.same_device)
            run.trace_ranks("weight sync", roles.trainer + roles.engines, sync.sends + sync.receives, step)
            with run.phase("switch to rollout", step):
                run.switch("wake_up", "offload")
            acc = run.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.steps else None
            run.checkpoint(step)
            parity = logprob_parity(old_logp, batch.rollout_logp_BT, batch.mask_BT)
            run.record(step, ro, batch, entropy, parity, updates, sync, acc, time.time() - t_step)
        return run.finish(acc_start)
    except BaseException:
        run.close(failed=True)
        raise
