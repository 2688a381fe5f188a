"""Calibration from measured runs, and how good the predictions are. Pure.

Every phase's prediction is `scale * modelled + fixed_s * events` (`rlhf.sim.cost.Seconds` carries the two
parts). Given measured seconds of a phase in several runs, `fit_phase` finds the non-negative (scale,
fixed_s) of least squared relative error (each run weighs the same, whether its step takes 1 s or 60 s).
`mape` and `spearman` score predictions against measurements on runs the fit did not see.
"""

from __future__ import annotations

import math
from typing import Sequence

from rlhf.sim.hardware import Calibration


def _solve(rows: Sequence[tuple[float, float, float]], use_scale: bool, use_fixed: bool) -> tuple[float, float]:
    """Least squares of (measured - scale * modelled - fixed * events) / measured over `rows`."""
    a11 = a12 = a22 = b1 = b2 = 0.0
    for m, e, y in rows:
        w = 1.0 / (y * y) if y > 0 else 0.0
        a11 += w * m * m
        a12 += w * m * e
        a22 += w * e * e
        b1 += w * m * y
        b2 += w * e * y
    if use_scale and use_fixed:
        det = a11 * a22 - a12 * a12
        if abs(det) > 1e-18 * max(1.0, a11 * a22):
            return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        return _solve(rows, True, False)
    if use_scale:
        return (b1 / a11 if a11 else 1.0), 0.0
    return 0.0, (b2 / a22 if a22 else 0.0)


def _error(rows, scale: float, fixed: float) -> float:
    return sum(((scale * m + fixed * e - y) / y) ** 2 for m, e, y in rows if y > 0)


def fit_phase(rows: Sequence[tuple[float, float, float]]) -> Calibration:
    """(modelled, events, measured) per run -> the phase's calibration; a phase with no modelled part (or no
    events) fits the other coefficient alone; negative solutions are replaced by the best one-term fit."""
    rows = [r for r in rows if r[2] > 0]
    if not rows:
        return Calibration()
    has_m, has_e = any(r[0] > 0 for r in rows), any(r[1] > 0 for r in rows)
    options = []
    if has_m and has_e:
        s, f = _solve(rows, True, True)
        if s > 0 and f >= 0:
            options.append((s, f))
    if has_m:
        options.append(_solve(rows, True, False))
    if has_e:
        options.append(_solve(rows, False, True))
    options = [(s if s > 0 else 1.0, max(0.0, f)) for s, f in options] or [(1.0, 0.0)]
    s, f = min(options, key=lambda o: _error(rows, *o))
    return Calibration(scale=s, fixed_s=f)


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error of `predicted` against `measured` (percent)."""
    pairs = [(p, m) for p, m in zip(predicted, measured) if m > 0]
    return 100.0 * sum(abs(p - m) / m for p, m in pairs) / len(pairs) if pairs else float("nan")


def _ranks(xs: Sequence[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (Pearson's on the ranks)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman needs two sequences of the same length >= 2, got {len(a)} and {len(b)}")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = math.sqrt(sum((x - ma) ** 2 for x in ra)), math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")
