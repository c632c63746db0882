"""One decoupled island's side of a sync: its fragments as flat vectors, the outer gradient against the
theta_g it started from, (quantized, error-feedback) pushes to the syncer, and the merged fragment
installed back into its model. The island's inner steps are the user's own program.

    island = Island(model, layers=lambda m: m.blocks, num_fragments=2, client=SyncerClient(...), island=k)
    model = island.join(model)                      # theta_g of every fragment
    ...  # inner steps
    model = island.sync(model, fragment=0, tokens=n)  # push, wait for the merge, install
    # or, never waiting: island.push(model, 0, tokens=n), then model = island.collect(model) every step
"""

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float32

from . import quantize as codec
from ._arguments import check_error_feedback, error_feedback_decay
from ._errors import ConfigError
from ._fragments import Fragmenter, Pattern
from ._rpc import SyncerClient, SyncRefused

PyTree = Any


def fragment_vector(params: PyTree, fragmenter: Fragmenter, fragment: int) -> np.ndarray:
    """`fragment`'s values in `params` (the model's trainable arrays) as one flat float32 host vector."""
    return np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in fragmenter.get(params, fragment)])


def fragment_vectors(params: PyTree, fragmenter: Fragmenter) -> list[np.ndarray]:
    """Every fragment of `params` as `fragment_vector` makes it."""
    return [fragment_vector(params, fragmenter, f) for f in range(fragmenter.num_fragments)]


def install_fragment(params: PyTree, fragmenter: Fragmenter, fragment: int, vector: np.ndarray) -> PyTree:
    """`params` with `fragment`'s values taken from the flat vector `vector` (cast to each leaf's dtype)."""
    values, offset = [], 0
    for v in fragmenter.get(params, fragment):
        n = int(np.prod(v.shape))
        values.append(jnp.asarray(vector[offset: offset + n].reshape(v.shape), dtype=v.dtype))
        offset += n
    return fragmenter.put(params, fragment, values)


@functools.partial(jax.jit, static_argnums=1)
def _encode(delta: Float32[Array, " n"], fmt: str):
    """`delta` in wire format `fmt`, and what the format lost of it (the error-feedback residual).
    One program per fragment size and format, shared by every `Island` of the process."""
    payload = codec.encode(delta, fmt)
    return payload, delta - codec.decode(payload, fmt, delta.shape)


class Island:
    """The syncing half of one decoupled island.

    **Arguments:**

    - `model`: the island's model (its trainable arrays, `eqx.is_inexact_array`, are synced).
    - `layers`: selector of the stacked layer module(s), as for `DiLoCo` (None: one fragment).
    - `num_fragments`, `fragment_pattern`: the fragments, as for `DiLoCo` (the syncer must have the same).
    - `client`: the `SyncerClient`.
    - `island`: this island's id.
    - `quantize`: wire format of outer gradients (`quantize.FORMATS`).
    - `error_feedback`: carry each fragment's quantization residual to its next push: True, or
      the decay beta in (0, 1] of that residual, as for `DiLoCo`.
    """

    def __init__(self, model: PyTree, *, layers: Callable[[PyTree], Any] | None, num_fragments: int = 1,
                 fragment_pattern: Pattern = "strided", client: SyncerClient, island: int,
                 quantize: str = "none", error_feedback: bool | float = False):
        if quantize not in codec.FORMATS:
            raise ConfigError(f"quantize must be one of {', '.join(codec.FORMATS)} (got {quantize!r})")
        params = eqx.filter(model, eqx.is_inexact_array)
        try:
            self.fragmenter = Fragmenter.for_model(params, layers, num_fragments, fragment_pattern)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if (problem := check_error_feedback(error_feedback)) is not None:
            raise ConfigError(problem)
        self.client, self.island, self.fmt, self.error_feedback = client, island, quantize, bool(error_feedback)
        self.ef_decay = error_feedback_decay(error_feedback)
        self.num_fragments = num_fragments
        self.sizes = [sum(v.size for v in self.fragmenter.get(params, f)) for f in range(num_fragments)]  # no host copy
        self.versions = [0] * num_fragments
        self.base: list[np.ndarray] = []
        self.residuals = [np.zeros(n, np.float32) for n in self.sizes]
        self.fastest_steps_per_s: float | None = None
        self.tokens_merged = 0.0  # theta_g's tokens as of the newest merge that came back
        self.lost_rounds = 0  # pushes whose tokens never reached theta_g (refused, or the syncer lost them)
        self._sender = ThreadPoolExecutor(max_workers=num_fragments, thread_name_prefix="island-push")
        self._pending: dict[int, tuple[Future, np.ndarray]] = {}

    def compile(self) -> None:
        """Compile (or load from the cache) each fragment's encoder now: at its first push it would stall
        the step. `join` calls it; a standby island calls it before it knows which island it becomes."""
        for n in self.sizes:
            _encode.lower(jnp.zeros(n, jnp.float32), self.fmt).compile()

    def _install(self, model: PyTree, fragment: int, theta: np.ndarray) -> PyTree:
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return eqx.combine(install_fragment(params, self.fragmenter, fragment, theta), static)

    def join(self, model: PyTree) -> PyTree:
        """Fetch theta_g of every fragment and return `model` holding it (start or restart)."""
        versions, thetas = self.client.join(self.island)
        if [t.size for t in thetas] != self.sizes:
            raise ConfigError(f"the syncer's fragments have sizes {[t.size for t in thetas]}, this island's model "
                              f"makes {self.sizes}: the syncer serves another model or fragment layout")
        self.versions, self.base = list(versions), [np.array(t, np.float32) for t in thetas]
        self.tokens_merged = float(self.client.status()["tokens_merged"])  # a restart may come after the run's end
        self.residuals = [np.zeros(n, np.float32) for n in self.sizes]
        for f, theta in enumerate(thetas):
            model = self._install(model, f, theta)
        self.compile()
        return model

    def _vector(self, model: PyTree, fragment: int) -> np.ndarray:
        return fragment_vector(eqx.filter(model, eqx.is_inexact_array), self.fragmenter, fragment)

    def push(self, model: PyTree, fragment: int, *, tokens: int, steps_per_s: float | None = None) -> None:
        """Send `fragment`'s outer gradient (made from `tokens` tokens) in the background and return at once;
        `collect` installs the merged fragment when it has come back. One push per fragment at a time."""
        if fragment in self._pending:
            raise RuntimeError(f"fragment {fragment} already has a push in flight: collect it first")
        current = self._vector(model, fragment)
        delta = self.base[fragment] - current
        if self.error_feedback:
            delta = delta + self.ef_decay * self.residuals[fragment]  # x 1.0 is exact: classic error feedback
        payload, residual = _encode(jnp.asarray(delta), self.fmt)
        if self.error_feedback:
            self.residuals[fragment] = np.asarray(residual)
        call = self._sender.submit(
            self.client.push, island=self.island, fragment=fragment, base_version=self.versions[fragment],
            tokens=int(tokens), fmt=self.fmt, payload=payload, steps_per_s=steps_per_s)
        self._pending[fragment] = (call, current)

    def in_flight(self, fragment: int) -> bool:
        return fragment in self._pending

    def has_landed(self, *, wait: bool = False) -> bool:
        """Whether `collect(model, wait=wait)` would install something: a merge in flight has come back
        (with `wait`: any merge is in flight)."""
        return any(wait or call.done() for call, _ in self._pending.values())

    def collect(self, model: PyTree, *, wait: bool = False) -> PyTree:
        """Install every merged fragment that has come back (with `wait`, wait for all in flight).

        The island's own steps since the push are kept: the fragment becomes the merged theta_g plus
        what the island moved since it sent (`theta_new + current - sent`), and its next outer gradient
        is taken against `theta_new`, so those steps reach theta_g with the next push. If the syncer
        asks the island to join again (it restarted, or the contribution was too stale), the round's
        tokens are lost and the island restarts from the current theta_g of every fragment."""
        for fragment, (call, sent) in list(self._pending.items()):
            if not (wait or call.done()):
                continue
            del self._pending[fragment]
            try:
                reply = call.result()
            except SyncRefused as e:
                if not e.rejoin:
                    raise
                self.lost_rounds += 1
                for other, (pending, _) in list(self._pending.items()):  # a rejoin replaces every fragment
                    try:
                        pending.result()
                    except SyncRefused:
                        pass
                    del self._pending[other]
                return self.join(model)
            theta = np.asarray(reply["theta"], np.float32)
            moved = self._vector(model, fragment) - sent
            self.versions[fragment], self.base[fragment] = int(reply["version"]), theta.copy()
            self.fastest_steps_per_s = reply.get("fastest_steps_per_s")
            self.tokens_merged = max(self.tokens_merged, float(reply.get("tokens_merged") or 0.0))
            model = self._install(model, fragment, theta + moved if moved.any() else theta)
        return model

    def sync(self, model: PyTree, fragment: int, *, tokens: int, steps_per_s: float | None = None) -> PyTree:
        """`push`, wait for the merge and return `model` holding the merged fragment (blocking, as a
        synchronous DiLoCo sync)."""
        self.push(model, fragment, tokens=tokens, steps_per_s=steps_per_s)
        return self.collect(model, wait=True)

    def leave(self) -> None:
        """Tell the syncer this island is done (the windows stop waiting for it)."""
        self.client.leave(self.island)
        self.close()

    def close(self) -> None:
        """Stop the background sender (pushes not yet started are dropped). Call it when the island ends
        for any reason, before closing the client: an idle sender thread is only stopped at the
        interpreter's exit, so a process that waits for its threads first would never end."""
        self._sender.shutdown(wait=False, cancel_futures=True)


def adaptive_sync_period(sync_period: int, steps_per_s: float, fastest_steps_per_s: float | None) -> int:
    """Dynamic Local Updates (arXiv 2401.09135): H of an island in proportion to its speed, so islands
    of different speed reach their syncs together; the fastest island keeps `sync_period`."""
    if not fastest_steps_per_s or steps_per_s <= 0:
        return sync_period
    return max(1, min(sync_period, round(sync_period * steps_per_s / fastest_steps_per_s)))

