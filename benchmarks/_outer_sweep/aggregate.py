"""Per cell, over seeds: eval-loss mean +- sd, the gap to the reference paired by seed, and
each outer setting against plain averaging."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import _common as common
from benchmarks._outer_sweep.grid import Spec


def _spec_of(row: dict[str, Any]) -> Spec:
    return Spec(**{f.name: row[f.name] for f in dataclasses.fields(Spec)})


def aggregate(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: per-seed losses, mean/sd, and gaps paired by seed with its reference."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_cell.setdefault(r["cell"], []).append(r)
    rows, by_seed = {}, {}
    for cell, runs in by_cell.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        spec = Spec(**runs[0]["spec"])
        curves = [r["curve"] for r in runs]
        steps = [p[0] for p in curves[0]]
        same_steps = all([p[0] for p in c] == steps for c in curves)
        by_seed[cell] = {r["seed"]: r["eval_loss"] for r in runs}
        rows[cell] = {
            "cell": cell,
            "label": spec.label(),
            **dataclasses.asdict(spec),
            "seeds": [r["seed"] for r in runs],
            "eval_loss": common.mean_sd([r["eval_loss"] for r in runs]),
            "final_train_loss": common.mean_sd([r["final_train_loss"] for r in runs if r["final_train_loss"] is not None]),
            "elapsed_s": sum(r["elapsed_s"] for r in runs),
            "curve": [{"step": s, "eval_loss": statistics.fmean(c[j][1] for c in curves)}
                      for j, s in enumerate(steps)] if same_steps else [],
        }
    for cell, row in rows.items():
        spec = _spec_of(row)
        ref = by_seed.get(spec.reference)
        if spec.algorithm == "diloco" and ref is not None:
            row["reference"] = spec.reference
            row["gap_pct"] = common.paired_gap(by_seed[cell], ref)
    # Each outer setting against plain averaging (outer lr 1, no momentum) in the same R, batch and H:
    # per seed, its gap minus plain averaging's gap (percentage points of the reference loss).
    gaps = {cell: {sd: 100 * (by_seed[cell][sd] - by_seed[row["reference"]][sd]) / by_seed[row["reference"]][sd]
                   for sd in row["gap_pct"]["seeds"]} for cell, row in rows.items() if "gap_pct" in row}
    for cell, row in rows.items():
        spec = _spec_of(row)
        plain = dataclasses.replace(spec, outer_lr=1.0, outer_momentum=0.0, nesterov=False).cell
        if spec.algorithm == "diloco" and plain != cell and cell in gaps and plain in gaps:
            seeds = sorted(set(gaps[cell]) & set(gaps[plain]))
            row["vs_plain_averaging_pp"] = common.mean_sd(gaps[cell][sd] - gaps[plain][sd] for sd in seeds) | {"seeds": seeds}
    key = lambda r: (r["replicas"], r["batch_size"], r["algorithm"] != "ddp", r["sync_period"],
                     -r["outer_lr"], r["outer_momentum"])
    return sorted(rows.values(), key=key)
