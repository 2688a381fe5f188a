"""The block-FP8 and per-channel int8 reference quantizers, and quantization inside the resharding plan: owners
quantize the blocks (rows) they hold and send bytes; every engine buffer then equals the reference quantizer
applied to the full weights, for every trainer layout into engines of tp1, tp2 and tp2 x ep2 (int8: every layout
whose trainer ranks hold whole rows; the others are refused)."""

import pytest
import torch

from rlhf.model.shapes import param_shapes
from rlhf.schema import ModelConfig
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.apply_local import apply_local
from weight_sync.pieces import local_tensors
from weight_sync.plan import Topology, plan_reshard
from weight_sync.quant import (FP8_DTYPE, FP8_MAX, INT8_MAX, TINY, BlockSplit, WireFormat, as_bytes, dequantize,
                               dequantize_fp8_block, is_quantized, owner_wire_buffers, quantize, quantize_fp8_block,
                               quantize_int8_channel, quantized_buffers, scale_shape, typed_buffers, wire_spec)


def reference(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, written plainly: the largest magnitude over 448 is the scale, values w / scale."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    s = torch.empty(nb, kb)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            scale = max(float(tile.abs().max()), TINY) / FP8_MAX
            s[i, j] = scale
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (
                tile / torch.tensor(scale, dtype=torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(as_bytes(a.contiguous()),
                                                                       as_bytes(b.contiguous()))


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 1), (128, 129)])
def test_quantizer_equals_the_block_by_block_reference(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    q, s = quantize_fp8_block(w)
    rq, rs = reference(w, 128)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == scale_shape(shape)
    assert same(q, rq) and same(s, rs)


def test_edge_blocks_zeros_and_one_huge_value():
    w = torch.zeros(200, 300)
    w[5, 7] = 1e30  # one huge value: its block's scale is set by it, the rest of the block underflows to 0
    w[5, 8] = 1.0
    w[150:, 200:] = torch.linspace(-2, 2, 50 * 100).reshape(50, 100)  # a partial corner block
    q, s = quantize_fp8_block(w)
    assert s.shape == (2, 3)
    assert s[0, 0].item() == pytest.approx(1e30 / FP8_MAX) and q[5, 7].float().item() == FP8_MAX
    assert q[5, 8].float().item() == 0.0
    assert s[0, 1].item() == pytest.approx(TINY / FP8_MAX) and not q[:128, 128:256].float().any()  # a zero block
    assert s[1, 2].item() == pytest.approx(2 / FP8_MAX)
    assert q[150:, 200:].float().abs().max().item() == FP8_MAX
    assert torch.isfinite(s).all()


def test_dequantized_within_e4m3_rounding_of_the_weight():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8_block(w)
    back = dequantize_fp8_block(q, s)
    amax = w.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3)).repeat_interleave(128, 0).repeat_interleave(128, 1)
    # 3 mantissa bits: a normal value within 2^-4 of itself; subnormals within half their step (2^-10 of 448)
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2 ** -4, amax / FP8_MAX * 2 ** -10)).all()


def test_aligned_regions_quantize_as_the_whole_tensor():
    w = torch.randn(3, 300, 260, generator=torch.Generator().manual_seed(2))
    q, s = quantize_fp8_block(w)
    for rows, cols in [((0, 128), (0, 260)), ((128, 300), (0, 128)), ((256, 300), (256, 260))]:
        rq, rs = quantize_fp8_block(w[:, rows[0]:rows[1], cols[0]:cols[1]])
        assert same(rq, q[:, rows[0]:rows[1], cols[0]:cols[1]])
        assert same(rs, s[:, rows[0] // 128:-(-rows[1] // 128), cols[0] // 128:-(-cols[1] // 128)])


def reference_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, written plainly: the largest magnitude over 127 is the scale, values round(w / scale)."""
    rows = w.reshape(-1, w.shape[-1]).float()
    q = torch.empty(rows.shape, dtype=torch.int8)
    s = torch.empty(rows.shape[0], 1)
    for i, row in enumerate(rows):
        scale = max(float(row.abs().max()), TINY) / INT8_MAX
        s[i, 0] = scale
        q[i] = torch.round(row / torch.tensor(scale, dtype=torch.float32)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.reshape(w.shape), s.reshape(*w.shape[:-1], 1)


@pytest.mark.parametrize("shape", [(256, 384), (3, 130, 200), (1, 1), (5000, 300)])
def test_int8_quantizer_equals_the_row_by_row_reference(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    if len(shape) == 2 and shape[0] > 2:
        w[1] = 0.0  # a zero row
        w[2, 7] = 1e30  # one huge value: the rest of its row rounds to 0
    kept = w.clone()
    q, s = quantize_int8_channel(w)
    assert torch.equal(w, kept)  # the owner's weights are read, never written
    rq, rs = reference_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == tuple(shape[:-1]) + (1,)
    assert same(q, rq) and same(s, rs)
    assert torch.isfinite(s).all() and (s > 0).all()
    if len(shape) == 2 and shape[0] > 2:
        assert not q[1].any() and q[2, 7] == 127 and not q[2, :7].any()
    back = dequantize(q, s, WireFormat("int8_channel"))  # rounded to the nearest step: within half of one
    assert ((back - w).abs() <= s * 0.5001 + w.abs() * 1e-6).all()


def test_int8_whole_rows_quantize_as_the_whole_tensor():
    w = torch.randn(3, 300, 260, generator=torch.Generator().manual_seed(2))
    q, s = quantize_int8_channel(w)
    for rows in [(0, 1), (7, 140), (299, 300)]:
        rq, rs = quantize_int8_channel(w[:, rows[0]:rows[1]])
        assert same(rq, q[:, rows[0]:rows[1]]) and same(rs, s[:, rows[0]:rows[1]])


def test_the_rule_keeps_embeddings_head_norms_and_routers_plain():
    shapes = param_shapes(model(layers=2, dense=1))
    quantized = sorted(n for n, s in shapes.items() if is_quantized(n, s))
    assert "model.layers.0.mlp.gate_proj.weight" in quantized
    assert "model.layers.1.self_attn.q_proj.weight" in quantized
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                  "model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight"):
        assert plain in shapes and plain not in quantized


# --- inside the plan ---

B = 4  # the block of these tests: the model's dimensions are multiples of B on every shard below


def model(layers: int = 2, dense: int = 0) -> ModelConfig:
    return ModelConfig(vocab_size=40, hidden_size=16, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=8, first_k_dense_layers=dense, intermediate_size=16)


TRAINERS = {"dp2 ep2": (Layout(dp=2, ep=2), 1), "tp2": (Layout(tp=2), 1), "tp2 ep2": (Layout(tp=2, ep=2), 1),
            "pp2": (Layout(pp=2), 1), "dp2 zero3": (Layout(dp=2), 3), "pp2 dp2 ep2": (Layout(pp=2, dp=2, ep=2), 1)}
ENGINES = {"tp1": InferenceLayout(tp=1), "tp2": InferenceLayout(tp=2), "tp2 ep2": InferenceLayout(tp=2, ep=2),
           "2 x tp2": InferenceLayout(tp=2, engines=2)}


@pytest.mark.parametrize("engines", ENGINES)
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("quantization", ["fp8_block", "int8_channel"])
def test_owners_quantize_what_they_hold_and_engines_equal_the_reference(quantization, trainer, engines):
    cfg = model(dense=1)
    layout, zero = TRAINERS[trainer]
    fmt = WireFormat(quantization, block=B)
    src = trainer_shard_spec(cfg, layout, zero_stage=zero)
    dst = engine_shard_spec(cfg, ENGINES[engines], rank_offset=layout.world_size // 2)
    if fmt.per_channel and layout.tp > 1:  # a TP rank holds part of each row of o_proj / down_proj
        with pytest.raises(BlockSplit, match=r"part of each row .*trainer.tp=1"):
            wire_spec(src, fmt)
        return
    wsrc, wdst = wire_spec(src, fmt), wire_spec(dst, fmt, sender=False)
    world = max(layout.world_size, layout.world_size // 2 + ENGINES[engines].world_size)
    plan = plan_reshard(wsrc, wdst, Topology.single_node(world))

    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(s, generator=g) for n, s in param_shapes(cfg).items()}
    shapes = src.shapes()
    send = {}
    for r in range(layout.world_size):  # each owner quantizes its own shard, nothing else
        own = rank_sharding(cfg, layout, r, zero_stage=zero)
        send[r] = owner_wire_buffers(local_tensors(full, own), quantized_buffers(own, fmt, shapes), fmt)
    typed = {r.rank: typed_buffers(r.buffer_shapes(), quantized_buffers(r, fmt, shapes), fmt) for r in dst.ranks}
    apply_local(plan, send, {rank: {n: as_bytes(t) for n, t in bufs.items()} for rank, bufs in typed.items()})

    ref = {n: quantize(t, fmt) if fmt.quantized(n, t.shape) else t.to(torch.bfloat16) for n, t in full.items()}
    for r in dst.ranks:
        for p in r.pieces:
            got = typed[r.rank][p.buffer][p.buffer_slices()]
            if isinstance(ref[p.param], tuple) and fmt.per_channel:  # the whole rows' scales, even for part of them
                q, s = ref[p.param]
                assert same(got, q[p.box.slices()]), (r.rank, p.param)
                lead = len(p.offset) - len(p.box.size)  # a buffer stacking 2-dim weights (experts) has more dims
                rows = tuple(p.offset[:lead]) + tuple(slice(o, o + n) for o, n in zip(p.offset[lead:-1], p.box.size[:-1]))
                mine = typed[r.rank][fmt.scale_name(p.buffer)][rows]
                assert same(mine, s[tuple(slice(a, a + n) for a, n in zip(p.box.start[:-1], p.box.size[:-1]))])
            elif isinstance(ref[p.param], tuple):
                q, s = ref[p.param]
                assert same(got, q[p.box.slices()]), (r.rank, p.param)
                lo = [a // B for a in p.box.start]
                hi = [-(-(a + n) // B) for a, n in zip(p.box.start, p.box.size)]
                lead = typed[r.rank][fmt.scale_name(p.buffer)][tuple(p.offset[:-2])]
                mine = lead[p.offset[-2] // B:p.offset[-2] // B + hi[0] - lo[0],
                            p.offset[-1] // B:p.offset[-1] // B + hi[1] - lo[1]]
                assert same(mine, s[lo[0]:hi[0], lo[1]:hi[1]]), (r.rank, p.param)
            else:
                assert same(got, ref[p.param][p.box.slices()]), (r.rank, p.param)

    bf16 = plan_reshard(wire_spec(src, WireFormat("none")), wire_spec(dst, WireFormat("none")),
                        Topology.single_node(world))
    assert bf16.bytes_minimal == 2 * sum(p.box.numel for r in dst.ranks for p in r.pieces)
    quantized = [p for r in dst.ranks for p in r.pieces if is_quantized(p.param, shapes[p.param])]
    quant = sum(p.box.numel for p in quantized)
    other = sum(p.box.numel for r in dst.ranks for p in r.pieces) - quant
    # values, a scale a block (fp8) or a row the piece holds part of (int8), bf16 rest
    scales = sum(p.box.numel // p.box.size[-1] for p in quantized) if fmt.per_channel else quant // (B * B)
    assert plan.bytes_minimal == quant + scales * 4 + 2 * other


def test_a_trainer_shard_that_cuts_blocks_is_refused_with_what_to_change():
    cfg = model()
    src = trainer_shard_spec(cfg, Layout(tp=4))  # 4 q rows and 2 k rows a rank: blocks of 8 cut
    with pytest.raises(BlockSplit, match=r"q_proj.weight: .* rows \[0, 4\) of 16.* 8 x 8 blocks.*trainer.tp"):
        wire_spec(src, WireFormat("fp8_block", block=8))
    wire_spec(src, WireFormat("none"))  # bf16 needs no blocks


def test_block_sized_quantization_halves_the_small_models_wire():
    """configs/model/qwen3_moe_small.yaml's shapes, trainer dp2 x ep2 into one tp1 engine, blocks of 128."""
    from rlhf.config import load_model_config

    cfg = load_model_config("configs/model/qwen3_moe_small.yaml")
    src = trainer_shard_spec(cfg, Layout(dp=2, ep=2))
    dst = engine_shard_spec(cfg, InferenceLayout(tp=1), rank_offset=0)
    topo = Topology.single_node(4)
    fp8 = plan_reshard(wire_spec(src, WireFormat()), wire_spec(dst, WireFormat()), topo)
    bf16 = plan_reshard(wire_spec(src, WireFormat("none")), wire_spec(dst, WireFormat("none")), topo)
    without_embeddings = bf16.bytes_minimal - 2 * 2 * 32000 * 512  # the embedding and the head stay bf16
    assert fp8.bytes_minimal - 2 * 2 * 32000 * 512 < 0.51 * without_embeddings


def test_a_replica_quantizes_only_what_it_sends():
    cfg = model()
    fmt = WireFormat("fp8_block", block=B)
    src = trainer_shard_spec(cfg, Layout(dp=2))  # every tensor on both ranks
    dst = engine_shard_spec(cfg, InferenceLayout(tp=1), rank_offset=2)
    plan = plan_reshard(wire_spec(src, fmt), wire_spec(dst, fmt), Topology.single_node(3))
    from weight_sync.quant import sent_buffers

    a, b = sent_buffers(plan, 0), sent_buffers(plan, 1)
    whole = {n for n, _ in src.ranks[0].buffers}
    assert a | b == whole and a < whole and b < whole  # the replicas share the sending, and the quantizing
    assert sent_buffers(plan, 0) is a  # once per plan
