"""The benchmarks' output convention (issue 12): without an explicit output folder a script
writes under runs/benchmarks/<name>_<mode>, never into the committed benchmarks/results;
and benchmarks/peak_bandwidth.py (metrics.jsonl reading, report, a --smoke run)."""

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import _common, convergence, moe, peak_bandwidth, quantization, throughput  # noqa: E402

RESULTS = (REPO / "benchmarks" / "results").resolve()


def _capture_run(monkeypatch, module):
    """Replace `module.run` (and the JAX set-up) by a recorder of the output folder it is given."""
    seen = {}

    def fake_run(*args, out_dir=None, json_path=None, **kw):
        seen["out_dir"], seen["json_path"] = pathlib.Path(out_dir), json_path
        return {"markdown": "", "total_elapsed_s": 0.0}

    monkeypatch.setattr(module, "run", fake_run)
    monkeypatch.setattr(_common, "setup_jax", lambda *a, **k: None)
    return seen


@pytest.mark.parametrize("module, name, argv, mode", [
    (convergence, "convergence", [], "quick"),
    (convergence, "convergence", ["--smoke"], "smoke"),
    (quantization, "quantization", ["--full"], "full"),
    (throughput, "throughput", [], "default"),
    (throughput, "throughput", ["--smoke"], "smoke"),
])
def test_default_output_is_not_the_committed_results(monkeypatch, module, name, argv, mode):
    seen = _capture_run(monkeypatch, module)
    module.main(argv)
    assert seen["out_dir"] == _common.default_out_dir(name, mode) == REPO / "runs" / "benchmarks" / f"{name}_{mode}"
    assert RESULTS not in seen["out_dir"].resolve().parents and seen["out_dir"].resolve() != RESULTS
    assert seen["json_path"] is None  # <out-dir>/<name>.json


@pytest.mark.parametrize("module", [convergence, quantization, throughput])
def test_committed_results_only_when_asked(monkeypatch, module, tmp_path):
    seen = _capture_run(monkeypatch, module)
    module.main(["--out-dir", str(tmp_path)])
    assert seen["out_dir"] == tmp_path


def test_moe_default_output(monkeypatch, tmp_path):
    written = []
    monkeypatch.setattr(moe, "setup_jax", lambda *a, **k: None)
    monkeypatch.setattr(moe, "configs", lambda quick, root: {})
    monkeypatch.setattr(moe, "machine_info", lambda: {})
    monkeypatch.setattr(moe, "write_json", lambda path, obj: written.append(pathlib.Path(path)))
    monkeypatch.setattr(moe, "write_text", lambda path, text: written.append(pathlib.Path(path)))
    moe.main(["--quick"])
    assert written == [_common.default_out_dir("moe", "quick") / "moe.json", _common.default_out_dir("moe", "quick") / "moe.md"]
    written.clear()
    moe.main(["--out-dir", str(tmp_path)])
    assert written == [tmp_path / "moe.json", tmp_path / "moe.md"]


# -- peak_bandwidth ------------------------------------------------------------------------


def _fake_run(run_dir: pathlib.Path, *, loss: float, peak: int, steps: int = 20):
    run_dir.mkdir(parents=True)
    lines = [{"step": 0, "eval_loss": 5.0}]
    for t in range(10, steps + 1, 10):
        lines.append({"step": t, "loss": 3.0, "sent_bytes": 100 * t, "wire_bytes": 100 * t, "peak_sync_bytes": peak})
    lines.append({"step": steps, "eval_loss": loss})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.slow
def test_peak_bandwidth_reads_metrics_and_reports(tmp_path):
    records = []
    for seed, (a, b) in enumerate([(2.0, 2.02), (2.1, 2.1)]):
        for name, loss, peak in (("default", a, 4000), ("fragments4", b, 1000)):
            _fake_run(tmp_path / f"{name}_s{seed}", loss=loss, peak=peak)
            rec = peak_bandwidth.read_run(tmp_path / f"{name}_s{seed}", 20)
            records.append({"name": name, "seed": seed, "command": name, "final_sync_line": None,
                            "sent_summary_line": None, "elapsed_s": 1.0, **rec})
    assert records[0] == {**records[0], "eval_loss": 2.0, "sent_bytes": 2000, "wire_bytes": 2000,
                          "peak_sync_bytes": 4000}
    result = peak_bandwidth.build_result(records, "full", 20, (0, 1), [], "cmd")
    default, frag = result["rows"]
    assert default["command"] == "python -m eqx_diloco.train"
    assert frag["command"] == "python -m eqx_diloco.train --diloco.num-fragments 4"
    assert frag["peak_vs_reference"] == 0.25 and frag["bytes_same_for_every_seed"]
    gap = frag["loss_gap_vs_reference_pct"]
    assert gap["n"] == 2 and gap["mean"] == pytest.approx(0.5)
    text = peak_bandwidth.render_markdown(result)
    assert "| `python -m eqx_diloco.train --diloco.num-fragments 4` | 2 |" in text and "(0.25x)" in text
    with pytest.raises(RuntimeError, match="step 30"):
        peak_bandwidth.read_run(tmp_path / "default_s0", 30)


def test_peak_bandwidth_stdout_lines():
    text = ("final sync of parameter group(s) [0, 1, 2]: their inner steps since the last \nscheduled sync\n"
            "done: ...\n  sent         197.82 kB per replica for synchronisation; DDP would have sent 1 MB\n")
    assert peak_bandwidth.stdout_lines(text) == {
        "final_sync_line": "final sync of parameter group(s) [0, 1, 2]",
        "sent_summary_line": "sent         197.82 kB per replica for synchronisation; DDP would have sent 1 MB"}
    assert peak_bandwidth.stdout_lines("") == {"final_sync_line": None, "sent_summary_line": None}


@pytest.mark.slow  # two CLI trainings as subprocesses
def test_peak_bandwidth_smoke(tmp_path):
    result = peak_bandwidth.main(["--smoke", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "peak_bandwidth.json").read_text())
    assert "| command |" in (tmp_path / "peak_bandwidth.md").read_text()
    default, frag = saved["rows"]
    assert len(result["rows"]) == 2 and frag["command"].endswith("--diloco.num-fragments 4")
    assert default["sent_bytes"] == frag["sent_bytes"] > 0  # the same values, split in 4 fragments
    assert 0 < frag["peak_sync_bytes"] < default["peak_sync_bytes"]
    assert frag["final_sync_line"].startswith("final sync of parameter group(s)")


def test_decoupled_benchmark_paces_islands_through_the_environment_knob(tmp_path):
    """The paced scenario's runs: every island's period in `$EQX_DILOCO_STEP_PERIODS`, decoupled islands
    with adaptive H; the slow scenario's knob unset (a caller's leftover must not leak in)."""
    from benchmarks import decoupled

    periods = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}
    with pytest.MonkeyPatch.context() as m:
        m.setenv("EQX_DILOCO_SLOW_ISLANDS", "1:5")
        paced = decoupled.Run("decoupled", 0, 10, tmp_path, tmp_path / "cache", periods=periods)
        sync = decoupled.Run("sync", 0, 10, tmp_path, tmp_path / "cache", periods=periods)
    assert paced.env["EQX_DILOCO_STEP_PERIODS"] == "0:0.1000,1:0.1000,2:0.1000,3:0.2000"
    assert "EQX_DILOCO_SLOW_ISLANDS" not in paced.env and "--decoupled.adaptive-h" in paced.cmd
    assert sync.env["EQX_DILOCO_STEP_PERIODS"] == paced.env["EQX_DILOCO_STEP_PERIODS"]
    assert "--decoupled.adaptive-h" not in sync.cmd and paced.run_dir.name.endswith("_paced_batch8")


def test_decoupled_benchmark_gives_spares_to_its_decoupled_failure_runs_but_not_the_no_spare_mode(tmp_path):
    """A decoupled run with kills, and its failure-free reference, launch with the spares; the no-spare
    mode and the elastic mode restart from scratch."""
    from benchmarks import decoupled

    def launcher(kind, kills=None):
        cmd = decoupled.Run(kind, 0, 10, tmp_path, tmp_path / "cache", kills=kills, spares=1).cmd
        return cmd[cmd.index("eqx_diloco.launch") + 1:cmd.index("--")]

    assert launcher("decoupled-no-wait", [1.0, 2.0])[-4:] == ["--max-restarts", "2", "--spares", "1"]
    assert launcher("decoupled")[-4:] == ["--max-restarts", "1", "--spares", "1"]  # the reference: one idle spare
    assert launcher(f"decoupled-no-wait{decoupled.NO_SPARE}", [1.0])[-2:] == ["--max-restarts", "1"]
    assert "--spares" not in launcher("elastic", [1.0]) and "--spares" not in launcher("sync")
    run = {"kills": [{"island": 1, "wall_s": 10.0}, {"island": 0, "wall_s": 20.0}],
           "step_times": {0: [19.0, 19.5], 1: [9.5, 12.5, 13.0]}}
    assert decoupled.back_after(run) == [2.5, None]
    summary = decoupled._goodput_summary({"decoupled-no-wait": [{"goodput_time": 0.9}, {"goodput_time": 1.0}],
                                          "elastic": [{"goodput_time": 0.4}]})
    assert summary[0] == "Goodput, time, mean +- sd over 2 seeds: decoupled-no-wait 0.950 +- 0.071."
    assert decoupled._goodput_summary({"elastic": [{"goodput_time": 0.4}]}) == []  # one seed: no spread to give


def test_decoupled_kill_gaps_take_the_survivors_and_the_same_stretch_of_the_failure_free_run():
    from benchmarks import decoupled

    def steps(start, every, count, skip=()):
        return [round(start + every * i, 3) for i in range(count) if i not in skip]

    # Island 1 is killed at 10.05 s and back at 13 s; island 2 stalls 0.9 s after the kill; island 0 is
    # killed at 20.05 s. The failure-free run started its steps 1 s later and has one 0.5 s gap at 11.5 s.
    run = {"first_step_s": 5.0, "kills": [{"island": 1, "wall_s": 10.05}, {"island": 0, "wall_s": 20.05},
                                          {"island": 2, "wall_s": 30.0}],  # when the others had finished
           "step_times": {0: steps(5.0, 0.1, 151), 1: steps(5.0, 0.1, 51) + steps(13.0, 0.1, 100),
                          2: steps(5.0, 0.1, 57) + steps(11.5, 0.1, 100)}}
    calm = {"first_step_s": 6.0, "step_times": {0: steps(6.0, 0.1, 200), 1: steps(6.0, 0.1, 200),
                                                 2: steps(6.0, 0.1, 56) + steps(12.0, 0.1, 100)}}
    windows = decoupled.kill_windows(run)
    assert [(round(a, 2), round(b, 2), islands) for a, b, islands in windows] == [
        (10.05, 20.05, [0, 2]), (20.05, 30.0, [1, 2]), (30.0, 50.0, [])]
    gaps, calm_gaps = decoupled.kill_gaps(run, calm)
    assert gaps[:2] == pytest.approx([0.9, 0.1]) and gaps[2] is None
    assert calm_gaps[:2] == pytest.approx([0.5, 0.1]) and calm_gaps[2] is None  # 11.05 .. 21.05 s: the calm run's 0.5 s
    assert decoupled.kill_gaps(run)[1] is None


def test_decoupled_report_compares_no_wait_islands_with_the_same_seeds_synchronous_runs():
    from benchmarks import decoupled

    def runs(losses):
        return [{"seed": s, "final_eval_loss": loss, "wall_s": 30.0} for s, loss in enumerate(losses)]

    result = {"mode": "quick", "islands": 4, "steps": 300, "flags": [], "median_step_s": 0.05,
              "machine": {"cpu_count": 2, "platform": "p", "python": "3", "jax": "0"}, "revisions": {"equal": "r"},
              "equal": {"decoupled": runs([1.0, 2.0]), "sync": runs([1.0, 2.0])},
              "equal_no_wait": {"decoupled-no-wait": runs([1.01, 2.02])}}
    text = decoupled.report(result)
    assert "With `--decoupled.no-wait` (2 seeds): final eval loss 1.5150 +- 0.7142" in text
    assert "paired by seed: +1.00% +- 0.00%." in text


def test_decoupled_report_pairs_time_to_target_by_seed_for_each_decoupled_mode():
    from benchmarks import decoupled

    def runs(times, seeds=(0, 1)):
        return [{"seed": s, "final_eval_loss": 1.0, "wall_s": 40.0, "time_to_target_s": t} for s, t in zip(seeds, times)]

    result = {"mode": "quick", "islands": 4, "steps": 300, "flags": [], "median_step_s": 0.05, "target_eval_loss": 1.8,
              "machine": {"cpu_count": 2, "platform": "p", "python": "3", "jax": "0"}, "revisions": {"equal": "r"},
              "equal": {"decoupled": runs([1, 1]), "sync": runs([1, 1])},
              "slow": {"decoupled": runs([9.0, 18.0]), "sync": runs([20.0, 10.0], seeds=(1, 0)),
                       "decoupled-no-wait": runs([5.0, 10.0])}}
    text = decoupled.report(result)
    assert "Decoupled: over synchronous wall time to target, paired by seed: 0.900 +- 0.000" in text
    assert "With `--decoupled.no-wait`: over synchronous wall time to target, paired by seed: 0.500 +- 0.000" in text
    assert "| decoupled-no-wait | 2 | 2 / 2 |" in text
