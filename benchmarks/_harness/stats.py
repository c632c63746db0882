"""Statistics over seeds or repeats: mean, sd and 95% t-interval, gaps paired by seed,
and their `mean +- sd` text."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with `dof` degrees of freedom (the next
    smaller tabulated dof above 20, so the interval errs wide; 1.96 beyond 30)."""
    if dof > 30:
        return 1.96
    return _T975[max(d for d in _T975 if d <= dof)]


def mean_sd(values: Iterable[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None below 2 values) and half-width of the 95%
    t-interval of the mean (None below 2 values), with the values themselves."""
    values = list(values)
    n = len(values)
    mean = statistics.fmean(values) if n else None
    sd = statistics.stdev(values) if n >= 2 else None
    ci = t975(n - 1) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": mean, "sd": sd, "ci95": ci, "values": values}


def paired_gap(losses: dict[int, float], reference: dict[int, float], *, scale: float = 100.0) -> dict[str, Any]:
    """Gap of a method to its reference, paired by seed: for every seed both have,
    `scale * (loss - reference) / reference` (scale 100: percent; 1: a fraction), then
    `mean_sd` of those per-seed gaps, plus the seeds used. `losses` and `reference` map
    seed -> final eval loss."""
    seeds = sorted(set(losses) & set(reference))
    gaps = [scale * (losses[s] - reference[s]) / reference[s] for s in seeds]
    return mean_sd(gaps) | {"seeds": seeds}


def fmt_pm(stat: dict[str, Any] | None, fmt: str, unit: str = "", *, scale: float = 1.0) -> str:
    """`mean +- sd` of a `mean_sd` dict (`-` without a mean; no sd part without an sd),
    each multiplied by `scale` and formatted with `fmt` (the sd without a sign)."""
    if not stat or stat.get("mean") is None:
        return "-"
    text = format(scale * stat["mean"], fmt) + unit
    if stat.get("sd") is not None:
        text += " +- " + format(scale * stat["sd"], fmt.replace("+", "")) + unit
    return text
