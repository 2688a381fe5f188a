"""`rlhf calibrate --out FILE`: this machine as a hardware description for the simulator, from micro-benchmarks
of about a minute or two: matmul FLOP/s by dtype on one device's threads, grouped expert matmuls against one
matmul of the same FLOPs, memory bandwidth, gloo point-to-point bandwidth and latency between two processes,
and a vLLM engine's decode-step time (its fixed cost per step, which dominates small models).

The per-phase calibration beyond that (a scale and a fixed cost per event, fitted on measured runs) is
benchmarks/sim_accuracy.py's job; an existing file's calibration is kept when it is rewritten here.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from rlhf.config.validate import cpu_has_amx_tiles
from rlhf.sim.hardware import Hardware, Link, calibration_from_dict, hardware_to_dict


def _timed(fn, repeat: int, budget_s: float = 1.0) -> float:
    """Median seconds of `fn` over up to `repeat` runs after a warm-up, fewer once `budget_s` is spent (a slow
    path, such as bf16 without hardware support, is measured without taking minutes)."""
    t0 = time.perf_counter()
    fn()  # warm-up
    times = [time.perf_counter() - t0]
    for _ in range(repeat):
        if sum(times) > budget_s and len(times) >= 2:
            break
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times)


def matmul_tflops(dtype, threads: int, shapes=((2048, 512, 1536), (1024, 512, 4096), (4096, 256, 512))) -> float:
    """Median over shapes of a model-like matmul's TFLOP/s on `threads` threads."""
    import torch

    torch.set_num_threads(threads)
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        seconds = _timed(lambda: a @ b, 5)
        out.append(2 * m * k * n / seconds / 1e12)
        if seconds > 0.5:  # a slow path (bf16 without hardware support): one shape says enough
            break
    return statistics.median(out)


def grouped_efficiency(threads: int, experts: int = 32, tokens: int = 4096, hidden: int = 512, ffn: int = 256) -> float:
    """Expert matmuls (tokens split over `experts`, each its own weights) against one matmul of the same FLOPs."""
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(tokens, hidden)
    w = torch.randn(experts, hidden, ffn)
    rows = x.split(tokens // experts)
    grouped = _timed(lambda: [r @ w[i] for i, r in enumerate(rows)], 5)
    w1 = torch.randn(hidden, ffn)
    one = _timed(lambda: x @ w1, 5)
    return min(1.0, one / grouped)


def memory_gbytes_per_s(threads: int, mib: int = 256) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.empty(mib << 18)  # float32
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / _timed(lambda: b.copy_(a), 5) / 1e9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p2p_worker(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from datetime import timedelta

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        big, tiny = torch.empty(16 << 20), torch.empty(1)  # 64 MiB, 4 B
        def pingpong(t, n):
            for _ in range(n):
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
        pingpong(big, 1)
        t0 = time.perf_counter()
        pingpong(big, 4)
        bw = 8 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
        pingpong(tiny, 20)
        t0 = time.perf_counter()
        pingpong(tiny, 200)
        lat = (time.perf_counter() - t0) / 400 * 1e6
        if rank == 0:
            out.send((bw, lat))
    finally:
        dist.destroy_process_group()


def _in_children(target, args_per_child, timeout: float, what: str):
    """Run `target(*args, conn)` in spawned children and return what the first sends on the pipe (a pipe, not a
    queue: no semaphore left in /dev/shm); every child is joined, or killed, before this returns."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=target, args=(*args, send)) for args in args_per_child]
    for p in procs:
        p.start()
    try:
        if not recv.poll(timeout):
            raise TimeoutError(f"{what} gave no result in {timeout:.0f} s")
        return recv.recv()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


def gloo_link(timeout: float = 120.0) -> Link:
    """Point-to-point between two processes on this machine over gloo: GB/s one way, microseconds a message."""
    port = _free_port()
    bw, lat = _in_children(_p2p_worker, [(0, port), (1, port)], timeout, "the gloo point-to-point measurement")
    return Link(bw, lat)


def _time_generate(llm, prompts, n: int) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def _decode_worker(batch_sizes, tokens: int, out) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from rlhf.config import load_model_config
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as d:
        m = load_model_config(repo / "configs" / "model" / "qwen3_moe_tiny.yaml")
        model = Qwen3MoeForCausalLM(m)  # random weights: only the time matters
        model.init_weights(0, std=0.02)
        save_tokenizer(build_tokenizer(m.vocab_size), d, model_max_length=m.max_position_embeddings)
        save_pretrained(model, d)
        llm = LLM(model=d, dtype="float32", enforce_eager=True, max_model_len=m.max_position_embeddings, seed=0)
        try:
            result = {}
            for b in batch_sizes:
                prompts = [{"prompt_token_ids": [5 + i % 7, 9, 11]} for i in range(b)]
                _time_generate(llm, prompts, 2)
                one, full = _time_generate(llm, prompts, 1), _time_generate(llm, prompts, tokens)
                result[b] = max(0.0, (full - one) / (tokens - 1))
            out.send(result)
        finally:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None:
                core.shutdown()


def decode_step_seconds(batch_sizes=(1, 32), tokens: int = 32, timeout: float = 300.0) -> dict:
    """A tiny vLLM engine's seconds per decode step at each batch size (prefill subtracted): what a step costs
    besides its FLOPs (scheduling, sampling, Python), the hardware's `engine_step_s`. The engine runs in a child
    process, so nothing of it outlives the measurement."""
    return _in_children(_decode_worker, [(batch_sizes, tokens)], timeout, "the vLLM decode measurement")


def calibrate(out: str | Path, threads: int = 1, vllm: bool = True, log=print) -> Hardware:
    """Measure this machine and write its hardware description to `out` (keeping a calibration it holds)."""
    import torch

    t0 = time.time()
    f32 = matmul_tflops(torch.float32, threads)
    bf16 = matmul_tflops(torch.bfloat16, threads)
    log(f"matmul: {f32 * 1e3:.0f} GFLOP/s float32, {bf16 * 1e3:.0f} GFLOP/s bfloat16 on {threads} thread(s)")
    grouped = grouped_efficiency(threads)
    mem = memory_gbytes_per_s(threads)
    log(f"grouped expert matmuls at {grouped:.2f} of one matmul; memory {mem:.1f} GB/s")
    link = gloo_link()
    log(f"gloo point-to-point: {link.gbytes_per_s:.2f} GB/s, {link.latency_us:.0f} us per message")
    cal: dict = {}
    # the quantized formats vllm-cpu serves on AMX, with the bytes a decode step effectively reads a weight: block
    # FP8 on our experts' kernel, which turns each block into bf16 in L1 beside the AMX products (generation measured
    # at 1.04-1.34x of bf16 engines'), W8A8 int8 on vLLM's int8 kernels (1.15-1.21x: docs/quantized_rollout.md)
    quant = {"fp8_block": 1.5, "int8_channel": 1.5} if cpu_has_amx_tiles() else {}
    previous = Path(out)
    if previous.is_file():  # a calibration fitted on measured runs outlives a re-measurement of the machine
        data = yaml.safe_load(previous.read_text()) or {}
        data = data if isinstance(data, dict) else {}
        cal = calibration_from_dict(data.get("calibration"), str(previous))
        kept = data.get("quantized_decode_bytes") or {}
        quant = {k: kept.get(k, v) for k, v in quant.items()}
    engine_step = 0.0
    if vllm:
        steps = decode_step_seconds()
        log("vLLM decode step (tiny model): " + ", ".join(f"batch {b}: {1e3 * s:.1f} ms" for b, s in steps.items()))
        engine_step = min(steps.values())
    cores = os.cpu_count() or 1
    hw = Hardware(name=Path(out).stem, device=f"{threads} core(s) of this {cores}-core machine (a stand-in device)",
                  device_type="cpu", devices_per_node=max(1, cores // threads), memory_gib=_memory_gib(),
                  memory_gbytes_per_s=mem, tflops={"float32": f32, "bfloat16": bf16}, grouped_matmul_efficiency=grouped,
                  engine_step_s=engine_step,
                  links={"node": link, "domain": link, "cross": link, "host": Link(0.0, 0.0)},
                  runtime_gib={"trainer": 1.0, "engine": 2.3}, quantized_decode_bytes=quant, calibration=cal,
                  sources=(f"rlhf calibrate on {socket.gethostname()}, {time.strftime('%Y-%m-%d')}, "
                           f"{time.time() - t0:.0f} s",))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("# This machine, measured by `rlhf calibrate` (rlhf/driver/calibrate.py); the calibration "
                         "is fitted by\n# benchmarks/sim_accuracy.py on measured runs (docs/simulate.md).\n"
                         + yaml.safe_dump(hardware_to_dict(hw), sort_keys=False))
    return hw


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return round(kib / (1 << 20), 1)
    except OSError:
        return 0.0
