"""`chaos.*` entries (faults injected on purpose, docs/faults.md) parsed: which engine or trainer rank, at
which step, in which phase. Read by validation (before anything starts) and by the driver."""

from __future__ import annotations

KILL_PHASES = ("generate", "sync", "evaluate")  # an engine killed or stopped: chaos.kill_engines, chaos.stop_engines
TRAINER_KILL_PHASES = ("update", "logprobs", "sync")
ENVIRONMENT_KILL_PHASES = ("step", "reset")


def engine_kills(entries: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """`chaos.kill_engines` (or `stop_engines`) as (step, engine, phase); ValueError naming the entry that is
    not one."""
    return _kills(entries, "ENGINE", KILL_PHASES)


def trainer_kills(entries: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """`chaos.kill_trainer_ranks` (or `stop_trainer_ranks`) as (step, rank, phase); ValueError naming the entry
    that is not one."""
    return _kills(entries, "RANK", TRAINER_KILL_PHASES)


def environment_kills(entries: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """`chaos.kill_environment_workers` as (step, worker, phase); ValueError naming the entry that is not one."""
    return _kills(entries, "WORKER", ENVIRONMENT_KILL_PHASES)


def _kills(entries: tuple[str, ...], what: str, phases: tuple[str, ...]) -> list[tuple[int, int, str]]:
    out = []
    for e in entries:
        where, _, phase = str(e).partition(":")
        index, at, step = where.partition("@")
        try:
            if not at:
                raise ValueError
            step, index, phase = int(step), int(index), phase or phases[0]
        except ValueError:
            raise ValueError(f"{e!r} is not {what}@STEP or {what}@STEP:PHASE (e.g. 1@3 or 1@3:{phases[1]})") from None
        if phase not in phases:
            raise ValueError(f"{e!r}: phase {phase!r} is none of {', '.join(phases)}")
        out.append((step, index, phase))
    return out
