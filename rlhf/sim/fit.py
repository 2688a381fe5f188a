"""Calibration from measured runs, and how good the predictions are. Pure.

Every phase's prediction is `scale * modelled + fixed_s * events + call_s * calls` (`rlhf.sim.cost.Seconds`
carries the three parts). Given a phase's measured seconds in several runs, `fit_phase` finds the
non-negative coefficients of least squared relative error (each run weighs the same, whether its step takes
1 s or 60 s): every subset of the three terms is solved and the best non-negative one kept. `mape` and
`spearman` score predictions against measurements on runs the fit did not see.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from rlhf.sim.hardware import Calibration


def _solve(rows: Sequence[Sequence[float]], cols: Sequence[int]) -> list[float] | None:
    """Weighted least squares of y over the chosen feature columns (Gaussian elimination; None if singular)."""
    n = len(cols)
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for *x, y in rows:
        w = 1.0 / (y * y)
        for i, ci in enumerate(cols):
            b[i] += w * x[ci] * y
            for j, cj in enumerate(cols):
                a[i][j] += w * x[ci] * x[cj]
    for i in range(n):  # elimination with partial pivoting
        piv = max(range(i, n), key=lambda r: abs(a[r][i]))
        if abs(a[piv][i]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            return None
        a[i], a[piv], b[i], b[piv] = a[piv], a[i], b[piv], b[i]
        for r in range(i + 1, n):
            f = a[r][i] / a[i][i]
            for c in range(i, n):
                a[r][c] -= f * a[i][c]
            b[r] -= f * b[i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][c] * x[c] for c in range(i + 1, n))) / a[i][i]
    return x


def _error(rows, coef: Sequence[float]) -> float:
    return sum(((sum(c * v for c, v in zip(coef, x)) - y) / y) ** 2 for *x, y in rows)


def fit_phase(rows: Sequence[Sequence[float]]) -> Calibration:
    """(modelled, events, calls, measured) per run -> the phase's calibration: the non-negative least-squares
    fit over every subset of the three terms that scales the modelled part (a term absent from every run is
    left at its default)."""
    rows = [tuple(r) if len(r) == 4 else (r[0], r[1], 1.0, r[2]) for r in rows]  # (modelled, events, measured)
    rows = [r for r in rows if r[3] > 0]
    if not rows:
        return Calibration()
    present = [k for k in range(3) if any(r[k] > 0 for r in rows)]
    best, best_err = None, math.inf
    for size in range(1, len(present) + 1):
        for cols in itertools.combinations(present, size):
            if 0 in present and 0 not in cols:
                continue  # a modelled part is always scaled (a scale of 0 would drop the physics)
            sol = _solve(rows, cols)
            if sol is None or any(v < 0 for v in sol) or (0 in cols and sol[cols.index(0)] == 0):
                continue
            coef = [0.0, 0.0, 0.0]
            for c, v in zip(cols, sol):
                coef[c] = v
            err = _error(rows, coef)
            if err < best_err - 1e-15:
                best, best_err = coef, err
    if best is None:
        return Calibration()
    return Calibration(scale=best[0] if best[0] > 0 else 1.0, fixed_s=best[1], call_s=best[2])


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
