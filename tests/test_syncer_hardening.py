"""A syncer no call can spoil or wedge, and a decoupled run that always ends: hostile gRPC calls against a
live syncer, damaged syncer checkpoints, and the decoupled launcher's failures (each with one line)."""

import os
import socket
import threading
import time

import grpc
import numpy as np
import optax
import pytest

from eqx_diloco._rpc import ATTEND_PER_ISLAND, SERVICE, TOKEN_KEY, SyncerClient, SyncerService
from eqx_diloco._syncer import Refused, Syncer
from eqx_diloco._wire import decode, encode
from eqx_diloco.lm.config import ConfigError

TOKEN = "secret-for-tests"

# Restoring a corrupt checkpoint makes orbax abandon its other pending reads, and a failed save its
# writes: their coroutines report "Exception ignored in ..." when garbage-collected, in whichever test
# runs then (as in test_checkpoint.py).
pytestmark = pytest.mark.filterwarnings(
    r"ignore:(?s)Exception ignored in.*(_read_array_index_and_device_put|Event loop is closed)"
    ":pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def live():
    """Starts syncers of one 8-value fragment (outer Nesterov SGD, as the trainer's) on free ports."""
    services = []

    def start(*, num_islands=2, grace_s=5.0, theta=None, fragments=1, **kwargs):
        syncer = Syncer([np.zeros(8, np.float32) if theta is None else theta] * fragments,
                        outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True), num_islands=num_islands,
                        grace_s=grace_s, **kwargs)
        service = SyncerService(syncer, address="127.0.0.1:0", token=TOKEN).start()
        services.append(service)
        return service

    yield start
    for service in services:
        service.stop(0)


def _call(port, name, message, *, timeout=10.0):
    """One raw call; returns (decoded reply, None) or (None, the RpcError)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/{name}")
        try:
            reply = call(encode(message), metadata=((TOKEN_KEY, TOKEN),), timeout=timeout)
            return decode(reply, source="the syncer"), None
        except grpc.RpcError as e:
            return None, e


def _push(**overrides):
    return dict(island=0, fragment=0, base_version=0, tokens=64, format="none", data=np.zeros(8, np.float32),
                scales=None, steps_per_s=None) | overrides


def _in_thread(fn, *args, **kwargs):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn(*args, **kwargs)))
    thread.start()
    return thread, out


@pytest.mark.parametrize("field, value, match", [
    ("island", True, "island True is not one of"),              # G07: JSON true is not island 1
    ("fragment", True, "fragment True is not one of"),          # G08b
    ("tokens", True, "tokens must be a positive integer"),      # G11b
    ("base_version", True, "base_version must be an integer"),
    ("tokens", 10**25, "tokens must be a positive integer at most"),   # G11c: outweighs every island
    ("tokens", 10**400, "tokens must be a positive integer at most"),  # G20 / G11d: overflows the merge
    ("steps_per_s", 1e308, "steps_per_s must be null or a number"),    # G12d
    ("steps_per_s", True, "steps_per_s must be null or a number"),
    ("data", np.full(8, 3e38, np.float32), "the island diverged"),     # G17: finite, yet makes theta_g Inf
])
def test_a_push_carrying_what_no_island_can_produce_is_refused_in_one_line(live, field, value, match):
    # Two islands and two fragments: `true` would be island 1 or fragment 1, both of this run.
    service = live(num_islands=2, fragments=2, min_quorum=1, max_tokens=1024)
    _call(service.port, "Join", {"island": 0})
    _, error = _call(service.port, "Push", _push(**{field: value}))
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in error.details() and "\n" not in error.details() and len(error.details()) < 300
    assert service.syncer.versions == [0, 0] and service.syncer.tokens_merged == 0
    # The syncer goes on serving: the island joins again and merges.
    _call(service.port, "Join", {"island": 0})
    reply, error = _call(service.port, "Push", _push(data=np.ones(8, np.float32)))
    assert error is None and reply["version"] == 1 and np.isfinite(reply["theta"]).all()


def test_join_and_attend_refuse_a_bool_island(live):
    service = live()
    _, error = _call(service.port, "Join", {"island": True})
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "island True is not one of" in error.details()
    assert service.syncer.joined == set()


def test_repeated_largest_pushes_never_make_theta_g_non_finite(live):
    """G17 with pushes inside the bound, again and again: momentum would carry theta_g to Inf. A merge
    whose result is not finite is refused as a whole (the islands join again), theta_g keeps its values."""
    service = live(num_islands=1, grace_s=0.0)
    outcomes = []
    for _ in range(40):
        joined, _ = _call(service.port, "Join", {"island": 0})
        scale = max(1.0, float(np.abs(joined["theta"][0]).max()))
        data = np.full(8, -min(999.0 * scale, 3e38), np.float32)
        reply, error = _call(service.port, "Push", _push(base_version=joined["versions"][0], data=data))
        outcomes.append(error.code() if error is not None else "merged")
        theta = service.syncer.fragment(0)[1]
        assert np.isfinite(theta).all()
        assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(service.syncer.opt_states))
    assert "merged" in outcomes and grpc.StatusCode.FAILED_PRECONDITION in outcomes
    _, error = _call(service.port, "Join", {"island": 0})
    assert error is None


def test_a_merge_that_fails_answers_every_island_of_its_window(live, monkeypatch):
    """G20: the merge raised inside the window and left its islands without a reply (the sender waited
    for its deadline). Any failure of a merge now refuses the window's contributions, each in one line."""
    service = live(num_islands=2, grace_s=10.0)
    for k in (0, 1):
        _call(service.port, "Join", {"island": k})

    def broken(*args):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr("eqx_diloco._syncer.merge_outer_gradient", broken)
    first, out0 = _in_thread(_call, service.port, "Push", _push(island=0), timeout=20)
    time.sleep(0.3)
    began = time.monotonic()
    _, error1 = _call(service.port, "Push", _push(island=1), timeout=20)
    first.join(20)
    _, error0 = out0["result"]
    assert time.monotonic() - began < 5
    for error in (error0, error1):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the merge of fragment 0 at version 0 failed (OverflowError" in error.details()
    assert service.syncer.versions == [0]


def test_the_merge_weights_cannot_overflow():
    """`float(sum(tokens))` overflowed for 10**400 tokens; the weights are ratios of integers now."""
    from eqx_diloco._syncer import merge_outer_gradient

    g = merge_outer_gradient([np.ones(2, np.float32), np.zeros(2, np.float32)], [10**400, 10**400], [0, 0])
    np.testing.assert_allclose(g, 0.5)


def test_open_attend_streams_cannot_take_the_servers_threads(live):
    """G18: 30 open Attend streams held all 12 server threads, and Status and Join timed out. An island
    holds at most ATTEND_PER_ISLAND streams; the rest are refused at once, and the syncer still answers."""
    service = live(num_islands=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{service.port}")
    attend = channel.unary_stream(f"/{SERVICE}/Attend")
    streams = [attend(encode({"island": i % 2}), metadata=((TOKEN_KEY, TOKEN),)) for i in range(30)]
    refused = []

    def drain(stream):
        try:
            for _ in stream:
                pass
        except grpc.RpcError as e:
            refused.append(e)

    threads = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        began = time.monotonic()
        reply, error = _call(service.port, "Status", {}, timeout=5)
        assert error is None, error
        reply, error = _call(service.port, "Join", {"island": 1}, timeout=5)
        assert error is None and time.monotonic() - began < 5
        exhausted = [e for e in refused if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert len(exhausted) == 30 - 2 * ATTEND_PER_ISLAND
        assert "already holds 2 open Attend streams" in exhausted[0].details()
    finally:
        for s in streams:
            s.cancel()
        channel.close()


def test_a_second_syncer_on_a_port_in_use_says_so_in_one_line(live):
    """DK18: gRPC's SO_REUSEPORT let a second syncer bind the port, and the kernel split the islands."""
    first = live()
    syncer = Syncer([np.zeros(8, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=2)
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{first.port} \\(in use"):
        SyncerService(syncer, address=f"127.0.0.1:{first.port}", token=TOKEN)


def test_an_address_that_cannot_be_bound_is_one_line():
    """DF02: `999.1.1.1:5555` was a 30-line RuntimeError traceback."""
    syncer = Syncer([np.zeros(8, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=2)
    with pytest.raises(ConfigError, match=r"cannot listen on 999.1.1.1:5555"):
        SyncerService(syncer, address="999.1.1.1:5555", token=TOKEN)


def test_the_client_of_an_honest_island_is_within_every_bound(live):
    """The bounds leave room for what islands send: tokens up to max_tokens and ordinary speeds."""
    service = live(num_islands=1, grace_s=0.0, max_tokens=1024)
    client = SyncerClient(f"127.0.0.1:{service.port}", token=TOKEN)
    try:
        client.join(0)
        from eqx_diloco import quantize

        reply = client.push(island=0, fragment=0, base_version=0, tokens=1024, fmt="none",
                            payload=quantize.Payload(np.full(8, 0.5, np.float32), None), steps_per_s=250.0)
        assert reply["version"] == 1 and service.syncer.steps_per_s == {0: 250.0}
    finally:
        client.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be an integer"),
    (dict(max_tokens=2**60), "max_tokens must be an integer"),
    (dict(max_delta_scale=float("inf")), "max_delta_scale must be"),
])
def test_bad_bounds_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=1, **kwargs)


def test_library_contributions_take_numpy_integers_but_not_bools():
    syncer = Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=1, grace_s=0.0)
    syncer.join(np.int64(0))
    ticket = syncer.contribute(np.int64(0), np.int32(0), np.int64(0), np.int64(8), np.ones(4, np.float32))
    assert syncer.wait(ticket)[0] == 1
    with pytest.raises(Refused, match="tokens must be a positive integer"):
        syncer.contribute(0, 0, 1, np.bool_(True), np.ones(4, np.float32))


# -- syncer checkpoints: checksums, the newest intact one, save failures --------------------------------------



def _syncer_at(versions_of_theta, *, momentum=0.9):
    """A syncer of two fragments whose theta_g took `versions_of_theta` merges of outer gradient -1."""
    syncer = Syncer([np.zeros(64, np.float32), np.zeros(32, np.float32)],
                    outer_optimizer=optax.sgd(0.5, momentum=momentum or None, nesterov=momentum > 0), num_islands=1,
                    grace_s=0.0)
    syncer.join(0)
    for v in range(versions_of_theta):
        for f, n in enumerate(syncer.sizes):
            syncer.wait(syncer.contribute(0, f, v, 16, np.full(n, -1.0, np.float32)))
    return syncer


def _two_checkpoints(directory):
    """Checkpoints of steps 2 and 4 in `directory`; returns the syncer state saved at step 2."""
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    older = _syncer_at(1)
    SyncerCheckpoints(directory).save_now(older)
    SyncerCheckpoints(directory).save_now(_syncer_at(2))
    return older.state_tree()


def _data_files(step_folder):
    return sorted((p for p in step_folder.rglob("*") if p.is_file() and p.stat().st_size > 64),
                  key=lambda p: p.stat().st_size)


def _flip_bytes(step_folder):
    """64 bytes flipped in the middle of every data file of the checkpoint (DK14c)."""
    for path in _data_files(step_folder):
        if "ocdbt" in str(path) or "/d/" in str(path):
            data = bytearray(path.read_bytes())
            middle = len(data) // 2
            data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
            path.write_bytes(bytes(data))


def _truncate(step_folder):
    """Every data file of the checkpoint cut to 100 bytes (DK14d)."""
    for path in _data_files(step_folder):
        if "ocdbt" in str(path) or "/d/" in str(path):
            path.write_bytes(path.read_bytes()[:100])


def _empty(step_folder):
    """The checkpoint's folder emptied (DK14e)."""
    import shutil

    for child in step_folder.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def _garbage_metadata(step_folder):
    """The checkpoint's JSON items replaced by bytes that are not JSON."""
    for name in ("meta", "config"):
        (step_folder / name / "metadata").write_bytes(b"\x00{not json")


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate, _empty, _garbage_metadata],
                         ids=["flipped", "truncated", "emptied", "metadata"])
def test_a_damaged_newest_syncer_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capfd, damage):
    """DK14c: flipped bytes restored silently (5,571 values changed, some non-finite); DK14d / DK14e: a
    truncated or emptied newest checkpoint was an 81- / 28-line traceback although an older one was intact."""
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    directory = tmp_path / "checkpoints"
    older = _two_checkpoints(directory)
    damage(directory / "4")
    fresh = _syncer_at(0)
    assert SyncerCheckpoints(directory).restore(fresh) == 2
    restored = fresh.state_tree()
    assert restored["versions"].tolist() == [1, 1]
    for a, b in zip(restored["theta"], older["theta"]):
        np.testing.assert_array_equal(a, b)
    err = capfd.readouterr().err
    assert "checkpoint 4 in" in err and "is corrupt or incomplete" in err and "Traceback" not in err
    assert (directory / "4.corrupt").exists()


def test_a_syncer_checkpoint_of_another_outer_optimizer_is_refused_in_one_line(tmp_path):
    """DK14b: `--diloco.outer-momentum 0` on a momentum checkpoint was a 48-line orbax traceback."""
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    SyncerCheckpoints(tmp_path).save_now(_syncer_at(1))
    with pytest.raises(ConfigError, match="checkpoint is incompatible with this config") as caught:
        SyncerCheckpoints(tmp_path).restore(_syncer_at(0, momentum=0.0))
    assert "\n" not in str(caught.value)


def test_no_intact_syncer_checkpoint_is_one_line(tmp_path):
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    SyncerCheckpoints(tmp_path).save_now(_syncer_at(1))
    _truncate(tmp_path / "2")
    with pytest.raises(ConfigError, match="none of the 1 checkpoints .* can be restored") as caught:
        SyncerCheckpoints(tmp_path).restore(_syncer_at(0))
    assert "\n" not in str(caught.value)


def test_tokens_merged_and_versions_survive_a_checkpoint_exactly(tmp_path):
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    syncer = _syncer_at(3)
    syncer.tokens_merged = 123456789012.375
    SyncerCheckpoints(tmp_path).save_now(syncer)
    fresh = _syncer_at(0)
    assert SyncerCheckpoints(tmp_path).restore(fresh) == 6
    assert fresh.tokens_merged == 123456789012.375 and fresh.versions == [3, 3]


def test_a_failed_background_save_is_reported_at_once_and_again_at_close(tmp_path):
    """DK5: the saver kept its error to itself until the end, and nothing said the run had no checkpoint."""
    from eqx_diloco._checkpoint import CheckpointSaveError
    from eqx_diloco._syncer_checkpoint import SyncerCheckpoints

    directory = tmp_path / "checkpoints"
    reported = threading.Event()
    messages = []
    checkpoints = SyncerCheckpoints(directory, on_error=lambda m: (messages.append(m), reported.set()))
    syncer = _syncer_at(1)
    checkpoints.save_now(syncer)
    checkpoints.follow(syncer)
    import shutil

    shutil.rmtree(directory)
    directory.write_text("not a folder")  # every later save fails (also as root, where modes do not)
    syncer.wait(syncer.contribute(0, 0, 1, 16, np.full(64, -1.0, np.float32)))
    checkpoints.mark()
    assert reported.wait(30)
    assert len(messages) == 1 and "saving checkpoint 3 in" in messages[0] and "\n" not in messages[0]
    with pytest.raises(CheckpointSaveError, match="saving checkpoint 3 in"):
        checkpoints.close()


# -- islands and the launcher: one line each ---------------------------------------------------------------


@pytest.mark.parametrize("line, match", [
    ('{"island": true}\n', "island True is not in"),                       # SB7: became island 1
    ('{"island": 1.9}\n', "island 1.9 is not in"),                         # SB4: became island 1
    ('{"island": 1e400}\n', "island inf is not in"),                       # SB12: OverflowError traceback
    ('{"island": 0, "cpus": "abc"}\n', '"cpus" must be null or a non-empty list'),  # SB6: TypeError traceback
    ('{"island": 0, "cpus": [-1]}\n', '"cpus" must be null or a non-empty list'),   # SB11: ValueError traceback
    ('{"island": 0, "cpus": [99999]}\n', '"cpus" must be null or a non-empty list'),  # SB5: OSError, no flag named
    ('{"island": 0, "cpus": [true]}\n', '"cpus" must be null or a non-empty list'),
])
def test_a_standby_island_refuses_a_bad_assignment_value_in_one_line(make_config, monkeypatch, line, match):
    import io

    from eqx_diloco.lm.island import IslandError, await_assignment

    monkeypatch.setattr("sys.stdin", io.StringIO(line))
    with pytest.raises(IslandError, match=match) as caught:
        await_assignment(make_config())
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("text", ["{garbage", '{"step": "40"}', '{"step": -1}', '{"step": true}', "[]", '{"steps": 4}'])
def test_a_garbage_progress_file_is_one_line(tmp_path, text):
    """DK17c: `{garbage` in island-1/progress.json was a JSONDecodeError traceback."""
    from eqx_diloco.lm.island import read_progress

    path = tmp_path / "progress.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"progress.json is not \{\"step\": N\} .*delete it to restart island 1") as e:
        read_progress(path, 1)
    assert "\n" not in str(e.value)
    path.write_text('{"step": 12}')
    assert read_progress(path, 1) == 12 and read_progress(tmp_path / "absent.json", 1) == 0


def test_the_shared_secret_is_never_a_flag_value(capsys, tmp_path):
    """DB1 / SEC2: `--decoupled.token T` showed in `ps`, and an ordinary run wrote it to config.json and
    its checkpoint. The flag is refused with one line saying where the secret goes, before anything is written."""
    from eqx_diloco.lm.train import main

    run = tmp_path / "run"
    code = main(["--decoupled.token", "s3cret", "--run-dir", str(run), "--data.source", "synthetic"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "$EQX_DILOCO_SYNCER_TOKEN" in err and "--decoupled.token-file" in err and "s3cret" not in err
    assert not (run / "config.json").exists()


def test_a_token_file_holds_the_secret_and_only_its_path_is_kept(make_config, tmp_path, monkeypatch):
    import dataclasses
    import json

    from eqx_diloco._json import to_jsonable
    from eqx_diloco.lm.config import DecoupledConfig, validate
    from eqx_diloco.lm.island import shared_token

    secret = tmp_path / "secret"
    secret.write_text("from-a-file\n")
    monkeypatch.setenv("EQX_DILOCO_SYNCER_TOKEN", "from-the-environment")
    config = make_config()
    config = dataclasses.replace(config, decoupled=DecoupledConfig(role="island", token_file=secret))
    validate(config)
    assert shared_token(config) == "from-a-file"
    assert "from-a-file" not in json.dumps(to_jsonable(config))
    monkeypatch.delenv("EQX_DILOCO_SYNCER_TOKEN")
    assert shared_token(dataclasses.replace(config, decoupled=DecoupledConfig(role="island", token_file=secret)))
    for bad, match in [(tmp_path / "absent", "is not a file"), (tmp_path, "is not a file")]:
        with pytest.raises(ConfigError, match=match):
            validate(dataclasses.replace(config, decoupled=DecoupledConfig(role="island", token_file=bad)))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty: its first line is the shared secret"):
        validate(dataclasses.replace(config, decoupled=DecoupledConfig(role="island", token_file=tmp_path / "empty")))


TD = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.batch-size", "4",
      "--train.seq-len", "16", "--data.source", "synthetic", "--train.eval-every", "0", "--diloco.sync-period", "4",
      "--train.log-every", "1"]


def test_a_log_dir_that_is_a_file_is_one_line(capsys, tmp_path):
    """DL01: `--decoupled --log-dir FILE` was a 17-line FileExistsError traceback."""
    from eqx_diloco.lm.launch import main as launch_main

    afile = tmp_path / "afile"
    afile.write_text("x")
    code = launch_main(["--decoupled", "--num-processes", "2", "--log-dir", str(afile), "--", *TD,
                        "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"error: --log-dir is not a folder: {afile}"


def test_a_second_decoupled_launch_on_a_run_folder_in_use_is_refused_before_it_starts(capsys, tmp_path):
    """DK7: two launches on one --run-dir interleaved progress, logs and checkpoints, and the second exited 0."""
    from eqx_diloco.lm._preflight import RunDirLock
    from eqx_diloco.lm.launch import main as launch_main

    run = tmp_path / "run"
    with RunDirLock(run, job="decoupled launch 1 abcd"):
        code = launch_main(["--decoupled", "--num-processes", "2", "--log-dir", str(tmp_path / "logs"), "--", *TD,
                            "--run-dir", str(run)])
    first = capsys.readouterr().err.strip().splitlines()[0]
    assert code == 2 and first == (f"error: --run-dir {run} is in use by another trainer (pid {os.getpid()} "
                                   f"on {socket.gethostname()})")
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


def test_a_syncer_started_by_hand_holds_the_run_folder(make_config, monkeypatch):
    import dataclasses

    from eqx_diloco.lm._preflight import RunDirLock
    from eqx_diloco.lm.config import DecoupledConfig
    from eqx_diloco.lm.syncer import run_syncer

    monkeypatch.delenv("EQX_DILOCO_DECOUPLED_JOB", raising=False)
    config = make_config()
    config = dataclasses.replace(config, decoupled=DecoupledConfig(role="syncer"))
    with RunDirLock(config.run_dir, job="decoupled launch 1 abcd"):
        with pytest.raises(ConfigError, match="is in use by another trainer"):
            run_syncer(config)
        monkeypatch.setenv("EQX_DILOCO_DECOUPLED_JOB", "decoupled launch 2 ffff")  # another launch's syncer
        with pytest.raises(ConfigError, match="is in use by another trainer"):
            run_syncer(config)


# -- decoupled runs through the real processes: every one ends, non-zero after an error ---------------------


def _launch(tmp_path, *flags, env=None, timeout=240, launcher=()):
    """`python -m eqx_diloco.launch --decoupled` of 2 islands; (return code, its output). A run still going
    after `timeout` seconds is killed (with every process of it) and fails the test."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2", *launcher,
               "--log-dir", str(tmp_path / "logs"), "--", *TD, "--run-dir", str(tmp_path / "run"), *flags]
    proc = subprocess.Popen(command, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # the syncer and the islands die with the launcher
        output, _ = proc.communicate()
        raise AssertionError(f"the decoupled run did not end within {timeout} s:\n{output}") from None
    return proc.returncode, output


@pytest.mark.slow  # a decoupled launch (about 40 s)
def test_islands_that_diverge_end_the_run_with_one_line_each(tmp_path):
    """DL03: with `--train.lr 1e6` the syncer refused both islands, which then never exited: no restart, and
    the launcher waited for ever. Now each island stops (its own non-finite loss, or the syncer's refusal
    of a diverged outer gradient), the launcher names both and exits 1."""
    code, output = _launch(tmp_path, "--train.steps", "16", "--train.lr", "1e6")
    assert code == 1, output
    for k in range(2):
        line = next(line for line in output.splitlines() if line.startswith(f"launcher: island {k} exited with 1"))
        assert ("non-finite loss" in line or "the island diverged" in line), output
    assert "Traceback" not in output


@pytest.mark.slow  # a syncer and an island process, by hand
def test_an_island_refused_after_it_joined_exits_at_once(tmp_path):
    """DK15: an island refused by the syncer (here: another client already contributed as island 0 in the
    window) printed its line and then never exited, so no supervisor could restart it."""
    import json
    import subprocess
    import sys

    from eqx_diloco.lm.launch import free_port

    port, run = free_port(), tmp_path / "run"
    env = dict(os.environ, EQX_DILOCO_SYNCER_TOKEN=TOKEN)
    common = [sys.executable, "-m", "eqx_diloco.train", *TD, "--run-dir", str(run), "--train.steps", "8",
              "--decoupled.syncer", f"127.0.0.1:{port}", "--decoupled.grace-s", "60"]
    syncer = subprocess.Popen([*common, "--decoupled.role", "syncer"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    island = None
    try:
        address = run / "syncer" / "address.json"
        deadline = time.monotonic() + 120
        while not (address.exists() and address.read_text()):
            assert syncer.poll() is None and time.monotonic() < deadline, syncer.stderr.read()
            time.sleep(0.1)
        # Island 0's window of fragment 0 is open with a contribution of "island 0" waiting for island 1.
        _call(port, "Join", {"island": 0})
        holder, _ = _in_thread(_call, port, "Push", _push(tokens=64, data=np.zeros(_fragment_size(port), np.float32)),
                               timeout=90)
        island = subprocess.Popen([*common, "--decoupled.role", "island", "--decoupled.island", "0"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, err = island.communicate(timeout=120)
        assert island.returncode == 1
        assert err.strip().splitlines()[-1] == ("error: island 0: the syncer refused it: refused: island 0 contributed "
                                                "to fragment 0 twice in one window (INVALID_ARGUMENT)")
    finally:
        for proc in (island, syncer):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.communicate(timeout=60)
    assert syncer.returncode == 0
    assert json.loads((run / "syncer" / "summary.json").read_text())["merges"] >= 0


def _fragment_size(port) -> int:
    reply, error = _call(port, "Join", {"island": 1})  # island 1 joins and never reports: windows wait for it
    assert error is None
    return reply["theta"][0].size


@pytest.mark.slow  # a decoupled launch (about 30 s)
def test_a_syncer_that_cannot_save_stops_the_run_with_one_line_and_a_non_zero_exit(tmp_path):
    """DK5 / DK5b: with `syncer/checkpoints` unwritable mid-run the syncer kept serving, nothing was saved,
    and the launcher exited 0 (a later syncer kill then restarted the run from the initial model)."""
    import subprocess
    import sys
    import shutil

    run = tmp_path / "run"
    command = [sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2", "--log-dir",
               str(tmp_path / "logs"), "--", *TD, "--run-dir", str(run), "--train.steps", "400"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "syncer" / "address.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        # Every later save fails (also as root, where file modes do not stop a write).
        checkpoints = run / "syncer" / "checkpoints"
        shutil.rmtree(checkpoints, ignore_errors=True)
        checkpoints.write_text("not a folder")
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, output
    failure = [line for line in output.splitlines() if line.startswith("launcher: the syncer exited with 1")]
    assert len(failure) == 1 and "error: syncer: saving checkpoint" in failure[0], output
    assert "Traceback" not in output


@pytest.mark.slow  # a syncer that cannot write its checkpoints at all (about 15 s)
def test_a_syncer_checkpoint_folder_that_cannot_be_written_is_found_before_the_islands_train(tmp_path):
    run = tmp_path / "run"
    (run / "syncer").mkdir(parents=True)
    (run / "syncer" / "checkpoints").write_text("not a folder")
    code, output = _launch(tmp_path, "--train.steps", "8", timeout=180)
    assert code == 1, output
    assert "launcher: the syncer exited with 1 and has no restarts left: error: syncer: saving checkpoint 0" in output
    assert not (run / "island-0" / "progress.json").exists()


@pytest.mark.slow  # two decoupled launches (about 50 s)
def test_a_finished_decoupled_run_stays_finished_with_fewer_steps(tmp_path):
    """DK17: rerunning a finished 40-step run with `--train.steps 20` trained for ever (5,388 steps in 150 s):
    the islands stopped only at step == --train.steps, and a restart began past it."""
    import json

    code, output = _launch(tmp_path, "--train.steps", "8")
    assert code == 0, output
    summary = json.loads((tmp_path / "run" / "syncer" / "summary.json").read_text())
    code, output = _launch(tmp_path, "--train.steps", "4", timeout=180)
    assert code == 0, output
    for k in range(2):
        from benchmarks._elastic.observe import read_jsonl

        steps = [r["step"] for r in read_jsonl(tmp_path / "run" / f"island-{k}" / "metrics.jsonl") if "loss" in r]
        assert max(steps) == 8
    assert json.loads((tmp_path / "run" / "syncer" / "summary.json").read_text())["versions"] == summary["versions"]


def test_a_syncer_without_checkpoints_does_not_undo_islands_that_synced(make_config, monkeypatch):
    """DK5b: the syncer restarted from the initial theta_g (`restored: null`) after its checkpoints were
    lost, the islands rejoined from it, and the run ended with exit 0."""
    import dataclasses

    from eqx_diloco.lm.config import DecoupledConfig
    from eqx_diloco.lm.syncer import run_syncer

    monkeypatch.delenv("EQX_DILOCO_DECOUPLED_JOB", raising=False)
    monkeypatch.setenv("EQX_DILOCO_SYNCER_TOKEN", TOKEN)
    config = make_config()
    config = dataclasses.replace(config, decoupled=DecoupledConfig(role="syncer", syncer="127.0.0.1:0"))
    (config.run_dir / "island-1").mkdir(parents=True)
    (config.run_dir / "island-1" / "progress.json").write_text('{"step": 24}')
    with pytest.raises(ConfigError, match=r"holds no checkpoint, but island 1 synced up to step 24") as caught:
        run_syncer(config)
    assert "\n" not in str(caught.value)
    assert not any((config.run_dir / "syncer" / "checkpoints").glob("[0-9]*"))


def test_a_second_island_k_on_one_run_folder_is_refused_in_one_line(make_config, monkeypatch):
    """DK15: a second island 0 on the run folder trained alongside the first, both writing
    island-0/metrics.jsonl, until the syncer refused one of them (which then hung)."""
    import dataclasses

    from eqx_diloco.lm._preflight import RunDirLock
    from eqx_diloco.lm.config import DecoupledConfig
    from eqx_diloco.lm.island import run_island

    monkeypatch.setenv("EQX_DILOCO_SYNCER_TOKEN", TOKEN)
    config = make_config()
    config = dataclasses.replace(config, decoupled=DecoupledConfig(role="island", island=0, syncer="127.0.0.1:1"))
    with RunDirLock(config.run_dir / "island-0", job="island 0"):
        with pytest.raises(ConfigError, match=f"island 0 of {config.run_dir} is already running: ") as caught:
            run_island(config)
    assert "\n" not in str(caught.value)
    assert not (config.run_dir / "island-0" / "metrics.jsonl").exists()
