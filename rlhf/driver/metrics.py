"""A step's metrics (W&B names) from what the roles answered: rollout, update, weight sync, switches.

Legend: P prompts, G samples per prompt, B samples, T tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from actors.replies import SyncReplies, UpdateReply
from rlhf.batch import TokenBatch
from rlhf.driver.rollout import Rollout
from rlhf.parity import Parity
from weight_sync.plan import Plan, Topology


def step_metrics(ro: Rollout, batch: TokenBatch, entropy_BT: torch.Tensor, parity: Parity,
                 updates: list[UpdateReply], sync: SyncReplies, plan: Plan, topology: Topology,
                 seconds: float, switch_bytes: dict[str, int]) -> dict[str, float]:
    """Every metric of one step but the driver's phase times and the held-out accuracy. `topology` carries
    the measured link bandwidth the sync floor is computed at."""
    sync_s = sync.seconds
    lengths = torch.tensor([len(c.token_ids) for c in ro.completions], dtype=torch.float32)
    receives = sync.receives
    m = {
        "reward/mean": float(ro.rewards_PG.mean()), "reward/std": float(ro.rewards_PG.std()),
        "accuracy/train": float(ro.scores_PG.mean()),
        "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
        "response/truncated_fraction": sum(c.finish_reason == "length" for c in ro.completions) / len(ro.completions),
        "rollout/groups_drawn": ro.groups_drawn, "rollout/groups_kept": len(ro.rows),
        "rollout/generated_tokens": ro.generated_tokens, "rollout/groups_stopped": ro.groups_stopped,
        "actor/entropy_old": float((entropy_BT * batch.mask_BT).sum() / batch.mask_BT.sum()),
        "parity/max_abs_diff": parity.max_abs_diff, "parity/mean_abs_diff": parity.mean_abs_diff,
        "parity/p99_abs_diff": parity.p99_abs_diff, "parity/tokens": parity.tokens,
        "time/generate": ro.generate_seconds, "time/reward": ro.reward_seconds, "time/step": seconds,
        "time/sync": sync_s, "time/sync_transfer": max(r.transfer_seconds for r in receives),
        "time/sync_install": max(r.install_seconds for r in receives),
        "time/update": max(u.seconds for u in updates),
        # the code verifier: the share of the step's scored samples per status (passed, failed, error, timeout)
        **{f"reward/code_{k}": v / sum(ro.verdicts.values()) for k, v in sorted(ro.verdicts.items())},
        **ro.agent,  # multi-turn episodes: agent/* (rlhf.driver.episodes)
        "sync/bytes_minimal": plan.bytes_minimal, "sync/bytes_network": plan.bytes_network,
        "sync/bytes_local": plan.bytes_local,
        "sync/bytes_received": sum(r.bytes_received for r in receives),
        "sync/bytes_shm": sum(r.bytes_shm for r in receives),
        "sync/bytes_in_place": sum(r.bytes_in_place for r in receives),
        "sync/bytes_sent": sum(r.bytes_sent for r in sync.sends),
        "sync/gb_per_s": plan.bytes_network / max(sync_s, 1e-9) / 1e9,
        "sync/floor_seconds": plan.floor_seconds(topology),
        "sync/link_gb_per_s": topology.link_bytes_per_s / 1e9,
        "sync/bytes_per_engine_rank_max": max((b for r in receives for b in r.bytes_per_rank), default=0),
        "sync/bytes_minimal_per_engine_rank_max": max((plan.bytes_into(rank) for r in receives for rank in r.ranks),
                                                      default=0),
        "sync/checked_transfers": sum(r.checked_transfers for r in receives),
        "sync/version": receives[0].version,
        "throughput/generate_tokens_per_s": ro.generated_tokens / max(ro.generate_seconds, 1e-9),
        "throughput/step_tokens_per_s": float(batch.attention_mask_BT.sum()) / seconds,
        "offload/bytes": switch_bytes.get("offload", 0), "onload/bytes": switch_bytes.get("onload", 0),
    }
    m.update(update_metrics(updates))
    m.update(expert_load(updates))
    return m


def update_metrics(updates: list[UpdateReply]) -> dict[str, float]:
    """Combine the trainer ranks' token-weighted sums; each DP index counted once (TP / PP copies agree)."""
    per_rank = [u.stats for u in updates]
    tokens = sum(s.tokens for s in per_rank) or 1.0
    out = {f"actor/{k}": sum(getattr(s, k) * s.tokens for s in per_rank) / tokens
           for k in ("clip_fraction", "ratio_mean", "kl", "entropy")}
    first = per_rank[0]
    out |= {"actor/loss": first.loss, "actor/grad_norm": first.grad_norm,
            "actor/optimizer_steps": first.optimizer_steps, "actor/lr": first.lr}
    bias = max(s.router_bias_abs_max for s in per_rank)
    if bias:  # sigmoid routers whose correction bias trainer.router_bias_update_rate moves
        out["expert_load/router_bias_abs_max"] = bias
    return out


def step_loads(updates: list[UpdateReply]) -> torch.Tensor | None:
    """Tokens per expert of every MoE layer [layers, experts] in the update's last optimizer step: the rows of
    each pipeline stage's reporting rank, in stage (= rank) order; None when no rank reported."""
    stats = [u.router for u in updates if u.router]
    return torch.tensor([row for s in stats for row in s], dtype=torch.float64) if stats else None


def expert_load(updates: list[UpdateReply]) -> dict[str, float]:
    """Per MoE layer: tokens of the busiest expert over the mean (1.0 is perfectly balanced)."""
    load = step_loads(updates)
    if load is None:
        return {}
    out = {f"expert_load/layer{i}_max_over_mean": float(row.max() / row.mean().clamp(min=1e-9))
           for i, row in enumerate(load)}
    out["expert_load/max_over_mean"] = max(out.values())
    return out


def expert_parallel_load(updates: list[UpdateReply], expert_maps: Sequence[Sequence[int]], shards: int,
                         prediction: list[list[float]] | None, theta: float = 0.9):
    """Per MoE layer: tokens on the busiest EP rank over the mean under the trainer's expert map of that layer
    (`expert_maps`, what EDPB balances; 1.0 is even), and how far the moving-average prediction of each
    expert's load (`rlhf.moe.balance.predict`) made before this step was from it. Returns (metrics, the
    prediction for the next step)."""
    from rlhf.moe.balance import predict

    load = step_loads(updates)  # [layers, experts]
    if load is None or not len(load):
        return {}, prediction
    if len(expert_maps) != len(load):
        raise ValueError(f"{len(expert_maps)} expert maps for the {len(load)} MoE layers the trainer reported")
    per_rank = torch.zeros(load.shape[0], shards, dtype=torch.float64)
    for i, emap in enumerate(expert_maps):
        per_rank[i].index_add_(0, torch.tensor(list(emap)), load[i])
    ratio = per_rank.max(1).values / per_rank.mean(1).clamp(min=1e-9)
    out = {}
    if shards > 1:
        out = {f"expert_load/layer{i}_ep_rank_max_over_mean": float(r) for i, r in enumerate(ratio)}
        out["expert_load/ep_rank_max_over_mean"] = float(ratio.max())
    if prediction is not None and len(prediction) != len(load):
        prediction = None  # another stage's layers (a resumed run with another layout): start again
    if prediction is not None:
        err = (torch.tensor(prediction, dtype=torch.float64) - load).abs().sum() / load.sum().clamp(min=1e-9)
        out["expert_load/prediction_error"] = float(err)  # sum |predicted - actual| over the tokens routed
    return out, predict(prediction, load.tolist(), theta)


def dp_balance(batch, mini_batches: Sequence[Sequence[int]], dp: int, max_tokens: int) -> dict[str, float]:
    """How even the DP ranks' predicted work is (`rlhf.micro_batches`: tokens plus the attention term), the worst
    mini-batch of the step: the slowest rank over the mean as the trainer splits the samples, and as a split by
    sample index would."""
    from rlhf.micro_batches import balance, by_index_imbalance

    if dp < 2:
        return {}
    after = before = 1.0
    for rows in mini_batches:
        lengths = [batch.lengths[r] for r in rows]
        after = max(after, balance(lengths, dp, max_tokens, batch.attention_cost).cost_imbalance)
        before = max(before, by_index_imbalance(lengths, dp, batch.attention_cost))
    return {"balance/dp_cost_max_over_mean": after, "balance/dp_cost_max_over_mean_by_index": before}


def progress_fields(m: dict[str, float], accuracy: list[tuple[int, float]]) -> dict[str, object]:
    """What the progress line shows after a step: reward, the last evaluated held-out accuracy with the step
    it is from (evaluations are every `eval_every` steps: never a blank `nan` in between), MB synced."""
    fields: dict[str, object] = {"reward": m["reward/mean"]}
    if accuracy:
        step, acc = accuracy[-1]
        fields["acc"] = f"{acc:.3f}@{step}"
    fields["sync_MB"] = (m["sync/bytes_received"] + m["sync/bytes_shm"]) / 1e6
    fields["parity_p99"] = f"{m['parity/p99_abs_diff']:.1e}"
    if "route/mismatch" in m:
        fields["route_mismatch"] = f"{m['route/mismatch']:.2%}"
    return fields
