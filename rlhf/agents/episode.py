"""One multi-turn episode as token ids, token in and token out.

Every turn continues from the exact ids already in the episode: the prompt, the tokens the policy sampled and
the observation tokens the environment's answers were tokenized into (each on its own, appended). Nothing is
ever re-rendered from text and tokenized again, so the trainer sees exactly the tokens the policy produced (the
silent drift at turn boundaries that re-rendering a conversation causes: a separator dropped, a tool result
tokenized differently in context). The check is kept anyway: each turn records the context it was sampled
from, and `verify` refuses an episode whose recorded contexts are not its own prefix (`agent/token_mismatch`).

The sample the trainer gets is the whole episode after the prompt, with a loss mask (1 on sampled tokens, 0 on
observations), each sampled token's behaviour logprob and weight version.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Sequence


class Status(str, Enum):
    running = "running"
    done = "done"  # the environment ended it
    max_turns = "max_turns"
    max_tokens = "max_tokens"  # the context is full: prompt and turns reached agent.max_tokens
    timeout = "timeout"  # an environment step ran past agent.step_timeout_s
    env_error = "env_error"  # the environment raised, or answered with something it may not
    token_mismatch = "token_mismatch"  # a turn was sampled from a context that is not the episode's own


# The stated rule: episodes the policy ended, or that ran into a limit, are trained on (their reward, 0 if the
# environment gave none); episodes the environment broke (or whose tokens cannot be trusted) are counted and
# kept out of the loss (weight 0), so an environment's fault never teaches the policy anything.
TRAINED = frozenset({Status.done, Status.max_turns, Status.max_tokens})


class TokenMismatch(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4  # model turns per episode
    max_tokens: int = 256  # the whole episode: prompt, sampled and observation tokens (the context)
    turn_tokens: int = 64  # new tokens per model turn at most
    step_timeout_s: float = 10.0  # one environment step


@dataclass
class Episode:
    index: int
    row: Any
    prompt_ids: tuple[int, ...]
    limits: Limits
    ids: list[int] = field(default_factory=list)  # after the prompt: sampled and observation tokens
    mask: list[int] = field(default_factory=list)  # 1 sampled, 0 observation
    logp: list[float] = field(default_factory=list)  # the sampled tokens' behaviour logprobs (0 for observations)
    versions: list[int] = field(default_factory=list)  # the weights that sampled each token (-1: observation)
    turn_starts: list[int] = field(default_factory=list)  # where each model turn begins in `ids`
    contexts: list[int] = field(default_factory=list)  # the context length each turn was sampled from
    cached: list[int] = field(default_factory=list)  # of each turn's context, tokens the engine's prefix cache served
    first_token_at: list[float] = field(default_factory=list)  # per turn, wall clock of its first token (0: unknown)
    observed_at: list[float] = field(default_factory=list)  # per observation, wall clock of its arrival
    status: Status = Status.running
    reward: float = 0.0
    error: str = ""
    restarts: int = 0  # times its environment was lost (its worker died) and the episode began again
    # routing replay: the routes of the last turn's completion (a `rlhf.moe.routing.RouteRef` or the engine's
    # array), which cover every token it fed (its whole context, the prefix cache's included, and its sampled
    # tokens but the last): all of the episode but observations after the last turn, which the trainer routes
    routes: Any = None

    def restart(self) -> None:
        """Back to the prompt: the environment holding the episode's state is gone, so its turns are too."""
        for name in ("ids", "mask", "logp", "versions", "turn_starts", "contexts", "cached", "first_token_at",
                     "observed_at"):
            getattr(self, name).clear()
        self.status, self.reward, self.error, self.restarts = Status.running, 0.0, "", self.restarts + 1
        self.routes = None

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    @property
    def running(self) -> bool:
        return self.status is Status.running

    @property
    def trained(self) -> bool:
        return self.status in TRAINED

    def context(self) -> list[int]:
        """The ids the next turn continues from: the prompt and everything after it, as they are."""
        return list(self.prompt_ids) + self.ids

    def room(self) -> int:
        """New tokens the next turn may sample: the turn's cap, within what is left of the context."""
        return min(self.limits.turn_tokens, self.limits.max_tokens - len(self.prompt_ids) - len(self.ids))

    def sampled(self, sent: Sequence[int], token_ids: Sequence[int], logp: Sequence[float],
                versions: int | Sequence[int], cached: int = 0, first_token_at: float = 0.0, routes: Any = None) -> None:
        """A model turn: `token_ids` sampled (with their `logp`) from the context `sent`, which must be this
        episode's own context, token for token (TokenMismatch otherwise: the episode ends and is not trained)."""
        if not self.running:
            raise RuntimeError(f"episode {self.index} is over ({self.status.value}): no more turns")
        if len(logp) != len(token_ids):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logp)} logprobs")
        own = self.context()
        if list(sent) != own:
            at = next((i for i, (a, b) in enumerate(zip(sent, own)) if a != b), min(len(sent), len(own)))
            self.end(Status.token_mismatch, error=f"turn {self.turns} was sampled from a context that differs from "
                     f"the episode's at token {at} ({len(sent)} against {len(own)} tokens)")
            raise TokenMismatch(self.error)
        if isinstance(versions, int):
            versions = [versions] * len(token_ids)
        self.contexts.append(len(own))
        self.cached.append(int(cached))
        self.first_token_at.append(float(first_token_at))
        self.turn_starts.append(len(self.ids))
        self.ids += list(token_ids)
        self.mask += [1] * len(token_ids)
        self.logp += [float(x) for x in logp]
        self.versions += list(versions)
        self.routes = routes

    def sampled_completion(self, sent: Sequence[int], out: Any) -> None:
        """`sampled` from an engine's completion (`actors.vllm.engine.Completion` or its fields): its tokens,
        logprobs, per-token versions (else its one version), cached prefix, first-token time and routes."""
        versions = list(out.token_versions) if getattr(out, "token_versions", ()) else out.weight_version
        self.sampled(sent, out.token_ids, out.logp, versions, getattr(out, "cached_tokens", 0),
                     getattr(out, "first_token_at", 0.0), getattr(out, "routes", None))

    def observed(self, token_ids: Sequence[int], at: float = 0.0) -> bool:
        """The environment's answer, appended as it is (never trained on). False, and the episode ended at
        max_tokens, where it does not fit in the context with room for one more sampled token."""
        if len(self.prompt_ids) + len(self.ids) + len(token_ids) >= self.limits.max_tokens:
            self.end(Status.max_tokens)
            return False
        self.observed_at.append(float(at))
        self.ids += list(token_ids)
        self.mask += [0] * len(token_ids)
        self.logp += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)
        return True

    def observation_latencies(self) -> list[float]:
        """Seconds from each observation's arrival to the first token of the turn that read it (where both
        times are known)."""
        return [t - o for o, t in zip(self.observed_at, self.first_token_at[1:]) if o > 0 and t > 0]

    def end(self, status: Status, reward: float | None = None, error: str = "") -> None:
        if self.running:
            self.status, self.error = status, error
            self.reward = float(reward) if reward is not None and status in TRAINED else 0.0

    def verify(self) -> None:
        """The token-fidelity check at batch assembly: every turn was sampled from the episode's own prefix
        and the per-token records line up. TokenMismatch names the first turn that breaks it."""
        n = len(self.ids)
        if not (len(self.mask) == len(self.logp) == len(self.versions) == n):
            raise TokenMismatch(f"episode {self.index}: {n} tokens but {len(self.mask)} mask, {len(self.logp)} "
                                f"logprob and {len(self.versions)} version entries")
        for k, (start, ctx) in enumerate(zip(self.turn_starts, self.contexts)):
            if ctx != len(self.prompt_ids) + start or self.mask[start:start + 1] != [1]:
                raise TokenMismatch(f"episode {self.index}: turn {k} was sampled from {ctx} tokens of context, "
                                    f"but starts at {len(self.prompt_ids) + start}")

    def sample(self) -> dict:
        """What the trainer's batch takes: prompt, response (everything after the prompt), per response token
        the loss mask, behaviour logprob and weight version; the reward and whether the loss counts it."""
        self.verify()
        return {"prompt": list(self.prompt_ids), "response": list(self.ids), "mask": list(self.mask),
                "logp": list(self.logp), "versions": list(self.versions), "reward": self.reward,
                "trained": self.trained, "status": self.status.value, "turns": self.turns}
