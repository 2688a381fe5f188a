"""Device lists as placement files write them ("0-3", "0,2", "0-1,4-5"): parse, format, abbreviate. Pure.

Devices are numbered globally, node * devices_per_node + local index; a list's order is rank order.
"""

from __future__ import annotations

from typing import Sequence

from rlhf.errors import ConfigError, Problem

DEVICES_SYNTAX = 'write global device indices (node * devices_per_node + local index) as "0-3", "0,2" or "0-1,4-5"'


def parse_devices(text: str, key: str = "devices") -> tuple[int, ...]:
    """"0-3" -> (0, 1, 2, 3); "0,2" -> (0, 2); "0-1,4-5" -> (0, 1, 4, 5); "" -> (). Order is kept (it is
    rank order). Raises ConfigError naming `key`."""
    devices, problem = read_devices(text, key)
    if problem is not None:
        raise ConfigError(str(problem))
    return devices


def read_devices(text: str, key: str) -> tuple[tuple[int, ...], Problem | None]:
    """The devices of `text`, or the problem with it (keyed `key`)."""
    text = str(text).strip()
    if not text:
        return (), None
    out: list[int] = []
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            return (), Problem(key, text, f"cannot read {item.strip()!r}; {DEVICES_SYNTAX}")
        if b < a:
            return (), Problem(key, text, f"range {item.strip()!r} runs backwards; write the low index first: "
                                          f"{DEVICES_SYNTAX}")
        if b - a > 1_000_000:
            return (), Problem(key, text, f"range {item.strip()!r} is larger than any cluster; {DEVICES_SYNTAX}")
        out.extend(range(a, b + 1))
    return tuple(out), None


def format_devices(devices: Sequence[int]) -> str:
    """The inverse of `parse_devices`: (0, 1, 2, 3, 6) -> "0-3,6" (runs of consecutive indices, order kept)."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs(devices))


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def abbreviate(values: Sequence[int], max_runs: int = 6) -> str:
    """Like `format_devices`, shortened for long lists: a strided pattern is written once, others cut."""
    runs = _runs(values)
    if len(runs) <= max_runs:
        return format_devices(values)
    span = {b - a for a, b in runs}
    strides = {runs[i + 1][0] - runs[i][0] for i in range(len(runs) - 1)}
    one = lambda r: f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"  # noqa: E731
    if len(span) == 1 and len(strides) == 1:
        return f"{one(runs[0])},{one(runs[1])},...,{one(runs[-1])} (every {strides.pop()})"
    return f"{','.join(one(r) for r in runs[:3])},...,{one(runs[-1])} ({len(values)} in all)"
