"""Apply the declared sharding (`rlhf.sharding.trainer`) to a Qwen3-MoE or DeepSeek-V3 model on one rank.

The model's maths is untouched; this module only
- keeps the layers of this rank's pipeline stage (others become parameter-free placeholders, so
  parameter names keep their global layer index; MTP modules stay on the last stage, never run),
- replaces parameters by this rank's local shards (`local_tensors` of the rank's sharding),
- wraps tensor-parallel regions with f/g collectives through forward hooks (attention and dense
  MLPs: copy to the TP group on entry, all-reduce the row-parallel output),
- swaps each MoE block for `ExpertParallelMoE`, which splits the TP group's tokens, routes them,
  sends each (token, expert) row to the EP rank holding the expert (flat or hierarchical all-to-all),
  applies the local experts and brings the rows back; shared experts run beside them, split over TP.

Gradient reduction groups follow from the same declarations: `grad_group_of`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM, SparseMoE, record_loads
from rlhf.moe.routing import Routing, observe
from rlhf.sharding.trainer import Split, TrainerSharding, grad_reduced_over_stage, is_frozen, split_of
from rlhf.parallel.comm import LayoutGroups, copy_to_group, gather_rows, gather_from_group, reduce_from_group, split_to_group
from rlhf.parallel.dispatch import Dispatcher


class Placeholder(nn.Module):
    """Stands in for a module that lives on another pipeline stage."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class ExpertParallelMoE(nn.Module):
    """A SparseMoE block whose experts are spread over the EP group. Keeps `gate` and `experts` as
    children so parameter names are unchanged."""

    def __init__(self, moe: SparseMoE, groups: LayoutGroups, expert_map: Sequence[int], dispatcher: Dispatcher):
        super().__init__()
        self.gate, self.experts = moe.gate, moe.experts
        if hasattr(moe, "shared_experts"):  # split over TP like a dense MLP, every token through it
            self.shared_experts = moe.shared_experts
        self.num_experts, self.moe_index = moe.num_experts, moe.moe_index
        self.groups = groups
        self.register_buffer("shard_of", torch.zeros(self.num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("local_index", torch.zeros(self.num_experts, dtype=torch.long), persistent=False)
        self.set_map(expert_map)
        self.dispatcher = dispatcher
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.step_tokens_per_expert: torch.Tensor | None = None

    def set_map(self, expert_map: Sequence[int]) -> None:
        """Dispatch by `expert_map` (expert -> EP shard) from now on: expert e is row `local_index[e]` of
        its shard's stack, the shard's experts stacked by id (as `rlhf.sharding.trainer` lays them out)."""
        shard_of = torch.tensor(tuple(expert_map), dtype=torch.long)
        local_index = torch.zeros(self.num_experts, dtype=torch.long)
        for shard in range(self.groups.size("ep")):
            ids = (shard_of == shard).nonzero().flatten()
            local_index[ids] = torch.arange(len(ids))
        self.shard_of.copy_(shard_of)
        self.local_index.copy_(local_index)

    def forward(self, x_BTH, valid_BT=None, routing: Routing | None = None):
        B, T, H = x_BTH.shape
        tp = self.groups.size("tp")
        x_SH = x_BTH.reshape(-1, H)
        S = x_SH.shape[0]
        valid_S = torch.ones(S, dtype=torch.bool, device=x_BTH.device) if valid_BT is None else valid_BT.reshape(-1)
        pad = (-S) % tp
        if pad:  # every TP rank takes an equal slice of the (replicated) tokens
            x_SH = torch.cat([x_SH, x_SH.new_zeros(pad, H)])
            valid_S = torch.cat([valid_S, valid_S.new_zeros(pad)])
        x_loc = split_to_group(x_SH, self.groups.tp)
        valid_loc = valid_S.chunk(tp)[self.groups.index("tp")] if tp > 1 else valid_S
        if routing is None:
            weights_Sk, experts_Sk, _ = self.gate(x_loc)
        else:  # this rank's slice of the routes, as of the tokens; what the router chose, gathered back
            i = self.moe_index
            forced, engine = (self._my_rows(routing.layer(r, i), pad) for r in (routing.forced_BTLk, routing.engine_BTLk))
            weights_Sk, experts_Sk, live_Sk = self.gate(x_loc, forced)
            observe(routing, i, live_Sk, engine,
                    lambda t: gather_rows(t, self.groups.tp)[:S])
        record_loads(self, experts_Sk[valid_loc])
        k = experts_Sk.shape[1]
        y_rows = self.dispatcher.run(x_loc, self.shard_of[experts_Sk], self.local_index[experts_Sk],
                                     self.experts.forward_rows)
        out_loc = (y_rows.view(-1, k, H) * weights_Sk[..., None]).sum(1)
        out = gather_from_group(out_loc, self.groups.tp)[:S].view(B, T, H)
        if hasattr(self, "shared_experts"):
            if tp == 1:
                return out + self.shared_experts(x_BTH)
            return out + reduce_from_group(self.shared_experts(copy_to_group(x_BTH, self.groups.tp)), self.groups.tp)
        return out

    def _my_rows(self, routes_Sk: torch.Tensor | None, pad: int) -> torch.Tensor | None:
        if routes_Sk is None or self.groups.size("tp") == 1:
            return routes_Sk
        routes_Sk = torch.cat([routes_Sk, routes_Sk.new_full((pad, routes_Sk.shape[1]), -1)])
        return routes_Sk.chunk(self.groups.size("tp"))[self.groups.index("tp")]


def _tp_input_hook(group):
    def hook(module, args):
        return (copy_to_group(args[0], group),) + tuple(args[1:])
    return hook


def _tp_output_hook(group):
    def hook(module, args, out):
        return reduce_from_group(out, group)
    return hook


def parallelize(model: Qwen3MoeForCausalLM, sharding: TrainerSharding, groups: LayoutGroups,
                local: dict[str, torch.Tensor], expert_maps: Mapping[str, Sequence[int]], stages: Sequence[range],
                dispatcher: Dispatcher) -> Qwen3MoeForCausalLM:
    """`expert_maps`: each expert layer's map by prefix (`rlhf.sharding.trainer.layer_expert_maps`)."""
    cfg, layout = model.config, groups.layout
    stage = layout.coords(groups.rank).pp
    K = cfg.num_key_value_heads
    if K % layout.tp and layout.tp % K:
        raise ValueError(f"trainer tp={layout.tp} must divide num_key_value_heads={K} or be a multiple of it "
                         "(KV heads are split over tp, or replicated by head group when tp exceeds them)")
    if cfg.tie_word_embeddings and layout.pp > 1:
        raise NotImplementedError("tied embeddings across pipeline stages are not supported; untie or use pp=1")
    inner = model.model
    last = len(stages) - 1
    for i, layer in enumerate(inner.layers):
        if i not in stages[stage] and not (i >= cfg.num_hidden_layers and stage == last):  # MTP: the last stage
            inner.layers[i] = Placeholder()
    if stage != 0:
        inner.embed_tokens = Placeholder()
    if stage != len(stages) - 1:
        inner.norm = Placeholder()
        model.lm_head = Placeholder()

    # Local shards replace the full parameters, by name.
    params = dict(model.named_parameters())
    missing = set(sharding.local_shapes) - set(params)
    if missing:
        raise RuntimeError(f"sharding names parameters the model lacks: {sorted(missing)[:3]}")
    for name in sharding.local_shapes:
        owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(owner, leaf, nn.Parameter(local[name], requires_grad=not is_frozen(name, cfg)))
    if cfg.tie_word_embeddings and stage == len(stages) - 1:
        model.lm_head.weight = inner.embed_tokens.weight
    stray = [n for n, _ in model.named_parameters() if n not in sharding.local_shapes
             and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if stray:
        raise RuntimeError(f"parameters without a shard: {stray[:3]}")

    for i in stages[stage]:
        layer = inner.layers[i]
        if layout.tp > 1:
            layer.self_attn.register_forward_pre_hook(_tp_input_hook(groups.tp))
            layer.self_attn.o_proj.register_forward_hook(_tp_output_hook(groups.tp))
        if layer.is_moe:
            layer.mlp = ExpertParallelMoE(layer.mlp, groups, expert_maps[f"model.layers.{i}.mlp.experts"], dispatcher)
        elif layout.tp > 1:
            layer.mlp.register_forward_pre_hook(_tp_input_hook(groups.tp))
            layer.mlp.down_proj.register_forward_hook(_tp_output_hook(groups.tp))
    return model


def grad_group_of(name: str, groups: LayoutGroups):
    """The group whose ranks hold the same shard of `name` but saw different tokens: its gradients are
    summed over that group. Experts: the expert replicas. Router and q/k norms: the whole stage
    (`STAGE_REDUCED_GRADS`). Everything else: the DP group (TP ranks see the same tokens)."""
    split = split_of(name)
    if split is Split.experts:
        return groups.expert_replica, "expert_replica"
    if grad_reduced_over_stage(name):
        return groups.stage, "stage"
    return groups.dp, "dp"


def replicas_of(name: str, groups: LayoutGroups) -> int:
    """How many ranks of the world hold an identical copy of this rank's shard of `name`."""
    layout = groups.layout
    split = split_of(name)
    if split is Split.experts:
        return layout.plane // layout.expert_shards
    if split is Split.tp_kv_rows:  # tp > KV heads: a KV head is replicated over its TP ranks too
        return layout.dp * groups.size("kv_head")
    if split in (Split.tp_rows, Split.tp_cols, Split.tp_kv_rows):
        return layout.dp
    return layout.plane
