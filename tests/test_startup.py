"""A newcomer's first run: the setup banner, the persistent compilation cache, the end-of-run
summary text, the help's usage line, export's default output, and benchmarks/startup.py."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import equinox as eqx
import jax
import numpy as np
import pytest

from eqx_diloco.lm._banner import describe_setup, finished_message, format_summary, model_size
from eqx_diloco.lm._cache import (default_cache_dir, enable_compilation_cache, every_process_writes,
                                  let_every_process_write, write_entries_atomically)
from eqx_diloco.lm.config import Config, DiLoCoConfig, MeshConfig
from eqx_diloco.lm.export import main as export_main
from eqx_diloco.lm.train import main as train_main
from models import Transformer, TransformerConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import startup  # noqa: E402

TINY = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
        "--train.batch-size", "4", "--data.source", "synthetic", "--train.eval-sequences", "4",
        "--diloco.sync-period", "2", "--train.warmup-steps", "1"]


@pytest.mark.parametrize("model", [
    TransformerConfig(num_layers=3, dim=64, num_heads=4),
    TransformerConfig(num_layers=2, dim=32, num_heads=2, mlp_ratio=3, vocab_size=300, tie_embeddings=True),
    TransformerConfig(num_layers=2, dim=32, num_heads=2, kind="moe", num_experts=3, top_k=1),
    TransformerConfig(num_layers=2, dim=32, num_heads=4, mlp="swiglu", num_kv_heads=1, qkv_bias=True, ffn_dim=40),
], ids=["dense", "tied", "moe", "llama"])
def test_model_size_counts_every_parameter(model):
    """The size the banner states from the config alone equals the built model's arrays."""
    config = Config(model=model)
    arrays = jax.tree.leaves(eqx.filter(Transformer(model, key=jax.random.key(1)), eqx.is_array))
    assert model_size(config) == (sum(a.size for a in arrays), sum(a.nbytes for a in arrays))


@pytest.mark.slow
def test_the_cli_and_the_package_import_without_jax():
    """So the setup is printed before JAX's import (seconds) starts."""
    code = ("import sys, eqx_diloco, eqx_diloco.lm.train, eqx_diloco.lm._banner, models; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))[:5]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_describe_setup_names_the_run():
    config = Config(diloco=DiLoCoConfig(num_fragments=4, overlap_steps=1, quantize="int4"), run_dir=pathlib.Path("r/x"))
    text = describe_setup(config)
    count, nbytes = model_size(config)
    assert text.splitlines()[0] == ("eqx_diloco: Streaming DiLoCo, R=2 replicas, H=20, P=4 fragments, tau=1, "
                                   "quantize int4")
    assert f"{count / 1e6:.2f}M parameters" in text and "6 layers, width 128" in text
    assert "mesh         diloco=2 x data=1" in text and "(2 of them communication devices" in text
    assert "2 x 8 sequences x 128 tokens = 2,048 tokens/step, 200 steps" in text
    assert "run dir      r/x" in text and "every 100 steps in r/x/checkpoints" in text
    assert "eqx_diloco: DDP" in describe_setup(Config(algorithm="ddp"))
    off = describe_setup(dataclasses.replace(config, compile_cache=False))
    assert "persistent cache off" in off
    assert "  compute      float32 matmuls, float32 parameters; xla attention; remat none; all layers unrolled" in text
    deep = describe_setup(dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=24)))
    assert "remat none; scan unroll 1" in deep  # scan_unroll auto keeps stacks deeper than 16 layers rolled
    shared = describe_setup(Config(mesh=MeshConfig(replicas_per_device=2)))
    assert "mesh         diloco=2 x data=1, 2 replicas per device (vmapped)" in shared
    # More replicas than devices (tests/conftest.py gives 12): packed two per device, and said so.
    packed = describe_setup(Config(diloco=DiLoCoConfig(num_replicas=24)))
    assert "packing      2 replicas per device (vmapped), too few devices for one each" in packed


@pytest.fixture
def jax_cache_writer(monkeypatch):
    """JAX's own cache writer for the test (whatever an earlier test installed), restored afterwards."""
    from jax._src import compiler

    writer = compiler._cache_write
    monkeypatch.setattr(compiler, "_cache_write", getattr(writer, "jax_writer", writer))
    return compiler


def test_the_cache_line_says_whether_other_cpu_processes_compile_every_run(monkeypatch, jax_cache_writer):
    one = [line for line in describe_setup(Config()).splitlines() if line.startswith("  compilation")]
    assert one == [f"  compilation  cached in {jax.config.jax_compilation_cache_dir}"]
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as process 0 of two sees it
    two = [line for line in describe_setup(Config()).splitlines() if line.startswith("  compilation")]
    assert two == [f"  compilation  cached in {jax.config.jax_compilation_cache_dir} (read back by process 0 only: "
                   "on CPU the other processes compile every run)"]
    assert let_every_process_write()  # what a multi-process CPU run does once it has joined
    two = [line for line in describe_setup(Config()).splitlines() if line.startswith("  compilation")]
    assert two == one


@pytest.mark.parametrize("every_process", [False, True])
def test_a_process_other_than_0_writes_its_programs_only_where_every_process_may(monkeypatch, jax_cache_writer,
                                                                               every_process):
    from jax._src import distributed

    if every_process:
        assert let_every_process_write() and every_process_writes()
    monkeypatch.setattr(distributed.global_state, "process_id", 1)  # as process 1 of a run sees itself
    cache = pathlib.Path(jax.config.jax_compilation_cache_dir)
    before = set(cache.iterdir())
    unique = int.from_bytes(os.urandom(3), "little")  # a program no earlier run compiled

    def program(x):
        return x * float(unique) + 1.0

    # Its own name, so an entry another test's thread writes meanwhile is not taken for it.
    program.__name__ = program.__qualname__ = f"startup_probe_{unique}"
    jax.block_until_ready(jax.jit(program)(jax.numpy.ones(3)))
    written = {f for f in set(cache.iterdir()) - before if f.name.startswith(f"jit_startup_probe_{unique}")}
    assert bool(written) == every_process


@pytest.mark.slow  # a whole CLI run in-process (about 4 s)
def test_cli_prints_the_banner_first_and_writes_its_phases(tmp_path, capsys):
    assert train_main([*TINY, "--train.steps", "2", "--checkpoint.every", "0", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("eqx_diloco: DiLoCo, R=2 replicas, H=2")
    assert any(line.startswith("  compilation  cached in ") for line in out[:10])
    # Where the time went (this test's process started long before: only the order is checked).
    record = json.loads((tmp_path / "r" / "phases" / "process-0.json").read_text())
    marks, names = record["marks"], [m["phase"] for m in record["marks"]]
    assert names[0] == "python and the flag parser imported" and names[-1] == "checkpoint written, logs closed"
    assert "first sync dispatched" in names and "first step compiled and dispatched" in names
    assert names.index("first step done") > names.index("first step compiled and dispatched")
    assert record["started_unix"] + marks[-1]["s"] <= time.time()  # the process's start on the wall clock
    assert [m["s"] for m in marks] == sorted(m["s"] for m in marks)


def test_help_usage_names_the_module(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    out = capsys.readouterr().out
    assert "python -m eqx_diloco.train" in out.split("\n\n")[0] or "usage: python -m eqx_diloco.train" in out
    assert "--no-compile-cache" in out and str(REPO) not in out.split("\n\n")[0]


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "eqx_diloco" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == pathlib.Path.home() / ".cache" / "eqx_diloco" / "jax"


def test_cache_off_changes_nothing():
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache(Config(compile_cache=False)) is None
    assert jax.config.jax_compilation_cache_dir == before


def test_a_reader_of_the_cache_finds_no_entry_or_the_whole_one(tmp_path):
    # JAX alone writes an entry in place: a reader polling for it got a truncated entry on every one of
    # 8 keys of 32 MB here. With the entries renamed into place, every read is whole.
    from jax._src import lru_cache

    assert write_entries_atomically()
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    value = os.urandom(32 << 20)
    keys = [f"key{i}" for i in range(8)]
    read_sizes = []

    def read_each_key_once_it_appears():
        for key in keys:
            while (entry := cache.get(key)) is None:
                pass
            read_sizes.append(len(entry))

    reader = threading.Thread(target=read_each_key_once_it_appears)
    reader.start()
    for key in keys:
        cache.put(key, value)
    reader.join(timeout=60)
    assert read_sizes == [len(value)] * len(keys)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{key}-cache" for key in keys)  # no temporaries
    cache.put(keys[0], b"other")  # the first entry of a key stays, as with JAX's own writer
    assert cache.get(keys[0]) == value


def _fresh_python(code: str, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cache_is_written_to_the_per_user_folder_and_read_back(tmp_path):
    code = """
        import jax, jax.numpy as jnp
        from eqx_diloco.lm._cache import enable_compilation_cache
        from eqx_diloco.lm.config import Config
        hits = []
        jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
        print(enable_compilation_cache(Config()))
        jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()
        print(f"hits {len(hits)}")
    """
    first = _fresh_python(code, {"XDG_CACHE_HOME": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    folder = tmp_path / "eqx_diloco" / "jax"
    assert first.stdout.splitlines()[0] == str(folder)
    entries = sorted(p.name for p in folder.iterdir())
    assert any(name.startswith("jit_") for name in entries), entries
    assert first.stdout.splitlines()[1] == "hits 0"
    # A second process loads the programs from the cache instead of compiling them again.
    second = _fresh_python(code, {"XDG_CACHE_HOME": str(tmp_path)})
    assert second.returncode == 0, second.stderr
    assert int(second.stdout.splitlines()[1].split()[1]) >= 1, second.stdout
    # A folder of the user's own (JAX's variable) caches small programs too (JAX's default minimum is 1 s).
    own = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "own")}
    assert _fresh_python(code, own).stdout.splitlines()[1] == "hits 0"
    assert int(_fresh_python(code, own).stdout.splitlines()[1].split()[1]) >= 1
    off = _fresh_python(code.replace("Config()", "Config(compile_cache=False)"), {"XDG_CACHE_HOME": str(tmp_path / "off")})
    assert off.returncode == 0 and off.stdout.splitlines()[0] == "None"
    assert not (tmp_path / "off").exists()


def test_format_summary():
    config = Config(run_dir=pathlib.Path("runs/a b"))
    param_bytes = model_size(config)[1]
    text = format_summary({"step": 200, "eval_loss": 2.2524, "sent_bytes": 10 * param_bytes,
                           "wall_time_s": 92.04}, config)
    lines = text.splitlines()
    assert lines[0] == ("done: 200 steps in 92.0 s, 409,600 tokens; final eval loss 2.2524 "
                        "(global model, held-out data)")
    assert "DDP would have sent" in text and "(20x more)" in text
    assert "runs/a b/metrics.jsonl" in text and "checkpoints  runs/a b/checkpoints" in text
    assert "python -m eqx_diloco.plot 'runs/a b' --out 'runs/a b/loss.png'" in text
    assert "python -m eqx_diloco.export 'runs/a b'" in text
    assert "python -m eqx_diloco.sample 'runs/a b/model.eqx' --prompt \"def \"" in text
    assert "--train.steps 400" in text
    # No checkpoints: nothing to export, so no export command.
    no_ck = format_summary({"step": 5, "sent_bytes": 0, "tokens": 7, "ddp_bytes": 100},
                           dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, every=0)))
    assert "eqx_diloco.export" not in no_ck and "checkpoints" not in no_ck and "done: 5 steps, 7 tokens" in no_ck
    ddp = format_summary({"step": 3, "sent_bytes": 3 * param_bytes}, Config(algorithm="ddp"))
    assert "DDP would have sent" not in ddp and "a float32 gradient every step" in ddp
    again = finished_message(config, 200)
    assert "already finished at step 200" in again and "--train.steps 400" in again and "'runs/a b'" in again


def test_export_defaults_into_the_run_folder(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    assert train_main([*TINY, "--train.steps", "2", "--checkpoint.every", "2", "--run-dir", str(run)]) == 0
    assert export_main([str(run)]) == 0
    assert (run / "model.eqx").is_file() and (run / "model.eqx.json").is_file()
    assert not (tmp_path / "model.eqx").exists()
    assert f"to {run / 'model.eqx'}" in capsys.readouterr().out


def test_startup_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "startup.json"
    out.write_text("{}")
    assert startup.main(["--quick", "--out", str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.slow
def test_startup_benchmark_quick(tmp_path):
    out = tmp_path / "startup.json"
    assert startup.main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    [run] = result["runs"]
    assert run["name"] == "tiny" and run["cache_entries"] > 0
    assert 0 < run["banner_cold_s"] < run["cold_s"] and 0 < run["warm_s"][0]
    assert run["speedup"] == pytest.approx(run["cold_s"] / run["warm_median_s"], abs=0.01)
    assert "| cold: s to step 1 |" in (tmp_path / "startup.md").read_text()


def test_each_phase_is_timed_from_process_start_and_written_per_process(tmp_path):
    from eqx_diloco.lm._phases import Phases

    phases = Phases()
    assert phases.since_process_start  # Linux: /proc gives the process's start
    phases.mark("a")
    phases.mark("b")
    phases.mark("a")  # the first end counts
    names = [name for name, _ in phases.marks]
    assert names == ["a", "b"] and 0 < phases.marks[0][1] <= phases.marks[1][1]
    phases.write(tmp_path, process=1)
    record = json.loads((tmp_path / "phases" / "process-1.json").read_text())
    assert [m["phase"] for m in record["marks"]] == ["a", "b"]


def test_the_breakdown_table_gives_each_phases_own_length():
    from benchmarks.startup_breakdown import markdown, own_lengths, summarize

    def run(wall, *ends):
        marks = [{"phase": name, "s": s} for name, s in zip(["imports", "compile", "done"], ends)]
        return {"wall_s": wall, "phases": {"process-0": marks}}

    assert own_lengths(run(5, 1.0, 3.5, 4.0)["phases"]["process-0"]) == {"imports": 1.0, "compile": 2.5, "done": 0.5}
    warm = summarize([run(5.0, 1.0, 3.0, 4.0), run(7.0, 1.0, 5.0, 6.0)])
    assert warm["wall_s"] == 6.0 and warm["phases"]["process-0"] == {"imports": 1.0, "compile": 3.0, "done": 1.0,
                                                                      "exit": 1.0}
    result = {"what": "w", "revision": "r", "steps": 4, "repeats": 2, "load_average": [0.1],
              "layouts": {"1 process": {"cold": summarize([run(9.0, 2.0, 7.0, 8.0)]), "warm": warm}}}
    text = markdown(result)
    assert "| compile | 5.00 | 3.00 |" in text and "| **whole run, start to exit** | **9.00** | **6.00** |" in text


def test_a_process_waits_for_its_coordinator_to_listen_before_joining():
    """Processes other than 0 poll the coordinator's port before `jax.distributed.initialize`: asked too early,
    gRPC refuses and tries again only after its one-second back-off, which every launched run paid."""
    import socket
    import threading

    from eqx_diloco.lm._devices import wait_until_reachable

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address, listening = f"127.0.0.1:{port}", threading.Event()
    server = socket.socket()

    def listen_later():
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.set()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        assert not listening.is_set() and wait_until_reachable(address, timeout_s=30) and listening.is_set()
    finally:
        server.close()
    assert not wait_until_reachable(address, timeout_s=0.2)  # nobody listens any more: gives up, returns False



def test_small_models_build_their_state_with_unoptimised_programs_on_cpu(monkeypatch):
    """The programs that run once (the model's and the state's initialisation) compile at LLVM level 0 with
    XLA:CPU's older fusion emitters while parameters x runs stay within the budget; beyond it, and on
    accelerators, XLA's defaults. The model built that way matches the optimised build to float32 rounding."""
    from eqx_diloco._rare_programs import UNOPTIMISED_BUDGET, rare_program_options
    from eqx_diloco.lm import _core

    unoptimised = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
    assert rare_program_options(1000, backend="cpu") == unoptimised
    assert rare_program_options(1000, runs=UNOPTIMISED_BUDGET // 1000, backend="cpu") == unoptimised
    assert rare_program_options(1000, runs=UNOPTIMISED_BUDGET // 1000 + 1, backend="cpu") is None
    assert rare_program_options(UNOPTIMISED_BUDGET + 1, backend="cpu") is None
    assert rare_program_options(1000, backend="gpu") is None and rare_program_options(1000, backend="tpu") is None
    config = TransformerConfig(vocab_size=64, dim=32, num_layers=2, num_heads=2)
    asked = []
    monkeypatch.setattr(_core, "rare_program_options", lambda n: asked.append(n) or rare_program_options(n))
    key = jax.random.key(3)
    fast, optimised = _core.new_model(config, key), _core._model_builder(())(config, key)
    assert asked == [config.num_params()]
    for a, b in zip(jax.tree.leaves(eqx.filter(fast, eqx.is_array)), jax.tree.leaves(eqx.filter(optimised, eqx.is_array))):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_the_trainer_compiles_its_syncs_unoptimised_while_the_runs_syncs_stay_within_the_budget():
    """The syncs (and theta_g's finite check) run once a sync: unoptimised on CPU while the run's syncs
    (steps / H, plus the final one) times the model's parameters stay within the budget."""
    from eqx_diloco._rare_programs import UNOPTIMISED_BUDGET, rare_program_options
    from eqx_diloco.lm._core import sync_options
    from eqx_diloco.lm._finite import finite_check
    from eqx_diloco.lm.trainer import Trainer

    config = Config()  # the default model, 200 steps, H = 20: 11 syncs
    num_params = config.model.num_params()
    assert 11 * num_params <= UNOPTIMISED_BUDGET < 2000 // 20 * num_params
    assert sync_options(config) == rare_program_options(num_params, runs=11) is not None
    long = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2000))
    assert sync_options(long) is None
    small = dataclasses.replace(config, model=TransformerConfig(vocab_size=256, dim=32, num_layers=2, num_heads=2),
                                run_dir=pathlib.Path("unused"))
    trainer = Trainer(small, verbose=False)
    assert trainer.core.sync_compiler_options == sync_options(small) is not None
    assert trainer.theta_finite is finite_check(sync_options(small)) is trainer.global_finite


@pytest.mark.parametrize("sync", [dict(num_fragments=1, sync_period=3),
                                  dict(num_fragments=2, sync_period=4, overlap_steps=1, alpha=0.5),
                                  dict(num_fragments=1, sync_period=3, outer_overlap="eager")],
                         ids=["blocking", "streaming-tau1", "eager"])
def test_syncs_compiled_unoptimised_compute_what_optimised_syncs_do(sync):
    """`sync_compiler_options` reaches every sync program (blocking, streamed and overlapped), and training
    through unoptimised syncs ends where training through XLA's defaults does."""
    import optax
    from custom_model import StackedMLP, loss_fn, make_batch
    from eqx_diloco import DiLoCo
    from eqx_diloco._rare_programs import rare_program_options

    model = StackedMLP(key=jax.random.key(0))

    def train(options):
        diloco = DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, inner_optimizer=optax.adam(1e-2),
                        sync_compiler_options=options, **sync)
        state = diloco.init(model)
        for step in range(2 * sync["sync_period"] + 1):
            state, _ = diloco.step(state, make_batch(step, 2))
        return diloco.settle(state)[0]

    unoptimised, optimised = train(rare_program_options(1000)), train(None)
    for a, b in zip(jax.tree.leaves((unoptimised.global_params, unoptimised.params)),
                    jax.tree.leaves((optimised.global_params, optimised.params)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(jax.errors.JaxRuntimeError, match="no_such_option"):  # the options reach the syncs' compiles
        train({"no_such_option": 1})


def test_sync_compiler_options_must_be_a_dict():
    import optax
    from custom_model import loss_fn
    from eqx_diloco import ConfigError, DiLoCo

    with pytest.raises(ConfigError, match=r"^sync_compiler_options must be a dict of XLA compiler options, or None "
                                          r"\(got 'O0'\)$"):
        DiLoCo(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=2, sync_period=3,
               inner_optimizer=optax.adam(1e-2), sync_compiler_options="O0")


def test_the_finite_check_compiled_unoptimised_finds_what_the_optimised_one_does():
    import jax.numpy as jnp

    from eqx_diloco._rare_programs import rare_program_options
    from eqx_diloco.lm._finite import _all_finite, all_finite, finite_check

    unoptimised = finite_check(rare_program_options(1000))
    assert unoptimised is finite_check(rare_program_options(10)) and unoptimised is not finite_check(None)
    optimised = jax.jit(_all_finite)
    for tree in [{"a": jnp.ones(3), "b": jnp.zeros((2, 2))}, {"a": jnp.array([1.0, jnp.nan]), "n": jnp.arange(3)},
                 {"a": jnp.array([jnp.inf]), "b": jnp.ones(2)}, {"n": jnp.arange(2)}]:
        assert bool(all_finite(tree)) == bool(unoptimised(tree)) == bool(optimised(tree)) == all(
            bool(np.all(np.isfinite(x))) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact))


@pytest.mark.slow  # a fresh interpreter
def test_a_run_without_checkpoints_never_imports_orbax(tmp_path):
    """orbax costs a fifth of a second to import: a fresh run looks for checkpoints without it (an empty or
    missing folder), and imports it at its first save or restore."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "3.corrupt").mkdir()  # moved aside: not a checkpoint
    code = f"""
        import sys
        import eqx_diloco.lm.trainer
        from eqx_diloco._checkpoint import Checkpointer
        for folder in ("missing", "empty"):
            assert Checkpointer({str(tmp_path)!r} + "/" + folder, every=10, keep=1).steps() == []
        print("orbax.checkpoint" in sys.modules)
    """
    out = _fresh_python(code, {})
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]


@pytest.mark.slow  # a trainer process
def test_a_finished_run_exits_with_its_exit_handlers_run_and_its_output_flushed(tmp_path):
    """The trainer leaves with os._exit (skipping the interpreter's teardown), but only after what a
    normal exit does: other threads joined, every atexit handler run, the streams flushed."""
    marker = tmp_path / "handler_ran"
    program = textwrap.dedent(f"""
        import atexit, os, sys, threading, time
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        def late():  # still running when the trainer returns: written only if the exit joins it
            while not os.path.exists({str(tmp_path / "run" / "phases" / "process-0.json")!r}):
                time.sleep(0.05)
            time.sleep(1.0)
            open({str(marker)!r} + ".thread", "w").write("joined")
        threading.Thread(target=late).start()
        sys.argv = ["eqx_diloco.train", *{[*TINY, "--train.steps", "4", "--run-dir", str(tmp_path / "run")]!r}]
        print("before the trainer", end="")  # no newline: flushed only at exit
        from eqx_diloco.lm.train import entry
        entry()
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.read_text() == "ran" and pathlib.Path(f"{marker}.thread").read_text() == "joined"
    assert "before the trainer" in proc.stdout and "metrics" in proc.stdout
