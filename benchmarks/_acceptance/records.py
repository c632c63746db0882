"""Training one acceptance run and the JSONL log of finished runs (a cut benchmark resumes)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from benchmarks import _common as common
from benchmarks import convergence
from benchmarks._acceptance.plan import Run, make_config


def load_records(path: pathlib.Path, sid: str) -> dict[str, dict[str, Any]]:
    """Finished runs with these settings in a JSONL log (a line cut short by a kill is skipped)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("settings_id") == sid:
                out[record["key"]] = record
    return out


def train_one(run: Run, scale: convergence.Scale, seed: int, run_dir: pathlib.Path, sid: str) -> dict[str, Any]:
    result = common.train_and_summarize(make_config(run, scale, run_dir, seed))
    if result["eval_loss"] is None or not result["curve"] or result["curve"][-1]["step"] != scale.steps:
        raise RuntimeError(f"{run_dir}: no evaluation at the last step {scale.steps}")
    return {"key": f"{run.name}_s{seed}", "run": run.name, "seed": seed, "settings_id": sid,
            **{k: result[k] for k in ("eval_loss", "final_train_loss", "sent_bytes", "wire_bytes",
                                      "peak_sync_bytes", "elapsed_s")},
            "curve": [[p["step"], p["eval_loss"]] for p in result["curve"]]}
