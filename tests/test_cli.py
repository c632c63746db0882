"""The command line: bad input gets a one-line error naming the flag; good input trains."""

import subprocess
import sys

import pytest

from eqx_diloco.lm.train import main
from util import read_metrics

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--checkpoint.every", "0"]

BAD = [
    (["--model.num-layers", "0"], "--model.num-layers must be >= 1"),
    (["--train.batch-size", "-3"], "--train.batch-size must be >= 1"),
    (["--train.steps", "0"], "--train.steps must be >= 1"),
    (["--diloco.num-replicas", "0"], "--diloco.num-replicas must be >= 1"),
    (["--model.dim", "100", "--model.num-heads", "3"], "--model.dim must be divisible by --model.num-heads"),
    (["--train.batch-size", "3", "--mesh.data", "2"], "--train.batch-size must be divisible by --mesh.data x --mesh.fsdp"),
    (["--mesh.fsdp", "0"], "--mesh.fsdp must be >= 1"),
    (["--mesh.tensor", "0"], "--mesh.tensor must be >= 1"),
    (["--train.batch-size", "6", "--mesh.fsdp", "4"], "--train.batch-size must be divisible by --mesh.data x --mesh.fsdp"),
    (["--mesh.fsdp", "2", "--mesh.replicas-per-device", "2"], "--mesh.replicas-per-device must be 1 with --mesh.fsdp"),
    (["--diloco.outer-state-memory", "host", "--diloco.outer-overlap", "eager", "--diloco.quantize", "int8",
      "--diloco.error-feedback"], "--diloco.outer-state-memory host needs --diloco.outer-overlap none"),
    (["--data.source", "text", "--data.path", "/nonexistent/corpus"], "--data.path does not exist"),
    (["--data.source", "tokens"], "--data.path is required with --data.source tokens"),
    (["--diloco.num-fragments", "0"], "--diloco.num-fragments must be >= 1"),
    (["--diloco.num-fragments", "4", "--model.num-layers", "4", "--diloco.sync-period", "8"],
     "--model.num-layers must be divisible by --diloco.num-fragments - 1"),
    (["--diloco.num-fragments", "3", "--model.num-layers", "4", "--diloco.sync-period", "10"],
     "--diloco.sync-period must be divisible by --diloco.num-fragments"),
    (["--diloco.num-fragments", "2", "--model.num-layers", "4", "--diloco.sync-period", "8",
      "--diloco.overlap-steps", "4"], "--diloco.overlap-steps must be < --diloco.sync-period / --diloco.num-fragments"),
    (["--diloco.overlap-steps", "-1"], "--diloco.overlap-steps must be >= 0"),
    (["--dist.metrics-lag", "-1"], "--dist.metrics-lag must be >= 0"),
    (["--dist.metrics-interval-s", "-0.5"], "--dist.metrics-interval-s must be a finite number >= 0"),
    (["--dist.metrics-interval-s", "inf"], "--dist.metrics-interval-s must be a finite number >= 0"),
    (["--diloco.alpha", "1.5"], "--diloco.alpha must be in [0, 1]"),
    (["--diloco.alpha", "-0.1"], "--diloco.alpha must be in [0, 1]"),
    (["--algorithm", "ddp", "--diloco.num-fragments", "2"], "--diloco.num-fragments applies to --algorithm diloco"),
    (["--algorithm", "ddp", "--diloco.overlap-steps", "1"], "--diloco.overlap-steps applies to --algorithm diloco"),
    (["--algorithm", "ddp", "--diloco.quantize", "int4"], "--diloco.quantize applies to --algorithm diloco"),
    (["--diloco.outer-lr", "0"], "--diloco.outer-lr must be > 0"),
    (["--diloco.outer-momentum", "1.0"], "--diloco.outer-momentum must be in [0, 1)"),
    (["--diloco.error-feedback"], "--diloco.error-feedback needs a lossy --diloco.quantize"),
    (["--train.seq-len", "100000"], "--train.seq-len is too long"),
    (["--diloco.router-sync-period", "5"], "--diloco.router-sync-period needs --model.kind moe"),
    (["--model.kind", "moe", "--model.top-k", "3"], "--model.top-k must be 1 or 2"),
    (["--dist.init-timeout-s", "0"], "--dist.init-timeout-s must be >= 1"),
    (["--model.num-kv-heads", "3"], "--model.num-kv-heads must divide --model.num-heads (got 3 and 2)"),
    (["--model.num-kv-heads", "0"], "--model.num-kv-heads must divide --model.num-heads (got 0 and 2)"),
    (["--model.norm-eps", "0"], "--model.norm-eps must be a finite number > 0"),
    (["--model.norm-eps", "inf"], "--model.norm-eps must be a finite number > 0"),
    (["--model.ffn-dim", "0"], "--model.ffn-dim must be >= 1"),
    (["--model.kind", "moe", "--model.mlp", "swiglu"], "--model.mlp swiglu applies to --model.kind dense"),
    (["--model.kind", "moe", "--model.ffn-dim", "64"], "--model.ffn-dim applies to --model.kind dense"),
    (["--model.init-from", "/nonexistent/model"], "--model.init-from must be a Hugging Face model folder"),
    (["--dist.num-processes", "2", "--dist.coordinator-address", "localhost"],
     "--dist.coordinator-address must be host:port"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_error_naming_the_flag(tmp_path, capsys, args, message):
    code = main([*TINY, "--run-dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1  # one line


def test_empty_and_unreadable_paths(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert main([*TINY, "--run-dir", str(tmp_path), "--data.source", "text", "--data.path", str(empty)]) == 2
    assert "--data.path holds no text" in capsys.readouterr().err
    tokens = tmp_path / "empty.bin"
    tokens.write_bytes(b"")
    assert main([*TINY, "--run-dir", str(tmp_path), "--data.source", "tokens", "--data.path", str(tokens)]) == 2
    assert "--data.path holds no tokens" in capsys.readouterr().err
    big = tmp_path / "ids.bin"
    big.write_bytes((1000).to_bytes(2, "little") * 10_000)
    assert main([*TINY, "--run-dir", str(tmp_path), "--data.source", "tokens", "--data.path", str(big)]) == 2
    assert "--model.vocab-size must exceed every token id" in capsys.readouterr().err


@pytest.mark.slow
def test_subprocess_error_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_diloco.train", "--model.dim", "100", "--model.num-heads", "3",
         "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --model.dim must be divisible by --model.num-heads (got 100 and 3)"
    ]


def test_unknown_data_source_is_rejected_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "--run-dir", str(tmp_path), "--data.source", "bogus"])
    assert exit_info.value.code == 2


@pytest.mark.slow
def test_text_folder_trains_and_writes_metrics_and_config(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    (folder / "b.txt").write_text("pack my box with five dozen liquor jugs. " * 300)
    run = tmp_path / "run"
    args = [*TINY, "--run-dir", str(run), "--data.source", "text", "--data.path", str(folder),
            "--diloco.num-replicas", "4", "--diloco.sync-period", "5", "--train.steps", "10", "--train.log-every", "5"]
    assert main(args) == 0
    lines = read_metrics(run)
    train = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train] == [5, 10]
    for key in ("loss", "replica_losses", "lr", "tokens_per_s", "sent_bytes", "peak_sync_bytes",
                "synced_fragment", "applied_fragment"):
        assert key in train[0], key
    assert len(train[0]["replica_losses"]) == 4
    assert train[1]["sent_bytes"] == 2 * train[0]["sent_bytes"] == 2 * train[0]["peak_sync_bytes"]
    assert [r["step"] for r in lines if "eval_loss" in r] == [0, 10]
    assert (run / "config.json").exists()


def test_an_os_error_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A disk error anywhere in the run (here: where the elastic progress file goes) is one line naming the
    file, not a traceback; the trainer's own failures keep their messages."""
    from eqx_diloco.lm import trainer

    def fail(self):
        raise PermissionError(13, "Permission denied", str(tmp_path / "progress.json.tmp"))

    monkeypatch.setattr(trainer.Trainer, "run", fail)
    assert main([*TINY, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: Permission denied: {tmp_path / 'progress.json.tmp'}\n"
