"""Decoupled islands: the syncer's merge against the equations, its windows (quorum, grace, staleness),
equivalence with synchronous DiLoCo, bad calls, restarts and rejoins, and the flags."""

import dataclasses
import pathlib
import threading
import time

import equinox as eqx
import grpc
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from sharded_util import CONFIG, R, batch, loss_fn, make_core, relative

from benchmarks._elastic.observe import read_jsonl
from eqx_diloco import schedule
from eqx_diloco._fragments import Fragmenter
from eqx_diloco._island import Island, fragment_vectors, install_fragment
from eqx_diloco._rpc import SERVICE, TOKEN_KEY, SyncerClient, SyncerService, SyncerUnreachable, SyncRefused
from eqx_diloco._syncer import Refused, Syncer
from eqx_diloco._syncer_checkpoint import SyncerCheckpoints
from eqx_diloco._wire import encode
from eqx_diloco.lm.config import ConfigError, DecoupledConfig, validate
from eqx_diloco.lm.launch import main as launch_main
from models.transformer import Transformer

TOKEN = "secret-for-tests"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_syncer(num_islands: int, **kwargs) -> tuple[Syncer, FakeClock]:
    """A syncer of one 4-value fragment (outer SGD at rate 1) on a fake clock, every island joined."""
    clock = FakeClock()
    syncer = Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=num_islands, clock=clock,
                    **kwargs)
    for k in range(num_islands):
        syncer.join(k)
    return syncer, clock


def nesterov_reference(theta0, windows, *, lr, mu):
    """theta_g after each window, from the merge's equations: g = sum_i n_i / (1 + s_i) delta_i / sum_i n_i,
    then SGD with Nesterov momentum: m <- mu m + g, theta <- theta - lr (g + mu m)."""
    theta, m = np.asarray(theta0, np.float64), np.zeros_like(theta0, np.float64)
    for version, window in enumerate(windows):
        total = sum(n for _, n, _ in window)
        g = sum(n / (1 + version - base) * np.asarray(d, np.float64) for d, n, base in window) / total
        m = mu * m + g
        theta = theta - lr * (g + mu * m)
    return theta


def test_merge_matches_the_equations_with_tokens_and_staleness():
    rng = np.random.default_rng(0)
    theta0 = rng.normal(size=50).astype(np.float32)
    clock = FakeClock()
    syncer = Syncer([theta0], outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True), num_islands=3,
                    min_quorum=2, grace_s=1.0, max_staleness=3, clock=clock)
    for k in range(3):
        syncer.join(k)
    # (island, tokens, base version) per window; the windows close at the quorum of 2.
    plan = [[(0, 100, 0), (1, 300, 0)], [(2, 50, 0), (0, 100, 1)], [(1, 200, 1), (2, 70, 1)], [(0, 10, 3), (1, 20, 0)]]
    windows = []
    for window in plan:
        entries = []
        for island, tokens, base in window:
            delta = rng.normal(size=50).astype(np.float32)
            ticket = syncer.contribute(island, 0, base, tokens, delta)
            entries.append((delta, tokens, base))
        assert ticket.done.is_set()
        windows.append(entries)
    expected = nesterov_reference(theta0, windows, lr=0.7, mu=0.9)
    assert syncer.versions == [4]
    np.testing.assert_allclose(syncer.theta[0], expected, rtol=1e-5, atol=1e-6)
    assert [r.staleness for r in syncer.merges] == [(0, 0), (1, 0), (1, 1), (0, 3)]
    assert syncer.tokens_merged == pytest.approx(sum(n for w in plan for _, n, _ in w))


def test_windows_close_at_the_quorum_or_after_the_grace_window():
    syncer, clock = fake_syncer(3, grace_s=2.0)
    one = np.ones(4, np.float32)
    a = syncer.contribute(0, 0, 0, 10, one)
    b = syncer.contribute(1, 0, 0, 10, one)
    clock.now = 1.9
    syncer.poll()
    assert not a.done.is_set()  # island 2 is still awaited
    clock.now = 2.0
    syncer.poll()
    assert a.done.is_set() and b.done.is_set() and syncer.merges[-1].by_grace
    assert syncer.present == {0, 1}  # island 2 missed it: the next windows do not wait for it
    c = syncer.contribute(0, 0, 1, 10, one)
    assert not c.done.is_set()
    syncer.contribute(1, 0, 1, 10, one)
    assert c.done.is_set() and not syncer.merges[-1].by_grace
    # Island 2 reports late (stale by 2): it counts again, and a window now waits for all three.
    late = syncer.contribute(2, 0, 0, 10, one)
    assert syncer.present == {0, 1, 2} and not late.done.is_set()
    syncer.contribute(0, 0, 2, 10, one)
    syncer.contribute(1, 0, 2, 10, one)
    assert late.done.is_set() and syncer.merges[-1].staleness == (2, 0, 0)
    # Leaving shrinks the quorum at once.
    d = syncer.contribute(0, 0, 3, 10, one)
    syncer.leave(1)
    syncer.leave(2)
    assert d.done.is_set()


def test_an_island_a_grace_window_left_out_is_merged_with_the_others_next_report():
    """Islands 0 and 1 report every second; island 2, a little late once, missed a window. Merged on its
    own, it would make every later window a version stale and out of phase; it waits for the others' next
    report instead, and from then on the three report together again."""
    syncer, clock = fake_syncer(3, grace_s=0.2, grace_max_s=5.0)
    one = np.ones(4, np.float32)
    syncer.contribute(0, 0, 0, 10, one)
    syncer.contribute(1, 0, 0, 10, one)
    clock.now = 0.2
    syncer.poll()  # island 2 is 0.3 s late: the window closes by grace without it
    assert syncer.merges[-1].islands == (0, 1) and syncer.merges[-1].by_grace
    clock.now = 0.3
    late = syncer.contribute(2, 0, 0, 10, one)
    clock.now = 0.9  # far past the grace window: still waiting for islands 0 and 1
    syncer.poll()
    assert not late.done.is_set() and syncer.versions == [1]
    clock.now = 1.0
    syncer.contribute(0, 0, 1, 10, one)
    assert not late.done.is_set()  # an ordinary window from here: it waits for island 1
    clock.now = 1.05
    syncer.contribute(1, 0, 1, 10, one)
    assert late.done.is_set() and late.result[0] == 2
    assert syncer.merges[-1].islands == (2, 0, 1) and syncer.merges[-1].staleness == (1, 0, 0)
    assert not syncer.merges[-1].by_grace
    # In phase again: the next round merges all three, fresh, at the quorum.
    for k in range(3):
        clock.now += 0.01
        syncer.contribute(k, 0, 2, 10, one)
    assert syncer.merges[-1].islands == (0, 1, 2) and syncer.merges[-1].staleness == (0, 0, 0)
    assert list(syncer._lags) == pytest.approx([0.05, 0.01, 0.02])  # from the first fresh report, not island 2


def test_a_late_island_waits_for_the_others_at_most_the_longest_grace_window():
    syncer, clock = fake_syncer(2, grace_s=0.2, grace_max_s=5.0)
    one = np.ones(4, np.float32)
    syncer.contribute(0, 0, 0, 10, one)
    clock.now = 0.2
    syncer.poll()
    late = syncer.contribute(1, 0, 0, 10, one)  # island 0 hangs, its connection open: nobody comes
    clock.now = 5.1
    syncer.poll()
    assert not late.done.is_set()
    clock.now = 5.2
    syncer.poll()
    assert late.done.is_set() and syncer.merges[-1].islands == (1,) and syncer.merges[-1].by_grace


def test_the_first_windows_wait_for_islands_still_starting():
    """Islands start apart: a window opened before island 1 has joined waits for it (the adaptive grace is
    `grace_max_s` until a window has filled its quorum), so both islands' first rounds merge together; an
    island that never starts is waited for that long only, once."""
    clock = FakeClock()
    syncer = Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=3, clock=clock,
                    grace_max_s=5.0)
    one = np.ones(4, np.float32)
    syncer.join(0)
    first = syncer.contribute(0, 0, 0, 10, one)
    clock.now = 4.0
    syncer.poll()
    assert not first.done.is_set()  # islands 1 and 2 have not joined yet
    syncer.join(1)
    syncer.contribute(1, 0, 0, 10, one)
    clock.now = 5.0
    syncer.poll()
    assert first.done.is_set() and syncer.merges[-1].islands == (0, 1) and syncer.merges[-1].by_grace
    assert syncer.present == {0, 1}  # island 2 never came: the next windows do not wait for it
    syncer.contribute(0, 0, 1, 10, one)
    assert syncer.contribute(1, 0, 1, 10, one).done.is_set() and not syncer.merges[-1].by_grace


def test_adaptive_grace_follows_arrival_lags_and_island_speed():
    syncer, clock = fake_syncer(2, grace_factor=3.0, grace_min_s=0.01, grace_max_s=5.0)
    assert syncer.grace() == 5.0  # nothing measured yet
    for version in range(6):
        syncer.contribute(0, 0, version, 1, np.zeros(4, np.float32), steps_per_s=1000.0)
        clock.now += 0.1
        syncer.contribute(1, 0, version, 1, np.zeros(4, np.float32), steps_per_s=1000.0)
    assert syncer.grace() == pytest.approx(0.3)  # 3 x the 0.1 s median lag
    syncer.steps_per_s = {0: 2.0, 1: 2.0}
    assert syncer.grace() == pytest.approx(1.0)  # at least two steps of the median island


def test_a_closed_connection_stops_the_wait_at_once_and_a_restarted_island_is_not_waited_for():
    syncer, clock = fake_syncer(3, grace_s=30.0)
    for k in range(3):
        syncer.connected(k)
    one = np.ones(4, np.float32)
    a = syncer.contribute(0, 0, 0, 10, one)
    syncer.contribute(1, 0, 0, 10, one)
    assert not a.done.is_set()  # island 2 is awaited
    syncer.disconnected(2)  # its process ended: no grace window to sit out
    assert a.done.is_set() and not syncer.merges[-1].by_grace and syncer.present == {0, 1}
    # Island 2 restarts and joins again, a round behind: the open window does not wait for it ...
    b = syncer.contribute(0, 0, 1, 10, one)
    syncer.join(2)
    syncer.connected(2)
    assert syncer.present == {0, 1} and not b.done.is_set()
    syncer.contribute(1, 0, 1, 10, one)
    assert b.done.is_set() and syncer.merges[-1].islands == (0, 1)
    # ... until it contributes: then the windows wait for it again.
    late = syncer.contribute(2, 0, 1, 10, one)
    assert syncer.present == {0, 1, 2} and not late.done.is_set()
    syncer.contribute(0, 0, 2, 10, one)
    syncer.contribute(1, 0, 2, 10, one)
    assert late.done.is_set() and syncer.merges[-1].staleness == (1, 0, 0)
    # An island with two connections (an old one lingering) counts as gone only when both closed.
    syncer.connected(2)
    syncer.disconnected(2)
    assert 2 in syncer.present
    syncer.disconnected(2)
    assert 2 not in syncer.present
    assert clock.now == 0.0  # no window ever waited for its grace


def test_the_adaptive_grace_uses_the_lags_of_the_first_full_window():
    syncer, clock = fake_syncer(4, grace_factor=3.0, grace_min_s=0.01, grace_max_s=10.0)
    for k in range(4):
        syncer.contribute(k, 0, 0, 1, np.zeros(4, np.float32))
        clock.now += 0.2
    assert syncer.grace() == pytest.approx(3 * 0.4)  # lags 0.2, 0.4, 0.6: their median, 3 times


@pytest.mark.parametrize("bad, match", [
    (dict(island=5), "not one of this run's 2 islands"),
    (dict(fragment=3), "not one of the run's 1 fragments"),
    (dict(tokens=0), "tokens must be a positive integer"),
    (dict(base_version=7), "never had"),
    (dict(delta=np.ones(3, np.float32)), "takes 4 float32 values"),
    (dict(delta=np.array([1, np.nan, 0, 0], np.float32)), "NaN or Inf"),
])
def test_the_merge_refuses_bad_contributions(bad, match):
    syncer = Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=2)
    syncer.join(0)
    args = dict(island=0, fragment=0, base_version=0, tokens=1, delta=np.zeros(4, np.float32)) | bad
    with pytest.raises(Refused, match=match):
        syncer.contribute(**args)
    assert syncer.versions == [0]


def test_too_stale_contributions_are_refused_and_counted():
    syncer, _ = fake_syncer(1, max_staleness=1)
    for version in range(3):
        syncer.contribute(0, 0, version, 1, np.zeros(4, np.float32))
    with pytest.raises(Refused, match="3 versions old, more than max_staleness 1"):
        syncer.contribute(0, 0, 0, 8, np.zeros(4, np.float32))
    assert syncer.tokens_refused == 8


# -- over gRPC --------------------------------------------------------------------------------------------


@pytest.fixture
def service():
    services = []

    def start(fragments, *, restore=None, address="127.0.0.1:0", **kwargs):
        syncer = Syncer(fragments, outer_optimizer=kwargs.pop("outer_optimizer", optax.sgd(1.0)),
                        num_islands=kwargs.pop("num_islands", 2), **kwargs)
        if restore is not None:
            assert SyncerCheckpoints(restore).restore(syncer) is not None
        s = SyncerService(syncer, address=address, token=TOKEN).start()
        services.append(s)
        return s

    yield start
    for s in services:
        s.stop(0)


def _model():
    return Transformer(CONFIG, key=jax.random.key(0))


def _inner_step(static):
    optimizer = optax.sgd(0.1, momentum=0.9)

    @jax.jit
    def step(params, opt_state, tokens):
        grads = jax.grad(lambda p: loss_fn(eqx.combine(p, static), tokens, None)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return optimizer, step


@pytest.mark.slow  # two gRPC islands and a DiLoCo core of the Transformer; the fast tier checks the merge's equations
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_decoupled_islands_equal_synchronous_streaming_diloco(service, quantize):
    """All islands fresh, equal tokens, quorum of all: each merge is DiLoCo's outer step (int4: with error
    feedback, the fragment's values as one vector, as DiLoCo sends them)."""
    H, P, steps = 4, 2, 12
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    quantized = dict(quantize="int4", error_feedback=True, exchange="gather") if quantize != "none" else {}
    core = make_core(num_fragments=P, outer_optimizer=outer, **quantized)
    state = core.init(_model())
    for t in range(steps):
        state, _ = core.step(state, batch(t))
    expected = [np.asarray(x) for x in jax.tree.leaves(core.global_model(state))]

    params, static = eqx.partition(_model(), eqx.is_inexact_array)
    fragmenter = Fragmenter.for_model(params, lambda m: m.blocks, P)
    s = service(fragment_vectors(params, fragmenter), outer_optimizer=outer, grace_s=30.0)
    optimizer, step = _inner_step(static)
    results, errors = {}, []

    def island(k):
        try:
            client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
            isl = Island(_model(), layers=lambda m: m.blocks, num_fragments=P, client=client, island=k,
                         quantize=quantize, error_feedback=quantize != "none")
            p = eqx.filter(isl.join(_model()), eqx.is_inexact_array)
            opt_state = optimizer.init(p)
            for t in range(steps):
                p, opt_state = step(p, opt_state, batch(t)[k])
                fragment = schedule.synced_fragment(t + 1, H, P)
                if fragment is not None:
                    p = eqx.filter(isl.sync(eqx.combine(p, static), fragment, tokens=64), eqx.is_inexact_array)
            results[k] = isl
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=island, args=(k,)) for k in range(R)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    assert all(not r.by_grace and len(r.islands) == R for r in s.syncer.merges)
    got = params
    for f in range(P):
        got = install_fragment(got, fragmenter, f, s.syncer.theta[f])
    for a, b in zip(jax.tree.leaves(got), expected):
        assert relative(a, b) <= 1e-5


def _raw_push(port, message, *, token=TOKEN):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(f"/{SERVICE}/Push", request_serializer=lambda x: x, response_deserializer=lambda x: x)
    try:
        call(message if isinstance(message, bytes) else encode(message), metadata=((TOKEN_KEY, token),), timeout=10)
        return None
    except grpc.RpcError as e:
        return e
    finally:
        channel.close()


def _push(**overrides):
    return dict(island=0, fragment=0, base_version=0, tokens=4, format="none", data=np.zeros(8, np.float32),
                scales=None, steps_per_s=None) | overrides


@pytest.mark.parametrize("message, token, code, match", [
    (_push(data=np.zeros(7, np.float32)), TOKEN, "INVALID_ARGUMENT", "payload needs data"),
    (_push(data=np.zeros(8, np.float64)), TOKEN, "INVALID_ARGUMENT", "payload needs data"),
    (_push(scales=np.zeros(1, np.float32)), TOKEN, "INVALID_ARGUMENT", "payload needs scales"),
    (_push(base_version=3), TOKEN, "FAILED_PRECONDITION", "never had"),
    (_push(data=np.full(8, np.nan, np.float32)), TOKEN, "INVALID_ARGUMENT", "NaN or Inf"),
    (_push(data=np.zeros(1 << 17, np.float32)), TOKEN, "RESOURCE_EXHAUSTED", "larger than max"),
    (_push(), "wrong", "UNAUTHENTICATED", "wrong or missing shared secret"),
    (_push(tokens=-1), TOKEN, "INVALID_ARGUMENT", "tokens must be a positive integer"),
    (_push(format="int3"), TOKEN, "INVALID_ARGUMENT", "unknown wire format"),
    (b"not a payload", TOKEN, "INVALID_ARGUMENT", "not a valid eqx_diloco payload"),
    ({"island": 0}, TOKEN, "INVALID_ARGUMENT", "malformed request"),
])
def test_bad_calls_are_refused_in_one_line_and_the_syncer_keeps_serving(service, message, token, code, match):
    s = service([np.zeros(8, np.float32)], num_islands=2, grace_s=0.0)
    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
    client.join(0)
    error = _raw_push(s.port, message, token=token)
    assert error is not None and error.code().name == code
    assert match in error.details() and "\n" not in error.details()
    if code in ("INVALID_ARGUMENT",) and isinstance(message, dict) and message.get("island") == 0:
        assert 0 not in client.status()["present"]  # the island is dropped from quorums
    # The syncer still serves: island 1 joins and merges on its own (island 0 was dropped or is absent).
    client.join(1)
    island = Island(np.zeros(8, np.float32), layers=None, client=client, island=1)
    island.versions, island.base = [0], [np.zeros(8, np.float32)]
    island.sync(np.ones(8, np.float32), 0, tokens=4)
    assert client.status()["merges"] == 1
    client.close()


@pytest.mark.parametrize("message, token, code, match", [
    ({"island": 7}, TOKEN, "INVALID_ARGUMENT", "not one of this run's 2 islands"),
    ({"fragment": 0}, TOKEN, "INVALID_ARGUMENT", "not one of this run's 2 islands"),
    (b"not a payload", TOKEN, "INVALID_ARGUMENT", "not a valid eqx_diloco payload"),
    ({"island": 0}, "wrong", "UNAUTHENTICATED", "wrong or missing shared secret"),
])
def test_bad_attend_calls_are_refused_in_one_line(service, message, token, code, match):
    s = service([np.zeros(8, np.float32)], num_islands=2)
    with grpc.insecure_channel(f"127.0.0.1:{s.port}") as channel:
        attend = channel.unary_stream(f"/{SERVICE}/Attend")
        request = message if isinstance(message, bytes) else encode(message)
        with pytest.raises(grpc.RpcError) as caught:
            list(attend(request, metadata=((TOKEN_KEY, token),), timeout=10))
    assert caught.value.code().name == code
    assert match in caught.value.details() and "\n" not in caught.value.details()
    assert s.syncer._connections == {}  # nothing counted as connected


def test_a_restarted_syncer_resumes_and_islands_ahead_of_it_rejoin(service, tmp_path):
    s = service([np.zeros(8, np.float32)], num_islands=1, grace_s=0.0)
    checkpoints = SyncerCheckpoints(tmp_path / "ckpt")
    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN, retry_s=30)
    island = Island(np.zeros(8, np.float32), layers=None, client=client, island=0, quantize="int8",
                    error_feedback=True)
    x = island.join(np.zeros(8, np.float32))
    x = island.sync(x - 1.0, 0, tokens=4)
    checkpoints.save_now(s.syncer)  # version 1 on disk
    x = island.sync(x - 1.0, 0, tokens=4)  # version 2 lost with the syncer
    assert island.versions == [2]
    port = s.port
    s.stop(0)
    restarted = {}

    def restart():
        time.sleep(0.5)  # the island's next push finds nobody listening and retries meanwhile
        restarted["service"] = service([np.zeros(8, np.float32)], num_islands=1, grace_s=0.0,
                                       address=f"127.0.0.1:{port}", restore=tmp_path / "ckpt")

    thread = threading.Thread(target=restart)
    thread.start()
    x = island.sync(x - 1.0, 0, tokens=4)  # refused as ahead of the syncer: the island joins again
    thread.join()
    assert island.lost_rounds == 1 and island.versions == [1]
    np.testing.assert_allclose(x, np.full(8, -1.0, np.float32))  # theta_g of version 1: one step of -1
    x = island.sync(x - 1.0, 0, tokens=4)
    assert island.versions == [2] and restarted["service"].syncer.tokens_merged == pytest.approx(8)
    client.close()


@pytest.mark.slow  # a client process that is killed
def test_a_killed_island_process_is_left_out_at_once_and_its_restart_is_not_waited_for(service):
    """Over gRPC, with a grace window of 60 s: island 1 is another process that joined (and so keeps an
    `Attend` stream open). SIGKILLed, the window island 0 opened closes at once without it; restarted, it
    joins again and island 0's next window still closes without waiting for it."""
    import subprocess
    import sys

    s = service([np.zeros(4, np.float32)], num_islands=2, grace_s=60.0)
    child = ("import sys, time; from eqx_diloco._rpc import SyncerClient; "
             f"SyncerClient('127.0.0.1:{s.port}', token={TOKEN!r}).join(1); print('joined', flush=True); "
             "time.sleep(120)")

    def island_1():
        proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "joined"
        _wait_for(lambda: s.syncer._connections.get(1, 0) >= 1, 30, "island 1's Attend stream")
        return proc

    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
    client.join(0)
    proc = island_1()
    assert s.syncer.present == {0, 1}
    pushed = threading.Thread(target=client.push, kwargs=dict(
        island=0, fragment=0, base_version=0, tokens=4, fmt="none", payload=quantize_payload(np.ones(4, np.float32))))
    started = time.monotonic()
    pushed.start()
    _wait_for(lambda: 0 in s.syncer._windows, 10, "island 0's contribution")
    proc.kill()
    proc.communicate()
    pushed.join(30)
    assert not pushed.is_alive() and time.monotonic() - started < 30  # not the 60 s grace window
    assert s.syncer.merges[-1].islands == (0,) and not s.syncer.merges[-1].by_grace
    restarted = island_1()  # joins again: a restart
    try:
        assert s.syncer.present == {0}
        client.push(island=0, fragment=0, base_version=1, tokens=4, fmt="none",
                    payload=quantize_payload(np.ones(4, np.float32)))
        assert s.syncer.versions == [2] and s.syncer.merges[-1].islands == (0,)
    finally:
        restarted.kill()
        restarted.communicate()
    client.close()


def quantize_payload(x):
    from eqx_diloco import quantize

    return quantize.encode(jax.numpy.asarray(x), "none")


def test_an_unreachable_syncer_is_reported_in_one_line():
    client = SyncerClient("127.0.0.1:1", token=TOKEN, retry_s=0.3)
    with pytest.raises(SyncerUnreachable, match="did not answer for 0 s"):
        client.join(0)


def test_the_island_refuses_a_syncer_of_another_model(service):
    s = service([np.zeros(5, np.float32)], num_islands=1)
    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
    with pytest.raises(ConfigError, match="serves another model"):
        Island(np.zeros(8, np.float32), layers=None, client=client, island=0).join(np.zeros(8, np.float32))
    with pytest.raises(SyncRefused, match="not one of this run's 1 islands"):
        client.join(3)


@pytest.mark.parametrize("overrides, match", [
    (dict(algorithm="ddp"), "--decoupled.role needs --algorithm diloco"),
    (dict(mesh={"replicas_per_device": 2}), "--mesh.replicas-per-device must be 0 or 1 with --decoupled.role"),
    (dict(dist={"num_processes": 2}), "--mesh.data x --mesh.fsdp x --mesh.tensor = 1 must be a multiple of "
                                      "--dist.num-processes 2"),
    (dict(dist={"num_processes": 2}, mesh={"fsdp": 2}, decoupled={"role": "syncer"}),
     "--dist.num-processes must be unset or 1 for the syncer"),
    (dict(diloco={"overlap_steps": 1, "sync_period": 4}), "--diloco.overlap-steps must be 0 with --decoupled.role"),
    (dict(decoupled={"island": 2}), r"--decoupled.island must be in \[0, 2\)"),
    (dict(decoupled={"min_quorum": 3}), r"--decoupled.min-quorum must be in \[1, 2\]"),
    (dict(decoupled={"grace_s": -1.0}), "--decoupled.grace-s must be >= 0"),
    (dict(decoupled={"grace_min_s": 2.0, "grace_max_s": 1.0}), "--decoupled.grace-min-s must be in"),
    (dict(decoupled={"max_staleness": -1}), "--decoupled.max-staleness must be >= 0"),
    (dict(decoupled={"syncer": "localhost"}), "--decoupled.syncer must be HOST:PORT"),
    (dict(decoupled={"role": "syncer", "standby": True}), "--decoupled.standby needs --decoupled.role island"),
])
def test_bad_decoupled_flags_are_refused_in_one_line(make_config, overrides, match):
    import dataclasses

    decoupled = dataclasses.replace(DecoupledConfig(role="island"), **overrides.pop("decoupled", {}))
    dist = overrides.pop("dist", {})
    config = dataclasses.replace(make_config(**overrides), decoupled=decoupled)
    config = dataclasses.replace(config, dist=dataclasses.replace(config.dist, **dist))
    with pytest.raises(ConfigError, match=match):
        validate(config)


@pytest.mark.parametrize("argv, match", [
    (["--num-processes", "2", "--", "--diloco.num-replicas", "3"], "--diloco.num-replicas must equal --num-processes 2"),
    (["--num-processes", "2", "--", "--elastic.enabled"], "--decoupled and --elastic.enabled exclude each other"),
    (["--num-processes", "2", "--", "--decoupled.island", "1"], "--decoupled.island is set by the launcher"),
    (["--num-processes", "2", "--max-restarts", "-1"], "--max-restarts must be >= 0"),
    (["--num-processes", "2", "--processes-per-island", "0"], "--processes-per-island must be >= 1"),
    (["--num-processes", "2", "--", "--dist.num-processes", "2"], "--dist.num-processes is set by the launcher"),
    (["--num-processes", "2", "--", "--decoupled.standby"], "--decoupled.standby is set by the launcher"),
    (["--num-processes", "2", "--spares", "1"], "--spares must be >= 0, and needs --max-restarts >= 1"),
    (["--num-processes", "2", "--max-restarts", "1", "--spares", "-1"], "--spares must be >= 0"),
])
def test_bad_decoupled_launcher_flags_are_refused_in_one_line(capsys, argv, match):
    assert launch_main(["--decoupled", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flag", ["--processes-per-island", "--spares"])
def test_processes_per_island_and_spares_need_decoupled_islands(capsys, flag):
    assert launch_main(["--num-processes", "2", flag, "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {flag} needs --decoupled (got 2)"


@pytest.mark.parametrize("line, match", [
    ("", "its standard input closed before it was given an island"),
    ("island 1\n", "expected a line"),
    ('{"cpus": null}\n', "expected a line"),
    ('{"island": 2}\n', r"island 2 is not in \[0, 2\)"),
])
def test_a_standby_island_refuses_a_bad_assignment_in_one_line(make_config, monkeypatch, line, match):
    import io

    from eqx_diloco.lm.island import IslandError, await_assignment

    monkeypatch.setattr("sys.stdin", io.StringIO(line))
    with pytest.raises(IslandError, match=match) as e:
        await_assignment(make_config())
    assert "\n" not in str(e.value)


def test_a_standby_island_becomes_the_island_it_is_given_on_the_cpus_it_is_given(make_config, monkeypatch):
    import io
    import json
    import os

    from eqx_diloco.lm._compile_cpus import keep_to_cpus
    from eqx_diloco.lm.island import await_assignment

    cpus = sorted(os.sched_getaffinity(0))
    seen = {}
    started, done = threading.Event(), threading.Event()

    def other_thread():  # a thread started before the assignment (as XLA's pools are) moves too
        started.set()
        done.wait(10)
        seen["thread"] = sorted(os.sched_getaffinity(0))

    thread = threading.Thread(target=other_thread)
    thread.start()
    started.wait(10)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"island": 1, "cpus": cpus[-1:]}) + "\n"))
    try:
        config = await_assignment(dataclasses.replace(make_config(), decoupled=DecoupledConfig(role="island", standby=True)))
        seen["main"] = sorted(os.sched_getaffinity(0))
    finally:
        done.set()
        thread.join()
        keep_to_cpus(cpus)  # every thread of this test process (XLA's pools too) back where it was
    assert config.decoupled.island == 1 and not config.decoupled.standby and config.decoupled.role == "island"
    assert seen == {"main": cpus[-1:], "thread": cpus[-1:]}


def _wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.slow
def test_the_launcher_runs_on_through_killed_islands_and_a_killed_syncer(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys

    run, steps = tmp_path / "run", 300
    flags = ["--run-dir", str(run), "--data.source", "synthetic", "--model.num-layers", "2", "--model.dim", "32",
             "--model.num-heads", "2", "--train.batch-size", "4", "--train.seq-len", "16", "--train.steps", str(steps),
             "--train.eval-every", "100", "--diloco.sync-period", "10", "--diloco.num-fragments", "2",
             "--diloco.quantize", "int4", "--diloco.error-feedback", "--mesh.fsdp", "2"]  # islands of 2 devices
    env = dict(os.environ, EQX_DILOCO_SLOW_ISLANDS="0:0.02,1:0.02")  # 20 ms more per step: killed mid-run
    # (Islands of several processes restart as a whole: test_one_dead_process_takes_its_island_down_...)
    proc = subprocess.Popen([sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2",
                             "--max-restarts", "1", "--log-dir", str(tmp_path / "logs"), "--", *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def step_of(k):
            return max((r["step"] for r in read_jsonl(run / f"island-{k}" / "metrics.jsonl") if "loss" in r), default=0)

        _wait_for(lambda: step_of(1) >= 60, 120, "island 1 at step 60")
        os.kill(int((run / "island-1" / "pid").read_text()), signal.SIGKILL)
        _wait_for(lambda: len(read_jsonl(run / "syncer" / "metrics.jsonl")) >= 12
                  and any((run / "syncer" / "checkpoints").glob("[0-9]*")), 120, "12 merges and a syncer checkpoint")
        os.kill(json.loads((run / "syncer" / "address.json").read_text())["pid"], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()  # the islands and the syncer die with the launcher
        proc.communicate()
    assert proc.returncode == 0, output
    assert "island 1 exited with -9; restart 1 of 1" in output and "syncer exited with -9; restart 1 of 1" in output
    for k in range(2):
        records = read_jsonl(run / f"island-{k}" / "metrics.jsonl")
        assert max(r["step"] for r in records if "loss" in r) == steps
    joins = [r for r in read_jsonl(run / "island-1" / "metrics.jsonl") if r.get("joined")]
    assert len(joins) == 2 and joins[1]["step"] > 0  # it rejoined where its newest sync left it
    assert {(r["devices"], r["processes"]) for r in joins} == {(2, 1)}
    assert json.loads((run / "syncer" / "address.json").read_text())["restored"] is not None
    summary = json.loads((run / "syncer" / "summary.json").read_text())
    computed = 4 * 16 * sum(1 for k in range(2) for r in read_jsonl(run / f"island-{k}" / "metrics.jsonl") if "loss" in r)
    assert 0.5 * computed < summary["tokens_merged"] < computed  # the kills lost some work, not most of it
    evals = [r["eval_loss"] for r in read_jsonl(run / "metrics.jsonl")]
    assert evals[-1] < 0.7 * evals[0]


@pytest.mark.slow  # stand-in processes, no JAX program: a few seconds
def test_one_dead_process_takes_its_island_down_and_the_island_restarts_whole(tmp_path):
    """Islands of 2 processes (`--processes-per-island 2`) under the decoupled launcher, with a stand-in
    trainer: island 1's process 1 fails at its first start; its leader, still running, is stopped with it,
    and island 1 starts again as 2 processes with a coordinator of its own; island 0 is never touched."""
    import json
    import os
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parent
    env = dict(os.environ, DECOUPLED_CHILD_DIR=str(tmp_path), DECOUPLED_CHILD_FAIL="1:1", DECOUPLED_CHILD_SECONDS="3",
               PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2",
                           "--processes-per-island", "2", "--max-restarts", "1", "--module", "decoupled_child",
                           "--log-dir", str(tmp_path / "logs"), "--", "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "2 decoupled islands of 2 processes" in proc.stderr
    assert "island 1 exited with 1; restart 1 of 1" in proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    starts, finished = [r for r in lines if "role" in r], {r["finished"] for r in lines if "finished" in r}
    island = {k: [s for s in starts if s["island"] == k] for k in ("0", "1")}
    # The processes of one start write in any order; a restart writes only after its first start failed.
    generations = (island["0"], island["1"][:2], island["1"][2:])
    assert [sorted(s["process"] for s in starts) for starts in generations] == [[0, 1]] * 3
    assert {s["processes"] for s in island["0"] + island["1"]} == {"2"}
    coordinators = [{s["coordinator"] for s in starts} for starts in generations]
    assert all(len(c) == 1 for c in coordinators) and len(set.union(*coordinators)) == 3  # one per island start
    assert not {s["pid"] for s in island["1"][:2]} & finished  # the first leader was stopped with its failed process
    assert finished == {s["pid"] for s in island["0"] + island["1"][2:]}  # every other island process finished
    assert [s["role"] for s in starts].count("syncer") == 1
    # Each island process keeps to its own share of the CPUs (one CPU each where they outnumber the CPUs),
    # a restart to the same one; the syncer may use every CPU.
    from eqx_diloco.lm._processes import cpu_shares

    shares = cpu_shares(4)
    assert all(s["cpus"] == shares[2 * int(s["island"]) + s["process"]] for s in island["0"] + island["1"])
    assert next(s["cpus"] for s in starts if s["role"] == "syncer") == sorted(os.sched_getaffinity(0))


@pytest.mark.slow  # one trainer process: start-up and a compile
def test_a_standby_trainer_compiles_then_stops_in_one_line_when_no_island_comes(tmp_path):
    """`python -m eqx_diloco.train --decoupled.standby` with nothing on its standard input (the launcher
    gone): it gets through its warm-up (the step run once, no syncer needed) to the wait, then exits 1
    with one line; no island folder is written."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "eqx_diloco.train", "--decoupled.role", "island", "--decoupled.standby",
           "--decoupled.syncer", "127.0.0.1:9", "--run-dir", str(run), "--data.source", "synthetic",
           "--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.batch-size", "2",
           "--train.seq-len", "16"]
    proc = subprocess.run(cmd, env=dict(os.environ, EQX_DILOCO_SYNCER_TOKEN=TOKEN), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "standby island: its standard input closed before it was given an island to become" in last
    assert not list(run.glob("island-*"))


@pytest.mark.slow  # stand-in processes, no JAX program: a few seconds
def test_a_spare_takes_a_lost_islands_place_and_a_new_spare_starts_behind_it(tmp_path):
    """`--spares 1` with islands of 2 processes and a stand-in trainer: island 1's process 1 fails at its
    first start; the spare's two processes (started as a standby, `--decoupled.standby`) are told they are
    island 1, each on island 1's share of the CPUs for that process, and finish as island 1; a new spare
    starts behind it (island 0 still has a restart left) and is stopped at the end, never needed."""
    import json
    import os
    import subprocess
    import sys

    tests = pathlib.Path(__file__).parent
    env = dict(os.environ, DECOUPLED_CHILD_DIR=str(tmp_path), DECOUPLED_CHILD_FAIL="1:1", DECOUPLED_CHILD_SECONDS="3",
               PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "2",
                           "--processes-per-island", "2", "--max-restarts", "1", "--spares", "1", "--module",
                           "decoupled_child", "--log-dir", str(tmp_path / "logs"), "--", "--run-dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "2 decoupled islands of 2 processes, 1 spare(s)" in proc.stderr
    assert "island 1 exited with 1; restart 1 of 1" in proc.stderr
    assert f"spare 0 took the place of island 1 (its output: {tmp_path / 'logs' / 'spare-0.log'})" in proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "run").parent.joinpath("starts.jsonl").read_text().splitlines()]
    starts = [r for r in lines if "role" in r]
    spares = [s for s in starts if s["role"] == "island" and s["island"] is None]
    islands = [s for s in starts if s["role"] == "island" and s["island"] is not None]
    took = [r for r in lines if "took" in r]
    finished = {r["finished"] for r in lines if "finished" in r}
    assert len(spares) == 4 and len(islands) == 4  # two spares of 2 processes; no fresh start of island 1
    assert sorted((r["took"], r["process"]) for r in took) == [("1", 0), ("1", 1)]
    first_spare = {s["pid"] for s in spares[:2]}  # the second spare starts only once the first took a place
    assert {r["pid"] for r in took} == first_spare
    from eqx_diloco.lm._processes import cpu_shares

    shares = cpu_shares(4)
    assert all(r["cpus"] == shares[2 + r["process"]] for r in took)  # island 1's share, process by process
    island0 = {s["pid"] for s in islands if s["island"] == "0"}
    assert finished == island0 | first_spare  # island 0, and island 1 as the spare; the new spare was stopped


@pytest.mark.slow  # two decoupled runs through the launcher (about 40 s)
def test_an_island_of_two_processes_trains_like_an_island_of_one(tmp_path):
    """One island (so every merge is deterministic) of fsdp 2 x tensor 2 over 2 processes, against the same
    island in one process: the same theta_g after 12 steps of 2 fragments, with int4 and error feedback."""
    import json
    import subprocess
    import sys

    def run(name, processes):
        run_dir = tmp_path / name
        flags = ["--run-dir", str(run_dir), "--data.source", "synthetic", "--model.num-layers", "2",
                 "--model.dim", "32", "--model.num-heads", "2", "--train.batch-size", "4", "--train.seq-len", "16",
                 "--train.steps", "12", "--train.eval-every", "12", "--diloco.sync-period", "6",
                 "--diloco.num-fragments", "2", "--diloco.quantize", "int4", "--diloco.error-feedback",
                 "--mesh.fsdp", "2", "--mesh.tensor", "2"]
        proc = subprocess.run([sys.executable, "-m", "eqx_diloco.launch", "--decoupled", "--num-processes", "1",
                               "--processes-per-island", str(processes), "--log-dir", str(tmp_path / f"{name}-logs"),
                               "--", *flags], capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (join,) = [r for r in read_jsonl(run_dir / "island-0" / "metrics.jsonl") if r.get("joined")]
        assert (join["devices"], join["processes"]) == (4, processes)
        return read_jsonl(run_dir / "metrics.jsonl")[-1], json.loads((run_dir / "syncer" / "summary.json").read_text())

    (one, one_summary), (two, two_summary) = run("one", 1), run("two", 2)
    assert one["versions"] == two["versions"] == [3, 2]  # fragment 0 at steps 3, 9 and the final sync
    assert one_summary["tokens_merged"] == two_summary["tokens_merged"] == 12 * 4 * 16
    np.testing.assert_allclose(two["eval_loss"], one["eval_loss"], rtol=1e-5)


def test_a_custom_model_trains_as_decoupled_islands_through_the_public_roles(service):
    """The library roles with a model that is not from `models/` (StackedMLP): two islands, int8 with error
    feedback, two fragments; every merge takes both islands, and the global model fits better."""
    from custom_model import IN_DIM, StackedMLP

    from eqx_diloco import decoupled

    model = StackedMLP(key=jax.random.key(0))
    layers = lambda m: m.blocks
    syncer = decoupled.make_syncer(model, layers=layers, num_fragments=2, num_islands=2, grace_s=30.0,
                                   outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True))
    s = SyncerService(syncer, address="127.0.0.1:0", token=TOKEN).start()
    xs = jax.random.normal(jax.random.key(1), (64, IN_DIM))
    ys = jax.numpy.sin(xs.sum(axis=1))

    def loss(m, x, y):
        return jax.numpy.mean((jax.vmap(m)(x) - y) ** 2)

    optimizer = optax.sgd(0.05, momentum=0.9)

    @eqx.filter_jit
    def step(m, opt_state, x, y):
        grads = eqx.filter_grad(loss)(m, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), opt_state

    errors = []

    def island(k):
        try:
            client = decoupled.SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
            isl = decoupled.Island(model, layers=layers, num_fragments=2, client=client, island=k, quantize="int8",
                                   error_feedback=True)
            m = isl.join(model)
            opt_state = optimizer.init(eqx.filter(m, eqx.is_inexact_array))
            for t in range(40):
                m, opt_state = step(m, opt_state, xs[k::2], ys[k::2])
                fragment = schedule.synced_fragment(t + 1, 4, 2)
                if fragment is not None:
                    m = isl.sync(m, fragment, tokens=32)
            isl.leave()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=island, args=(k,)) for k in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    s.stop(0)
    assert not errors, errors
    assert syncer.versions == [10, 10] and all(len(r.islands) == 2 for r in syncer.merges)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    fragmenter = Fragmenter.for_model(params, layers, 2)
    trained = params
    for f in range(2):
        trained = decoupled.install_fragment(trained, fragmenter, f, syncer.theta[f])
    assert loss(eqx.combine(trained, static), xs, ys) < 0.5 * loss(model, xs, ys)


def test_a_push_in_the_background_keeps_the_steps_made_meanwhile(service):
    """`push` returns at once; `collect` installs theta_new plus what the island moved since it sent, and the
    next outer gradient is taken against theta_new."""
    s = service([np.zeros(4, np.float32)], num_islands=1, grace_s=0.0)
    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
    island = Island(np.zeros(4, np.float32), layers=None, client=client, island=0)
    x = island.join(np.zeros(4, np.float32))
    island.push(x - 1.0, 0, tokens=4)  # outer gradient +1: theta_g becomes -1 (sgd lr 1)
    assert island.in_flight(0)
    with pytest.raises(RuntimeError, match="already has a push in flight"):
        island.push(x, 0, tokens=4)
    x = island.collect(x - 1.5, wait=True)  # the island went on by -0.5 after sending
    np.testing.assert_allclose(x, np.full(4, -1.5, np.float32))
    assert island.versions == [1] and not island.in_flight(0)
    np.testing.assert_allclose(island.base[0], np.full(4, -1.0, np.float32))
    x = island.sync(x, 0, tokens=4)  # those -0.5 now reach theta_g: -1 - 0.5
    np.testing.assert_allclose(np.asarray(s.syncer.theta[0]), np.full(4, -1.5, np.float32))
    client.close()


def test_adaptive_h_follows_the_islands_speed():
    from eqx_diloco.decoupled import adaptive_sync_period

    assert adaptive_sync_period(10, 5.0, 10.0) == 5  # half as fast: syncs every H / 2 steps
    assert adaptive_sync_period(10, 10.0, 10.0) == 10
    assert adaptive_sync_period(10, 20.0, 10.0) == 10  # never above H
    assert adaptive_sync_period(10, 0.1, 10.0) == 1  # never below 1
    assert adaptive_sync_period(10, 5.0, None) == 10  # nothing measured yet


@pytest.mark.parametrize("kwargs, match", [
    ({"num_islands": 0}, "num_islands must be >= 1"),
    ({"min_quorum": 3}, r"min_quorum must be in \[1, 2\]"),
    ({"grace_s": -0.5}, "grace_s must be >= 0"),
    ({"grace_min_s": 2.0, "grace_max_s": 1.0}, "need 0 <= grace_min_s <= grace_max_s"),
    ({"max_staleness": -1}, "max_staleness must be >= 0"),
])
def test_bad_syncer_arguments_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), **({"num_islands": 2} | kwargs))
    with pytest.raises(ConfigError, match="needs a non-empty shared secret"):
        SyncerService(Syncer([np.zeros(4, np.float32)], outer_optimizer=optax.sgd(1.0), num_islands=1),
                      address="127.0.0.1:0", token="")


def test_the_syncer_and_a_joined_island_compile_their_programs_before_the_first_sync(service):
    """`Syncer.compile_ahead` compiles each fragment's outer step and `Island.join` each fragment's encoder,
    so neither program is lowered at the first push and merge (where every island would wait for it)."""
    lowered = []

    def listen(event, duration, **kwargs):
        if event.endswith("jaxpr_to_mlir_module_duration"):  # one per program lowered
            lowered.append(event)

    rng = np.random.default_rng(7)  # sizes and an optimizer no other test compiled
    s = service([rng.normal(size=37).astype(np.float32)], num_islands=1, grace_s=0.0,
                outer_optimizer=optax.sgd(0.61, momentum=0.37, nesterov=True))
    s.syncer.compile_ahead()
    client = SyncerClient(f"127.0.0.1:{s.port}", token=TOKEN)
    island = Island(np.zeros(37, np.float32), layers=None, client=client, island=0, quantize="int8",
                    error_feedback=True)
    moved = island.join(np.zeros(37, np.float32)) - 0.25  # the island's training, done before listening
    jax.block_until_ready(moved)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        island.sync(moved, 0, tokens=4)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        client.close()
    assert island.versions == [1] and lowered == [], f"{len(lowered)} programs were lowered at the first sync"


@pytest.mark.slow  # compiles a 4-device and a 1-device step
def test_a_sharded_island_steps_like_a_one_device_island(make_config, tmp_path):
    """`--mesh.fsdp 2 --mesh.tensor 2`: the island's parameters are laid out by the trainer's rules over its
    4 devices (and kept there after a merge installs host values), and its steps compute what one
    device computes."""
    from eqx_diloco.lm.island import initial_model, island_placement

    config = make_config(mesh={"fsdp": 2, "tensor": 2}, train={"batch_size": 4})
    model = initial_model(config)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    shardings, batch_sharding = island_placement(config, model)
    assert batch_sharding.mesh.size == 4
    assert shardings.blocks.attn.q.spec == PartitionSpec(None, "fsdp", "tensor")
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (3, 4, 17), 0, config.model.vocab_size))
    losses = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix float and int32 counts
        _train_both(params, static, shardings, batch_sharding, tokens, config, model, losses)
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    with pytest.raises(ConfigError, match="an island of --mesh.data x --mesh.fsdp x --mesh.tensor = 64 devices"):
        island_placement(make_config(mesh={"fsdp": 64}), model)


def _train_both(params, static, shardings, batch_sharding, tokens, config, model, losses):
    from eqx_diloco.lm.island import _make_step
    from eqx_diloco.lm.optimizers import inner_optimizer

    for sharded in (False, True):
        p = jax.tree.map(np.array, params)  # fresh buffers: the step donates them
        p = jax.device_put(p, shardings) if sharded else jax.tree.map(jax.numpy.asarray, p)
        optimizer = inner_optimizer(config.train, model.weight_decay_mask(), config.optim)
        step, opt_state, out = _make_step(static, optimizer, 0.0), optimizer.init(p), []
        for t in range(3):
            batch = jax.device_put(tokens[t], batch_sharding) if sharded else tokens[t]
            p, opt_state, loss = step(p, opt_state, batch, jax.random.key(t))
            out.append(float(loss))
        losses[sharded] = out
        if sharded:
            assert p.blocks.attn.q.sharding.spec == PartitionSpec(None, "fsdp", "tensor")


def test_without_waiting_an_island_pushes_a_fragment_again_only_once_its_merge_is_back(service, make_config,
                                                                                       monkeypatch):
    """`--decoupled.no-wait` with merges slower than H steps: the island waits only for its first merge (not
    after a restart); a push due while the previous one is open goes out once that merge came back,
    carrying every step made since, so pushes are fewer than steps / H; the run ends at the first merge
    that brings theta_g to --train.steps of tokens. The island's step program compiles once (its first and second steps see
    arguments laid out alike)."""
    import json

    from eqx_diloco.decoupled import make_syncer
    from eqx_diloco.lm import island as island_module
    from eqx_diloco.lm.island import initial_model, run_island

    steps_made = []
    make_step = island_module._make_step
    monkeypatch.setattr(island_module, "_make_step", lambda *a, **k: steps_made.append(make_step(*a, **k)) or steps_made[-1])

    config = make_config(train={"steps": 24})
    syncer = make_syncer(initial_model(config), layers=lambda m: m.blocks, num_islands=1, grace_s=0.0,
                         outer_optimizer=optax.sgd(1.0))
    contribute = syncer.contribute

    def slow_contribute(*args, **kwargs):  # every merge comes back well after the island's next H = 2 steps
        time.sleep(0.4)
        return contribute(*args, **kwargs)

    syncer.contribute = slow_contribute
    s = SyncerService(syncer, address="127.0.0.1:0", token=TOKEN).start()
    monkeypatch.setenv("EQX_DILOCO_SYNCER_TOKEN", TOKEN)
    config = dataclasses.replace(config, decoupled=DecoupledConfig(
        role="island", island=0, syncer=f"127.0.0.1:{s.port}", wait=False))
    config = dataclasses.replace(config, diloco=dataclasses.replace(config.diloco, num_replicas=1))
    log = config.run_dir / "island-0" / "metrics.jsonl"
    try:
        with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix float and int32 counts
            assert run_island(config) == 0
            first_run = len(log.read_text().splitlines())
            # Restarted, with a budget not reached yet: it goes on from its newest sync and waits for no merge.
            longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=240))
            assert run_island(longer) == 0
            second_run = len(log.read_text().splitlines())
            assert run_island(longer) == 0  # restarted after the run's end: it joins and stops
    finally:
        s.stop(0)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    lines, restarted, after_end = lines[:first_run], lines[first_run:second_run], lines[second_run:]
    assert [r.keys() >= {"joined"} or r.keys() >= {"budget_reached"} for r in after_end] == [True, True]
    steps, syncs = [r for r in lines if "loss" in r], [r for r in lines if "sync" in r]
    tokens_per_step = config.train.batch_size * config.train.seq_len
    assert restarted[0]["joined"] and restarted[0]["step"] == syncs[-1]["step"] and restarted[-1]["budget_reached"]
    waits = [r["wait_s"] for r in restarted if "sync" in r]
    assert waits and max(waits) < 0.4
    budget = 24 * tokens_per_step
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    sent = [r["tokens_sent"] for r in syncs]
    assert sum(sent[:-1]) < budget <= sum(sent) == lines[-1]["tokens_merged"]  # it stopped at that merge
    assert lines[-1]["budget_reached"]
    assert len(syncs) < len(steps) // 2 and max(sent) > 2 * tokens_per_step
    assert syncs[0]["wait_s"] >= 0.4 and all(r["wait_s"] < 0.4 for r in syncs[1:])  # only the first merge waited
    # Each later round counts from the step its merge came back in (H = 2: the next push one step later).
    merged = [r for r in lines if "merged" in r]
    assert len(merged) == len(syncs) - 1
    assert [r["step"] for r in syncs[2:]] == [r["step"] + 1 for r in merged[:-1]]
    assert len(steps_made) == 3 and steps_made[0]._cache_size() == 1  # one program per run


def test_a_standby_island_compiles_before_its_assignment_and_trains_as_the_island_it_is_given(make_config,
                                                                                            monkeypatch):
    """`--decoupled.standby`: the island runs its step once before it reads which island it is (so the
    run's steps reuse that program: one compile in all), then trains as island 1 of 2, in island 1's
    folder, from theta_g."""
    import io
    import json

    from eqx_diloco.decoupled import make_syncer
    from eqx_diloco.lm import island as island_module
    from eqx_diloco.lm.island import initial_model, run_island

    steps_made, order = [], []
    make_step = island_module._make_step
    monkeypatch.setattr(island_module, "_make_step", lambda *a, **k: steps_made.append(make_step(*a, **k)) or steps_made[-1])

    class Assignment(io.StringIO):
        def readline(self, *args):  # the step has run (compiled) by the time the island reads its id
            order.append(steps_made[0]._cache_size())
            return super().readline(*args)

    monkeypatch.setattr("sys.stdin", Assignment(json.dumps({"island": 1, "cpus": None}) + "\n"))
    config = make_config(train={"steps": 6})
    syncer = make_syncer(initial_model(config), layers=lambda m: m.blocks, num_islands=2, grace_s=0.0,
                         outer_optimizer=optax.sgd(1.0))
    s = SyncerService(syncer, address="127.0.0.1:0", token=TOKEN).start()
    monkeypatch.setenv("EQX_DILOCO_SYNCER_TOKEN", TOKEN)
    config = dataclasses.replace(config, decoupled=DecoupledConfig(
        role="island", syncer=f"127.0.0.1:{s.port}", standby=True))
    try:
        with jax.numpy_dtype_promotion("standard"):  # optax's schedules mix float and int32 counts
            assert run_island(config) == 0
    finally:
        s.stop(0)
    assert order == [1] and steps_made[0]._cache_size() == 1  # compiled before the assignment, and only then
    assert not (config.run_dir / "island-0").exists()
    lines = read_jsonl(config.run_dir / "island-1" / "metrics.jsonl")
    assert lines[0]["joined"] and [r["step"] for r in lines if "loss" in r] == list(range(1, 7))
    assert [r["sync"] for r in lines if "sync" in r] == [0, 0, 0]
    assert len(syncer.merges) == 3
