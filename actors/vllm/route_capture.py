"""Routing replay (R3): record, inside a vLLM worker, the experts its MoE router chose for every token.

The trainer later forces its MoE forward onto these choices, so the policy it scores routes exactly as
the one that sampled. vLLM's own capture (`enable_return_routed_experts`) refuses to start on CPU (it
needs model runner V2), so this module does it from our worker extension, with two hooks:

- every MoE layer's router (`BaseRouter.select_experts`, router/base_router.py) calls its `capture_fn`
  with the logical top-k ids of each row of the forward, before EPLB mapping and before the expert-map
  patch of `actors/vllm/worker_ext.py` turns them into local ids (that happens inside the experts'
  `apply`). This is the slot vLLM's `bind_routed_experts_capturer` uses; the routers are not rebuilt by
  `reload_weights` (it reloads in place), so the hook survives weight updates.
- a forward hook on the model commits one forward: rows 0..n-1 are the scheduled tokens (rows past n are
  padding), request i of the runner's persistent batch (`input_batch.req_ids`) owns rows
  `query_start_loc[i]:query_start_loc[i+1]` (`GPUModelRunner._prepare_inputs`, also run by the CPU
  runner), and each row's position is the `positions` argument the model itself was given. Chunked
  prefill and continuous batching need nothing more; a preempted request recomputed from scratch
  yields the same positions again, and the later rows win (they made the KV its next tokens read).

Tokens served from the prefix cache run no forward, so a request's cached prefix has no rows of its own.
Its routes are those of the forward that computed the cached KV blocks (the same tokens at the same
positions under the same weights: the engine drops its prefix cache with old weights), so each captured row
is also kept by its KV slot (block id x block size + offset, from the runner's block table, as vLLM keys its
own capture), and a request whose first forward starts past position 0 takes positions 0..p0-1 from the
slots its block table names, read at that forward, while the request holds those blocks. A slot never
captured (a block computed while capture was off) leaves the positions missing, and `take` refuses them.
Data parallelism is refused: with DP + EP vLLM gathers every DP rank's tokens before routing, so rows no
longer match this rank's batch.

Only the worker of rank 0 records: every TP (or EP) rank routes the same full batch to the same ids.
Ids are stored as uint8 when the model has at most 256 experts (every Qwen3 / DeepSeek MoE), else
int16: one byte per id halves what a long rollout holds and sends back.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class RouteCapture:
    """One worker's captured routes: per forward, the ids of every MoE layer for its scheduled rows."""

    def __init__(self, model_runner):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self.runner = model_runner
        model = model_runner.get_model()
        layers = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
        if not layers:
            raise ValueError("route capture: the model has no fused-MoE layer")
        for m in layers:
            if m.is_monolithic or not isinstance(m.router, BaseRouter):
                raise ValueError(f"route capture: {m.layer_name} routes inside a monolithic kernel or with "
                                 f"{type(m.router).__name__}; its ids cannot be observed")
        num_experts = layers[0].router.global_num_experts
        self.dtype, self.np_dtype = (torch.uint8, np.uint8) if num_experts <= 256 else (torch.int16, np.int16)
        self.top_k = layers[0].router.top_k
        self.routers = [m.router for m in layers]
        self._step: list[torch.Tensor | None] = [None] * len(layers)  # this forward's ids, per MoE layer
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (request code, position, ids) rows
        self._codes: dict[str, int] = {}  # vLLM request id -> code in the chunks
        self._started = np.zeros(0, bool)  # by code: its first forward was seen (a cached prefix taken from slots)
        # every captured row by KV slot (grown as slots appear), and whether the slot holds a captured row
        self._slot_ids = np.zeros((0, len(layers), self.top_k), self.np_dtype)
        self._slot_set = np.zeros(0, bool)
        model.register_forward_hook(self._commit, with_kwargs=True)
        self.enabled = False

    def enable(self, on: bool) -> None:
        for j, router in enumerate(self.routers):
            router.set_capture_fn(self._recorder(j) if on else None)
        self.enabled = on
        if not on:
            self._clear()
            self._slot_set[:] = False  # blocks computed from now on are not captured

    def _recorder(self, j: int):
        def record(topk_ids: torch.Tensor) -> None:
            self._step[j] = topk_ids.to(self.dtype)  # a copy: the kernel may reuse or remap its buffer

        return record

    def _commit(self, module, args, kwargs, output) -> None:
        """After each forward: keep the rows of scheduled tokens, tagged with their request and position.
        Forwards outside a step (profiling, warm-up: no request in the batch) are dropped."""
        step, self._step = self._step, [None] * len(self.routers)
        num_reqs = self.runner.input_batch.num_reqs
        if not self.enabled or not num_reqs or any(s is None for s in step):
            return
        starts = self.runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        n = int(starts[-1])
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        if positions.dim() == 2:  # M-RoPE: (3, tokens); the first row is the text position
            positions = positions[0]
        codes = np.fromiter((self._codes.setdefault(r, len(self._codes))
                             for r in self.runner.input_batch.req_ids[:num_reqs]), np.int64, num_reqs)
        rows_of = np.repeat(np.arange(num_reqs), np.diff(starts))
        pos = positions[:n].cpu().numpy().astype(np.int64)
        ids = torch.stack([s[:n] for s in step], dim=1).cpu().numpy()
        table = self.runner.input_batch.block_table[0]
        blocks, size = table.get_numpy_array(), table.block_size
        slots = blocks[rows_of, pos // size].astype(np.int64) * size + pos % size
        if len(slots) and slots.max() >= len(self._slot_set):
            grow = max(int(slots.max()) + 1, 2 * len(self._slot_set))
            self._slot_ids = np.concatenate([self._slot_ids, np.zeros((grow - len(self._slot_ids),
                                                                       *self._slot_ids.shape[1:]), self.np_dtype)])
            self._slot_set = np.concatenate([self._slot_set, np.zeros(grow - len(self._slot_set), bool)])
        self._slot_ids[slots], self._slot_set[slots] = ids, True  # first: a request of this forward may read them
        if len(self._codes) > len(self._started):
            self._started = np.concatenate([self._started, np.zeros(len(self._codes) - len(self._started), bool)])
        first = np.flatnonzero(~self._started[codes] & (np.diff(starts) > 0))  # a decode step has none: no loop
        self._started[codes[first]] = True
        for i in first:  # a request's first forward past position 0: its cached prefix, from the slots
            p0 = int(pos[starts[i]])
            if p0 > 0:
                prefix = np.arange(p0)
                slots = blocks[i, prefix // size].astype(np.int64) * size + prefix % size
                have = slots < len(self._slot_set)
                have[have] = self._slot_set[slots[have]]
                self._chunks.append((np.full(int(have.sum()), codes[i]), prefix[have], self._slot_ids[slots[have]]))
        self._chunks.append((codes[rows_of], pos, ids))

    def _clear(self) -> None:
        self._chunks, self._codes, self._started = [], {}, np.zeros(0, bool)

    def take(self, request_ids) -> dict:
        """The routes of the requests LLM.generate / add_request was given as `request_ids` (external ids),
        packed for `unpack_routes`; then forgets everything captured (call once per generation, after it:
        the rows of anything else, e.g. a prompt-logprob pass, are dropped too). A sample's rows are the
        tokens it fed through the model, by position: its prompt and its output but the last token."""
        chunks, codes_of = self._chunks, self._codes
        self._clear()
        keys, blocks = [], []
        if chunks:
            codes, positions, ids = (np.concatenate(c) for c in zip(*chunks))
            wanted = set(request_ids)
            for rid, code in codes_of.items():
                key = _external_id(rid, wanted)
                if key is None:
                    continue
                rows = np.flatnonzero(codes == code)
                rows = rows[np.argsort(positions[rows], kind="stable")]
                pos = positions[rows]
                last = np.append(pos[1:] != pos[:-1], True)  # a recomputed position: its latest rows
                rows, pos = rows[last], pos[last]
                if not np.array_equal(pos, np.arange(len(pos))):
                    raise RuntimeError(f"route capture: request {rid} lacks routes for some positions (has "
                                       f"{len(pos)} of 0..{int(pos[-1])}): a prefix served from KV blocks "
                                       "computed while capture was off")
                keys.append(list(key))
                blocks.append(ids[rows])
        # plain types only: without VLLM_ALLOW_INSECURE_SERIALIZATION an engine core in its own process
        # returns a collective_rpc reply through msgpack with no type information, and ndarrays come back
        # as undecodable lists
        return {"keys": keys, "lengths": [len(b) for b in blocks], "dtype": np.dtype(self.np_dtype).str,
                "shape": [len(self.routers), self.top_k],
                "routes": np.concatenate(blocks).tobytes() if blocks else b""}


def unpack_routes(reply: dict) -> dict[tuple[str, int], np.ndarray]:
    """A `take_routes` reply as {(request id, sample index): routes [positions, moe_layers, k]}."""
    flat = np.frombuffer(reply["routes"], dtype=np.dtype(reply["dtype"])).reshape(-1, *reply["shape"]).copy()
    ends = np.cumsum(reply["lengths"])
    return {(rid, int(i)): flat[e - n:e] for (rid, i), n, e in zip(reply["keys"], reply["lengths"], ends)}


def _external_id(rid: str, wanted: set[str]) -> tuple[str, int] | None:
    """(external request id, sample index) of a vLLM-internal id, or None when not among `wanted`.
    vLLM appends "-<8 random chars>" to the id it was given (`InputProcessor.assign_request_id`, unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) and names sample i of an n > 1 request "i_<that id>"
    (`ParentRequest.get_child_info`)."""
    for base in (rid.rsplit("-", 1)[0], rid):
        if base in wanted:
            return base, 0
        index, _, parent = base.partition("_")
        if index.isdigit() and parent in wanted:
            return parent, int(index)
    return None


def set_route_capture(worker, on: bool) -> bool:
    """Start (or stop, dropping what was captured) recording routes in this worker; the hooks are
    installed on first use. Needs an engine without data
    parallelism (see the module's docstring). Returns whether this worker records (rank 0 only)."""
    if on:
        if worker.vllm_config.parallel_config.data_parallel_size > 1:
            raise ValueError("route capture does not support data parallelism (DP ranks route each other's tokens)")
    if worker.rank != 0:
        return False
    capture = getattr(worker, "_rlhf_routes", None)
    if capture is None:
        if not on:
            return False
        capture = worker._rlhf_routes = RouteCapture(worker.model_runner)
    capture.enable(on)
    return on


def take_routes(worker, request_ids) -> dict | None:
    """`RouteCapture.take` on rank 0 (decode its reply with `unpack_routes`); None on other ranks, which
    record nothing."""
    if worker.rank != 0:
        return None
    capture = getattr(worker, "_rlhf_routes", None)
    if capture is None or not capture.enabled:
        raise RuntimeError("route capture is off: call set_route_capture(worker, True) first")
    return capture.take(request_ids)


def split_routes(completions: list, stages: Sequence[Sequence[int]]) -> tuple:
    """(completions with `routes` a `RouteRef` to their rows, then one block per stage: every completion's
    routes in order over the stage's MoE layers [rows, layers, k]). The blocks' references are filled in by
    whoever receives them (`actors.roles.Roles.generate`)."""
    from dataclasses import replace

    from rlhf.moe.routing import RouteRef

    missing = [i for i, c in enumerate(completions) if c.routes is None]
    if missing:
        raise RuntimeError(f"generate_routed: {len(missing)} completion(s) without routes: the engine was "
                           "built without capture_routes")
    if not completions:
        return ([], *(np.zeros((0, len(layers), 1), np.uint8) for layers in stages))
    whole = np.concatenate([c.routes for c in completions])
    starts = np.cumsum([0] + [len(c.routes) for c in completions])
    out = [replace(c, routes=RouteRef(int(s), len(c.routes), itemsize=whole.itemsize))
           for c, s in zip(completions, starts)]
    return (out, *(np.ascontiguousarray(whole[:, list(layers)]) for layers in stages))


def routes_of(routes: dict | None, request_id: str, index: int, fed: int):
    """One sample's routes from `unpack_routes`' dict, checked to cover every token it fed through the model."""
    if routes is None:
        return None
    r = routes.get((request_id, index))
    if r is None or r.shape[0] != fed:
        raise RuntimeError(f"route capture: request {request_id} sample {index} has routes for "
                           f"{None if r is None else r.shape[0]} tokens, it fed {fed} through the model")
    return r
