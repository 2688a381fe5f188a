"""Many episodes, turn by turn, over one batch `generate`.

Each round hands every running episode's own context (its ids as they are) to `generate` in one call, appends
what came back as the turn's sampled tokens, decodes only those tokens for the environment, and appends the
environment's answer tokenized on its own. Environment steps of a round run at once, each on a daemon thread of
its own and within `limits.step_timeout_s` of the round's start (a hung step's thread is left behind, and
never holds up the process's exit); an episode ends at its environment's `done`, at max_turns, when its context is
full (max_tokens), or with a counted failure (timeout, env_error). Nothing is dropped without a status.

`generate(contexts, max_tokens, stop, seeds, episodes)` returns one completion per context with `token_ids`,
`logp`, `weight_version`, `finish_reason` and optionally `token_versions`; `episodes` are the contexts' episode
indices (a run sends each episode's turns to one engine: `actors.roles.Roles.generate`'s `engine_of`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Callable, Sequence

from rlhf.agents.environment import check_observation
from rlhf.agents.episode import Episode, Limits, Status, TokenMismatch

Generate = Callable[[list[list[int]], list[int], Sequence[str], list[int], list[int]], list]


def turn_seed(seed: int, episode: int, turn: int) -> int:
    return (seed * 1_000_003 + episode * 7_919 + turn) % (2**31 - 1)


def run_episodes(generate: Generate, make_env: Callable[[], Any], rows: Sequence, prompts: Sequence[Sequence[int]],
                 tok, limits: Limits, seed: int = 0) -> tuple[list[Episode], Counter]:
    """Episodes for `rows` (one per row, starting from `prompts`, their token ids), run to their ends. Returns
    the episodes in row order and a Counter of their end statuses plus `token_mismatch`, `env_steps`."""
    episodes = [Episode(i, r, tuple(p), limits) for i, (r, p) in enumerate(zip(rows, prompts))]
    counts: Counter = Counter()
    envs: list[Any] = [None] * len(episodes)
    for ep in episodes:
        try:
            envs[ep.index] = make_env()
            envs[ep.index].reset(ep.row)
        except Exception as e:
            ep.end(Status.env_error, error=f"reset: {type(e).__name__}: {e}")
    stop = tuple(getattr(next((e for e in envs if e is not None), None), "stop", ()))
    while True:
        live = [ep for ep in episodes if ep.running]
        for ep in live:
            if ep.turns >= limits.max_turns:
                ep.end(Status.max_turns)
            elif ep.room() <= 0:
                ep.end(Status.max_tokens)
        live = [ep for ep in live if ep.running]
        if not live:
            break
        contexts = [ep.context() for ep in live]
        outs = generate(contexts, [ep.room() for ep in live], stop,
                        [turn_seed(seed, ep.index, ep.turns) for ep in live], [ep.index for ep in live])
        if len(outs) != len(live):
            raise RuntimeError(f"generate returned {len(outs)} completions for {len(live)} contexts")
        texts = {}
        for ep, sent, out in zip(live, contexts, outs):
            try:
                ep.sampled(sent, out.token_ids, out.logp,
                           list(out.token_versions) if getattr(out, "token_versions", ()) else out.weight_version,
                           getattr(out, "cached_tokens", 0))
            except TokenMismatch:
                counts["token_mismatch"] += 1
                continue
            if getattr(out, "finish_reason", "stop") != "stop" and ep.room() <= 0:
                ep.end(Status.max_tokens)  # cut off by the full context: not a turn the environment judges
                continue
            texts[ep.index] = tok.decode(list(out.token_ids), skip_special_tokens=True)
        deadline = time.monotonic() + limits.step_timeout_s
        steps = {ep.index: _Step(envs[ep.index], texts[ep.index]) for ep in live if ep.running}
        for step in steps.values():
            step.start()
        counts["env_steps"] += len(steps)
        for ep in live:
            if ep.index in steps:
                _answer(ep, steps[ep.index], envs[ep.index], tok, deadline, limits.step_timeout_s)
    counts.update(ep.status.value for ep in episodes)
    return episodes, counts


class _Step(threading.Thread):
    """One environment step on a daemon thread of its own."""

    def __init__(self, env, text: str):
        super().__init__(daemon=True, name="env-step")
        self.env, self.text, self.out, self.error = env, text, None, None

    def run(self) -> None:
        try:
            self.out = self.env.step(self.text)
        except BaseException as e:  # reported on the episode, not raised on a thread nobody joins
            self.error = e


def _answer(ep: Episode, step: _Step, env, tok, deadline: float, timeout_s: float) -> None:
    step.join(max(0.0, deadline - time.monotonic()))
    if step.is_alive():
        ep.end(Status.timeout, error=f"step ran past agent.step_timeout_s={timeout_s}")
        return
    if step.error is not None:
        ep.end(Status.env_error, error=f"step: {type(step.error).__name__}: {step.error}")
        return
    try:
        obs = check_observation(step.out, env)
    except ValueError as e:
        ep.end(Status.env_error, error=str(e))
        return
    if obs.done:
        ep.end(Status.done, obs.reward)
        return
    ids = list(obs.token_ids) if obs.token_ids is not None else tok.encode(obs.text, add_special_tokens=False).ids
    ep.observed(ids)
