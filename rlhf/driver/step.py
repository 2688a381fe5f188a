"""The learning half of a step (`loop.run_step`), whatever the rollout source: from a step's rollouts to the
weights the engines serve next. Each line is one phase:

    old logprobs (trainer, unless the update's own forward gives them) -> reference logprobs
    -> advantages -> policy update (mini-batches x epochs) -> weight sync (checksum verified)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.remote import RoleError
from actors.replies import SyncReplies
from actors.roles import batch_logprobs, batch_route_differs
from rlhf.algorithms.objective import advantages, kl_reward_penalty, on_policy
from rlhf.batch import TokenBatch
from rlhf.driver.metrics import dp_balance
from rlhf.driver.rollout import Rollout
from rlhf.driver.run import Run
from rlhf.moe.routing import RouteStats


@dataclass(frozen=True)
class Learned:
    """What one step's training made of its rollouts."""

    batch: TokenBatch
    old_logp: torch.Tensor  # the trainer's logprobs at the start of the update [B, T-1]
    entropy: torch.Tensor
    updates: list
    sync: SyncReplies
    # route/* (with engine routes in the batch): how often the trainer's routing differs; balance/*: how even the
    # DP ranks' predicted work is
    metrics: dict


def learn(run: Run, ro: Rollout, step: int, switch: bool = True) -> Learned:
    """A step from its rollouts on: old and reference logprobs, advantages, the update and the weight sync
    (the engines serve version `step` when it returns). `switch`: co-located roles change turns around it."""
    cfg, roles = run.cfg, run.roles
    batch = run.token_batch(ro)
    mini_batches = run.mini_batches(len(batch), step)
    off_policy = not on_policy(cfg.algorithm, cfg.trainer.epochs, len(mini_batches))
    routes, route_bytes = None, {}
    if run.route_stages is not None:  # each trainer rank reads its own share of the routes, apart from the batch
        routes, route_bytes = run.route_shares(ro, batch, [range(len(batch))] * off_policy + mini_batches)
    if switch:
        with run.phase("switch to training", step):
            run.switch("sleep", "onload")
    old_logp = entropy = differs = None  # on-policy: the update's own forward gives them (rlhf.algorithms.objective)
    if off_policy:
        with run.phase("old logprobs", step):
            old_logp, entropy, replies = roles.logprobs(roles.trainer, run.put(batch), routes)
        run.trace_ranks("old logprobs", roles.trainer, replies, step)
        differs = batch_route_differs(replies)
    if ro.ref_logp is not None:  # computed beside an earlier step (StaleSync: `stale_sync.Producer`)
        ref_logp = batch.response_matrix(ro.ref_logp)
    else:  # without routes: the policy's are not the reference's
        ref_logp = run.reference_logprobs(batch, step)
    rewards_PG = ro.rewards_PG
    if cfg.algorithm.kl_in_reward and ref_logp is not None:
        rewards_PG = rewards_PG - kl_reward_penalty(cfg.algorithm, old_logp, ref_logp, batch.mask_BT).view_as(rewards_PG)
    extras = dict(advantages_B=advantages(cfg.algorithm, rewards_PG), old_logp_BT=old_logp, ref_logp_BT=ref_logp)
    batch = batch.with_(**extras)
    posted = None
    with run.phase("update", step):
        sent = roles.submit(roles.trainer, "update", run.put(batch), mini_batches, per_rank=routes, offload_next=switch)
        if switch and run.can_post_sync(step):  # synchronous loop, engines idle: the sync goes out behind the update
            posted = run.weights.post(roles, step)
        try:
            updates = roles.wait(sent)
        except RoleError:
            run.faults.update_failed(posted[1] if posted else [])  # settled where the trainer ranks restart
            raise
    run.trace_ranks("update", roles.trainer, updates, step)
    run.experts.observe(updates)  # before this step's checkpoint, which saves the load prediction
    run.experts.balance(step, roles)  # EDPB: experts may move between the trainer's EP ranks before the sync
    if old_logp is None:
        old_logp, entropy = batch_logprobs([u.logprobs for u in updates])
        differs = batch_route_differs([u.logprobs for u in updates])
    with run.phase("weight sync", step):  # what the loop waits for after the update (a posted sync: its rest)
        sync = run.sync_weights(step, posted)
    run.trace_ranks("weight sync", roles.trainer + roles.engines, sync.sends + sync.receives, step)
    if switch:
        with run.phase("switch to rollout", step):
            run.switch("wake_up", "offload")
    return Learned(batch, old_logp, entropy, updates, sync, route_metrics(run, ro, differs) | route_bytes
                   | dp_balance(batch, mini_batches, cfg.trainer.dp, cfg.trainer.micro_batch_tokens))


def route_metrics(run: Run, ro: Rollout, differs_BT) -> dict:
    if differs_BT is None or run.route_stages is None:
        return {}
    m = run.cfg.model
    s = RouteStats.counted(differs_BT, [c.routes.positions if c.routes is not None else 0 for c in ro.completions],
                           m.num_hidden_layers - m.first_k_dense_layers)
    return {"route/mismatch": s.mismatch, "route/tokens_any_mismatch": s.tokens_any_mismatch,
            "route/token_layers": s.token_layers}
