"""The trainer's signal handling: SIGTERM / SIGHUP stop the run at a step boundary every process
agrees on, and (elastic runs) SIGUSR1 re-forms it at the next sync boundary.

A handler only records the signal. The loop publishes it with every step's values (`rows`), and
the largest signal any process published is what all of them act on (`agree`), at the same step."""

import contextlib
import dataclasses
import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class TrainingStopped(Exception):
    """SIGTERM or SIGHUP stopped training at a step boundary (after a checkpoint of that step).

    `signum` is the signal, `step` the last step trained; the message is one line.
    """

    def __init__(self, message: str, *, signum: int, step: int):
        super().__init__(message)
        self.signum, self.step = signum, step


@dataclasses.dataclass
class StopSignals:
    """The signals of one run.

    - `elastic`: also answer SIGUSR1 (the elastic launcher: an island wants to rejoin).
    - `seen`: this process's signal, 0 if none.
    - `agreed`: the stop signal every process agreed on, 0 if none.
    - `reform_due`: every island agreed to re-form at the next sync boundary.
    """

    elastic: bool = False
    seen: int = 0
    agreed: int = 0
    reform_due: bool = False
    _arrays: dict[int, Any] = dataclasses.field(default_factory=dict)  # rows per signal, built once

    @contextlib.contextmanager
    def installed(self):
        """Record SIGTERM / SIGHUP (and SIGUSR1 if elastic) while the loop runs. A second stop
        signal ends the process at once (the default action). Installed after
        `jax.distributed.initialize`, so it replaces JAX's preemption notifier, which would
        otherwise swallow SIGTERM. Off the main thread (tests) nothing can be installed."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            self.seen = signum
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_DFL)

        def reform_handler(signum, frame):
            self.seen = self.seen or signum

        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        if self.elastic:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, reform_handler)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)

    def rows(self, num_replicas: int, mesh: Mesh) -> Any:
        """(R,) rows of this process's signal number, for the per-step gather (every process
        publishes its own replicas' rows; the maximum is what all agree on)."""
        if jax.process_count() == 1:
            return np.full((num_replicas,), self.seen, np.int32)
        if self.seen not in self._arrays:
            rows = np.full((num_replicas,), self.seen, np.int32)
            self._arrays[self.seen] = jax.make_array_from_callback(
                (num_replicas,), NamedSharding(mesh, PartitionSpec("diloco")), lambda index: rows[index])
        return self._arrays[self.seen]

    def agree(self, published: np.ndarray) -> None:
        """Act on the signals every process published with one step's values."""
        signum = int(np.max(published))
        if signum == signal.SIGUSR1:
            self.reform_due = True
        else:
            self.agreed = self.agreed or signum
