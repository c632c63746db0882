"""`python -m benchmarks.eager --quick` runs and computes its statistics from the per-seed numbers."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_eager_benchmark_quick(tmp_path):
    root = Path(__file__).parents[1]
    # Blocking and eager only (delayed goes through the same benchmark code with another mode, and
    # tests/test_eager.py checks it against the paper's equations): this also checks --methods.
    cmd = [sys.executable, "-m", "benchmarks.eager", "--quick", "--seeds", "0", "1", "--steps", "12",
           "--methods", "eager", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "eager.json").read_text())
    assert result["num_devices"] == 4 and result["seeds"] == [0, 1]
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"none", "eager"}  # blocking always runs: the gaps are to it
    for row in rows.values():
        values = row["eval_loss"]["values"]
        assert row["eval_loss"]["mean"] == pytest.approx(statistics.fmean(values))
        assert row["eval_loss"]["sd"] == pytest.approx(statistics.stdev(values))
    blocking = rows["none"]["eval_loss"]["values"]
    gaps = [e / b - 1 for e, b in zip(rows["eager"]["eval_loss"]["values"], blocking)]
    assert rows["eager"]["gap_to_blocking"]["mean"] == pytest.approx(statistics.fmean(gaps))
    assert "| eager |" in (tmp_path / "eager.md").read_text()


@pytest.mark.parametrize("argv, message", [(["--lr", "0"], "--lr must be > 0 (got 0.0)"),
                                           (["--dim", "40"], "--dim must be a multiple of 16 (got 40)")])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, capsys, argv, message):
    from benchmarks import eager

    with pytest.raises(SystemExit) as exit_:
        eager.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before the output folder was made
