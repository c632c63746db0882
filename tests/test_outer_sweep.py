"""`python -m benchmarks.outer_sweep --quick` end to end in a subprocess: JSON structure, seed
statistics recomputed from the per-seed numbers, resuming, --report and --help.

Numbers from the quick settings mean nothing and timings are never asserted.
"""

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def sweep(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.outer_sweep", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer_sweep")
    plots = [] if HAVE_MPL else ["--no-plots"]
    # The batch study only: the default_regime study's grid and its R = 1 reference are checked
    # without training below (its two cells cost a third of this fixture's time).
    log = sweep("--quick", "--study", "batch", "--out", out, *plots)
    return out, log, json.loads((out / "outer_sweep.json").read_text())


@pytest.mark.slow
def test_quick_json_structure(quick):
    out, log, result = quick
    assert result["benchmark"] == "outer_sweep" and result["mode"] == "quick"
    assert result["num_cpu_devices"] == 2 and result["seeds"] == [0, 1]
    assert set(result["studies"]) == {"batch"}
    runs = {r["key"]: r for r in result["runs"]}
    assert len(runs) == result["num_runs"] == 8
    for r in runs.values():
        assert math.isfinite(r["eval_loss"]) and r["curve"][-1][0] == 10 and r["elapsed_s"] > 0
    batch = result["studies"]["batch"]
    assert batch["data_split"] == "contiguous" and batch["scale"]["batch_sizes"] == [2, 4]
    cells = {c["cell"]: c for c in batch["cells"]}
    assert set(cells) == {"ddp_R2_b2", "ddp_R2_b4", "diloco_R2_b2_H5_lr0.7_m0.9n", "diloco_R2_b4_H5_lr0.7_m0.9n"}
    # Progress: one line per finished run with its eval loss, time and an ETA.
    lines = [line for line in log.splitlines() if line.startswith("[")]
    assert len(lines) == 8 and all("eval " in line and "ETA" in line for line in lines)
    names = ["outer_sweep.json", "outer_sweep.md", "outer_sweep_runs.jsonl"]
    if HAVE_MPL:
        names += ["outer_sweep_batch_gap_vs_batch.png", "outer_sweep_batch_loss_vs_step.png"]
    for name in names:
        assert (out / name).stat().st_size > 0, name
    assert "| run |" in (out / "outer_sweep.md").read_text()


@pytest.mark.slow
def test_statistics_come_from_the_per_seed_runs(quick):
    _, _, result = quick
    runs = {(r["study"], r["cell"], r["seed"]): r["eval_loss"] for r in result["runs"]}
    checked = 0
    for name, study in result["studies"].items():
        for cell in study["cells"]:
            losses = [runs[(name, cell["cell"], s)] for s in cell["seeds"]]
            assert cell["seeds"] == [0, 1]
            assert cell["eval_loss"]["values"] == losses
            assert cell["eval_loss"]["mean"] == pytest.approx(statistics.fmean(losses))
            assert cell["eval_loss"]["sd"] == pytest.approx(statistics.stdev(losses))
            if cell["algorithm"] == "diloco":
                ref = [runs[(name, cell["reference"], s)] for s in cell["seeds"]]
                gaps = [100 * (x - y) / y for x, y in zip(losses, ref)]
                assert cell["gap_pct"]["values"] == pytest.approx(gaps)
                assert cell["gap_pct"]["mean"] == pytest.approx(statistics.fmean(gaps))
                assert cell["gap_pct"]["sd"] == pytest.approx(statistics.stdev(gaps))
                # 95% t-interval with 1 degree of freedom.
                assert cell["gap_pct"]["ci95"] == pytest.approx(12.706 * statistics.stdev(gaps) / math.sqrt(2))
                checked += 1
    assert checked == 2


def test_r1_diloco_is_compared_with_plain_training_and_the_copy_cell_is_not_run():
    from benchmarks import outer_sweep

    scale = outer_sweep.STUDIES["full"]["default_regime"]
    cells = [spec.cell for spec in outer_sweep.plan(scale)]
    # R = 1 DiLoCo with outer lr 1 and no momentum copies the replica: plain training, not run.
    assert "diloco_R2_b8_H10_lr1_m0" in cells and "diloco_R1_b8_H10_lr1_m0" not in cells
    scale = outer_sweep.STUDIES["quick"]["default_regime"]
    specs = outer_sweep.plan(scale)
    assert [s.cell for s in specs] == ["ddp_R1_b2", "diloco_R1_b2_H5_lr0.7_m0.9n"]
    loss = {("ddp", 0): 2.0, ("ddp", 1): 2.2, ("diloco", 0): 2.1, ("diloco", 1): 2.2}
    records = [{"key": outer_sweep.run_key("default_regime", s, seed), "study": "default_regime", "cell": s.cell,
                "spec": dataclasses.asdict(s), "seed": seed, "scale_id": outer_sweep.scale_id(scale),
                "eval_loss": loss[(s.algorithm, seed)], "final_train_loss": 2.5,
                "curve": [[10, loss[(s.algorithm, seed)]]], "elapsed_s": 1.0}
               for s in specs for seed in (0, 1)]
    result = outer_sweep.build_result(records, {"default_regime": scale}, (0, 1), "quick")
    by_cell = {c["cell"]: c for c in result["studies"]["default_regime"]["cells"]}
    r1 = by_cell["diloco_R1_b2_H5_lr0.7_m0.9n"]
    assert r1["reference"] == "ddp_R1_b2"
    assert r1["gap_pct"]["values"] == pytest.approx([5.0, 0.0])  # (2.1 - 2.0) / 2.0, (2.2 - 2.2) / 2.2


@pytest.mark.slow
def test_resume_skips_finished_runs_and_report_rerenders(quick, tmp_path):
    out, _, result = quick
    log = sweep("--quick", "--study", "batch", "--out", out, "--no-plots")
    assert "0 to go" in log and not [line for line in log.splitlines() if line.startswith("[")]
    again = json.loads((out / "outer_sweep.json").read_text())
    assert again["runs"] == result["runs"]
    sweep("--report", "--from", out / "outer_sweep.json", "--out", tmp_path, "--no-plots")
    rendered = json.loads((tmp_path / "outer_sweep.json").read_text())
    assert rendered["studies"]["batch"]["cells"] == result["studies"]["batch"]["cells"]
    assert (tmp_path / "outer_sweep.md").read_text().startswith("# Outer-optimizer study (quick)")


@pytest.mark.slow
def test_help_documents_every_mode():
    text = sweep("--help", timeout=120)
    for flag in ("--quick", "--full", "--report", "--plan", "--seeds", "--out", "--split", "benchmarks/results"):
        assert flag in text, flag
