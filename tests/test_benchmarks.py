"""Smoke tests of the benchmark scripts on microscopic settings: structure and finiteness only.

Numbers from these settings mean nothing and timings are never asserted.
"""

import copy
import dataclasses
import importlib.util
import json
import math
import pathlib
import statistics
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common, convergence, quantization, throughput  # noqa: E402
from models import Transformer, TransformerConfig  # noqa: E402

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def quiet(_msg):
    pass


_RUNS = {}


@pytest.fixture
def shared_runs(monkeypatch):
    """Trainer runs with equal configs (up to run_dir) are run once per session: the
    convergence and quantization smoke tests share their streaming int4 run."""
    real = _common.train_and_summarize

    def cached(config, **kw):
        key = dataclasses.replace(config, run_dir=pathlib.Path("."))
        if key not in _RUNS:
            _RUNS[key] = real(config, **kw)
        return copy.deepcopy(_RUNS[key])

    monkeypatch.setattr(_common, "train_and_summarize", cached)


@pytest.mark.slow  # runs the benchmark end to end
def test_convergence_smoke(tmp_path, shared_runs):
    result = convergence.run("smoke", out_dir=tmp_path, make_plots=HAVE_MPL, log=quiet)
    scale = convergence.SCALES["smoke"]
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert saved["benchmark"] == "convergence" and len(saved["runs"]) == len(result["runs"]) >= 2
    assert "| run |" in (tmp_path / "convergence.md").read_text()
    if HAVE_MPL:
        assert (tmp_path / "convergence_loss_vs_step.png").stat().st_size > 0
        assert (tmp_path / "convergence_loss_vs_bytes.png").stat().st_size > 0
    runs = {r["method"]: r for r in saved["runs"]}
    for r in saved["runs"]:
        for key in ("eval_loss", "sent_bytes", "peak_sync_bytes", "elapsed_s", "loss_vs_ddp_pct", "bytes_vs_ddp"):
            assert finite(r[key]), (r["name"], key, r[key])
        assert r["tokens"] == r["replicas"] * r["batch_size"] * scale.steps * scale.seq_len
        steps = [p["step"] for p in r["curve"]]
        assert steps == list(range(0, scale.steps + 1, scale.eval_every))
        assert all(finite(p["eval_loss"]) and finite(p["sent_bytes"]) for p in r["curve"])
        assert r["curve"][-1]["sent_bytes"] == r["sent_bytes"] == r["metrics_sent_bytes"]
    ddp, streaming = runs["ddp"], runs["streaming"]
    assert ddp["sent_bytes"] == scale.steps * ddp["peak_sync_bytes"]  # one full gradient every step
    assert streaming["sent_bytes"] < ddp["sent_bytes"] and streaming["peak_sync_bytes"] < ddp["peak_sync_bytes"]


def test_convergence_suites_are_valid_configs(tmp_path):
    from eqx_diloco.lm.config import validate

    for mode in ("quick", "full"):
        scale = convergence.SCALES[mode]
        specs = convergence.suite(scale, mode)
        assert len({s.name for s in specs}) == len(specs)
        tokens = {s.replicas * s.batch_size for s in specs}
        assert len(tokens) == 1  # same global batch, same steps: same total tokens
        for spec in specs:
            validate(convergence.make_config(spec, scale, tmp_path, 0))
            if spec.method != "ddp":
                assert scale.steps % spec.sync_period == 0


@pytest.mark.slow  # runs the benchmark end to end
def test_quantization_smoke(tmp_path, shared_runs):
    formats = (("none", False), ("int4", False))  # the same streaming setting as the convergence smoke run
    result = quantization.run("smoke", formats=formats, fragments=2, noise_seeds=(), out_dir=tmp_path, log=quiet)
    saved = json.loads((tmp_path / "quantization.json").read_text())
    assert "| format |" in (tmp_path / "quantization.md").read_text()
    rows = {(r["format"], r["error_feedback"]): r for r in saved["runs"]}
    assert set(rows) == set(formats) and len(result["runs"]) == len(rows)
    for r in rows.values():
        for key in ("eval_loss", "loss_delta_pct", "bytes_ratio", "metrics_sent_bytes", "bits_per_value"):
            assert finite(r[key]), (r["label"], key, r[key])
        assert isinstance(r["within_1pct"], bool)
    assert rows[("none", False)]["bytes_ratio"] == 1.0 and rows[("none", False)]["loss_delta_pct"] == 0.0
    assert 0 < rows[("int4", False)]["bytes_ratio"] < 0.2


@pytest.mark.slow  # runs the benchmark end to end
def test_throughput_smoke(tmp_path):
    result = throughput.run(throughput.SMOKE, out_dir=tmp_path, log=quiet)
    saved = json.loads((tmp_path / "throughput.json").read_text())
    assert "## (b)" in (tmp_path / "throughput.md").read_text()
    assert finite(saved["peak"]["flops_per_s"]) and saved["peak"]["flops_per_s"] > 0
    assert finite(saved["flops"]["flops_per_token"])
    rows = saved["throughput"]["rows"]
    assert rows[0]["variant"].startswith("plain") and len(rows) == len(result["throughput"]["rows"]) >= 2
    for r in rows:
        assert finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and finite(r["mfu"])
    assert all(finite(r["ratio_vs_plain"]) for r in rows[1:])
    for c in saved["compile"]:
        for variant in ("scan", "unrolled"):
            assert all(finite(c[variant][k]) for k in ("lower_s", "compile_s", "total_s"))
        assert finite(c["unrolled_over_scan"])


def test_unrolled_loss_equals_scan_loss():
    config = TransformerConfig(num_layers=3, dim=16, num_heads=2, mlp_ratio=2)
    model = eqx.filter_jit(Transformer)(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 256)
    both = eqx.filter_jit(lambda m, t: (throughput.scan_loss(m, t), throughput.unrolled_loss(m, t)))
    scan, unrolled = both(model, tokens)
    np.testing.assert_allclose(np.asarray(unrolled), np.asarray(scan), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_model_flops_parameter_counts(tie):
    cfg = TransformerConfig(num_layers=3, dim=32, num_heads=2, mlp_ratio=4, tie_embeddings=tie)
    model = eqx.filter_eval_shape(Transformer, cfg, key=jax.random.key(0))
    counts = throughput.model_flops(cfg, seq_len=64)
    assert counts["n_params"] == sum(x.size for x in jax.tree.leaves(model))
    attn = model.blocks.attn
    matrices = [attn.q, attn.k, attn.v, attn.out, model.blocks.ffn.up, model.blocks.ffn.down]
    head = model.embed if model.head is None else model.head
    assert counts["n_matmul"] == sum(x.size for x in matrices) + head.size
    assert counts["flops_per_token"] == 6 * counts["n_matmul"] + 12 * 3 * 64 * 32


def test_markdown_table_and_jsonable():
    text = _common.markdown_table([{"a": 1, "b": None}], [("A", "a", None), ("B", "b", lambda v: f"{v:.1f}")])
    assert text.splitlines() == ["| A | B |", "|---|---|", "| 1 | - |"]
    assert _common.jsonable({"x": jnp.float32(1.5), "y": float("nan"), "p": pathlib.Path("a")}) == {
        "x": 1.5, "y": "nan", "p": "a"}


def test_overlap_pairs_each_method_with_its_neighbouring_compute_only_runs():
    from benchmarks.overlap import baseline_of, paired_repeat, repeat_order, rotated, summarize

    # compute_only speeds drift: 0.2, 0.3, 0.4 s/step; each method sits between two of them.
    speeds = iter([0.2, 0.25, 0.3, 0.5, 0.4])
    names = []

    def run(name):
        names.append(name)
        return {"s_per_step": next(speeds), "bytes_per_sync": 0 if name == "compute_only" else 5, "steps": 9,
                "timed_after_step": 3}

    one = paired_repeat(run, ["eager", "ddp"])
    assert names == ["compute_only", "eager", "compute_only", "ddp", "compute_only"]
    assert one["eager"]["compute_only_s_per_step"] == pytest.approx(0.25)
    assert one["ddp"]["compute_only_s_per_step"] == pytest.approx(0.35)
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"] and rotated(["a", "b", "c"], 3) == ["a", "b", "c"]

    # Two layouts: each method between runs of its own baseline; a baseline run is shared only within a layout.
    speeds, names = iter([0.2, 0.6, 0.4, 0.3, 0.1, 0.5, 0.9, 0.3]), []
    baseline = {"eager": "compute_only_comm", "tau3": "compute_only_comm", "ddp": "compute_only"}
    order = repeat_order(["ddp", "eager", "tau3"], baseline, 1)
    assert order == ["tau3", "eager", "ddp"]  # groups reversed on odd repeats, each rotated
    two = paired_repeat(run, order, baseline)
    assert names == ["compute_only_comm", "tau3", "compute_only_comm", "eager", "compute_only_comm",
                     "compute_only", "ddp", "compute_only"]
    assert two["tau3"]["compute_only_s_per_step"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert two["eager"]["compute_only_s_per_step"] == pytest.approx(0.25)  # (0.4 + 0.1) / 2
    assert two["ddp"]["compute_only_s_per_step"] == pytest.approx(0.4)  # (0.5 + 0.3) / 2, not the comm runs
    assert two["ddp"]["baseline"] == "compute_only" and two["eager"]["baseline"] == "compute_only_comm"
    assert baseline_of(["--diloco.outer-overlap", "eager"]) == "compute_only_comm"
    assert baseline_of(["--diloco.sync-period", "16"]) == "compute_only"

    def repeat(compute, eager):
        return {"eager": {"s_per_step": eager, "compute_only_s_per_step": compute, "bytes_per_sync": 5, "steps": 9,
                          "timed_after_step": 3}}

    out = summarize([repeat(0.2, 0.25), repeat(0.3, 0.3), repeat(0.2, 0.4)])["eager"]
    assert out["s_per_step"] == 0.3
    # Utilization per repeat against that repeat's paired compute_only: 0.8, 1.0, 0.5.
    utilization = out["compute_utilization"]
    assert utilization["values"] == pytest.approx([0.8, 1.0, 0.5])
    assert utilization["mean"] == pytest.approx(2.3 / 3)
    sd = statistics.stdev([0.8, 1.0, 0.5])
    assert utilization["sd"] == pytest.approx(sd)
    assert utilization["ci95"] == pytest.approx(4.303 * sd / 3 ** 0.5)
    assert out["bytes_per_sync"] == 5

@pytest.mark.slow  # starts one process per variant
def test_gpu_benchmark_smoke_runs_every_variant_and_says_when_torch_is_missing(tmp_path, monkeypatch):
    from benchmarks import gpu

    monkeypatch.delenv(gpu.TORCH_REF_ENV, raising=False)
    results = gpu.main(["--smoke", "--out-dir", str(tmp_path), "--torch-python", str(tmp_path / "no-python")])
    rows = results["shapes"]["smoke"]["rows"]
    for variant in ("cli", "unrolled", "rolled", "plain", "round"):
        assert rows[variant]["tokens_per_s"] > 0 and 0 < rows[variant]["mfu"], (variant, rows[variant])
    assert rows["cli"]["tokens_per_step"] == 2 * rows["unrolled"]["tokens_per_step"]  # the CLI's R = 2, one device
    assert rows["unrolled"]["layers_per_iteration"] == 2 and rows["rolled"]["layers_per_iteration"] == 1
    assert rows["torch"]["error"] == "missing: no PyTorch reference given (--torch-ref or $EQX_DILOCO_TORCH_REF)"
    table = (tmp_path / "gpu.md").read_text()
    assert "| cli |" in table and "| rolled |" in table and "| torch | missing" in table
    assert "No PyTorch reference in this run" in table and "MFU (spec)" in table


def test_gpu_benchmark_knows_the_cards_it_is_run_on():
    from benchmarks import gpu

    assert gpu.spec_peak("TPU v5 lite") == (197, 16)
    assert gpu.spec_peak("NVIDIA H200") == (989, 141)
    assert gpu.spec_peak("cpu") is None


@pytest.mark.slow  # trains four microscopic runs
def test_compression_smoke_tabulates_gaps_and_bits(tmp_path):
    from benchmarks import compression

    assert compression.main(["--quick", "--out", str(tmp_path), "--settings", "topk2-int2,muon", "--replicas", "2",
                             "--seeds", "0", "1"]) == 0
    result = json.loads((tmp_path / "compression.json").read_text())
    rows = result["by_replicas"]["2"]
    assert list(rows) == ["float32", "topk2-int2", "muon"]  # float32 is always run: every gap is to it
    assert rows["float32"]["bits_per_parameter"] == 32 and rows["float32"]["gap"] is None
    assert 0 < rows["topk2-int2"]["bits_per_parameter"] < 1
    assert rows["topk2-int2"]["wire_bytes"] < rows["float32"]["wire_bytes"]
    assert rows["muon"]["gap"]["n"] == 2 and rows["muon"]["gap"]["seeds"] == [0, 1]
    assert "| topk2-int2 |" in (tmp_path / "compression.md").read_text()


def test_vs_torchft_says_when_torchft_is_missing_and_computes_its_ratios(tmp_path, capsys):
    from benchmarks import vs_torchft

    assert vs_torchft.main(["--repeats", "1", "--torch-python", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: torchft is not installed: no --torch-python given")
    # eqx_diloco's tokens/s per replica: steps 10 -> 200 of the metrics' timestamps.
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 1.0, "time": 0.5 * s} for s in range(1, 201)] + [{"step": 200, "eval_loss": 1.0}]
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    assert vs_torchft.eqx_tokens_per_s(metrics) == pytest.approx(190 * 256 / 95.0)
    pairs = [{"torchft": {"wall_s": 5.0, "start_to_step_1_s": 4.0, "tokens_per_s_per_replica": 100.0},
              "eqx_diloco": {"wall_s": w, "start_to_step_1_s": 2.0, "tokens_per_s_per_replica": t},
              "eqx_diloco_cold": {"wall_s": 2 * w, "start_to_step_1_s": 6.0}, "load_average": (0.5, 0.5, 0.5)}
             for w, t in ((10.0, 50.0), (5.0, 150.0))]
    out = vs_torchft.summarize(pairs)
    assert out["wall_ratio"]["values"] == [2.0, 1.0] and out["tokens_per_s_ratio"]["values"] == [0.5, 1.5]
    assert out["start_to_step_1_ratio"]["values"] == [0.5, 0.5] and out["cold_wall_ratio"]["values"] == [4.0, 2.0]
    assert ("| diloco | 5.0, 5.0 | 10.0, 5.0 | 1.50 +- 0.71 | 4.0, 4.0 | 2.0, 2.0 | 0.50 +- 0.00 | 3.00 +- 1.41; "
            "1.50 +- 0.00 | 1.00 +- 0.71 | 0.0x, 0.0x | 0.0x, 0.0x | 0.50, 0.50 |") in vs_torchft.render({"diloco": out})
    del pairs[0]["eqx_diloco_cold"], pairs[1]["eqx_diloco_cold"]  # without --cold: no cold ratios, a dash
    assert vs_torchft.summarize(pairs)["cold_wall_ratio"] is None
    assert "| 0.50 +- 0.00 | -; - |" in vs_torchft.render({"diloco": vs_torchft.summarize(pairs)})
    # Seconds to step 1 of eqx_diloco: process 0's start on the wall clock plus its "first step done" mark.
    (tmp_path / "run" / "phases").mkdir(parents=True)
    (tmp_path / "run" / "phases" / "process-0.json").write_text(json.dumps(
        {"since_process_start": True, "started_unix": 100.5,
         "marks": [{"phase": "first step compiled and dispatched", "s": 2.0}, {"phase": "first step done", "s": 2.25}]}))
    assert vs_torchft.eqx_first_step_s(tmp_path / "run", started=100.0) == pytest.approx(2.75)
    # The slowest steps, as multiples of the median step: one sync step of 2 s, one other step of 1.5 s.
    records = [{"step": s, "loss": 1.0, "time": 0.5 * s + (1.5 if s >= 50 else 0) + (1.0 if s >= 100 else 0),
                "synced_fragment": 0 if s == 100 else None} for s in range(1, 201)]
    metrics.write_text("\n".join(json.dumps(r) for r in records))
    spread = vs_torchft.eqx_step_spread(metrics)
    assert spread == {"median_step_s": 0.5, "slowest_sync_step_x": 3.0, "slowest_other_step_x": 4.0}
    # torchft's, from replica 0's own step times: step 1 left out, a sync step of 0.3 s, another of 0.25 s.
    rows = [{"step": s, "step_time_s": 5.0 if s == 1 else 0.3 if s == 10 else 0.25 if s == 7 else 0.1,
             "sync": s % 10 == 0} for s in range(1, 41)]
    (tmp_path / "metrics_r0.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    spread = vs_torchft.torchft_step_spread(tmp_path / "metrics_r0.jsonl")
    assert spread == pytest.approx({"median_step_s": 0.1, "slowest_sync_step_x": 3.0, "slowest_other_step_x": 2.5})
    pairs[0]["torchft"].update(spread)
    assert "| 3.0x, 2.5x | 0.0x, 0.0x |" in vs_torchft.render({"diloco": vs_torchft.summarize(pairs)})


def test_vs_torchft_writes_its_table_beside_its_json(tmp_path, monkeypatch):
    from benchmarks import vs_torchft

    corpus = tmp_path / "texts"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text")
    pair = {"torchft": {"wall_s": 5.0, "start_to_step_1_s": 4.0, "tokens_per_s_per_replica": 100.0},
            "eqx_diloco": {"wall_s": 4.0, "start_to_step_1_s": 2.0, "tokens_per_s_per_replica": 120.0},
            "load_average": (1.0, 1.0, 1.0)}
    monkeypatch.setattr(vs_torchft, "CORPUS", corpus)
    monkeypatch.setattr(vs_torchft, "torchft_missing", lambda python: None)
    monkeypatch.setattr(vs_torchft, "run_pair", lambda *args, **kwargs: copy.deepcopy(pair))
    monkeypatch.setattr(vs_torchft.common, "revision", lambda: "0" * 40)  # git is a process
    out = tmp_path / "results" / "vs.json"
    assert vs_torchft.main(["--torch-python", "py", "--repeats", "2", "--only", "diloco", "--no-warm-up",
                            "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["configs"]["diloco"]["wall_ratio"]["values"] == [0.8, 0.8]
    table = out.with_suffix(".md").read_text()
    assert table == vs_torchft.render({"diloco": vs_torchft.summarize([pair, pair])}) + "\n"
    assert "| diloco | 5.0, 5.0 | 4.0, 4.0 | 0.80 +- 0.00 |" in table


@pytest.mark.slow  # compiles and times both settings
def test_scan_unroll_smoke(tmp_path):
    from benchmarks import scan_unroll

    scan_unroll.run(scan_unroll.SMOKE, out_dir=tmp_path, log=quiet)
    saved = json.loads((tmp_path / "scan_unroll.json").read_text())
    assert "| smoke | 2 |" in (tmp_path / "scan_unroll.md").read_text()
    (row,) = saved["rows"]
    for key in ("step_rolled_ms", "step_unrolled_ms", "compile_rolled_s", "compile_unrolled_s", "speedup",
                "compile_ratio"):
        assert finite(row[key]) and row[key] > 0
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert len(row["all"]["step_s"]["rolled"]) == scan_unroll.SMOKE.rounds


@pytest.mark.slow  # the revision comes from git
def test_rare_programs_smoke(tmp_path):
    from benchmarks import rare_programs

    rare_programs.run(rare_programs.SMOKE, out_dir=tmp_path, log=quiet)
    saved = json.loads((tmp_path / "rare_programs.json").read_text())
    (row,) = saved["rows"]
    assert f"| 1 x 32 | {row['params']:,} |" in (tmp_path / "rare_programs.md").read_text()
    for key in ("compile_defaults_s", "compile_unoptimised_s", "run_defaults_ms", "run_unoptimised_ms"):
        assert finite(row[key]) and row[key] > 0
    assert row["compile_saved_s"] == row["compile_defaults_s"] - row["compile_unoptimised_s"]


@pytest.mark.slow  # two processes join a jax.distributed run
def test_psum_floor_smoke(tmp_path):
    from benchmarks import psum_floor

    assert psum_floor.main(["--calls", "3", "--floats", "1000", "--out-dir", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "psum_floor.json").read_text())
    rows = {r["setting"]: r for r in saved["rows"]}
    assert list(rows) == ["pinned", "pinned-loop-normal", "unpinned"] and saved["floats"] == 1000
    for row in saved["rows"]:
        assert row["calls"] == 3 and 0 < row["median_ms"] <= row["p90_ms"] <= row["max_ms"]
    # gloo's one network thread per process is found in a real jax.distributed process, as the trainer finds it
    assert [rows[s]["idled_threads"] for s in rows] == [1, 0, 1]
    assert "| each pinned to a core of its own | 3 | 1 |" in (tmp_path / "psum_floor.md").read_text()
    with pytest.raises(SystemExit):
        psum_floor.main(["--calls", "0"])


def test_sync_breakdown_pairs_the_processes_syncs_in_order():
    from benchmarks import sync_step

    # Process 1 finished its inner step 3 ms after process 0 at the first sync, 1 ms before it at the
    # second; process 0 has one sync more (a run cut short): only the syncs both have are paired.
    p0 = [{"inner_done": 10.000, "sync_done": 10.008}, {"inner_done": 20.000, "sync_done": 20.005},
          {"inner_done": 30.0, "sync_done": 30.1}]
    p1 = [{"inner_done": 10.003, "sync_done": 10.009}, {"inner_done": 19.999, "sync_done": 20.004}]
    got = sync_step.sync_breakdown([p0, p1])
    assert np.allclose(got["inner_steps_apart_ms"], [3.0, 1.0])
    assert np.allclose(got["sync_after_later_inner_ms"], [5.0, 6.0, 5.0, 4.0])
    took, synced = [1.0, 2.0, 1.0, 1.0, 4.0], [False, True, False, False, True]
    summary = sync_step.summarize([(took, synced)], [got])
    assert summary["sync_step_x"] == {"median": 3.0, "p90": 3.8, "max": 4.0}
    assert summary["other_step_x"]["max"] == 1.0 and summary["syncs_probed"] == 2
    assert summary["median_step_ms"]["mean"] == 1000.0 and np.isclose(summary["inner_steps_apart_ms"]["max"], 3.0)


@pytest.mark.slow  # two 2-process runs of the trainer
def test_sync_step_smoke(tmp_path):
    from benchmarks import sync_step

    argv = ["--repeats", "1", "--steps", "8", "--sync-period", "4", "--cpus", "split", "--no-warm-up",
            "--out-dir", str(tmp_path)]
    assert sync_step.main(argv) == 0
    saved = json.loads((tmp_path / "sync_step.json").read_text())
    (setting,) = saved["settings"].values()
    assert setting["runs"] == 1 and setting["syncs_probed"] == 2  # after steps 4 and 8
    for key in ("sync_step_x", "inner_steps_apart_ms", "sync_after_later_inner_ms"):
        assert 0 <= setting[key]["median"] <= setting[key]["p90"] <= setting[key]["max"] and finite(setting[key]["max"])
    assert "| each process on a core of its own (split) | 1 |" in (tmp_path / "sync_step.md").read_text()
    with pytest.raises(SystemExit):
        sync_step.main(["--steps", "4", "--sync-period", "4"])


@pytest.mark.slow  # imports the trainer in a subprocess
def test_offline_deps_copies_what_the_gpu_benchmark_imports_with_metadata(tmp_path):
    from benchmarks import offline_deps

    copied = offline_deps.main([str(tmp_path / "deps")])
    assert {"equinox", "optax", "jaxtyping"} <= set(copied) and not {"jax", "numpy", "eqx_diloco"} & set(copied)
    assert (tmp_path / "deps" / "equinox" / "__init__.py").is_file()
    assert list((tmp_path / "deps").glob("jaxtyping-*.dist-info"))  # jaxtyping reads its own version at import
