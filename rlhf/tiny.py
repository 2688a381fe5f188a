"""`rlhf make-tiny DIR`: a tiny MoE policy for the addition task, warm-started by a short SFT pass.

DIR becomes an HF model directory (config.json, model.safetensors, tokenizer files) that transformers
and vLLM open, plus the task's prompt files beside the weights:

    DIR/train.jsonl     RL training prompts
    DIR/heldout.jsonl   held-out prompts the reported accuracy was measured on
    DIR/tiny.json       what was built: parameters, SFT steps, held-out accuracy, seed

SFT stops as soon as greedy held-out accuracy reaches `target_accuracy` (checked every
`eval_every` steps), so the policy lands with room for RL to improve and enough reward signal for
GRPO. Everything is deterministic for a seed on a given machine.

`task="code"` (`rlhf make-tiny DIR --task code`): the same sums answered as a program, `347+58=` ->
`print(405)`; each row's answer is its stdin/stdout test (`{"inputs": [""], "outputs": ["405"]}`) and
held-out accuracy runs the programs in the code verifier's sandbox (`reward.kind: code`,
docs/code_reward.md). The tokenizer's alphabet gains the characters of `print()`.

`task="tool"` (`rlhf make-tiny DIR --task tool`): sums of up to 5-digit numbers, too long for the tiny policy to
add in its head, answered with the calculator tool (`rlhf.agents.calculator`, docs/agents.md): the warm start
shows the episode `12345+678=<calc>12345+678</calc><result>13023</result>13023` (the result is the environment's,
out of the loss) and, for `direct_share` of the problems (the majority by default), the sum written at once, which
it cannot learn. So the policy can call and copy but mostly does not: SFT stops when greedy episodes whose first
token is forced to `<calc>` reach the target (`heldout_accuracy_with_call`), and `heldout_accuracy`, greedy episodes
left to choose, starts near 0; RL has to find that calling pays (configs/tiny_cpu_tool.yaml). The tags are whole
tokens of the tokenizer.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from rlhf.agents.episode import Limits
from rlhf.schema import Architecture, Attention, ModelConfig
from rlhf.data.arithmetic import Problem, is_correct, make_problems, write_jsonl
from rlhf.data.tokenizer import ALPHABET, build_tokenizer, save_tokenizer
from rlhf.model.generate import greedy_generate
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM


@dataclass(frozen=True)
class TinySpec:
    seed: int = 0
    max_digits: int = 3
    n_sft: int = 20_000
    n_train: int = 4_000
    n_heldout: int = 256
    target_accuracy: float = 0.2
    min_accuracy: float = 0.05
    max_sft_steps: int = 2_000
    eval_every: int = 25
    batch_size: int = 64
    lr: float = 3e-3
    init_std: float = 0.02
    task: str = "add"  # add: the sum's digits; code: a program printing it, scored in the sandbox; tool: a call
    direct_share: float = 0.6  # tool task: the share of warm-start problems answered without the calculator


TASKS = ("add", "code", "tool")
CODE_ALPHABET = ALPHABET + "print()"
TOOL_WORDS = ("<calc>", "</calc>", "<result>", "</result>")  # rlhf.agents.calculator.Calculator's default tags
TOOL_MAX_DIGITS = 5
TOOL_LIMITS = Limits(max_turns=3, max_tokens=64, turn_tokens=16)  # configs/tiny_cpu_tool.yaml's agent limits


def as_code(problems: Sequence[Problem]) -> list[Problem]:
    """The problems with their answers as stdin/stdout tests of a program (`print(405)` passes `405`'s)."""
    return [Problem(p.prompt, json.dumps({"inputs": [""], "outputs": [p.answer]})) for p in problems]


def sft_target(p: Problem, task: str, direct: bool = False) -> list[tuple[str, bool]]:
    """What the warm start teaches for a problem, as pieces of text after the prompt and whether the policy
    writes each (the calculator's result it reads, and learns nothing from)."""
    if task == "code":
        return [(f"print({p.answer})", True)]
    if task == "tool" and not direct:
        return [(f"<calc>{p.prompt.rstrip('=')}</calc>", True), (f"<result>{p.answer}</result>", False),
                (p.answer, True)]
    return [(p.answer, True)]


def make_tiny_args(cfg) -> str:
    """What `rlhf make-tiny` needs, besides the directory, to write the tiny policy a run (a RunConfig) trains:
    the model by name when it is not the default one, and the code task's rows for `reward.kind: code`."""
    from rlhf.schema import RewardKind

    args = [f"--model {cfg.model.name}"] if cfg.model.name == "pangu_moe_tiny" else []
    if cfg.agent.environment == "rlhf.agents.calculator:Calculator":
        return " ".join(args + ["--task tool"])
    code = cfg.reward.kind is RewardKind.code or cfg.agent.environment == "rlhf.agents.code:CodeFeedback"
    return " ".join(args + (["--task code"] if code else []))


def sft_lr(model_cfg: ModelConfig) -> float:
    """The warm start's learning rate by architecture and width: the tiny DeepSeek-V3 / Pangu model made no progress
    at Qwen3-MoE's 3e-3 (loss 1.7, accuracy 0 after 950 steps; loss 1.25 after 2,900 with warmup and gradient
    clipping, a one-off script outside the repo) and learns at 1e-3. So does the 256-wide Qwen3-MoE of
    FP8 rollout (`qwen3_moe_fp8_tiny`): 0.070 after 2,000 steps at 3e-3, 0.215 after 1,475 at 1e-3."""
    wide = model_cfg.hidden_size >= 256
    return 1e-3 if model_cfg.architecture is Architecture.pangu_moe or wide else TinySpec.lr


def sft_init_std(model_cfg: ModelConfig) -> float:
    """The random start's standard deviation by attention kind. Multi-head latent attention has no per-head
    query / key RMSNorm (Qwen3 normalises both, so its first attention scores are of order one): on a 96-wide
    model at std 0.02 its first scores are of order 0.01, attention is uniform and the bilinear q.k grows out
    of it slowly. From 0.1 the tiny DeepSeek-V3 / Pangu model reaches make-tiny's target in 525 steps instead of
    2,225 (docs/tiny_world.md, `--init-std`)."""
    return 0.1 if model_cfg.attention is Attention.mla else TinySpec.init_std


def sft_max_steps(model_cfg: ModelConfig) -> int:
    """The warm start's step budget by architecture: from std 0.02 the tiny Pangu model's held-out accuracy
    after 2,000 steps at 1e-3 was 0.086 in one build and 0.223 in another (the same seed, other thread counts:
    float rounding sends the runs apart); from `sft_init_std`'s 0.1 it reaches 0.2 near step 500, and the
    larger budget stays as a margin."""
    return 4_000 if model_cfg.architecture is Architecture.pangu_moe else TinySpec.max_sft_steps


def heldout_accuracy(model: Qwen3MoeForCausalLM, tok, problems: Sequence[Problem], max_new_tokens: int,
                     task: str = "add") -> float:
    """Greedy held-out accuracy: of the answers (add), the programs (code), or of episodes that call the calculator
    (tool: their first token forced to `<calc>`, `tool_success`)."""
    if task == "tool":
        return tool_success(model, tok, problems, force_call=True)
    prompts = [tok.encode(p.prompt).ids for p in problems]
    texts = [tok.decode(o) for o in greedy_generate(model, prompts, max_new_tokens)]
    if task == "code":  # the programs run as the run's reward workers run them
        from rlhf.data.verifiers import score_batch
        from rlhf.schema import RewardKind

        scores, _ = score_batch(RewardKind.code, texts, [p.answer for p in as_code(problems)])
        return sum(scores) / len(problems)
    return sum(is_correct(t, p.answer) for t, p in zip(texts, problems)) / len(problems)


def tool_success(model: Qwen3MoeForCausalLM, tok, problems: Sequence[Problem], limits: Limits = TOOL_LIMITS,
                 force_call: bool = False) -> float:
    """The share of greedy episodes with the calculator (`rlhf.agents.runner`, our model in place of the engines)
    that end rewarded; `force_call`: each episode's first token is `<calc>` (how well the policy calls and copies,
    whether or not it would choose to call)."""
    from types import SimpleNamespace

    from rlhf.agents.calculator import Calculator
    from rlhf.agents.runner import run_episodes

    eos = model.config.eos_token_id

    def generate(contexts, max_tokens, stop, seeds, episodes):
        stop_ids, longest = {tok.token_to_id(s) for s in stop}, max(max_tokens)
        first = [force_call and len(c) == len(p) for c, p in zip(contexts, (prompts[e] for e in episodes))]
        forced = [[calc] if f else [] for f in first]
        outs = []
        rows = greedy_generate(model, [c + f for c, f in zip(contexts, forced)], longest, stop_ids=stop_ids)
        for raw, cap, f in zip(rows, max_tokens, forced):
            at_stop = bool(raw) and raw[-1] in stop_ids
            at_eos = not at_stop and len(raw) < longest  # greedy_generate ended it at EOS, which it does not return
            row = f + raw + [eos] * at_eos
            finished = (at_stop or at_eos) and len(row) <= cap
            row = row[:cap]
            outs.append(SimpleNamespace(token_ids=row, logp=[0.0] * len(row), weight_version=0,
                                        finish_reason="stop" if finished else "length"))
        return outs

    calc, prompts = tok.token_to_id(TOOL_WORDS[0]), [tok.encode(p.prompt).ids for p in problems]
    eps, _ = run_episodes(generate, Calculator, problems, prompts, tok, limits)
    return sum(e.reward > 0 for e in eps) / max(len(eps), 1)


def _sft_batch(tok, problems: Sequence[Problem], eos: int, pad: int, task: str = "add",
               direct: Sequence[bool] = ()):
    """Token ids [B, T], attention mask, and a loss mask that covers what the policy writes and its EOS."""
    seqs, masks = [], []
    for i, p in enumerate(problems):
        seq = tok.encode(p.prompt).ids
        mask = [False] * len(seq)
        for text, written in sft_target(p, task, bool(direct and direct[i])):
            piece = tok.encode(text, add_special_tokens=False).ids
            seq, mask = seq + piece, mask + [written] * len(piece)
        seqs.append(seq + [eos])
        masks.append(mask + [True])
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        loss_mask[i, :len(s)] = torch.tensor(m)
    return ids, attn, loss_mask


def make_tiny(out_dir: str | Path, model_cfg: ModelConfig, spec: TinySpec = TinySpec(), log=print) -> dict:
    if spec.task not in TASKS:
        raise ValueError(f"task {spec.task!r}: use one of {', '.join(TASKS)}")
    t0 = time.time()
    out = Path(out_dir)
    torch.manual_seed(spec.seed)
    tok = build_tokenizer(model_cfg.vocab_size, CODE_ALPHABET if spec.task == "code" else ALPHABET,
                          TOOL_WORDS if spec.task == "tool" else ())
    digits = TOOL_MAX_DIGITS if spec.task == "tool" else spec.max_digits
    heldout = make_problems(spec.n_heldout, seed=spec.seed * 3 + 1, max_digits=digits)
    train = make_problems(spec.n_train, seed=spec.seed * 3 + 2, max_digits=digits, exclude={p.prompt for p in heldout})
    sft = make_problems(spec.n_sft, seed=spec.seed * 3 + 3, max_digits=digits,
                        exclude={p.prompt for p in heldout + train})

    model = Qwen3MoeForCausalLM(model_cfg)
    model.init_weights(spec.seed, std=spec.init_std)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    rng = random.Random(spec.seed)
    max_new = digits + 2 + (len("print()") if spec.task == "code" else 0)
    acc, step = heldout_accuracy(model, tok, heldout, max_new, spec.task), 0
    log(f"make-tiny: {n_params:,} parameters; step 0 held-out accuracy {acc:.3f}")
    while acc < spec.target_accuracy and step < spec.max_sft_steps:
        model.train()
        for _ in range(spec.eval_every):
            batch = rng.sample(sft, spec.batch_size)
            direct = [spec.task == "tool" and rng.random() < spec.direct_share for _ in batch]
            ids, attn, loss_mask = _sft_batch(tok, batch, model_cfg.eos_token_id, model_cfg.pad_token_id, spec.task,
                                              direct)
            logits = model(ids[:, :-1], attn[:, :-1])
            loss = F.cross_entropy(logits[loss_mask[:, 1:]], ids[:, 1:][loss_mask[:, 1:]])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        model.eval()
        acc = heldout_accuracy(model, tok, heldout, max_new, spec.task)
        log(f"make-tiny: step {step} loss {loss.item():.3f} held-out accuracy {acc:.3f}")
    if acc < spec.min_accuracy:
        raise RuntimeError(f"make-tiny: held-out accuracy {acc:.3f} after {step} SFT steps is below "
                           f"{spec.min_accuracy}; raise max_sft_steps or lr")

    chosen = tool_success(model, tok, heldout) if spec.task == "tool" else acc  # left to choose whether to call
    save_tokenizer(tok, out, model_max_length=model_cfg.max_position_embeddings)
    save_pretrained(model, out)
    written = as_code if spec.task == "code" else list
    write_jsonl(written(train), out / "train.jsonl")
    write_jsonl(written(heldout), out / "heldout.jsonl")
    summary = {
        "dir": str(out),
        "params": n_params,
        "heldout_accuracy": chosen,
        **({"heldout_accuracy_with_call": acc} if spec.task == "tool" else {}),
        "heldout_file": str(out / "heldout.jsonl"),
        "train_file": str(out / "train.jsonl"),
        "sft_steps": step,
        "seconds": round(time.time() - t0, 1),
        "spec": asdict(spec),
    }
    (out / "tiny.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
