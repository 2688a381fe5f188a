"""The simulator prices the trainer's matmuls at the rate of the dtype they run in (trainer.compute_dtype), while
its memory stays that of the parameters' dtype."""

from pathlib import Path

from rlhf.config import load_run_config
from rlhf.sim.workload import workload

SMALL = Path(__file__).resolve().parents[4] / "configs" / "small_cpu.yaml"


def test_bf16_compute_is_priced_as_bf16_and_stored_as_fp32():
    fp32 = workload(load_run_config(SMALL, ["trainer.compute_dtype=float32"]))
    bf16 = workload(load_run_config(SMALL, ["trainer.compute_dtype=bfloat16"]))
    assert (fp32.train_dtype, bf16.train_dtype) == ("float32", "bfloat16")
    assert fp32.train_bytes == bf16.train_bytes == 4
