"""Syncs on the host's CPU devices (`comm_device="host"`), tested on CPU with compute and exchange on
separate device sets: `_host.host_devices` (the seam that says which devices are the host's) is
pointed at the last simulated CPU devices, the compute mesh takes the first ones."""

import dataclasses
import logging
import sys
import threading
import types
from concurrent.futures import Future

import jax
import numpy as np
import optax
import pytest

from custom_model import StackedMLP, loss_fn, make_batch
from eqx_diloco import ConfigError, DiLoCo, _host, _outer
from eqx_diloco._host import sync_placement
from eqx_diloco._mesh import _island_over_processes, build_meshes
from eqx_diloco.lm import Trainer
from eqx_diloco.lm._banner import sync_lines
from util import train_losses

R = 2


@pytest.fixture
def host_is_the_last_devices(monkeypatch):
    """The host's CPU devices are the last R of the process (compute takes the first ones)."""
    last = sorted(jax.devices("cpu"), key=lambda d: d.id)[-R:]
    monkeypatch.setattr(_host, "host_devices", lambda process, taken=frozenset(): [d for d in last if d not in taken])
    return last


def _core(**overrides):
    kwargs = dict(loss_fn=loss_fn, layers=lambda m: m.blocks, num_replicas=R, sync_period=6,
                  inner_optimizer=optax.adam(1e-2), outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    return DiLoCo(**{**kwargs, **overrides})


def _train(diloco, steps):
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    losses = []
    for step in range(steps):
        state, metrics = diloco.step(state, make_batch(step, R))
        losses.append(np.asarray(metrics["loss"]))
    state, _ = diloco.settle(state)
    return np.stack(losses), jax.device_get(state), diloco.global_model(state)


CASES = {
    "streaming-p3-tau1": dict(num_fragments=3, overlap_steps=1, alpha=0.5),
    "streaming-tau2-int8-ef": dict(num_fragments=2, overlap_steps=2, quantize="int8", error_feedback=True),
    "eager-p3": dict(outer_overlap="eager", num_fragments=3),
    "delayed": dict(outer_overlap="delayed"),
    # Both replicas vmapped on one compute device, their sync on one host device.
    "streaming-two-replicas-per-device": dict(num_fragments=3, overlap_steps=1, replicas_per_device=2),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n not in ("streaming-p3-tau1", "eager-p3")
                                  else n for n in CASES])
def test_host_syncs_equal_syncs_on_the_compute_devices(name, host_is_the_last_devices, monkeypatch):
    """Bit for bit: losses, the whole state and the global model, over two rounds and a bit; every
    launched sync is copied to the host's devices by the handoff thread, not by the caller."""
    copied_by = []
    move = _outer.move_to_mesh

    def recording(tree, src, dst):
        copied_by.append((threading.current_thread().name, set(dst.devices.flat) <= set(host_is_the_last_devices)))
        return move(tree, src, dst)

    for module in ("eqx_diloco._outer", "eqx_diloco._eager"):
        monkeypatch.setattr(sys.modules[module], "move_to_mesh", recording)
    on_host = _core(comm_device="host", **CASES[name])
    on_compute = _core(comm_device="off", **CASES[name])
    assert on_host.sync_on_host and on_compute.comm_mesh is None
    rows = R // CASES[name].get("replicas_per_device", 1)
    assert set(on_host.comm_mesh.devices.flat) == set(host_is_the_last_devices[:rows])
    got, want = _train(on_host, 14), _train(on_compute, 14)
    np.testing.assert_array_equal(got[0], want[0])
    for x, y in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
        np.testing.assert_array_equal(x, y)
    to_host = [thread for thread, onto_host in copied_by if onto_host]
    assert to_host and set(to_host) == {"eqx_diloco-host-sync"}


def test_a_launch_returns_before_its_values_reach_the_host(host_is_the_last_devices, monkeypatch):
    """The caller gets a Future at once, while the copy to the host waits (here: for a release)."""
    release, move = threading.Event(), _outer.move_to_mesh

    def held(tree, src, dst):
        if set(dst.devices.flat) == set(host_is_the_last_devices):
            assert release.wait(30)
        return move(tree, src, dst)

    monkeypatch.setattr(_outer, "move_to_mesh", held)
    diloco = _core(comm_device="host", num_fragments=3, overlap_steps=1)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    for step in range(2):  # fragment 0 syncs after step 2
        state, _ = diloco.step(state, make_batch(step, R))
    in_flight = diloco._sync_groups[0].in_flight
    assert isinstance(in_flight.launched, Future) and not in_flight.launched.done()
    release.set()
    state, _ = diloco.step(state, make_batch(2, R))  # merged after step 3: the result arrived
    assert diloco._sync_groups[0].in_flight is None
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state.params)))


@pytest.mark.parametrize("mode,overrides", [("none", dict(num_fragments=2, overlap_steps=2)), ("eager", {})])
def test_host_install_programs_compile_on_the_handoff_thread(mode, overrides, host_is_the_last_devices, caplog):
    """The install of an arriving sync is compiled ahead, by the handoff thread: never by the caller."""
    diloco = _core(comm_device="host", outer_overlap=mode, **overrides)
    state = diloco.init(StackedMLP(key=jax.random.key(0)))
    jax.config.update("jax_log_compiles", True)  # for every thread (`jax.log_compiles()` is for this one)
    try:
        with caplog.at_level(logging.WARNING):
            for step in range(13):
                state, _ = diloco.step(state, make_batch(step, R))
            state, _ = diloco.settle(state)
    finally:
        jax.config.update("jax_log_compiles", False)
    threads = {r.threadName for r in caplog.records if "Compiling jit(install)" in r.getMessage()}
    assert threads == {"eqx_diloco-host-sync"}


def test_auto_means_host_on_an_accelerator_and_communication_devices_on_cpu():
    assert sync_placement("auto", "cpu") == "on"
    assert sync_placement("auto", "gpu") == sync_placement("auto", "tpu") == "host"
    assert [sync_placement(c, "gpu") for c in ("on", "host", "off")] == ["on", "host", "off"]


def test_host_on_a_cpu_backend_takes_the_devices_compute_leaves():
    mesh, comm_mesh = build_meshes(R, comm_device="host")
    compute = set(mesh.devices.flat)
    assert len(compute) == R and comm_mesh.devices.shape == (R, 1, 1, 1)
    assert set(comm_mesh.devices.flat) == set(_host.host_devices(0, frozenset(compute))[:R])
    assert set(comm_mesh.devices.flat).isdisjoint(compute)


def test_host_without_enough_cpu_devices_is_refused_in_one_line(monkeypatch):
    one = sorted(jax.devices("cpu"), key=lambda d: d.id)[-1:]
    monkeypatch.setattr(_host, "host_devices", lambda process, taken=frozenset(): one)
    with pytest.raises(ConfigError, match=r"^comm_device host needs 2 CPU devices per process beside the compute "
                                          r"devices .* process 0 has 1; call eqx_diloco.use_cpu_devices\(n\)") as e:
        _core(comm_device="host", num_fragments=3, overlap_steps=1)
    assert "\n" not in str(e.value)


def test_host_where_an_island_spans_processes_is_refused_in_one_line():
    devices = sorted(jax.devices("cpu"), key=lambda d: d.id)
    with pytest.raises(ConfigError, match=r"^comm_device host needs whole islands per process \(each island spans 2 "
                                          r"processes\)"):
        _island_over_processes([devices[:2], devices[2:4]], 2, 2, 1, 1, "host")


def test_an_unknown_comm_device_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^comm_device must be auto, on, host or off \(got 'gpu'\)$"):
        _core(comm_device="gpu")


def _devices(platform, n):
    return types.SimpleNamespace(devices=np.asarray([types.SimpleNamespace(platform=platform)] * n))


def test_the_banner_says_where_syncs_run_and_whether_they_overlap(make_config):
    overlapped = make_config(diloco=dict(num_fragments=3, sync_period=6, overlap_steps=1, comm_device="auto"))
    host = dataclasses.replace(overlapped, diloco=dataclasses.replace(overlapped.diloco, comm_device="host"))
    gpu = _devices("gpu", 2)
    assert sync_lines(host, gpu, _devices("cpu", 2)) == [
        "  syncs        on 2 CPU devices of the host, copied there and back: they overlap the steps "
        "(--diloco.comm-device host)"]
    assert sync_lines(overlapped, _devices("cpu", 2), _devices("cpu", 2)) == [
        "  syncs        on 2 communication devices: they overlap the steps (--diloco.comm-device auto)"]
    assert sync_lines(overlapped, gpu, None) == [
        "  syncs        on the compute devices, after the steps in each gpu device's queue: they do not overlap "
        "compute (--diloco.comm-device auto)"]
    assert sync_lines(make_config(), gpu, None)[0].startswith("  syncs        blocking, on the compute devices")
    assert sync_lines(make_config(algorithm="ddp"), gpu, None) == []


@pytest.mark.slow  # two CLI trainings
def test_cli_run_with_host_syncs_equals_syncs_on_the_compute_devices(make_config, host_is_the_last_devices):
    host = make_config(diloco=dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5, comm_device="host"),
                       train=dict(steps=10))
    off = dataclasses.replace(host, run_dir=host.run_dir.parent / "off",
                              diloco=dataclasses.replace(host.diloco, comm_device="off"))
    a, b = Trainer(host, verbose=False), Trainer(off, verbose=False)
    assert set(a.comm_mesh.devices.flat) == set(host_is_the_last_devices) and b.comm_mesh is None
    a.run()
    b.run()
    assert train_losses(host.run_dir) == train_losses(off.run_dir)
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # a CLI training as 2 processes, and one in this process
def test_host_syncs_across_processes_equal_one_process(make_config, tmp_path):
    """Each process copies its replica's fragment to a CPU device of its own and the exchange runs over gloo."""
    from test_multiprocess import _launch

    flags = ["--diloco.num-replicas", "2", "--diloco.sync-period", "6", "--diloco.num-fragments", "3",
             "--diloco.overlap-steps", "1", "--diloco.alpha", "0.5", "--diloco.comm-device", "host",
             "--train.steps", "8", "--model.num-layers", "2", "--model.dim", "32", "--model.mlp-ratio", "2",
             "--train.lr", "0.01"]
    single = make_config(diloco=dict(num_replicas=2, sync_period=6, num_fragments=3, overlap_steps=1, alpha=0.5,
                                     comm_device="off"),
                         train=dict(steps=8, lr=0.01, batch_size=4, seq_len=16, eval_every=50, warmup_steps=20))
    Trainer(single, verbose=False).run()
    proc = _launch(2, tmp_path / "multi", *flags)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "  syncs        on 2 communication devices: they overlap the steps (--diloco.comm-device host)" in out
    np.testing.assert_allclose(train_losses(tmp_path / "multi"), train_losses(single.run_dir), rtol=1e-6)


@pytest.mark.slow  # two trainings of a small transformer each
@pytest.mark.parametrize("extra", [dict(fsdp=2), dict(outer_state_memory="host")],
                         ids=["fsdp2", "outer-state-in-host-memory"])
def test_host_syncs_of_a_sharded_island_or_host_memory_outer_state_equal_syncs_on_its_devices(extra):
    """A partner CPU device per shard (nothing gathered), or theta_g kept in pinned host memory: bit for bit."""
    from sharded_util import finished_model, make_core, train

    overrides = dict(num_fragments=3, sync_period=6, overlap_steps=1, alpha=0.5, **extra)
    on_host, on_own = make_core(comm_device="host", **overrides), make_core(comm_device="off", **overrides)
    assert dict(on_host.comm_mesh.shape) == {"diloco": 2, "data": 1, "fsdp": extra.get("fsdp", 1), "tensor": 1}
    (host_state, host_losses), (own_state, own_losses) = train(on_host, 12), train(on_own, 12)
    np.testing.assert_array_equal(host_losses, own_losses)
    for got, want in zip(finished_model(on_host, host_state), finished_model(on_own, own_state)):
        np.testing.assert_array_equal(got, want)


def test_host_sync_benchmark_smoke(tmp_path):
    from benchmarks import host_sync

    out = tmp_path / "host_sync.md"
    host_sync.main(["--size", "32", "--matmuls", "2", "--sync-mb", "1", "--sync-iters", "2", "--steps", "6",
                    "--tau", "2", "--out", str(out)])
    rows = [line.split(" | ")[0].strip("| ") for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows == ["what", "backend", "step", "sync", "overlap", "copy", "loop none", "loop inline", "loop thread"]
