"""One policy update of the trainer on a real-sized shape, timed and profiled without Ray or vLLM.

    python -m benchmarks.update_profile                # one rank, 32 samples x (8 + 128) tokens, small model
    python -m benchmarks.update_profile --ranks 2      # dp2 x ep2 over two gloo processes, 64 samples
    python -m benchmarks.update_profile --ranks 2 --compute-dtype bfloat16 --no-profile   # mixed precision
    python -m benchmarks.update_profile --compute-dtype bfloat16 --profile-memory        # ops by memory allocated
    python -m benchmarks.update_profile --ranks 1 --threads 2 --samples-per-rank 64      # one rank of two threads
    python -m benchmarks.update_profile --memory-categories --micro-batch-tokens 1024     # tensors at the peak, by kind
    python -m benchmarks.update_profile --ranks 2 --compute-dtype bfloat16 --by-shape      # ops by operand shapes

Each rank holds the samples one DP rank of `configs/small_cpu.yaml` holds (32), runs `--steps` timed update
steps (2; GRPO loss, one optimizer step each) and one more under `torch.profiler` (unless --no-profile); prints
rank 0's ops (`--table-rank`) by self CPU time and ends with one JSON line: `step_seconds` of the timed steps,
each rank's `cpu_seconds` in them (user and system: what a run whose cores are full pays), the micro-batches,
rank 0's distinct matmul shapes in the profiled step (`matmul_shapes`: the primitives oneDNN builds in bf16), and
each rank's resident memory (`memory_gib`: now and the peak so far, and glibc's free heap, after init and after
each timed step).
The weights are random (our code), written once to `out/bench/<model name>-update`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(rank: int, model_yaml: str, model_dir: str, ranks: int, samples_per_rank: int, new_tokens: int,
           compute_dtype: str | None = None, profile: bool = True, micro_batch_tokens: int = 4096,
           profile_memory: bool = False, memory_categories: bool = False,
           expert_rows_multiple: int | None = None, threads: int = 1, by_shape: bool = False,
           steps: int = 2, rows: int | None = None, offload: bool = False) -> dict:
    import torch

    if expert_rows_multiple is not None:  # the bf16 experts' row padding on cpu (1: none)
        import rlhf.model.qwen3_moe as qwen3_moe

        qwen3_moe.EXPERT_ROWS_MULTIPLE = expert_rows_multiple

    from rlhf.algorithms.objective import LossRecord, loss_normaliser, policy_loss
    from rlhf.batch import TokenBatch
    from rlhf.config import load_model_config
    from rlhf.sharding.layout import Layout
    from rlhf.parallel.trainer import ParallelTrainer
    from rlhf.schema import AlgorithmConfig, DType, TrainerConfig

    torch.set_num_threads(threads)
    cfg = load_model_config(model_yaml)
    g = torch.Generator().manual_seed(0)
    B = samples_per_rank * ranks
    prompts = [[1] + torch.randint(3, 30, (7,), generator=g).tolist() for _ in range(B)]
    responses = [torch.randint(3, cfg.vocab_size, (new_tokens,), generator=g).tolist() for _ in range(B)]
    batch = TokenBatch.from_samples(prompts, responses, [[-1.0] * new_tokens] * B)
    batch = batch.with_(advantages_B=torch.randn(B, generator=g))
    layout = Layout(dp=ranks, ep=ranks)
    tcfg = TrainerConfig(dp=ranks, ep=ranks, micro_batch_tokens=micro_batch_tokens,
                         compute_dtype=DType(compute_dtype) if compute_dtype else None)
    trainer = ParallelTrainer(cfg, tcfg, layout, rank, model_dir)
    memory = {"after_init": _memory_gib()}
    algo = AlgorithmConfig()
    normaliser = loss_normaliser(algo, batch.mask_BT)
    mbs = batch.micro_batches(list(range(B)), ranks, layout.coords(rank).dp, micro_batch_tokens)

    def step():
        trainer.train_step(mbs, lambda lp, e, mb: policy_loss(algo, lp, e, mb.extras, normaliser, LossRecord()))

    seconds, cpu = [], []
    for _ in range(steps):
        if offload and seconds:  # as a co-located run: the trainer offloaded between its updates
            trainer.offload()
            trainer.onload()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        seconds.append(round(time.perf_counter() - t0, 2))
        cpu.append(round(time.process_time() - c0, 2))
        memory[f"after_step_{len(seconds)}"] = _memory_gib()
    table, categories, shapes = "", None, None
    if memory_categories:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    record_shapes=True, with_stack=True) as prof:
            step()
        categories = _tensor_peak_gb(prof)
    elif profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=profile_memory,
                                    record_shapes=True) as prof:
            step()
        table = prof.key_averages(group_by_input_shape=by_shape).table(
            sort_by="self_cpu_memory_usage" if profile_memory else "self_cpu_time_total",
            row_limit=rows or (25 if profile_memory or by_shape else 15))
        shapes = matmul_shapes(prof)
    from rlhf.host_memory import process_allocator

    return {"step_seconds": seconds, "cpu_seconds": cpu, "micro_batches": len(mbs), "table": table, "memory_gib": memory,
            "allocator": process_allocator(),
            "tensor_peak_gb": categories, "matmul_shapes": shapes}


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def matmul_shapes(prof) -> int:
    """Distinct (op, operand shapes) among the profiled step's matmuls: the primitives oneDNN builds for a bf16
    step on cpu (`rlhf.host_memory.small_onednn_cache`)."""
    return len({(e.key, str(e.input_shapes)) for e in prof.key_averages(group_by_input_shape=True)
                if e.key in MATMUL_OPS})


def _tensor_peak_gb(prof) -> dict:
    """The profiled step's tensors at their peak, GB by kind (parameters, optimizer state, gradients, activations,
    temporaries), from torch's memory profiler (a private module: `torch.profiler._memory_profiler`). What the
    process holds beyond these (allocator caches, oneDNN's buffers, libraries) is the resident size less this."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    import torch

    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    peak = max(sizes, key=sum)
    names = {i + 1: c.name.lower() if c is not None else "unknown" for c, i in _CATEGORY_TO_INDEX.items()}
    out = {names.get(j, str(j)): round(v / 1e9, 3) for j, v in enumerate(peak) if v}
    return out | {"total": round(sum(peak) / 1e9, 3)}


def _memory_gib() -> dict:
    """This process's resident memory now and its peak so far (VmRSS, VmHWM), and what the allocator holds free
    for later allocations (`heap_free`: freed, not handed back), GiB."""
    from rlhf.host_memory import heap_free_bytes

    with open("/proc/self/status") as f:
        kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    free = heap_free_bytes()
    return {"rss": round(kb["VmRSS"] / (1 << 20), 2), "peak": round(kb["VmHWM"] / (1 << 20), 2)} \
        | ({} if free is None else {"heap_free": round(free / (1 << 30), 2)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.update_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "configs" / "model" / "qwen3_moe_small.yaml"))
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2, 4), help="dp = ep = ranks gloo processes")
    parser.add_argument("--samples-per-rank", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default=None,
                        help="trainer.compute_dtype (default: the model's dtype)")
    parser.add_argument("--micro-batch-tokens", type=int, default=4096, help="trainer.micro_batch_tokens")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (a trainer rank has 1 on cpu; --ranks 1 --threads 2 "
                             "--samples-per-rank 64 is the two-rank update on one rank of two threads)")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps before the profiled one (the first compiles and allocates: compare the rest)")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step after the timed ones")
    parser.add_argument("--profile-memory", action="store_true",
                        help="the profiled step's ops by the memory they allocate (torch.profiler profile_memory)")
    parser.add_argument("--memory-categories", action="store_true",
                        help="instead of the ops table: the profiled step's tensors at their peak by kind (tensor_peak_gb)")
    parser.add_argument("--by-shape", action="store_true", help="the ops table by operand shapes")
    parser.add_argument("--rows", type=int, default=None, help="rows of the ops table (15; 25 by shape or memory)")
    parser.add_argument("--table-rank", type=int, default=0,
                        help="whose ops table to print (each rank waits in the collectives for the other's work)")
    parser.add_argument("--expert-rows-multiple", type=int, default=None,
                        help="pad each expert's rows to a multiple of this under bf16 on cpu (1: no padding; default: "
                             "rlhf.model.qwen3_moe.EXPERT_ROWS_MULTIPLE)")
    parser.add_argument("--offload", action="store_true",
                        help="offload and onload the trainer between steps, as a co-located run does (on cpu its "
                             "freed heap goes back to the system: the next step faults its pages in again)")
    parser.add_argument("--allocator", choices=("auto", "jemalloc", "glibc"), default="auto",
                        help="the ranks' malloc, as a run's trainer.cpu_allocator chooses it (rlhf.host_memory."
                             "allocator_env): jemalloc keeping freed pages, or glibc's with transparent huge pages")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="with --allocator glibc: glibc's malloc without transparent huge pages")
    args = parser.parse_args(argv)
    if args.expert_rows_multiple is not None and args.expert_rows_multiple < 1:
        parser.error(f"--expert-rows-multiple {args.expert_rows_multiple}: give 1 (no padding) or more, e.g. 64")
    if args.memory_categories and args.ranks != 1:  # torch's memory profiler fails on the collectives' outputs
        parser.error("--memory-categories profiles one rank: give --ranks 1 (it holds every expert)")
    if not 0 <= args.table_rank < args.ranks:
        parser.error(f"--table-rank {args.table_rank}: give a rank below --ranks {args.ranks}")
    if args.rows is not None and args.rows < 1:
        parser.error(f"--rows {args.rows}: give at least 1")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: give at least 1")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: give 1 or more")
    if args.no_huge_pages and args.allocator != "glibc":
        parser.error("--no-huge-pages is glibc's setting: give --allocator glibc with it")
    if args.micro_batch_tokens < 1:
        parser.error(f"--micro-batch-tokens {args.micro_batch_tokens}: give a positive token count, e.g. 1024")

    from rlhf.config import load_model_config
    from rlhf.host_allocator import allocator_env
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
    from rlhf.parallel.launch import run_ranks

    cfg = load_model_config(args.model)
    from rlhf.cpu_matmul import half_matmul_fast
    from rlhf.schema import DType

    dtype = DType(args.compute_dtype) if args.compute_dtype else cfg.dtype
    if not half_matmul_fast(dtype):  # hours a step (rlhf/cpu_matmul.py)
        parser.error(f"{dtype.value}: this cpu has no {dtype.value} matmul instructions (no AVX-512 or AMX), where "
                     "torch's reference loop runs them about 50x slower than fp32: give --compute-dtype float32")
    model_dir = REPO / "out" / "bench" / f"{cfg.name}-update"
    if not (model_dir / "config.json").is_file():
        model = Qwen3MoeForCausalLM(cfg)
        model.init_weights(0, std=0.02)
        save_pretrained(model, model_dir)
    if not args.no_huge_pages:  # as a run's trainer processes start (the ranks inherit it)
        try:
            os.environ.update(allocator_env(args.allocator))
        except FileNotFoundError as e:
            parser.error(f"--allocator jemalloc: {e}")
    results = run_ranks(worker, args.ranks, args.model, str(model_dir), args.ranks, args.samples_per_rank,
                        args.new_tokens, args.compute_dtype, not args.no_profile, args.micro_batch_tokens,
                        args.profile_memory, args.memory_categories, args.expert_rows_multiple, args.threads,
                        args.by_shape, args.steps, args.rows, args.offload, timeout_s=1800)
    print(results[args.table_rank]["table"], file=sys.stderr)
    print(json.dumps({"model": cfg.name, "ranks": args.ranks, "samples_per_rank": args.samples_per_rank,
                      "new_tokens": args.new_tokens, "compute_dtype": args.compute_dtype or cfg.dtype.value,
                      "micro_batch_tokens": args.micro_batch_tokens, "micro_batches": results[0]["micro_batches"],
                      "expert_rows_multiple": args.expert_rows_multiple, "threads": args.threads,
                      "allocator": results[0]["allocator"],
                      "step_seconds": {r: res["step_seconds"] for r, res in enumerate(results)},
                      "cpu_seconds": {r: res["cpu_seconds"] for r, res in enumerate(results)},
                      "matmul_shapes": results[0]["matmul_shapes"],
                      "memory_gib": {r: res["memory_gib"] for r, res in enumerate(results)}}
                     | ({"tensor_peak_gb": {r: res["tensor_peak_gb"] for r, res in enumerate(results)}}
                        if args.memory_categories else {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
