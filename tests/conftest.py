import contextlib
import dataclasses
import os
import tempfile
from pathlib import Path

import jax

# Tests check values, not speed: XLA's CPU backend without LLVM optimization, and with its older
# (non-MLIR) fusion emitters, compiles the many small test programs faster (the first took about a
# sixth off the fast tier; the second then over a third of its CPU time, and a fifth of the full
# suite's: benchmarks/results/test_suite.txt). Set before the backend starts; subprocesses inherit them.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                    "--xla_cpu_use_fusion_emitters=false"]).strip()
# Simulated CPU devices for the ("diloco", "data") mesh; must be set before JAX starts.
jax.config.update("jax_num_cpu_devices", 12)
# Every implicit dtype promotion is a bug in this code base: make it an error in tests.
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Likewise implicit rank promotion (broadcasting (n,) against (m, n) without saying so), as in Equinox's tests.
jax.config.update("jax_numpy_rank_promotion", "raise")
# Many tests build trainers of the same tiny shapes, and subprocess tests start the same
# programs again: one persistent compilation cache for the session (and its subprocesses)
# compiles each program once. A cache hit is the same executable, so results are unchanged.
_cache = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="eqx_diloco_test_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Several workers (and their subprocesses) share that folder and often compile one program at once.
from eqx_diloco.lm._cache import write_entries_atomically  # noqa: E402

assert write_entries_atomically(), "this JAX's persistent cache is not the one eqx_diloco's cache writer expects"

# A cluster manager's variables (a CI job started by srun or mpirun) would make every trainer run in these
# tests join that job; tests/cluster_jobs.py sets them where a test means to.
for _name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "PMIX_"))]:
    del os.environ[_name]

import pytest  # noqa: E402

from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, MeshConfig, TrainConfig  # noqa: E402
from models import TransformerConfig  # noqa: E402


def tiny_config(run_dir: Path, *, algorithm="diloco", model=None, diloco=None, train=None, data=None, mesh=None,
                checkpoint=None) -> Config:
    """A config small enough to compile and run in a few seconds on 2 CPU cores."""
    base_model = TransformerConfig(num_layers=2, dim=32, num_heads=2, mlp_ratio=2)
    base_train = TrainConfig(steps=8, batch_size=4, seq_len=16, lr=1e-2, warmup_steps=2, log_every=1,
                             eval_every=0, eval_sequences=4)
    return Config(
        algorithm=algorithm,
        run_dir=run_dir,
        model=dataclasses.replace(base_model, **(model or {})),
        # The papers' outer optimizer (not the CLI default): tests then exercise the outer momentum.
        diloco=dataclasses.replace(DiLoCoConfig(num_replicas=2, sync_period=2, outer_lr=0.7, outer_momentum=0.9),
                                   **(diloco or {})),
        train=dataclasses.replace(base_train, **(train or {})),
        data=dataclasses.replace(DataConfig(source="synthetic"), **(data or {})),
        mesh=dataclasses.replace(MeshConfig(), **(mesh or {})),
        checkpoint=dataclasses.replace(CheckpointConfig(every=0), **(checkpoint or {})),
    )


@pytest.fixture
def make_config(tmp_path):
    return lambda **kw: tiny_config(tmp_path / "run", **kw)


# -- scheduling on xdist workers (`-n 3 --dist loadfile`) ----------------------------------
# Three workers on 2 cores: many slow tests wait on processes that sleep or start (launcher
# supervision, kills and restarts), and a third worker keeps the cores busy meanwhile (the full
# suite 820 s against 919 s with two; benchmarks/results/test_suite.txt).
# xdist hands out whole files in collection order, by default reordered to "most tests first",
# which put the longest files (a few tests of a minute or more each) last, one worker finishing
# them alone. Longest first instead (measured on the 2-core machine, see
# benchmarks/results/test_suite.txt): the short files then fill in at the end. Only the order
# of files changes; every test still runs, and tests within a file keep their order.
SLOW_FILES_FIRST = (
    "test_elastic.py",  # with test_multiprocess.py, on one worker one after the other (their many processes)
    "test_outer_sweep.py",
    "test_memory.py",  # two compiles of a 1.3B-parameter step
    "test_multiprocess.py",
    "test_clusters.py",  # jobs of 2 and 4 processes under emulated SLURM and Open MPI
    "test_checkpoint.py",
    "test_eager_benchmark.py",
    "test_trainer_hardening.py",
    "test_acceptance_benchmark.py",
    "test_decoupled.py",  # a launcher run with an island and the syncer killed
    "test_quantized_sync.py",
    "test_benchmarks.py",
    "test_benchmark_outputs.py",
    "test_equivalence.py",
)


def pytest_configure(config):
    if getattr(config.option, "loadscopereorder", None):  # xdist's "most tests first": ours instead
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    # Known-slow files first, in the order above; then the rest by number of tests, as xdist would.
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -counts[item.path.name]))


# -- the fast tier ---------------------------------------------------------------------------
# `pytest -m "not slow"` is the inner loop: it starts no process. A test not marked slow that
# tries to is an error, so the tier cannot silently grow slow again.


class SubprocessInFastTest(RuntimeError):
    pass


@contextlib.contextmanager
def _refusing_processes(nodeid: str):
    def refuse(*args, **kwargs):
        raise SubprocessInFastTest(f"{nodeid} starts a process: mark it @pytest.mark.slow")

    import subprocess

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "posix_spawn", refuse, raising=False)
        yield


@pytest.fixture(autouse=True)
def _no_subprocess_in_fast_tests(request):
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    with _refusing_processes(request.node.nodeid):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """The same rule for module- and session-scoped fixtures, which are set up before the
    autouse fixture above: one first set up for a fast test may not start a process either."""
    item = getattr(request, "_pyfuncitem", None)  # the test whose setup needs the fixture
    if fixturedef.scope == "function" or item is None or item.get_closest_marker("slow") is not None:
        yield
        return
    with _refusing_processes(item.nodeid):
        yield
