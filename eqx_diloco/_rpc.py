"""The syncer as a gRPC service, and the islands' client of it.

gRPC carries the bytes; every request and reply is a `_wire` payload (raw array bytes under a typed
JSON header), never pickle, so whatever reaches the port can only ever build numpy arrays and plain
values. No generated protobuf code is needed: the methods are unary calls on bytes.

Methods of the service `eqx_diloco.Syncer`:

- `Join {island}` -> `{versions, theta}`: a (re)starting island gets every fragment's theta_g.
- `Push {island, fragment, base_version, tokens, format, data, scales, steps_per_s}` ->
  `{version, theta, tokens_merged, fastest_steps_per_s}`: one (quantized) outer gradient; the reply comes when the
  window it joined has merged (at most the grace window later).
- `Leave {island}` -> `{}`: an island that finished.
- `Attend {island}` -> a stream that never yields: a joined island's client keeps it open while the
  island runs. When it closes (the island's process ended, or its link dropped) the syncer stops
  waiting for the island at once instead of after a grace window. An island may hold at most
  `ATTEND_PER_ISLAND` open streams (more are refused, RESOURCE_EXHAUSTED), and HTTP/2 keepalive
  pings close the stream of a host that vanished, so open streams never take the server's threads.
- `Status {}` -> versions, islands present, tokens merged and refused, merges so far.

Every call carries the shared secret in the metadata `x-eqx-diloco-token` and is refused
(UNAUTHENTICATED) without it. A refused push is one line (INVALID_ARGUMENT: the island is dropped
from quorums; FAILED_PRECONDITION / NOT_FOUND: the island must join again, e.g. after the syncer
restarted from a checkpoint older than the island's theta_g). The client retries calls the syncer
could not answer (it is restarting) with exponential backoff.
"""

import hmac
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import jax
import numpy as np

from . import quantize
from ._errors import ConfigError
from ._syncer import Refused, Syncer, is_integer
from ._wire import WireFormatError, decode, encode

SERVICE = "eqx_diloco.Syncer"
TOKEN_KEY = "x-eqx-diloco-token"
TOKEN_ENV = "EQX_DILOCO_SYNCER_TOKEN"
_HEADER_SLACK = 1 << 16  # bytes a push may carry beyond its largest float32 fragment (header, scales)
ATTEND_PER_ISLAND = 2  # an island's open `Attend` streams: its own, and a restarted one's while the old one closes
_SHORT_CALLS = 8  # server threads beyond the ones waiting pushes and open streams can hold (Join, Status, Leave)
# Pings on idle connections find a host that vanished without closing its streams (a power cut, a
# dropped link): its stream is closed within about a minute, and its thread freed.
_KEEPALIVE = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 20_000),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def _identity(x: bytes) -> bytes:
    return x


class SyncRefused(RuntimeError):
    """The syncer refused a call (one line). `rejoin` says whether joining again fixes it."""

    def __init__(self, message: str, *, rejoin: bool):
        super().__init__(message)
        self.rejoin = rejoin


class SyncerUnreachable(RuntimeError):
    """The syncer did not answer within the client's retry budget."""


class SyncerService:
    """Serves a `Syncer` over gRPC.

    **Arguments:**

    - `syncer`: the state and merge rule.
    - `address`: `host:port` to listen on (port 0: any free port, see `port`).
    - `token`: the shared secret every call must carry.
    - `max_workers`: server threads; each waiting push and each open `Attend` stream holds one
      (default: what every island's pushes of every fragment and its streams can hold, and 8 more).
    """

    def __init__(self, syncer: Syncer, *, address: str, token: str, max_workers: int | None = None):
        if not token:
            raise ConfigError("the syncer needs a non-empty shared secret ($" + TOKEN_ENV + " or --decoupled.token-file)")
        self.syncer, self.token = syncer, token.encode()
        # A push carries one fragment (float32 at most); a join's reply carries all of them.
        self.max_message = 4 * max(syncer.sizes) + _HEADER_SLACK
        self._payload_shapes: dict[tuple[int, str], Any] = {}
        # No SO_REUSEPORT: a second syncer on a port in use must fail, not split the islands with the first.
        options = [("grpc.max_receive_message_length", self.max_message),
                   ("grpc.max_send_message_length", 4 * sum(syncer.sizes) + _HEADER_SLACK),
                   ("grpc.so_reuseport", 0), *_KEEPALIVE]
        # A window holds one push per island, so waiting pushes are at most islands x fragments.
        workers = max_workers or syncer.num_islands * (len(syncer.sizes) + ATTEND_PER_ISLAND) + _SHORT_CALLS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options)
        self._streams: dict[int, int] = {}  # open `Attend` streams per island
        self._streams_lock = threading.Lock()
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            self._guarded(method), request_deserializer=_identity, response_serializer=_identity)
            for name, method in [("Join", self._join), ("Push", self._push), ("Leave", self._leave),
                                 ("Status", self._status)]}
        handlers["Attend"] = grpc.unary_stream_rpc_method_handler(
            self._attend, request_deserializer=_identity, response_serializer=_identity)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises "Failed to bind to address ..." where older ones returned 0
            self.port = 0
        if self.port == 0:
            raise ConfigError(f"the syncer cannot listen on {address} (in use, or not an address of this host)")
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._stopped = threading.Event()

    def start(self) -> "SyncerService":
        self.server.start()
        self._ticker.start()
        # Open `Attend` streams hold server threads, which the interpreter joins at exit; threading's
        # exit callbacks run before that join, so a service never stopped still lets its process end.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(self._stop_at_exit)
        return self

    def _stop_at_exit(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self.server.stop(0)

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopped.set()
        self.server.stop(grace_s).wait()

    def _tick(self) -> None:
        # Windows close by grace even when no island calls in (all the others wait in `Push`).
        while not self._stopped.wait(0.01):
            self.syncer.poll()

    def _check_token(self, context: grpc.ServicerContext) -> None:
        sent = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        if not hmac.compare_digest(str(sent).encode(), self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "refused: wrong or missing shared secret")

    @staticmethod
    def _message(request: bytes, context: grpc.ServicerContext) -> dict:
        """The request's message (raises `WireFormatError`, or `Refused` when it is not an object)."""
        message = decode(request, source=f"a request from {context.peer()}")
        if not isinstance(message, dict):
            raise Refused("the request is not an object")
        return message

    def _attend(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._check_token(context)
        try:
            island = self._message(request, context).get("island")
            self.syncer.check_island(island)
        except (Refused, WireFormatError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: {e}")
        with self._streams_lock:
            full = self._streams.get(island, 0) >= ATTEND_PER_ISLAND
            if not full:
                self._streams[island] = self._streams.get(island, 0) + 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"refused: island {island} already holds {ATTEND_PER_ISLAND} open Attend streams")
        try:
            self.syncer.connected(island)
        except BaseException:
            self._release_stream(island)
            raise
        ended = threading.Event()
        context.add_callback(ended.set)  # the call ended: the island closed it, or its connection dropped
        try:
            while context.is_active() and not self._stopped.is_set():
                ended.wait(0.25)
        finally:
            self._release_stream(island)
            self.syncer.disconnected(island)
        yield from ()

    def _release_stream(self, island: int) -> None:
        with self._streams_lock:
            self._streams[island] -= 1

    def _guarded(self, method: Callable[[dict], dict]) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            self._check_token(context)
            island = None
            try:
                message = self._message(request, context)
                island = message.get("island")
                return encode(method(message))
            except Refused as e:
                if e.kind == "invalid" and is_integer(island) and 0 <= island < self.syncer.num_islands:
                    self.syncer.drop(island)
                code = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "version": grpc.StatusCode.FAILED_PRECONDITION,
                        "unknown": grpc.StatusCode.NOT_FOUND}[e.kind]
                context.abort(code, f"refused: {e}")
            except WireFormatError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: {e}")
            except (KeyError, TypeError, ValueError) as e:
                if is_integer(island) and 0 <= island < self.syncer.num_islands:
                    self.syncer.drop(island)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: malformed request ({type(e).__name__}: {e})")

        return handler

    def _join(self, message: dict) -> dict:
        fragments = self.syncer.join(message["island"])
        return {"versions": [v for v, _ in fragments], "theta": [t for _, t in fragments]}

    def _leave(self, message: dict) -> dict:
        self.syncer.leave(message["island"])
        return {}

    def _status(self, message: dict) -> dict:
        s = self.syncer
        return {"versions": list(s.versions), "present": sorted(s.present), "tokens_merged": s.tokens_merged,
                "tokens_refused": s.tokens_refused, "merges": len(s.merges)}

    def _expected(self, fragment: int, fmt: str) -> Any:
        key = (fragment, fmt)
        if key not in self._payload_shapes:
            self._payload_shapes[key] = jax.eval_shape(
                lambda x: quantize.encode(x, fmt), jax.ShapeDtypeStruct((self.syncer.sizes[fragment],), np.float32))
        return self._payload_shapes[key]

    def _push(self, m: dict) -> dict:
        island, fragment, fmt = m["island"], m["fragment"], m["format"]
        if fmt not in quantize.FORMATS:
            raise Refused(f"unknown wire format {fmt!r}")
        self.syncer.check_island(island)
        if not (is_integer(fragment) and 0 <= fragment < len(self.syncer.sizes)):
            raise Refused(f"fragment {fragment!r} is not one of the run's {len(self.syncer.sizes)} fragments")
        expected = self._expected(fragment, fmt)
        for name, got, want in [("data", m["data"], expected.data), ("scales", m["scales"], expected.scales)]:
            got_spec = None if got is None else (np.asarray(got).shape, np.asarray(got).dtype)
            want_spec = None if want is None else (want.shape, np.dtype(want.dtype))
            if got_spec != want_spec:
                raise Refused(f"fragment {fragment}'s {fmt} payload needs {name} {want_spec}, got {got_spec}")
        payload = quantize.Payload(np.asarray(m["data"]), None if m["scales"] is None else np.asarray(m["scales"]))
        delta = np.asarray(quantize.decode(payload, fmt, (self.syncer.sizes[fragment],)), np.float32)
        ticket = self.syncer.contribute(island, fragment, m["base_version"], m["tokens"], delta,
                                        steps_per_s=m.get("steps_per_s"))
        version, theta = self.syncer.wait(ticket)
        return {"version": version, "theta": theta, "tokens_merged": self.syncer.tokens_merged,
                "fastest_steps_per_s": max(self.syncer.steps_per_s.values(), default=None)}


class SyncerClient:
    """An island's connection to the syncer.

    **Arguments:**

    - `address`: the syncer's `host:port`.
    - `token`: the shared secret.
    - `retry_s`: how long a call keeps retrying (exponential backoff) while the syncer is unreachable.
    - `max_message`: the largest message sent or received, in bytes.
    """

    def __init__(self, address: str, *, token: str, retry_s: float = 120.0, max_message: int = 1 << 30):
        self.address, self.retry_s = address, retry_s
        self._metadata = ((TOKEN_KEY, token),)
        options = [("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", max_message)]
        self.channel = grpc.insecure_channel(address, options=options)
        self._calls = {name: self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_identity,
                                                      response_deserializer=_identity)
                       for name in ("Join", "Push", "Leave", "Status")}
        self._attend_call = self.channel.unary_stream(f"/{SERVICE}/Attend", request_serializer=_identity,
                                                      response_deserializer=_identity)
        self._attending: threading.Thread | None = None
        self._closed = threading.Event()
        self._presence: Any = None

    def close(self) -> None:
        self._closed.set()
        if self._presence is not None:
            self._presence.cancel()
        self.channel.close()

    def attend(self, island: int) -> None:
        """Keep an `Attend` stream open for `island` until `close` (a thread; once per client): the
        syncer stops waiting for the island as soon as this process ends. Reopened with backoff after
        the syncer restarts."""
        if self._attending is not None:
            return

        def keep_open() -> None:
            request, delay = encode({"island": island}), 0.05
            while not self._closed.is_set():
                self._presence = self._attend_call(request, metadata=self._metadata)
                try:
                    for _ in self._presence:
                        pass
                    delay = 0.05  # the syncer ended it (it stopped): reconnect to its successor
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                        return  # refused (a wrong secret fails the island's own calls in one line)
                except ValueError:  # the channel was closed under the stream
                    return
                self._closed.wait(delay * (0.5 + random.random()))
                delay = min(2.0, 2 * delay)

        self._attending = threading.Thread(target=keep_open, name=f"attend-island-{island}", daemon=True)
        self._attending.start()

    def call(self, name: str, message: dict, *, timeout: float = 600.0) -> dict:
        request = encode(message)
        delay, deadline = 0.05, time.monotonic() + self.retry_s
        while True:
            try:
                reply = self._calls[name](request, metadata=self._metadata, timeout=timeout, wait_for_ready=False)
                return decode(reply, source=f"the syncer at {self.address}")
            except grpc.RpcError as e:
                code, detail = e.code(), e.details() or str(e.code())
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    raise SyncRefused(detail, rejoin=True) from None
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise SyncRefused(f"{detail} ({code.name})", rejoin=False) from None
                if time.monotonic() + delay > deadline:
                    raise SyncerUnreachable(
                        f"the syncer at {self.address} did not answer for {self.retry_s:.0f} s ({detail})") from None
                time.sleep(delay * (0.5 + random.random()))
                delay = min(2.0, 2 * delay)

    def join(self, island: int) -> tuple[list[int], list[np.ndarray]]:
        """Join as `island` (and `attend` it): the versions and theta_g of every fragment."""
        reply = self.call("Join", {"island": island})
        self.attend(island)
        return list(reply["versions"]), list(reply["theta"])

    def push(self, *, island: int, fragment: int, base_version: int, tokens: int, fmt: str,
             payload: quantize.Payload, steps_per_s: float | None = None) -> dict:
        return self.call("Push", {
            "island": island, "fragment": fragment, "base_version": base_version, "tokens": tokens, "format": fmt,
            "data": np.asarray(payload.data), "scales": None if payload.scales is None else np.asarray(payload.scales),
            "steps_per_s": steps_per_s})

    def leave(self, island: int) -> None:
        self.call("Leave", {"island": island})

    def status(self) -> dict:
        return self.call("Status", {})
