"""`python -m eqx_diloco.plot`: real runs plotted into a non-trivial PNG, labels that tell runs apart,
one-line errors."""

import json

import numpy as np
import pytest

from eqx_diloco.lm import plot
from eqx_diloco.lm.config import Config, DiLoCoConfig
from eqx_diloco.lm.metrics import to_jsonable
from eqx_diloco.lm.train import main as train_main

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--checkpoint.every", "0", "--train.steps", "6",
        "--train.eval-every", "2", "--train.eval-sequences", "4", "--train.log-every", "1",
        "--diloco.sync-period", "2", "--train.warmup-steps", "1"]


def fake_run(path, config: Config, evals=((0, 5.0), (4, 3.0)), steps=4, bytes_per_step=100):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(to_jsonable(config)))
    lines = []
    for t in range(1, steps + 1):
        lines.append({"step": t, "loss": 5.0 - 0.4 * t, "sent_bytes": t * bytes_per_step})
    for s, v in evals:
        lines.append({"step": s, "eval_loss": v})
    lines.sort(key=lambda r: (r["step"], "eval_loss" in r))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 9, "lo')
    return path


@pytest.mark.slow
def test_two_real_runs_make_a_png(tmp_path, capsys):
    a, b = tmp_path / "diloco", tmp_path / "ddp"
    assert train_main([*TINY, "--run-dir", str(a)]) == 0
    assert train_main([*TINY, "--run-dir", str(b), "--algorithm", "ddp"]) == 0
    out = tmp_path / "figs" / "loss.png"
    assert plot.main([str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "DiLoCo R2 H2" in printed and "DDP R2" in printed
    assert out.stat().st_size > 20_000
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 1000
    rgb = image[..., :3].reshape(-1, 3)
    colors = np.unique((rgb * 255).astype(np.uint8), axis=0)
    assert len(colors) > 50  # curves, labels and a legend, not a blank canvas
    # Both runs' line colours (matplotlib's C0 and C1) are drawn.
    for hex_color in ("1f77b4", "ff7f0e"):
        target = np.array([int(hex_color[i:i + 2], 16) for i in (0, 2, 4)])
        assert (np.abs((rgb * 255).astype(int) - target).sum(axis=1) < 10).sum() > 100, hex_color

    run = plot.read_run(a)
    assert [s for s, _, _ in run.evals] == [0, 2, 4, 6]
    assert [s for s, _, _ in run.train] == [1, 2, 3, 4, 5, 6]
    # Evaluation points carry the bytes sent by their step: nothing at step 0, growing after each sync.
    sent = [b for *_, b in run.evals]
    assert sent[0] == 0 and sent[1] > 0 and sent == sorted(sent)
    assert plot.read_run(b).evals[-1][2] > sent[-1]  # DDP sends a gradient every step


def test_default_out_is_in_the_run_folder(tmp_path):
    run = fake_run(tmp_path / "r", Config())
    assert plot.main([str(run)]) == 0
    assert (run / "loss.png").stat().st_size > 10_000


def test_labels_tell_runs_apart(tmp_path):
    base = Config()
    runs = [
        fake_run(tmp_path / "a", base),
        fake_run(tmp_path / "b", Config(algorithm="ddp"), bytes_per_step=5000),
        fake_run(tmp_path / "c", Config(diloco=DiLoCoConfig(num_fragments=4, overlap_steps=1, quantize="int4",
                                                            error_feedback=True))),
        fake_run(tmp_path / "d", Config(diloco=DiLoCoConfig(sync_period=50))),
    ]
    read = [plot.read_run(r) for r in runs]
    plot.label_runs(read)
    assert [r.label for r in read] == ["DiLoCo R2 H20", "DDP R2", "Streaming DiLoCo R2 H20 P4 tau1 int4+EF",
                                       "DiLoCo R2 H50"]
    # Equal labels: the config fields that differ are named.
    import dataclasses

    seeds = [fake_run(tmp_path / f"s{s}", dataclasses.replace(base, train=dataclasses.replace(base.train, seed=s)))
             for s in (0, 1)]
    read = [plot.read_run(r) for r in seeds]
    plot.label_runs(read)
    assert [r.label for r in read] == ["DiLoCo R2 H20 (seed=0)", "DiLoCo R2 H20 (seed=1)"]
    # Equal configs (only the folder differs): the folder names.
    read = [plot.read_run(fake_run(tmp_path / n, base)) for n in ("first", "second")]
    plot.label_runs(read)
    assert [r.label for r in read] == ["DiLoCo R2 H20 (first)", "DiLoCo R2 H20 (second)"]
    # Several runs of very different bytes: plotted with a log bytes axis without error.
    assert plot.main([*map(str, runs), "--out", str(tmp_path / "all.png"), "--title", "t"]) == 0


def test_a_run_without_config_json_is_labelled_by_its_folder(tmp_path):
    run = fake_run(tmp_path / "mine", Config())
    (run / "config.json").unlink()
    read = plot.read_run(run)
    plot.label_runs([read])
    assert read.label == "mine"


@pytest.mark.parametrize("case,message", [
    ("missing", "run folder does not exist"),
    ("no_metrics", "no metrics.jsonl in"),
    ("empty", "holds no loss values"),
])
def test_one_line_errors(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert plot.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("line,message", [
    ('{"step": 1e400, "loss": 1}', '"step" must be a whole number >= 0 (got Infinity)'),  # NPL1: a traceback
    ('{"step": -3, "loss": 1}', '"step" must be a whole number >= 0 (got -3)'),
    ('{"step": 2.5, "loss": 1}', '"step" must be a whole number >= 0 (got 2.5)'),
    ('{"step": 2, "loss": 1, "sent_bytes": -1e400}', '"sent_bytes" must be a whole number >= 0 (got -Infinity)'),
])
def test_a_step_or_byte_count_that_cannot_be_is_a_one_line_error(tmp_path, capsys, line, message):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n' + line + "\n")
    assert plot.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {run / 'metrics.jsonl'} line 2: {message}\n", err
    assert not (tmp_path / "x.png").exists()


def test_unknown_output_format_is_one_line_error(tmp_path, capsys):
    run = fake_run(tmp_path / "r", Config())
    assert plot.main([str(run), "--out", str(tmp_path / "x.notaformat")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out") and err.count("\n") == 1, err


@pytest.mark.parametrize("config,message", [
    ([1, 2], "is not a run config: expected a JSON object, got list"),
    ({"diloco": None}, '"diloco" must be a JSON object (got null)'),
    ({"diloco": {"num_fragments": None}}, "diloco.num_fragments must be an integer (got null)"),
    ({"diloco": {"num_replicas": True}}, "diloco.num_replicas must be an integer (got true)"),
    ({"diloco": {"alpha": "0.5"}}, 'diloco.alpha must be a number (got "0.5")'),
    ({"algorithm": 3}, "algorithm must be a string (got 3)"),
])
def test_a_config_json_of_the_wrong_shape_is_a_one_line_error(tmp_path, capsys, config, message):
    run = fake_run(tmp_path / "r", Config())
    (run / "config.json").write_text(json.dumps(config))
    assert plot.main([str(run), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'config.json'}") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()


def test_odd_metrics_run_dirs_and_outputs_are_one_line_errors(tmp_path, capsys):
    def refused(*args) -> str:
        assert plot.main([*map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        return err

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "metrics.jsonl").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 5000, np.uint8)))
    assert "holds no loss values" in refused(garbage, "--out", tmp_path / "g.png")  # the metrics, not --out
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert f"RUN_DIR is not a folder: {a_file}" in refused(a_file)
    run = fake_run(tmp_path / "r", Config())
    folder = tmp_path / "outdir"
    folder.mkdir()
    assert f"--out is a folder: {folder}" in refused(run, "--out", folder)
    assert list(tmp_path.glob("outdir*")) == [folder]
    assert f"cannot write --out {a_file / 'x.png'}" in refused(run, "--out", a_file / "x.png")  # no such folder


def test_an_out_without_suffix_reports_the_file_it_wrote(tmp_path, capsys):
    run = fake_run(tmp_path / "r", Config())
    assert plot.main([str(run), "--out", str(tmp_path / "curves")]) == 0
    assert f"wrote {tmp_path / 'curves.png'} " in capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 10_000 and not (tmp_path / "curves").exists()
