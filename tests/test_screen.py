"""What the screen confirms: the setup lines name every setting that changes the algorithm or the
link, gloo's connection lines do not reach the terminal, the elastic summary covers every
generation, and every `next:` command the trainer prints runs as printed."""

import json
import os
import re
import select
import shlex
import threading
import time

import numpy as np
import pytest
import tyro

from eqx_diloco.lm._banner import format_summary, setup_lines
from eqx_diloco.lm._devices import drop_gloo_noise, forward_without_gloo_lines
from eqx_diloco.lm.elastic import Generation, generations_summary
from eqx_diloco.lm.config import Config
from eqx_diloco.lm.export import main as export_main
from eqx_diloco.lm.launch import GENERATION_ENV, LINK_LIMIT_ENV
from eqx_diloco.lm.plot import main as plot_main
from eqx_diloco.lm.sample import main as sample_main
from eqx_diloco.lm.train import main as train_main

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--train.eval-every", "0",
        "--diloco.sync-period", "2"]


# -- the setup lines ----------------------------------------------------------------------

@pytest.mark.parametrize("overlap", ["eager", "delayed"])
def test_setup_lines_name_the_outer_overlap(overlap):
    head = setup_lines(tyro.cli(Config, args=["--diloco.outer-overlap", overlap]))[0]
    assert f"outer overlap {overlap}" in head, head


def test_setup_lines_name_the_router_sync_period_and_only_when_set():
    moe = ["--model.kind", "moe"]
    assert "routers synced every 5 steps" in setup_lines(tyro.cli(Config, args=[*moe, "--diloco.router-sync-period",
                                                                                 "5"]))[0]
    assert "routers" not in setup_lines(tyro.cli(Config, args=moe))[0]
    assert "outer overlap" not in setup_lines(tyro.cli(Config, args=moe))[0]


def test_setup_lines_show_the_launchers_link_limit(monkeypatch):
    monkeypatch.delenv(LINK_LIMIT_ENV, raising=False)
    assert not [line for line in setup_lines(Config()) if "link" in line]
    monkeypatch.setenv(LINK_LIMIT_ENV, "800mbit")  # as `launch --bandwidth 800mbit` sets it
    assert "  link         800mbit between the processes (launcher --bandwidth: a rate-limited loopback)" in \
        setup_lines(Config())


# -- gloo's connection lines ----------------------------------------------------------------

GLOO = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
SHORT = b"[Gloo] Rank 1 is connected to 0 peer ranks. Expected number of connected peer ranks is : 1\n"


def test_gloos_connected_lines_are_dropped_and_everything_else_passes_in_order():
    """What native code writes to stdout in a multi-process run goes through this filter (see
    `quiet_gloo_lines`); a line split over two writes is still recognised, and a partial line that
    cannot be gloo's (a progress bar's carriage return) is not held back."""
    source_r, source_w = os.pipe()
    target_r, target_w = os.pipe()
    thread = threading.Thread(target=forward_without_gloo_lines, args=(source_r, target_w))
    thread.start()
    os.write(source_w, GLOO + b"step 1\n" + GLOO[:20])
    os.write(source_w, GLOO[20:] + SHORT + b"[Gl")
    os.write(source_w, b"ad] not gloo\n" + b"50%\r")
    received, deadline = b"", time.monotonic() + 30
    while not received.endswith(b"50%\r"):  # passed on before the writer closes
        ready, _, _ = select.select([target_r], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, received
        received += os.read(target_r, 65536)
    os.close(source_w)
    thread.join(timeout=10)
    os.close(target_w)
    with os.fdopen(target_r, "rb") as rest:
        received += rest.read()
    os.close(source_r)
    assert received == b"step 1\n" + SHORT + b"[Glad] not gloo\n50%\r"


def test_two_gloo_messages_written_into_each_other_are_both_dropped():
    """Two communicators connecting at once, from two threads: std::cout writes in pieces, so one
    message lands inside the other (as seen in a 2-process run)."""
    zero = b"[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0\n"
    nested = zero[:31] + zero + zero[31:]
    assert nested.startswith(b"[Gloo] Rank 0 is connected to 0[Gloo]")
    assert drop_gloo_noise(b"a\n" + nested + b"b\n") == (b"a\nb\n", b"")
    # The outer message's first piece arrives alone: held back until the rest comes.
    passed, held = drop_gloo_noise(b"a\n" + nested[:31])
    assert (passed, held) == (b"a\n", nested[:31])
    assert drop_gloo_noise(held + nested[31:] + b"b\n") == (b"b\n", b"")
    # A shortfall inside another message is kept, in full.
    assert drop_gloo_noise(zero[:31] + SHORT + zero[31:]) == (zero[:31] + SHORT + zero[31:], b"")


# -- the elastic summary --------------------------------------------------------------------

def test_the_elastic_summary_counts_every_generation():
    """3 islands; island 2 lost at step 22 (back to the boundary at 20), back at 40: the steps 21-22 the
    three islands trained before the loss were trained twice."""
    gens = [Generation([0, 1, 2], 0, 100.0, last_step=22, ended=160.0),
            Generation([0, 1], 20, 163.0, last_step=40, ended=200.0),
            Generation([0, 1, 2], 40, 201.0, last_step=60, ended=250.5)]
    assert generations_summary(gens, tokens_per_island_step=64) == [
        "3 generations in 150.5 s, 10,624 tokens trained (384 of them in steps redone after a re-form)",
        "  generation 0: islands [0, 1, 2], steps 0-22 in 60.0 s, 4,224 tokens",
        "  generation 1: islands [0, 1], steps 20-40 in 37.0 s, 2,560 tokens",
        "  generation 2: islands [0, 1, 2], steps 40-60 in 49.5 s, 3,840 tokens",
    ]


def test_a_later_generations_own_summary_leaves_time_and_tokens_to_the_launcher(monkeypatch):
    config = tyro.cli(Config, args=["--elastic.enabled", "--diloco.num-replicas", "3"])
    summary = {"step": 60, "wall_time_s": 86.7, "tokens": 184_320, "eval_loss": 2.4763}
    assert format_summary(summary, config).startswith("done: 60 steps in 86.7 s, 184,320 tokens")
    monkeypatch.setenv(GENERATION_ENV, "2")
    head = format_summary(summary, config).splitlines()[0]
    assert head.startswith("done: 60 steps (generation 2 of an elastic run: the launcher's summary below")
    assert "86.7" not in head and "184,320" not in head


# -- the next: commands -----------------------------------------------------------------------

MAINS = {"eqx_diloco.plot": plot_main, "eqx_diloco.export": export_main, "eqx_diloco.sample": sample_main}


def _token_file(tmp_path) -> list[str]:
    """A token file of a 300-id vocabulary (more than bytes: the model reads and writes ids) and its flags."""
    ids = np.random.default_rng(0).integers(0, 300, 20_000).astype(np.uint16)
    ids[0] = 7
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 300,
                                                          "num_tokens": int(ids.size)}))
    return ["--data.source", "tokens", "--data.path", str(path)]


@pytest.mark.slow
@pytest.mark.parametrize("data", ["bytes", "tokens"])
def test_every_next_command_runs_as_printed(tmp_path, capsys, data):
    """The sample command of a token model used to fail (rc 2: its default prompt, a newline, is no token id)."""
    run = tmp_path / "run"
    args = [*TINY, "--run-dir", str(run), "--train.steps", "4", "--checkpoint.every", "2",
            *(_token_file(tmp_path) if data == "tokens" else [])]
    assert train_main(args) == 0
    out = capsys.readouterr().out
    hints = [line.strip() for line in out.split("\nnext:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert [h.split()[2] if h.startswith("python") else h.split(":")[0] for h in hints] == \
        ["eqx_diloco.plot", "eqx_diloco.export", "eqx_diloco.sample", "more steps"]
    for hint in hints:
        if hint.startswith("more steps:"):  # "the same command with --train.steps N"
            steps = re.search(r"--train\.steps (\d+)", hint)[1]
            assert train_main([*args, "--train.steps", steps]) == 0
            assert "resumed from checkpoint at step 4" in capsys.readouterr().out
            continue
        _, _, module, *argv = shlex.split(hint, comments=True)  # python -m MODULE ARGS
        assert MAINS[module](argv) == 0, (hint, capsys.readouterr().err)
        if module == "eqx_diloco.sample" and data == "tokens":
            assert "--prompt 7" in hint  # the data's first token id
    assert (run / "loss.png").exists() and (run / "model.eqx").exists()
