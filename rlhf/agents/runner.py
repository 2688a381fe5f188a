"""Many episodes, turn by turn, over one batch `generate`.

Each round hands every running episode's own context (its ids as they are) to `generate` in one call, appends
what came back as the turn's sampled tokens, decodes only those tokens for the environment, and appends the
environment's answer tokenized on its own. An episode ends at its environment's `done`, at max_turns, when its
context is full (max_tokens), or with a counted failure (timeout, env_error). Nothing is dropped without a status.

The episodes' environments live in an `Environments`: in this process (`LocalEnvironments`, one per episode, its
steps on threads) or in Ray actors (`actors.environment.EnvironmentPool`, the run's environment workers). Either
answers a batch of resets or steps with one `Outcome` each within `limits.step_timeout_s` (a hung step's thread
is left behind, and never holds up the process's exit); `lost` means the environment's state is gone (its worker
died): the episode begins again from its prompt on a fresh environment, at most `MAX_RESTARTS` times.

`generate(contexts, max_tokens, stop, seeds, episodes)` returns one completion per context with `token_ids`,
`logp`, `weight_version`, `finish_reason` and optionally `token_versions`; `episodes` are the contexts' episode
indices (a run sends each episode's turns to one engine: `actors.roles.Roles.generate`'s `engine_of`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from rlhf.agents.environment import Observation, check_observation
from rlhf.agents.episode import Episode, Limits, Status, TokenMismatch

Generate = Callable[[list[list[int]], list[int], Sequence[str], list[int], list[int]], list]
MAX_RESTARTS = 2  # an episode whose environment is lost more often than this ends as env_error


@dataclass(frozen=True)
class Outcome:
    """What became of one environment call: `ok` (a step's checked `observation`; a reset's None), `timeout`,
    `env_error` (`error` says what), or `lost` (the environment is gone with its worker)."""

    kind: str
    observation: Observation | None = None
    error: str = ""
    at: float = 0.0  # wall clock when the call returned


class Environments(Protocol):
    stop: Sequence[str]  # strings that end a model turn besides EOS

    def reset(self, keys: Sequence[int], rows: Sequence[Any]) -> list[Outcome]: ...

    def step(self, keys: Sequence[int], texts: Sequence[str]) -> list[Outcome]: ...

    def close(self, keys: Sequence[int] | None = None) -> None:
        """Drop the environments of `keys` (their episodes are over; None: every one)."""


def call_within(calls: Sequence[Callable[[], Any]], timeout_s: float, what: str) -> list[Outcome]:
    """Run the calls at once, each on a daemon thread of its own, and wait for them under one deadline: each
    call's Outcome (`ok` with its result as the observation, checked by the caller; `timeout`; `env_error`)."""
    threads = [_Call(c) for c in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    out = []
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            out.append(Outcome("timeout", error=f"{what} ran past agent.step_timeout_s={timeout_s}"))
        elif t.error is not None:
            out.append(Outcome("env_error", error=f"{what}: {type(t.error).__name__}: {t.error}"))
        else:
            out.append(Outcome("ok", t.out, at=t.at))
    return out


class _Call(threading.Thread):
    """One environment call on a daemon thread of its own."""

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True, name="env-call")
        self.fn, self.out, self.error, self.at = fn, None, None, 0.0

    def run(self) -> None:
        try:
            self.out = self.fn()
        except BaseException as e:  # reported on the episode, not raised on a thread nobody joins
            self.error = e
        self.at = time.time()


class LocalEnvironments:
    """One environment per episode key, made by `make_env`, in this process; resets and steps on threads under
    `timeout_s` (`call_within`), observations checked here (`check_observation`)."""

    def __init__(self, make_env: Callable[[], Any], timeout_s: float):
        self.make_env, self.timeout_s, self.envs = make_env, timeout_s, {}
        try:
            self.stop = tuple(getattr(make_env(), "stop", ()))
        except Exception:  # each episode's reset then says why
            self.stop = ()

    def reset(self, keys: Sequence[int], rows: Sequence[Any]) -> list[Outcome]:
        def one(key, row):
            self.envs[key] = env = self.make_env()
            env.reset(row)

        return [Outcome(o.kind, None, o.error) for o in
                call_within([lambda k=k, r=r: one(k, r) for k, r in zip(keys, rows)], self.timeout_s, "reset")]

    def step(self, keys: Sequence[int], texts: Sequence[str]) -> list[Outcome]:
        envs = [self.envs[k] for k in keys]
        outs = call_within([lambda e=e, t=t: e.step(t) for e, t in zip(envs, texts)], self.timeout_s, "step")
        return [checked(o, e) for o, e in zip(outs, envs)]

    def close(self, keys: Sequence[int] | None = None) -> None:
        if keys is None:
            self.envs.clear()
        for k in keys or ():
            self.envs.pop(k, None)


def checked(outcome: Outcome, env: Any) -> Outcome:
    """A step's `ok` outcome with its observation checked (`env_error` saying what is wrong with it)."""
    if outcome.kind != "ok":
        return outcome
    try:
        return Outcome("ok", check_observation(outcome.observation, env), at=outcome.at)
    except ValueError as e:
        return Outcome("env_error", error=str(e))


def turn_seed(seed: int, episode: int, turn: int) -> int:
    return (seed * 1_000_003 + episode * 7_919 + turn) % (2**31 - 1)


def run_episodes(generate: Generate, envs: Environments | Callable[[], Any], rows: Sequence,
                 prompts: Sequence[Sequence[int]], tok, limits: Limits, seed: int = 0,
                 key_base: int = 0) -> tuple[list[Episode], Counter]:
    """Episodes for `rows` (one per row, starting from `prompts`, their token ids), run to their ends; `envs` an
    `Environments` or a factory of environments (then made in this process). Episode i's environment is held
    under key `key_base + i` (two calls sharing `envs` at once, as StaleSync's producer and an evaluation do,
    give bases far apart) and dropped at the end. Returns the episodes in row order and a Counter of their end
    statuses (token_mismatch among them) plus `env_steps` and `restarted`."""
    if isinstance(envs, type) or not hasattr(envs, "step"):  # a class or a function making environments
        envs = LocalEnvironments(envs, limits.step_timeout_s)
    episodes = [Episode(i, r, tuple(p), limits) for i, (r, p) in enumerate(zip(rows, prompts))]
    counts: Counter = Counter()
    fresh = list(episodes)  # episodes whose environment is yet to be reset
    while True:
        while fresh:  # an environment lost at reset (its worker died) is made again on a fresh worker
            again = []
            for ep, o in zip(fresh, envs.reset([key_base + ep.index for ep in fresh], [ep.row for ep in fresh])):
                if o.kind == "lost":
                    _lost(ep, counts)
                    again += [ep] if ep.running else []
                elif o.kind != "ok":
                    ep.end(Status.timeout if o.kind == "timeout" else Status.env_error, error=o.error)
            fresh = again
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
        outs = generate(contexts, [ep.room() for ep in live], envs.stop,
                        [turn_seed(seed, ep.index, ep.turns) for ep in live], [ep.index for ep in live])
        if len(outs) != len(live):
            raise RuntimeError(f"generate returned {len(outs)} completions for {len(live)} contexts")
        texts = {}
        for ep, sent, out in zip(live, contexts, outs):
            try:
                ep.sampled_completion(sent, out)
            except TokenMismatch:  # the episode ended as token_mismatch: counted with the statuses
                continue
            if getattr(out, "finish_reason", "stop") != "stop" and ep.room() <= 0:
                ep.end(Status.max_tokens)  # cut off by the full context: not a turn the environment judges
                continue
            texts[ep.index] = tok.decode(list(out.token_ids), skip_special_tokens=True)
        stepping = [ep for ep in live if ep.running]
        counts["env_steps"] += len(stepping)
        for ep, o in zip(stepping, envs.step([key_base + ep.index for ep in stepping],
                                             [texts[ep.index] for ep in stepping])):
            _answer(ep, o, tok, counts)
        fresh = [ep for ep in stepping if ep.running and ep.turns == 0]  # restarted: reset them again
    envs.close([key_base + ep.index for ep in episodes])
    counts.update(ep.status.value for ep in episodes)
    return episodes, counts


def _lost(ep: Episode, counts: Counter) -> None:
    """The episode's environment is gone: begin again from the prompt, or end it after MAX_RESTARTS."""
    if ep.restarts >= MAX_RESTARTS:
        ep.end(Status.env_error, error=f"its environment was lost {ep.restarts + 1} times (worker died)")
        return
    ep.restart()
    counts["restarted"] += 1


def _answer(ep: Episode, o: Outcome, tok, counts: Counter) -> None:
    if o.kind == "lost":
        _lost(ep, counts)
    elif o.kind == "timeout":
        ep.end(Status.timeout, error=o.error)
    elif o.kind != "ok":
        ep.end(Status.env_error, error=o.error)
    elif o.observation.done:
        ep.end(Status.done, o.observation.reward)
    else:
        obs = o.observation
        ids = list(obs.token_ids) if obs.token_ids is not None else tok.encode(obs.text, add_special_tokens=False).ids
        ep.observed(ids, o.at)
