"""`rlhf eval RUN.yaml`: score a policy directory on the run's task with our model and with vLLM.

Greedy held-out accuracy under both, their token-level agreement, and one rollout batch as the RL
loop would draw it (prompts_per_step prompts x group_size samples) with its mean reward, response
length and generation throughput.
"""

from __future__ import annotations

import random
import time

from actors.vllm.engine import VLLMEngine
from rlhf.data.prompts import load_prompts
from rlhf.data.verifiers import accuracy_scores
from rlhf.data.tokenizer import load_tokenizer
from rlhf.model.generate import greedy_generate
from rlhf.model.hf_io import check_model_dir, load_pretrained
from rlhf.schema import RunConfig
from rlhf.tiny import make_tiny_args


def evaluate(cfg: RunConfig, log=print) -> dict:
    model_dir = check_model_dir(cfg.model, make_tiny_args(cfg))
    tok = load_tokenizer(model_dir)
    eos = cfg.model.eos_token_id
    heldout = load_prompts(cfg.data.heldout_files, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.skip_bad_rows)
    train = load_prompts(cfg.data.train_files, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.skip_bad_rows)
    prompts = [tok.encode(r.prompt).ids for r in heldout.rows]
    max_new = cfg.rollout.max_new_tokens

    model = load_pretrained(model_dir).eval()
    ours = greedy_generate(model, prompts, max_new)
    answers = [r.answer for r in heldout.rows]
    acc_torch = sum(accuracy_scores(cfg.reward, [tok.decode(o) for o in ours], answers)) / len(heldout)
    log(f"eval: torch greedy held-out accuracy {acc_torch:.3f} on {len(heldout)} prompts")

    t0 = time.time()
    engine = VLLMEngine(str(model_dir), cfg.rollout, cfg.placement.device_type, seed=cfg.seed,
                        max_model_len=cfg.model.max_position_embeddings)
    start_s = time.time() - t0
    greedy = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_new)
    vllm_ids = [list(c.token_ids[:-1]) if c.token_ids[-1:] == (eos,) else list(c.token_ids) for c in greedy]
    acc_vllm = sum(accuracy_scores(cfg.reward, [tok.decode(v) for v in vllm_ids], answers)) / len(heldout)
    agree = sum(v == o for v, o in zip(vllm_ids, ours)) / len(ours)
    log(f"eval: vLLM greedy held-out accuracy {acc_vllm:.3f}; greedy agreement with torch {agree:.3f}")

    rows = random.Random(cfg.seed).sample(train.rows, min(cfg.data.prompts_per_step, len(train)))
    t0 = time.time()
    samples = engine.generate([tok.encode(r.prompt).ids for r in rows], n=cfg.algorithm.group_size, seed=cfg.seed)
    gen_s = time.time() - t0
    rewards = accuracy_scores(cfg.reward, [tok.decode(s.token_ids, skip_special_tokens=True) for s in samples],
                              [rows[s.prompt_index].answer for s in samples])
    engine.close()
    n_tokens = sum(len(s.token_ids) for s in samples)
    log(f"eval: rollout {len(rows)} prompts x {cfg.algorithm.group_size}: mean reward "
        f"{sum(rewards) / len(rewards):.3f}, {n_tokens / gen_s:.0f} tokens/s")
    return {
        "model_dir": str(model_dir),
        "heldout_prompts": len(heldout),
        "heldout_accuracy_torch": acc_torch,
        "heldout_accuracy_vllm": acc_vllm,
        "greedy_agreement": agree,
        "rollout_samples": len(samples),
        "rollout_reward_mean": sum(rewards) / len(rewards),
        "rollout_response_tokens_mean": n_tokens / len(samples),
        "rollout_tokens_per_s": n_tokens / gen_s,
        "engine_start_s": round(start_s, 1),
    }
