"""What the `auto` choices resolve to on GPU and TPU, checked on CPU through their platform seams."""

import jax.numpy as jnp
import pytest

from models import TransformerConfig
from models._config import AUTO_UNROLL_MAX_LAYERS, compiling_for, target_platform


@pytest.mark.parametrize("layers", [2, 12, AUTO_UNROLL_MAX_LAYERS, AUTO_UNROLL_MAX_LAYERS + 1, 24, 48])
def test_auto_unroll_is_every_layer_on_gpu_and_tpu_and_the_depth_rule_on_cpu(layers):
    config = TransformerConfig(num_layers=layers)
    for platform in ("cuda", "rocm", "tpu"):
        assert config.layers_per_iteration(platform) == layers
    assert config.layers_per_iteration("cpu") == (layers if layers <= AUTO_UNROLL_MAX_LAYERS else 1)
    assert config.layers_per_iteration() == config.layers_per_iteration("cpu")  # this machine


def test_auto_keeps_the_stack_rolled_for_remat_on_gpu_and_tpu():
    """remat saves memory over a rolled stack only (`_fit.least_memory`); the CPU rule is unchanged."""
    for remat in ("block", "dots"):
        config = TransformerConfig(num_layers=12, remat=remat)
        assert config.layers_per_iteration("cuda") == config.layers_per_iteration("tpu") == 1
        assert config.layers_per_iteration("cpu") == 12


def test_explicit_scan_unroll_is_kept_on_every_platform():
    for platform in ("cpu", "cuda", "tpu"):
        assert TransformerConfig(num_layers=24, scan_unroll=1).layers_per_iteration(platform) == 1
        assert TransformerConfig(num_layers=24, scan_unroll=4).layers_per_iteration(platform) == 4
        assert TransformerConfig(num_layers=24, scan_unroll=0).layers_per_iteration(platform) == 24


def test_compiling_for_resolves_auto_choices_as_on_that_platform():
    config = TransformerConfig(num_layers=24, dim=768, num_heads=12)
    assert target_platform() == "cpu"
    assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
        jnp.float32, "xla", 1)
    with compiling_for("cuda"):
        assert target_platform() == "cuda"
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "cudnn", 24)
    with compiling_for("tpu"):
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "xla", 24)
    assert target_platform() == "cpu"


# -- checkpoints by time -------------------------------------------------------------------------

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import json  # noqa: E402

from eqx_diloco.lm._checkpoint_schedule import ACCELERATOR_MINUTES, checkpoint_minutes  # noqa: E402
from eqx_diloco.lm.config import CheckpointConfig, Config, ConfigError, validate  # noqa: E402
from eqx_diloco.lm.trainer import Trainer  # noqa: E402


def test_checkpoints_go_by_time_on_gpu_and_tpu_by_steps_on_cpu_and_as_set():
    default = Config()
    assert checkpoint_minutes(default, "cpu") == 0
    assert checkpoint_minutes(default, "cuda") == checkpoint_minutes(default, "tpu") == ACCELERATOR_MINUTES
    for platform in ("cpu", "tpu"):
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every_minutes=2.5)), platform) == 2.5
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every_minutes=0)), platform) == 0
        assert checkpoint_minutes(Config(checkpoint=CheckpointConfig(every=0, every_minutes=3)), platform) == 0


@pytest.mark.parametrize("minutes", [-1.0, float("inf"), float("nan")])
def test_bad_checkpoint_minutes_are_refused(minutes):
    with pytest.raises(ConfigError, match="--checkpoint.every-minutes must be a finite number >= 0"):
        validate(Config(checkpoint=CheckpointConfig(every_minutes=minutes)))


def _saved_steps(tmp_path, name, every, minutes, capsys):
    from conftest import tiny_config

    config = tiny_config(tmp_path / name, train=dict(steps=6), checkpoint=dict(every=every, keep=10,
                                                                               every_minutes=minutes))
    trainer = Trainer(config, verbose=True)
    trainer.run()
    out = capsys.readouterr().out
    return sorted(int(p.name) for p in trainer.checkpointer.directory.iterdir() if p.name.isdigit()), out


def test_checkpoints_by_time_replace_the_step_schedule(tmp_path, capsys):
    steps, out = _saved_steps(tmp_path, "steps", 2, None, capsys)  # CPU: by steps
    assert steps == [2, 4, 6]
    assert "every 2 steps" in out
    steps, out = _saved_steps(tmp_path, "hours", 2, 1000.0, capsys)  # not a minute passes: only the end's
    assert steps == [6]
    assert "every 1000 minutes (--checkpoint.every-minutes)" in out
    # Every step is that long after the last save: saves at steps the step schedule (100) never reaches.
    # (The clock is read with each step's values, which a save's step has already consumed: every other step.)
    steps, _ = _saved_steps(tmp_path, "often", 100, 1e-9, capsys)
    assert steps == [2, 4, 6]


def test_the_banner_gives_the_size_of_a_checkpoint(make_config):
    trainer = Trainer(make_config(checkpoint=dict(every=5)), verbose=False)
    state_bytes = sum(x.size * x.dtype.itemsize for x in __import__("jax").tree.leaves(trainer.abstract_state))
    [line] = trainer.banner_lines()
    from eqx_diloco.lm._banner import format_bytes

    assert line.startswith(f"  checkpoint   {format_bytes(state_bytes)} each (the whole train state), every 5 steps")
    assert json.dumps(line)  # one line


# -- islands spread over the devices given -------------------------------------------------------

from eqx_diloco.lm import _spread  # noqa: E402
from eqx_diloco.lm._spread import spread_over_devices  # noqa: E402
from eqx_diloco.lm.config import DiLoCoConfig, MeshConfig, TrainConfig  # noqa: E402

GiB = 2**30


def test_a_gpu_node_spreads_its_islands_data_parallel_where_a_replica_fits():
    spread = spread_over_devices(Config(), devices=8, platform="cuda", num_processes=1, device_memory=80 * GiB)
    assert (spread.config.mesh.data, spread.config.mesh.fsdp, spread.per_island, spread.idle) == (4, 1, 4, 0)
    assert spread.lines() == ["  islands      each on 4 devices (--mesh.data 4, data parallel: a replica fits one "
                              "device)"]
    # One island per node of 8 GPUs (examples/slurm/diloco.sbatch: one process per node, no mesh flags).
    spread = spread_over_devices(Config(), devices=8, platform="cuda", num_processes=2, device_memory=80 * GiB)
    assert (spread.config.mesh.data, spread.idle) == (8, 0)


def test_a_replica_too_large_for_one_device_spreads_over_fsdp():
    big = Config(model=TransformerConfig(num_layers=24, dim=2048, num_heads=16, vocab_size=32768))
    spread = spread_over_devices(big, devices=8, platform="tpu", num_processes=2, device_memory=16 * GiB)
    assert (spread.config.mesh.data, spread.config.mesh.fsdp, spread.axis) == (1, 8, "fsdp")
    assert "fsdp: a replica's train state does not fit one device" in spread.lines()[0]


def test_devices_the_batch_cannot_use_are_said_to_be_idle():
    config = Config(train=TrainConfig(batch_size=6))
    spread = spread_over_devices(config, devices=8, platform="tpu", num_processes=1, device_memory=16 * GiB)
    assert (spread.config.mesh.data, spread.idle) == (3, 2)
    assert spread.lines()[1] == ("  idle         2 of this process's 8 devices train nothing (see --mesh.data, "
                                 "--mesh.fsdp and --train.batch-size, which the devices of an island divide)")


def test_mesh_flags_and_the_cpu_are_left_as_they_are():
    given = Config(mesh=MeshConfig(data=2))
    spread = spread_over_devices(given, devices=8, platform="cuda", num_processes=1, device_memory=80 * GiB)
    assert spread.config is given and spread.axis is None and spread.idle == 4
    assert len(spread.lines()) == 1 and "4 of this process's 8 devices train nothing" in spread.lines()[0]
    spread = spread_over_devices(Config(), devices=12, platform="cpu", num_processes=1, device_memory=None)
    assert spread.config == Config() and spread.lines() == []
    # replicas packed onto too few devices: nothing to spread, nothing idle
    spread = spread_over_devices(Config(diloco=DiLoCoConfig(num_replicas=4)), devices=2, platform="cuda",
                                 num_processes=1, device_memory=80 * GiB)
    assert spread.config.mesh == MeshConfig() and spread.lines() == []


def as_accelerator(monkeypatch, device_memory=None, devices=12):
    """The trainer sees this machine's simulated CPU devices as `devices` TPU chips of `device_memory` bytes."""
    monkeypatch.setattr(_spread, "device_facts", lambda: dict(devices=devices, platform="tpu", num_processes=1,
                                                              device_memory=device_memory))


def test_the_trainer_spreads_islands_on_simulated_devices_and_trains_the_same(make_config, monkeypatch):
    config = make_config(train=dict(steps=3), checkpoint=dict(every=0))
    plain = Trainer(config, verbose=False)
    assert plain.mesh.devices.shape == (2, 1, 1, 1) and plain.banner_lines() == []
    plain_summary = plain.run()
    as_accelerator(monkeypatch)
    spread = Trainer(dataclasses.replace(config, run_dir=config.run_dir.parent / "spread"), verbose=False)
    assert spread.mesh.devices.shape == (2, 4, 1, 1)  # 6 devices per island, 4 of them divide the batch of 4
    assert spread.config.mesh.data == 4
    assert spread.banner_lines() == [
        "  islands      each on 4 devices (--mesh.data 4, data parallel: a replica fits one device)",
        "  idle         4 of this process's 12 devices train nothing (see --mesh.data, --mesh.fsdp and "
        "--train.batch-size, which the devices of an island divide)"]
    summary = spread.run()
    np.testing.assert_allclose(summary["eval_loss"], plain_summary["eval_loss"], rtol=1e-5)


# -- fit before the first step --------------------------------------------------------------------

from eqx_diloco.lm._fit import fit_on_device, step_memory  # noqa: E402


def _activation_heavy(make_config):
    return make_config(model=dict(num_layers=4, dim=64, num_heads=2), train=dict(batch_size=8, seq_len=128))


def test_the_step_runs_as_given_where_it_fits_else_with_remat_block_over_a_rolled_stack(make_config):
    config = _activation_heavy(make_config)
    need = step_memory(config)
    block = dataclasses.replace(config, model=dataclasses.replace(config.model, remat="block", scan_unroll=1))
    need_block = step_memory(block)
    assert need_block.total < need.total / 2 and need.state == need_block.state
    fit = fit_on_device(config, need.total, "tpu")
    assert fit.config is config and fit.line.endswith(": fits with --model.remat none")
    fit = fit_on_device(config, need_block.total, "tpu")
    assert fit.config == block
    assert fit.line.startswith("  memory       --model.remat block --model.scan-unroll 1: the step needs")
    assert fit_on_device(config, None, "cpu").line is None  # CPU: nothing checked


def test_a_step_the_compiler_refuses_as_too_large_is_measured_from_its_message(make_config):
    """XLA:TPU refuses, at compile time, a program whose temporaries exceed the chip (seen on a TPU v5e at
    12 x 768, R = 2: the fit check's own compile raised). The check reads the compiler's figure instead."""
    import jax

    from eqx_diloco.lm._fit import refused_temporaries

    config = _activation_heavy(make_config)
    compiled = step_memory(config)
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(29.98G) exceeds available HBM (15.75G).")

    def refuse(lowered):
        raise jax.errors.JaxRuntimeError(message)

    refused = step_memory(config, compile=refuse)
    assert refused.temporaries == int(29.98 * 2**30) == refused_temporaries(jax.errors.JaxRuntimeError(message))
    assert refused.state == compiled.state and refused.total == refused.state + refused.temporaries
    # Measured that way, the step does not fit a 16 GiB device as given, and the lean flags are tried next.
    calls = []

    def measure(c):
        calls.append(c.model.remat)
        return refused if c.model.remat == "none" else compiled

    fit = fit_on_device(config, 16 * 2**30, "tpu", measure=measure)
    assert calls == ["none", "block"] and fit.config.model.remat == "block"
    # Any other compile error is not a measurement: it propagates.
    assert refused_temporaries(jax.errors.JaxRuntimeError("INTERNAL: something else")) is None

    def broken(lowered):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        step_memory(config, compile=broken)


def test_a_step_that_fits_nowhere_says_what_would(make_config):
    config = _activation_heavy(make_config)
    need = step_memory(dataclasses.replace(config, model=dataclasses.replace(config.model, remat="block",
                                                                               scan_unroll=1)))
    memory = need.state + need.temporaries // 3
    with pytest.raises(ConfigError) as error:
        fit_on_device(config, memory, "tpu")
    message = str(error.value)
    assert "\n" not in message and message.startswith("the inner step needs ")
    fsdp = -(-need.total // memory)
    assert f"--mesh.fsdp {fsdp} (devices per island; now 1)" in message
    assert "--train.batch-size 2 (now 8)" in message  # a third of the temporaries: about a third of the batch


def test_the_trainer_checks_the_fit_with_a_device_memory_it_is_given(make_config, monkeypatch):
    as_accelerator(monkeypatch, device_memory=10_000, devices=2)
    with pytest.raises(ConfigError, match=r"^the inner step needs .* per tpu device with --model.remat block --model.scan-unroll 1 "):
        Trainer(make_config(), verbose=False)
    as_accelerator(monkeypatch, device_memory=16 * GiB, devices=2)
    trainer = Trainer(make_config(), verbose=False)
    assert trainer.banner_lines()[0].startswith("  memory       the step needs ")
    assert trainer.banner_lines()[0].endswith("of 17.18 GB per tpu device: fits with --model.remat none")


@pytest.mark.slow  # two processes through the launcher
def test_processes_checkpoint_by_time_on_the_same_steps(tmp_path):
    """Every process saves at the steps the agreed clock picks (a save on one process alone would hang the
    collective save): the run finishes, with saves between the step schedule's."""
    import subprocess
    import sys

    from test_cli import TINY

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--", *TINY, "--run-dir",
               str(run_dir), "--diloco.num-replicas", "2", "--train.steps", "8", "--dist.metrics-lag", "2",
               "--checkpoint.every", "100", "--checkpoint.every-minutes", "1e-9", "--checkpoint.keep", "20"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == 8 and saved[0] < 8, saved  # the step schedule (100) alone saves the end's only
    assert "every 1e-09 minutes (--checkpoint.every-minutes)" in done.stdout
