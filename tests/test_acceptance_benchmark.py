"""`python -m benchmarks.acceptance --smoke` runs and reports every comparison with paired statistics."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # 12 trainer runs in a subprocess: about a minute on a loaded 2-core machine
def test_acceptance_smoke(tmp_path):
    root = Path(__file__).parents[1]
    cmd = [sys.executable, "-m", "benchmarks.acceptance", "--smoke", "--no-plots", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "acceptance.json").read_text())
    assert result["complete"] and result["seeds"] == [0, 1] and result["num_devices"] == 4
    from eqx_diloco.lm.config import DiLoCoConfig

    assert result["settings"]["outer_lr"] == DiLoCoConfig().outer_lr
    assert result["settings"]["outer_momentum"] == DiLoCoConfig().outer_momentum
    comparisons = {c["name"]: c for c in result["comparisons"]}
    assert set(comparisons) == {"diloco_vs_ddp", "streaming_vs_diloco", "int4_vs_float32", "r1_vs_plain"}
    for c in comparisons.values():
        gap = c["gap_pct"]
        run = result["runs"][c["run"]]["per_seed_eval_loss"]
        ref = result["runs"][c["reference"]]["per_seed_eval_loss"]
        expected = [100 * (run[s] - ref[s]) / ref[s] for s in ("0", "1")]  # JSON keys are strings
        assert gap["n"] == 2 and gap["values"] == pytest.approx(expected)
        assert gap["mean"] == pytest.approx(statistics.fmean(expected))
        assert gap["sd"] == pytest.approx(statistics.stdev(expected))
        assert all(math.isfinite(gap[k]) for k in ("mean", "sd", "ci95"))
        assert isinstance(c["verdict"]["met"], bool) and c["verdict"]["text"]
    for r in result["runs"].values():
        assert r["eval_loss"]["n"] == 2 and math.isfinite(r["eval_loss"]["mean"]) and math.isfinite(r["eval_loss"]["sd"])
    assert len(result["records"]) == 12
    text = (tmp_path / "acceptance.md").read_text()
    assert "| DiLoCo R = 2 vs DDP R = 2 | within 4% of DDP | 2 |" in text
    assert "+-" in text
    # A second invocation finds every run in the JSONL and trains nothing.
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "12 runs, 0 to go" in again.stdout
