"""The tiled decode MoE kernel (`rlhf_cpu::decode_moe`, actors/vllm/csrc/decode_moe.cpp) computes a bf16 model's
experts: equal to a reference in torch that rounds where a bf16 layer does, for every routing shape an engine
meets (one row, the 1-4 row tiles and more, empty experts, zero-weight slots of other expert-parallel ranks), the
same bits on one thread or several; bad input is refused; the build is cached and leaves nothing half-written."""

import os
import subprocess

import pytest
import torch

from rlhf.config.validate import tiled_moe_missing

WHY = tiled_moe_missing()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"the tiled kernel cannot run here: {WHY}")


def _ops():
    from actors.vllm import cpu_moe

    cpu_moe.load()
    return torch.ops.rlhf_cpu


def _layer(E=8, H=256, I=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16()
    return w13, w2


def _reference(x, ids, weights, w13, w2):
    """fp32 products of the bf16 values, rounded to bf16 where the kernel (and a bf16 model) rounds."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    I = w2.shape[2]
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            w = weights[t, s].item()
            if w == 0:
                continue
            e = ids[t, s].item()
            h = (x[t].float() @ w13[e].float().T).bfloat16().float()
            act = (torch.nn.functional.silu(h[:I]) * h[I:]).bfloat16().float()
            out[t] += w * (act @ w2[e].float().T)
    return out.bfloat16()


def _routes(T, E, k, seed, counts=None):
    g = torch.Generator().manual_seed(seed)
    if counts is None:
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g) * 2, -1), k)
        return ids.int().contiguous(), (weights / weights.sum(-1, keepdim=True)).contiguous()
    # rows per expert as given: slot (t, s) of the flattened order goes to the experts in turn
    flat = torch.cat([torch.full((n,), e) for e, n in enumerate(counts)])
    assert flat.numel() == T * k
    ids = flat[torch.randperm(T * k, generator=g)].view(T, k)
    return ids.int().contiguous(), torch.rand(T, k, generator=g).contiguous()


@needs_kernel
@pytest.mark.parametrize("T,counts", [
    (1, None),  # one token: every expert of it has one row
    (2, [1, 1, 2, 0, 0, 0, 0, 0]),  # the 1- and 2-row tiles, empty experts
    (6, [3, 4, 5, 0, 0, 0, 0, 0]),  # 3, 4 and 5 rows (a 4-row tile and a 1-row one)
    (16, [9, 0, 11, 1, 2, 3, 4, 2]),  # uneven counts
    (48, None),  # a prefill's many rows per expert
])
def test_kernel_equals_a_bf16_reference(T, counts):
    ops, (w13, w2) = _ops(), _layer()
    x = (torch.randn(T, 256, generator=torch.Generator().manual_seed(T)) * 0.5).bfloat16()
    ids, weights = _routes(T, 8, 4 if counts is None else sum(counts) // T, T, counts)
    got = ops.decode_moe(x, ids, weights, ops.decode_moe_pack(w13), ops.decode_moe_pack(w2))
    want = _reference(x, ids, weights, w13, w2)
    # the kernel sums its dot products in another order than torch's fp32 matmul, so an intermediate rounding to
    # bf16 can go the other way: within 2 bf16 steps of the output's scale (measured: most entries equal)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= scale * 2 ** -7
    assert (got == want).float().mean() > 0.9


@needs_kernel
def test_zero_weight_slots_are_skipped_as_expert_parallel_ranks_need():
    # the expert-map patch (actors/vllm/worker_ext.py) gives another rank's experts weight 0 and id 0: this rank's
    # share is its own experts' sum alone, whatever expert 0 would have computed
    ops, (w13, w2) = _ops(), _layer()
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 0.5).bfloat16()
    ids, weights = _routes(5, 8, 4, 1)
    foreign = ids >= 4
    got = ops.decode_moe(x, torch.where(foreign, 0, ids).int(), torch.where(foreign, 0.0, weights), *map(
        ops.decode_moe_pack, (w13, w2)))
    want = _reference(x, ids, torch.where(foreign, 0.0, weights), w13, w2)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    nan = w13.clone()
    nan[0] = float("nan")  # expert 0's output is never looked at for the zero-weight slots
    got_nan = ops.decode_moe(x, torch.where(foreign, 0, ids).int(), torch.where(foreign, 0.0, weights),
                             ops.decode_moe_pack(nan), ops.decode_moe_pack(w2))
    mine0 = (ids == 0).any(-1)
    assert torch.equal(got_nan[~mine0], got[~mine0])


@needs_kernel
def test_threads_give_the_same_bits():
    ops, (w13, w2) = _ops(), _layer(E=16)
    x = (torch.randn(24, 256, generator=torch.Generator().manual_seed(2)) * 0.5).bfloat16()
    ids, weights = _routes(24, 16, 4, 2)
    packed = ops.decode_moe_pack(w13), ops.decode_moe_pack(w2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.decode_moe(x, ids, weights, *packed)
        torch.set_num_threads(2)
        two = ops.decode_moe(x, ids, weights, *packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_a_tokens_output_does_not_depend_on_the_other_tokens():
    # an expert's rows go through its tiles in groups of one to four: every row's sums run in the same order whatever
    # the batch, so a token decodes to the same bits alone or among 40 (what makes a sample independent of its batch)
    ops, (w13, w2) = _ops(), _layer()
    x = (torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    ids, weights = _routes(40, 8, 4, 3)
    packed = ops.decode_moe_pack(w13), ops.decode_moe_pack(w2)
    together = ops.decode_moe(x, ids, weights, *packed)
    alone = torch.cat([ops.decode_moe(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], *packed) for t in range(40)])
    assert torch.equal(together, alone)


@needs_kernel
def test_bad_input_is_refused_with_what_is_wrong():
    ops, (w13, w2) = _ops(), _layer()
    packed = ops.decode_moe_pack(w13), ops.decode_moe_pack(w2)
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    ids, weights = torch.tensor([[0, 8], [1, 2]], dtype=torch.int32), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=r"expert id 8 out of range \[0, 8\)"):
        ops.decode_moe(x, ids, weights, *packed)
    with pytest.raises(RuntimeError, match="ids \\[T, k\\] int32"):
        ops.decode_moe(x, ids.long(), weights, *packed)
    with pytest.raises(RuntimeError, match="N a multiple of 64 and K of 32, got 96"):
        ops.decode_moe_pack(torch.zeros(2, 96, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="packed w13"):
        ops.decode_moe(torch.zeros(2, 128, dtype=torch.bfloat16), ids.clamp(max=7), weights, *packed)


@needs_kernel
def test_build_is_cached_and_a_killed_builds_file_is_removed(tmp_path, monkeypatch):
    from actors.vllm import cpu_moe

    monkeypatch.setenv("RLHF_KERNEL_CACHE", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{cpu_moe.library_path().name}.{dead.pid}.tmp"  # a build killed before its rename
    stale.write_bytes(b"half")
    live = tmp_path / f"{cpu_moe.library_path().name}.{os.getppid()}.tmp"
    live.write_bytes(b"building")  # a build still running (in a live process) is left alone
    path = cpu_moe.build()
    assert path.parent == tmp_path and path.stat().st_size > 0 and not stale.exists() and live.exists()
    built = path.stat().st_mtime_ns
    assert cpu_moe.build() == path and path.stat().st_mtime_ns == built  # found, not built again
    monkeypatch.setenv("CXX", "false")  # another compiler: another name, and its failure says what ran
    with pytest.raises(RuntimeError, match="building decode_moe.cpp failed \\(false "):
        cpu_moe.build()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, live.name])


def test_tiled_is_refused_before_any_actor_where_the_machine_cannot(monkeypatch):
    from pathlib import Path

    from rlhf.config import load_run_config
    from rlhf.errors import ConfigError

    tiny = Path(__file__).parents[4] / "configs" / "tiny_cpu.yaml"
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(ConfigError, match=r"rollout.cpu_moe_kernel = 'tiled': .*(no-such-compiler|avx512_bf16).*"
                                          r"use auto"):
        load_run_config(tiny, ["rollout.cpu_moe_kernel=tiled"])
    assert load_run_config(tiny, ["rollout.cpu_moe_kernel=auto"]).rollout.cpu_moe_kernel.value == "auto"


def test_a_failed_build_is_tried_once_a_process_auto_falls_back_and_tiled_says_why(monkeypatch, caplog):
    import functools

    from actors.vllm import cpu_moe
    from rlhf.schema import CpuMoeKernel

    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("building decode_moe.cpp failed (c++ ...)")

    monkeypatch.setattr(cpu_moe, "tiled_moe_missing", lambda: None)  # a machine that could run it
    monkeypatch.setattr(cpu_moe, "build", failing)
    # a fresh process's memory of the outcome (the real one, which may hold the loaded ops, comes back after)
    monkeypatch.setattr(cpu_moe, "_load_error", functools.lru_cache(maxsize=1)(cpu_moe._load_error.__wrapped__))
    with caplog.at_level("WARNING"):
        assert [cpu_moe.available(CpuMoeKernel.auto) for _ in range(3)] == [False] * 3  # three layers
    assert calls == [1]
    assert "vLLM's MoE kernel serves (building decode_moe.cpp failed" in caplog.text
    with pytest.raises(RuntimeError, match="rollout.cpu_moe_kernel=tiled: building decode_moe.cpp failed"):
        cpu_moe.available(CpuMoeKernel.tiled)
    assert cpu_moe.available(CpuMoeKernel.vllm) is False and calls == [1]
