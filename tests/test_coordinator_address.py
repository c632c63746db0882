"""The coordinator of a local multi-process run (the launcher's, or one given a loopback
`--dist.coordinator-address`) listens on the loopback interface only: JAX's own default is every
interface, for a service with no authentication whose key-value store carries compiled programs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eqx_diloco.lm._devices import coordinator_bind_address

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


@pytest.mark.parametrize(("coordinator", "bind"), [
    ("127.0.0.1:4000", "127.0.0.1:4000"),
    ("127.0.0.7:4000", "127.0.0.7:4000"),
    ("localhost:4000", "localhost:4000"),
    ("[::1]:4000", "[::1]:4000"),
    ("10.1.2.3:4000", None),  # another host must reach it: JAX's default (every interface)
    ("node7:4000", None),
])
def test_a_loopback_coordinator_binds_loopback(monkeypatch, coordinator, bind):
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    assert coordinator_bind_address(coordinator) == bind


def test_the_bind_address_variable_wins(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:4000")
    assert coordinator_bind_address("127.0.0.1:4000") == "0.0.0.0:4000"


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_COORDINATOR_BIND_ADDRESS", None)
    return env


def _listening(stdout: str) -> list[str]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout
    return lines[0]["listening"]


@pytest.mark.slow  # two JAX processes through the launcher
def test_a_local_launch_coordinator_listens_on_loopback_only(tmp_path):
    """SEC1: `launch --num-processes 2` used to listen on `[::]:PORT` (every interface)."""
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--module",
                           "coordinator_child"], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _listening(proc.stdout) == ["127.0.0.1"], proc.stdout


@pytest.mark.slow  # two JAX processes started by hand
def test_a_loopback_coordinator_address_by_hand_listens_on_loopback_only(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    coordinator = f"127.0.0.1:{port}"
    procs = [subprocess.Popen([sys.executable, "-m", "coordinator_child", "--coordinator", coordinator,
                               "--processes", "2", "--id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env(), cwd=tmp_path) for i in range(2)]
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert _listening(outputs[0][0]) == ["127.0.0.1"], outputs[0][0]
