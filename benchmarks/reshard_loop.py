"""The in-loop half of `python -m benchmarks.reshard_bench --in-loop`: a layout pair measured through real
roles, as `rlhf train` runs them (Ray actors on the placement's stand-in devices, vLLM engines whose
every worker is a rank of the sync group), side by side in every repeat:

- `sync`: `Roles.sync_weights`, each engine worker receiving exactly its own slices (checksummed, then
  installed): what the run does every step;
- `baseline`: gather-then-broadcast into the same engines: every trainer rank's shards gathered in the
  driver (Ray's object store), whole HF tensors assembled, broadcast to every engine, and every worker
  of every engine installing the whole model (`VLLMEngine.update_weights`), as frameworks without
  shard-to-shard resharding do;
- `floor`: the plan's busiest rank's bytes over the link measured between trainer rank 0 and an engine
  worker (`Roles.link_probe`).

The policy is the model YAML's shape with random weights and a tokenizer padded to its vocabulary,
written by our own code under `out/bench/<model name>` (nothing is downloaded).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

from rlhf.config import ModelConfig, load_run_config
from rlhf.config.validate import validate_run
from rlhf.sharding.layout import InferenceLayout, Layout

REPO = Path(__file__).resolve().parents[1]


def write_policy(cfg: ModelConfig, out: Path, seed: int = 0) -> Path:
    """A random policy of `cfg`'s shape and a tokenizer padded to its vocabulary, once per shape."""
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    d = out / cfg.name
    if not (d / "config.json").is_file():
        model = Qwen3MoeForCausalLM(cfg)
        model.init_weights(seed, std=0.02)
        save_tokenizer(build_tokenizer(cfg.vocab_size), d)
        save_pretrained(model, d)
    return d


def run_config(model: ModelConfig, src: Layout, dst: InferenceLayout, model_dir: Path):
    """The tiny run's config with this model, trainer layout and engines, co-located on as many stand-in
    devices as the larger role needs."""
    base = load_run_config(REPO / "configs" / "tiny_cpu.yaml")
    devices = max(src.world_size, dst.world_size)
    cfg = dataclasses.replace(
        base, model=dataclasses.replace(model, path=str(model_dir)),
        trainer=dataclasses.replace(base.trainer, pp=src.pp, dp=src.dp, tp=src.tp, ep=src.ep,
                                    experts_over_tp_ep=src.experts_over_tp_ep),
        rollout=dataclasses.replace(base.rollout, tp=dst.tp, ep=dst.ep, num_engines=dst.engines),
        placement=dataclasses.replace(base.placement, devices_per_node=devices))
    validate_run(cfg)
    return cfg


def run_in_loop(model: ModelConfig, src: Layout, dst: InferenceLayout, repeats: int) -> dict:
    from actors.remote import call_all
    from actors.roles import Roles, connect
    from rlhf.placement import device_map
    from rlhf.placement.transfer import sync_layout
    from weight_sync.pieces import assemble, buffer_region

    model_dir = write_policy(model, REPO / "out" / "bench")
    cfg = run_config(model, src, dst, model_dir)
    dm = device_map(cfg)
    sync = sync_layout(cfg, dm)
    plan = sync.plan()
    same_device = sync.same_device_pairs()
    shapes = sync.dst_spec().shapes()
    owned = connect(cfg.placement, log=lambda m: None)
    roles = None
    try:
        roles = Roles.start(cfg, dm, str(model_dir), sync, log=lambda m: None)
        link = roles.link_probe(sync)

        def synced(version: int) -> float:
            t0 = time.perf_counter()
            replies = roles.sync_weights(sync, version, same_device)
            assert [b for r in replies.receives for b in r.bytes_per_rank] == \
                [plan.bytes_into(r) for k in range(dst.engines) for r in sync.engine_ranks(k)]
            return time.perf_counter() - t0

        def gathered_and_broadcast(version: int) -> float:
            t0 = time.perf_counter()
            full: dict = {}
            for pieces, buffers in roles.all(roles.trainer, "hf_shards"):
                assemble(pieces, shapes, buffer_region(buffers), full)
            import ray

            ref = ray.put(list(full.items()))
            call_all([(e, "update_weights", (ref, version), {}) for e in roles.engines], roles.timeout_s)
            return time.perf_counter() - t0

        synced(1), gathered_and_broadcast(2)  # warm-up: plans cached, shared memory mapped
        sync_s, base_s = [], []
        for i in range(repeats):
            sync_s.append(synced(3 + 2 * i))
            base_s.append(gathered_and_broadcast(4 + 2 * i))
        synced(3 + 2 * repeats)  # leave the engines on the resharded weights
    finally:
        if roles is not None:
            roles.shutdown()
        if owned:
            import ray

            ray.shutdown()
    floor = plan.floor_seconds(dataclasses.replace(sync.topology, link_bytes_per_s=link))
    per_rank = [plan.bytes_into(r) for k in range(dst.engines) for r in sync.engine_ranks(k)]
    model_bytes = sum(_numel(s) for s in shapes.values()) * plan.dtype_bytes
    return {"mode": "in_loop", "repeats": repeats, "link_gb_per_s": round(link / 1e9, 3),
            "bytes_minimal": plan.bytes_minimal, "bytes_per_engine_rank": per_rank,
            "baseline_bytes_per_engine_rank": model_bytes,
            "sync_seconds": round(min(sync_s), 4), "sync_seconds_median": round(statistics.median(sync_s), 4),
            "baseline_seconds": round(min(base_s), 4),
            "baseline_seconds_median": round(statistics.median(base_s), 4),
            "floor_seconds": round(floor, 4),
            "sync_over_floor": round(min(sync_s) / floor, 2) if floor else None,
            "speedup_vs_baseline": round(min(base_s) / min(sync_s), 2)}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
