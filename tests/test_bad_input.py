"""Bad input through the real command lines: exit code 2 and one line on stderr naming the flag.

Every case is refused before JAX compiles anything. Each runs as its own process, forked from one
interpreter that imported JAX, Equinox and Orbax once (tests/fork_cli.py), a few at a time.
"""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from safetensors.numpy import load_file, save_file

from eqx_diloco.lm import _preflight
from eqx_diloco.lm._preflight import RunDirLock, check_memory, check_writable, memory_estimates
from eqx_diloco.lm.config import Config, ConfigError
from eqx_diloco.lm.export import save_model
from eqx_diloco.lm.hf import write_hf
from eqx_diloco.lm.metrics import MetricsLog
from models import Transformer, TransformerConfig

import fork_cli

TINY = TransformerConfig(num_layers=1, dim=16, num_heads=2, mlp_ratio=2)
TRAIN = ("eqx_diloco.train", "--train.steps", "2", "--run-dir", "{tmp}/run")

# (id, argv (module first), extra environment, what the one line must name)
CASES = [
    ("data-path-without-source", [*TRAIN, "--data.path", "{tmp}/file"], {}, "--data.path"),
    ("max-corpus-bytes-0", [*TRAIN, "--data.max-corpus-bytes", "0"], {}, "--data.max-corpus-bytes"),
    ("max-corpus-bytes-negative", [*TRAIN, "--data.max-corpus-bytes", "-1"], {}, "--data.max-corpus-bytes"),
    ("empty-run-dir", ["eqx_diloco.train", "--run-dir", ""], {}, "--run-dir"),
    ("negative-heartbeat", [*TRAIN, "--dist.heartbeat-timeout-s", "-5"], {}, "--dist.heartbeat-timeout-s"),
    ("negative-seed", [*TRAIN, "--train.seed", "-1"], {}, "--train.seed"),
    ("b1-is-1", [*TRAIN, "--train.b1", "1.0"], {}, "--train.b1"),
    ("b1-nan", [*TRAIN, "--train.b1", "nan"], {}, "--train.b1"),
    ("b2-negative", [*TRAIN, "--train.b2", "-0.1"], {}, "--train.b2"),
    ("rope-base-0", [*TRAIN, "--model.rope-base", "0"], {}, "--model.rope-base"),
    ("rope-base-inf", [*TRAIN, "--model.rope-base", "inf"], {}, "--model.rope-base"),
    ("lr-inf", [*TRAIN, "--train.lr", "inf"], {}, "--train.lr"),
    ("text-dev-zero", [*TRAIN, "--data.source", "text", "--data.path", "/dev/zero"], {}, "--data.path"),
    ("text-fifo", [*TRAIN, "--data.source", "text", "--data.path", "{tmp}/fifo"], {}, "--data.path"),
    ("tokens-dev-zero", [*TRAIN, "--data.source", "tokens", "--data.path", "/dev/zero"], {}, "--data.path"),
    ("run-dir-is-a-file", ["eqx_diloco.train", "--run-dir", "{tmp}/file"], {}, "--run-dir"),
    ("run-dir-under-a-file", ["eqx_diloco.train", "--run-dir", "{tmp}/file/run"], {}, "--run-dir"),
    ("checkpoint-dir-is-a-file", [*TRAIN, "--checkpoint.dir", "{tmp}/file"], {}, "--checkpoint.dir"),
    ("checkpoint-dir-under-a-file", [*TRAIN, "--checkpoint.dir", "{tmp}/file/ck"], {}, "--checkpoint.dir"),
    ("more-processes-than-replicas-env", list(TRAIN), {"JAX_NUM_PROCESSES": "3"}, "--diloco.num-replicas"),
    ("process-count-env-not-a-number", list(TRAIN), {"JAX_NUM_PROCESSES": "two"}, "$JAX_NUM_PROCESSES"),
    ("more-processes-than-replicas-flag", [*TRAIN, "--dist.num-processes", "3"], {}, "--diloco.num-replicas"),
    ("huge-eval-sequences", [*TRAIN, "--train.eval-sequences", "100000000"], {}, "--train.eval-sequences"),
    ("huge-batch", [*TRAIN, "--train.batch-size", "100000000"], {}, "--train.batch-size"),
    ("launch-3-processes-2-replicas", ["eqx_diloco.launch", "--num-processes", "3", "--", "--train.steps", "1"], {},
     "--num-processes"),
    ("launch-4-processes-6-replicas",
     ["eqx_diloco.launch", "--num-processes", "4", "--", "--diloco.num-replicas=6"], {}, "--num-processes"),
    ("launch-0-processes", ["eqx_diloco.launch", "--num-processes", "0"], {}, "--num-processes"),
    ("attention-cudnn-on-cpu", [*TRAIN, "--model.attention", "cudnn"], {}, "--model.attention"),
    ("attention-cudnn-float32", [*TRAIN, "--model.attention", "cudnn", "--model.dtype", "float32"], {},
     "--model.attention"),
    ("scan-unroll-negative", [*TRAIN, "--model.scan-unroll", "-1"], {}, "--model.scan-unroll"),
    ("elastic-eager", [*TRAIN, "--elastic.enabled", "--diloco.outer-overlap", "eager"], {}, "--elastic.enabled"),
    ("elastic-ddp", [*TRAIN, "--algorithm", "ddp", "--elastic.enabled"], {}, "--elastic.enabled"),
    ("elastic-keep-1-snapshot", [*TRAIN, "--elastic.enabled", "--elastic.keep-snapshots", "1"], {},
     "--elastic.keep-snapshots"),
    ("elastic-min-replicas-0", [*TRAIN, "--elastic.min-replicas", "0"], {}, "--elastic.min-replicas"),
    ("elastic-one-process-two-replicas", [*TRAIN, "--elastic.enabled"], {}, "--elastic.enabled"),
    ("launch-max-restarts-without-elastic",
     ["eqx_diloco.launch", "--num-processes", "2", "--max-restarts", "1", "--", "--train.steps", "1"], {},
     "--max-restarts"),
    ("launch-elastic-3-processes-2-replicas",
     ["eqx_diloco.launch", "--num-processes", "3", "--", "--elastic.enabled", "--diloco.num-replicas", "2"], {},
     "--num-processes"),
    ("launch-elastic-min-replicas-above-islands",
     ["eqx_diloco.launch", "--num-processes", "2", "--", "--elastic.enabled", "--elastic.min-replicas", "3"], {},
     "--elastic.min-replicas"),
    ("launch-negative-drain", ["eqx_diloco.launch", "--num-processes", "2", "--drain-s", "-1"], {}, "--drain-s"),
    ("init-from-unknown-architecture", [*TRAIN, "--model.init-from", "{tmp}/gpt2"], {}, "--model.init-from"),
    ("init-from-contradicting-dim", [*TRAIN, "--model.init-from", "{tmp}/llama", "--model.dim", "64"], {},
     "--model.dim"),
    ("init-from-missing-tensor", [*TRAIN, "--model.init-from", "{tmp}/llama-no-head"], {}, "--model.init-from"),
    ("export-to-a-folder", ["eqx_diloco.export", "{tmp}/no-run", "{tmp}"], {}, "OUT"),
    ("sample-truncated-model", ["eqx_diloco.sample", "{tmp}/truncated.eqx"], {}, "truncated.eqx"),
    ("sample-random-model", ["eqx_diloco.sample", "{tmp}/random.eqx"], {}, "random.eqx"),
    ("sample-mismatched-metadata", ["eqx_diloco.sample", "{tmp}/mismatched.eqx"], {}, "mismatched.eqx"),
    ("sample-metadata-not-json", ["eqx_diloco.sample", "{tmp}/notjson.eqx"], {}, "notjson.eqx.json"),
    ("sample-invalid-utf8-prompt", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--prompt", b"\xff\xfe"], {},
     "--prompt"),
    ("sample-token-beyond-vocab", ["eqx_diloco.sample", "{tmp}/ids.eqx", "--prompt", "1 300"], {}, "--prompt"),
    ("sample-negative-token", ["eqx_diloco.sample", "{tmp}/ids.eqx", "--prompt", "5 -1"], {}, "--prompt"),
    ("sample-token-not-a-number", ["eqx_diloco.sample", "{tmp}/ids.eqx", "--prompt", "a b"], {}, "--prompt"),
    ("sample-huge-context", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--context", "30000"], {}, "--context"),
    ("sample-temperature-nan", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--temperature", "nan"], {}, "--temperature"),
    ("sample-temperature-inf", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--temperature", "inf"], {}, "--temperature"),
    # NE07: 4 lines of numpy's RuntimeWarning (overflow in the float32 cast) before sampling.
    ("sample-temperature-huge", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--temperature", "1e308"], {}, "--temperature"),
]

# Commands that succeed, run by the same forking runner: it reports what `python -m` would.
GOOD_CASES = [
    ("sample-greedy", ["eqx_diloco.sample", "{tmp}/bytes.eqx", "--prompt", "ab", "--max-new-tokens", "3",
                       "--temperature", "0"], {}),
    ("train-help", ["eqx_diloco.train", "--help"], {}),
]


def _write_models(tmp: Path) -> None:
    model = Transformer(TINY, key=jax.random.key(0))
    save_model(tmp / "bytes.eqx", model, {"seq_len": 16})
    ids = TransformerConfig(**{**TINY.__dict__, "vocab_size": 300})
    save_model(tmp / "ids.eqx", Transformer(ids, key=jax.random.key(0)), {"seq_len": 16})
    raw, meta = (tmp / "bytes.eqx").read_bytes(), (tmp / "bytes.eqx.json").read_text()
    (tmp / "truncated.eqx").write_bytes(raw[: len(raw) // 2])
    (tmp / "random.eqx").write_bytes(os.urandom(len(raw)))
    wider = json.loads(meta)
    wider["model"]["dim"] = 32
    (tmp / "mismatched.eqx").write_bytes(raw)
    (tmp / "mismatched.eqx.json").write_text(json.dumps(wider))
    (tmp / "notjson.eqx").write_bytes(raw)
    (tmp / "notjson.eqx.json").write_text("{ not json")
    for name in ("truncated", "random"):
        (tmp / f"{name}.eqx.json").write_text(meta)
    llama = TransformerConfig(**{**TINY.__dict__, "mlp": "swiglu", "num_kv_heads": 1})
    for name in ("llama", "gpt2", "llama-no-head"):
        write_hf(Transformer(llama, key=jax.random.key(0)), tmp / name)
    (tmp / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    tensors = load_file(tmp / "llama-no-head" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, tmp / "llama-no-head" / "model.safetensors")


def _in(tmp: Path, argv: list) -> list:
    """`argv` with "{tmp}" standing for the cases' folder (bytes arguments as they are)."""
    return [a.replace("{tmp}", str(tmp)) if isinstance(a, str) else a for a in argv]


def _run(argv: list, env: dict, tmp: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *_in(tmp, argv)], env={**os.environ, **env}, cwd=tmp, capture_output=True,
                          timeout=240)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's finished process: forks of one interpreter that imported JAX once (tests/fork_cli.py)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "file").write_text("a regular file\n")
    os.mkfifo(tmp / "fifo")
    _write_models(tmp)
    named = [*((name, argv, env) for name, argv, env, _ in CASES), *GOOD_CASES]
    # Each case its own run folder: cases run a few at a time, and a trainer that gets as far as
    # locking its run folder must not find another case's lock there.
    cases = [(_in(tmp, [a.replace("{tmp}/run", f"{{tmp}}/runs/{name}") if isinstance(a, str) else a for a in argv]),
              env, str(tmp)) for name, argv, env in named]
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("fork_cli.py"))],
                          input=fork_cli.encode(cases).encode(), capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return {name: subprocess.CompletedProcess(argv, rc, out, err)
            for (name, argv, _), (rc, out, err) in zip(named, fork_cli.decode(proc.stdout.decode()))}


# Every case is a process (forked by tests/fork_cli.py): the full suite's. test_cli.py checks the
# flag checks in-process in the fast tier.
@pytest.mark.slow
@pytest.mark.parametrize("name, argv, env, flag", CASES, ids=[c[0] for c in CASES])
def test_refused_with_one_line_naming_the_flag(results, name, argv, env, flag):
    proc = results[name]
    err = proc.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and flag in lines[0], lines[0]


@pytest.mark.slow
def test_the_forking_runner_reports_what_python_m_would(results):
    greedy = results["sample-greedy"]
    assert greedy.returncode == 0, greedy.stderr.decode(errors="replace")
    text = greedy.stdout.decode()
    assert text.startswith("ab") and len(text.encode()) >= 6, text  # the prompt, 3 new bytes, a newline
    help_ = results["train-help"]
    assert help_.returncode == 0 and "--diloco.num-fragments" in help_.stdout.decode()


@pytest.mark.slow
def test_second_trainer_on_a_locked_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir):
        proc = _run(["eqx_diloco.train", "--run-dir", str(run_dir), "--train.steps", "1"], {}, tmp_path)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    assert err.strip().splitlines() == [f"error: --run-dir {run_dir} is in use by another trainer ({holder})"]
    assert not (run_dir / "metrics.jsonl").exists()


def test_run_dir_lock_is_exclusive_and_released(tmp_path, monkeypatch):
    monkeypatch.setattr(_preflight, "_LOCK_RETRY_S", 0.1)  # how long a taker retries a held lock (2 s)
    with RunDirLock(tmp_path / "run"):
        with pytest.raises(ConfigError, match="in use by another trainer"):
            with RunDirLock(tmp_path / "run"):
                pass
    with RunDirLock(tmp_path / "run"):  # released on exit: a new run may take it
        pass


@pytest.mark.slow
def test_lock_of_a_killed_trainer_does_not_block_the_next(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from eqx_diloco.lm._preflight import RunDirLock\n"
                               f"with RunDirLock({str(tmp_path / 'run')!r}):\n print('locked', flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
        with RunDirLock(tmp_path / "run"):
            pass
    holder.kill()
    holder.communicate(timeout=10)  # reaps it and closes the pipe
    with RunDirLock(tmp_path / "run"):
        pass


def test_check_writable_creates_both_folders_and_refuses_files(tmp_path):
    config = Config(run_dir=tmp_path / "a" / "run")
    check_writable(config)
    assert (tmp_path / "a" / "run" / "checkpoints").is_dir()
    assert not list((tmp_path / "a" / "run").glob(".write_check_*"))
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="--run-dir is not a folder"):
        check_writable(Config(run_dir=tmp_path / "f"))


def test_memory_estimate_names_the_flag_that_does_not_fit():
    config = Config()
    need = memory_estimates(config)
    check_memory(config, available=max(need.values()))  # fits exactly: no error
    eval_only = need["--train.eval-sequences"]
    assert eval_only == 4 * config.train.eval_sequences * config.train.seq_len * 2 * config.model.vocab_size
    batch = need["--train.batch-size"]
    with pytest.raises(ConfigError, match="--train.batch-size is too large"):
        check_memory(config, available=batch - 1)
    # Two processes each hold half the replicas.
    assert memory_estimates(config, num_processes=2)["--train.batch-size"] * 2 == batch
    # bfloat16 compute and rematerialisation shrink what a step keeps; the lightest saves least.
    step = lambda **model: memory_estimates(Config(model=TransformerConfig(**model)))["--train.batch-size"]  # noqa: E731
    assert step(dtype="bfloat16") < batch
    assert step(remat="block") < step(remat="dots") < step(remat="none") == batch
    assert step(dtype="auto") == step(dtype="float32")  # host memory: a CPU run computes in float32


def test_metrics_write_null_for_non_finite_numbers(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "per_replica": [1.5, float("-inf")]})
    log.close()

    def refuse(constant):
        raise AssertionError(f"bare {constant} in metrics.jsonl")

    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"step": 1, "loss": None, "grad_norm": None, "per_replica": [1.5, None]}
    assert not math.isnan(record["per_replica"][0])


def test_metrics_log_starts_the_file_again_when_it_is_deleted(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"step": 1})
    (tmp_path / "metrics.jsonl").unlink()
    log.write({"step": 2})
    log.write({"step": 3})
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2, 3]


def test_fresh_start_in_a_used_run_dir_keeps_the_earlier_runs_files(tmp_path):
    from eqx_diloco.lm.metrics import set_aside_earlier_run

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.json").write_text("{}\n")
    assert [p.name for p in set_aside_earlier_run(tmp_path)] == ["metrics.jsonl.1", "config.json.1"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 7}\n')
    (tmp_path / "metrics.jsonl.2").write_text("taken\n")
    assert [p.name for p in set_aside_earlier_run(tmp_path)] == ["metrics.jsonl.3"]
    assert (tmp_path / "metrics.jsonl.1").read_text() == '{"step": 1}\n'
    assert (tmp_path / "metrics.jsonl.3").read_text() == '{"step": 7}\n'
    assert set_aside_earlier_run(tmp_path) == []  # nothing left to keep
