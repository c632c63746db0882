"""The syncer of decoupled islands: theta_g and the outer optimizer state per fragment, merged from
whichever islands reported, without a global barrier. Transport-free (the gRPC service in `_rpc`
wraps it) and thread-safe: every island's call runs in its own server thread.

**Windows.** Contributions to a fragment collect in an open *window*. The first contribution opens
it; it closes, and is merged, once `min_quorum` of the *present* islands are in it, or once the grace
window has passed since it opened. An island that contributed waits for its window to close and gets
the merged fragment back, so no island waits longer than the grace window (a late one, below, at most
`grace_max_s`). Every island is present from the start, joined or not: the first windows wait for
islands still starting (at most `grace_max_s`, the grace window until a window filled its quorum), so
the first rounds merge together. An island stops counting towards the quorum when its connection
closes (`disconnected`: its process ended or its link dropped; the others stop waiting at once), or
when a window closes by grace without it (it is dead but its connection lingers, or it is slow), and
counts again as soon as it contributes. An island that joins again (it restarted, or fell behind) is
a round or more behind the others, so it counts only from its first contribution: no window waits
for its restart. So a lost island whose connection closes costs the others no wait, and one that
hangs costs one grace window, once.

**A late island rejoins the others' phase.** The contribution of an island that a window closed by
grace without opens a *patient* window: it waits for the others' next report (their quorum and grace
from the first of them, at most `grace_max_s` in all) and is merged with it, one version stale. Merged
alone, between the others' rounds, it would keep both sides a version stale and out of phase.

**Adaptive grace.** With `grace_s=None`, the grace window is `grace_factor` times the median lag of
recent arrivals behind their window's first arrival (in windows that filled their quorum), but at
least two steps of the median island (islands report their speed) and `grace_min_s`, and at most
`grace_max_s`: islands of equal speed that drift a little are waited for, one that is a whole round
behind is not.

**Tokens merged.** A merge of fragment f adds its contributions' tokens times f's share of the
parameters to `tokens_merged`, so an island's round counts its tokens once when every fragment of it
has been merged (the goodput's numerator).

**The merge (token-weighted, staleness down-weighted).** An island's outer gradient of fragment f is
`delta_i = theta_g^{b_i} - theta_i`: its fragment after its own inner steps, against the version `b_i`
of theta_g it started from. A window closing at version `v` merges

    g = sum_i w_i delta_i / sum_i n_i,    w_i = n_i / (1 + s_i),    s_i = v - b_i,

where `n_i` is the tokens behind `delta_i` and `s_i` its staleness, and applies the outer optimizer to
`g` as to a gradient (version `v + 1`). Token weights make islands with different H (`adaptive-H`,
DyLU) or batch count by their work; fresh contributions (`s_i = 0`) give the token-weighted mean,
which with equal tokens is synchronous DiLoCo's mean. A stale contribution was computed from a
theta_g that lacks the newer merges; dividing its step by `1 + s` is the staleness-dependent learning
rate of asynchronous SGD (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016), and it keeps the
denominator the tokens actually merged, so a lone stale island moves theta_g by a fraction of its
fresh step (Delayed Nesterov, arXiv 2401.09135, instead buffers contributions and applies momentum
every N of them; down-weighting needs no buffer beyond the window, so the merge happens when the
islands that waited for it are there). Contributions more than `max_staleness` versions old are
refused: their tokens are lost rather than pulling theta_g back.

**What a call may carry.** Every number is checked against what a run can produce before it reaches
the merge: ids, versions and token counts are integers (JSON `true` is not 1), token counts at most
`max_tokens` (below 2**53 in any case, so every sum stays exact in float64), outer gradients finite
and at most `max_delta_scale` times the fragment's largest magnitude (at least 1), speeds finite and
at most `MAX_STEPS_PER_S`. A merge whose result would not be finite is not applied: every
contribution of its window is refused (the islands join again), and theta_g keeps its values.
"""

import dataclasses
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._errors import ConfigError

MAX_TOKENS = 2**53 - 1  # every token count and sum of them is exact in float64
MAX_STEPS_PER_S = 1e6  # a reported speed above this is no island's


class Refused(ValueError):
    """A contribution or call the syncer refuses. Its message is one line; the island is dropped."""

    def __init__(self, message: str, *, kind: str = "invalid"):
        super().__init__(message)
        self.kind = kind  # "invalid", "version" (the island must join again), "unknown" (not joined)


def is_integer(x: Any) -> bool:
    """Whether `x` is an integer and not a bool (JSON `true` would otherwise count as 1)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _brief(x: Any, limit: int = 40) -> str:
    """`repr(x)`, cut to `limit` characters (a 400-digit token count stays one short line)."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def merge_outer_gradient(deltas: Sequence[np.ndarray], tokens: Sequence[int], staleness: Sequence[int]) -> np.ndarray:
    """The merged outer gradient `sum_i n_i / (1 + s_i) delta_i / sum_i n_i` (float32). Each weight is a
    ratio of integers, at most 1, so no token count can overflow it."""
    total = sum(int(n) for n in tokens)
    out = np.zeros_like(deltas[0], dtype=np.float32)
    for delta, n, s in zip(deltas, tokens, staleness):
        out += np.float32(int(n) / total / (1 + int(s))) * delta.astype(np.float32)
    return out


@dataclasses.dataclass
class _Ticket:
    island: int
    fragment: int
    base_version: int
    tokens: int
    delta: np.ndarray
    arrived: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: tuple[int, np.ndarray] | None = None
    error: "Refused | None" = None  # the window's merge was not applied (a non-finite result, or it failed)


@dataclasses.dataclass
class _Window:
    opened: float
    tickets: list[_Ticket]
    patient: bool = False  # opened by an island a grace window left out: waits for the others' next report
    first: int = 0  # the ticket that opened it as an ordinary window (the others' lags count from it)


@dataclasses.dataclass(frozen=True)
class MergeRecord:
    """One merge: the fragment, its new version, the islands merged with their staleness and tokens,
    whether the window closed by grace, and the wall time (seconds since the syncer started)."""

    fragment: int
    version: int
    islands: tuple[int, ...]
    staleness: tuple[int, ...]
    tokens: int
    by_grace: bool
    time: float


class Syncer:
    """theta_g of every fragment and its outer optimizer state, merged from islands' contributions.

    **Arguments:**

    - `fragments`: theta_g's initial values, one flat float32 array per fragment.
    - `outer_optimizer`: the optax optimizer applied to each merged outer gradient (per fragment).
    - `num_islands`: how many islands the run has (ids `0 .. num_islands - 1`).
    - `min_quorum`: present islands a window waits for before it merges (capped at the islands
      present); None: all of them.
    - `grace_s`: fixed grace window in seconds, or None for the adaptive one (see the module docstring).
    - `grace_factor`, `grace_min_s`, `grace_max_s`: the adaptive grace window's rule.
    - `max_staleness`: the oldest contribution merged, in versions behind the fragment.
    - `max_tokens`: the largest token count one contribution may carry (None: `MAX_TOKENS`); a run
      knows it from its batch, sequence length and sync period.
    - `max_delta_scale`: the largest outer gradient value merged, in multiples of the fragment's
      largest magnitude (at least 1): a contribution beyond it is refused.
    - `on_merge`: called (outside the lock) with each `MergeRecord`.
    - `clock`: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        fragments: Sequence[np.ndarray],
        *,
        outer_optimizer: optax.GradientTransformation,
        num_islands: int,
        min_quorum: int | None = None,
        grace_s: float | None = None,
        grace_factor: float = 3.0,
        grace_min_s: float = 0.05,
        grace_max_s: float = 10.0,
        max_staleness: int = 4,
        max_tokens: int | None = None,
        max_delta_scale: float = 1e3,
        on_merge: Callable[[MergeRecord], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_islands < 1:
            raise ConfigError(f"num_islands must be >= 1 (got {num_islands})")
        if min_quorum is not None and not 1 <= min_quorum <= num_islands:
            raise ConfigError(f"min_quorum must be in [1, {num_islands}] (got {min_quorum})")
        if grace_s is not None and not grace_s >= 0:
            raise ConfigError(f"grace_s must be >= 0 (got {grace_s})")
        if not 0 <= grace_min_s <= grace_max_s:
            raise ConfigError(f"need 0 <= grace_min_s <= grace_max_s (got {grace_min_s}, {grace_max_s})")
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0 (got {max_staleness})")
        if max_tokens is not None and not (is_integer(max_tokens) and 1 <= max_tokens <= MAX_TOKENS):
            raise ConfigError(f"max_tokens must be an integer in [1, 2**53) (got {max_tokens!r})")
        if not (math.isfinite(max_delta_scale) and max_delta_scale > 0):
            raise ConfigError(f"max_delta_scale must be a finite number > 0 (got {max_delta_scale})")
        self.theta = [np.array(f, np.float32).reshape(-1) for f in fragments]
        self.sizes = tuple(t.size for t in self.theta)
        self.outer_optimizer = outer_optimizer
        self.opt_states = [outer_optimizer.init(jnp.asarray(t)) for t in self.theta]
        self.versions = [0] * len(self.theta)
        self.num_islands, self.max_staleness = num_islands, max_staleness
        self.max_tokens = MAX_TOKENS if max_tokens is None else int(max_tokens)
        self.max_delta_scale = float(max_delta_scale)
        self._scales = [self._scale(t) for t in self.theta]  # each fragment's largest magnitude (at least 1)
        self.min_quorum = num_islands if min_quorum is None else min_quorum
        self.grace_s, self.grace_factor = grace_s, grace_factor
        self.grace_min_s, self.grace_max_s = grace_min_s, grace_max_s
        self.on_merge, self.clock = on_merge, clock
        self.started = clock()
        self.joined: set[int] = set()  # islands that may contribute (joined, not dropped or left)
        self.present: set[int] = set(range(num_islands))  # the islands windows wait for (all, at the start)
        self._joined_once: set[int] = set()  # islands that joined before: a later join is a restart
        self._connections: dict[int, int] = {}  # open connections per island (`connected`)
        self.tokens_merged = 0.0
        self.tokens_refused = 0.0
        self.steps_per_s: dict[int, float] = {}  # each island's reported speed
        self.merges: list[MergeRecord] = []
        self._windows: dict[int, _Window] = {}
        self._late: dict[int, set[int]] = {}  # per fragment: islands its last window closed by grace without
        self._lags: deque[float] = deque(maxlen=64)
        self._lock = threading.Lock()
        self._update = jax.jit(lambda theta, state, gradient: self._apply(outer_optimizer, theta, state, gradient))

    @staticmethod
    def _scale(theta: np.ndarray) -> float:
        return max(1.0, float(np.max(np.abs(theta), initial=0.0)))

    def compile_ahead(self) -> None:
        """Compile (or load from the persistent cache) every fragment's outer step now, before islands
        push: compiled at a fragment's first merge, it would hold every island waiting on that merge."""
        for theta, opt_state in zip(self.theta, self.opt_states):
            self._update.lower(jnp.asarray(theta), opt_state, jnp.asarray(theta)).compile()

    # -- state a checkpoint holds -------------------------------------------------------------------------

    def state_tree(self) -> dict[str, Any]:
        """What a checkpoint holds (host arrays): theta_g, outer optimizer states, versions, tokens merged."""
        with self._lock:
            return {
                "theta": [t.copy() for t in self.theta],
                "opt_states": jax.tree.map(np.asarray, self.opt_states),
                "versions": np.asarray(self.versions, np.int64),
                "tokens_merged": np.asarray(self.tokens_merged, np.float64),
            }

    def load_state_tree(self, tree: dict[str, Any]) -> None:
        """Install a tree `state_tree` made (a restored checkpoint); refuses one of another layout."""
        sizes = tuple(np.asarray(t).size for t in tree["theta"])
        if sizes != self.sizes:
            raise ConfigError(f"the syncer checkpoint holds fragments of sizes {sizes}, this run makes {self.sizes}")
        with self._lock:
            self.theta = [np.array(t, np.float32).reshape(-1) for t in tree["theta"]]
            self.opt_states = jax.tree.map(jnp.asarray, tree["opt_states"])
            self.versions = [int(v) for v in np.asarray(tree["versions"])]
            self.tokens_merged = float(tree["tokens_merged"])
            self._scales = [self._scale(t) for t in self.theta]

    # -- islands' calls -----------------------------------------------------------------------------------

    def check_island(self, island: int) -> None:
        """Raise `Refused` unless `island` is an integer id of this run (not a bool)."""
        if not (is_integer(island) and 0 <= island < self.num_islands):
            raise Refused(f"island {_brief(island)} is not one of this run's {self.num_islands} islands")

    def join(self, island: int) -> list[tuple[int, np.ndarray]]:
        """A starting island (it counts towards quorums) or a restarting one (it counts from its first
        contribution); returns (version, theta_g) per fragment."""
        self.check_island(island)
        with self._lock:
            self.joined.add(island)
            if island in self._joined_once:
                self.present.discard(island)
            else:
                self.present.add(island)
            self._joined_once.add(island)
            fragments = [(v, t.copy()) for v, t in zip(self.versions, self.theta)]
        self.poll()
        return fragments

    def connected(self, island: int) -> None:
        """`island` opened a connection that stays open while it runs (the service's `Attend`)."""
        self.check_island(island)
        with self._lock:
            self._connections[island] = self._connections.get(island, 0) + 1

    def disconnected(self, island: int) -> None:
        """One of `island`'s connections closed; with none left it stops counting towards quorums at
        once (its process ended or its link dropped) until it contributes again."""
        with self._lock:
            self._connections[island] = left = self._connections.get(island, 0) - 1
            if left <= 0:
                self.present.discard(island)
        self.poll()

    def leave(self, island: int) -> None:
        """An island that finished: the windows stop waiting for it."""
        self.check_island(island)
        with self._lock:
            self.joined.discard(island)
            self.present.discard(island)
        self.poll()

    def drop(self, island: int) -> None:
        """Leave `island` out (a refused call): it may contribute again once it joins again."""
        with self._lock:
            self.joined.discard(island)
            self.present.discard(island)
        self.poll()

    def contribute(self, island: int, fragment: int, base_version: int, tokens: int, delta: np.ndarray,
                   *, steps_per_s: float | None = None) -> _Ticket:
        """Put one outer gradient in `fragment`'s open window; `wait` on the returned ticket for the merge.

        Raises `Refused` (one line; the caller drops the island) for an unknown island or fragment, a
        version the fragment never had or one older than `max_staleness`, a token count that is not an
        integer in [1, `max_tokens`], a speed that is not None or a number in (0, `MAX_STEPS_PER_S`], a
        wrong size, a non-finite value or one beyond `max_delta_scale` times the fragment's scale.
        """
        self.check_island(island)
        if not (is_integer(fragment) and 0 <= fragment < len(self.theta)):
            raise Refused(f"fragment {_brief(fragment)} is not one of the run's {len(self.theta)} fragments")
        if not (is_integer(tokens) and 0 < tokens <= self.max_tokens):
            raise Refused(f"tokens must be a positive integer at most {self.max_tokens} (got {_brief(tokens)})")
        if not is_integer(base_version):
            raise Refused(f"base_version must be an integer (got {_brief(base_version)})")
        island, fragment, tokens, base_version = int(island), int(fragment), int(tokens), int(base_version)
        if not (steps_per_s is None or (isinstance(steps_per_s, (int, float, np.integer, np.floating))
                                        and not isinstance(steps_per_s, (bool, np.bool_))
                                        and 0 < steps_per_s <= MAX_STEPS_PER_S)):
            raise Refused(f"steps_per_s must be null or a number in (0, {MAX_STEPS_PER_S:g}] (got {_brief(steps_per_s)})")
        delta = np.asarray(delta)
        if delta.dtype != np.float32 or delta.shape != (self.sizes[fragment],):
            raise Refused(f"fragment {fragment} takes {self.sizes[fragment]} float32 values, got "
                          f"{delta.dtype} of shape {delta.shape}")
        if not np.isfinite(delta).all():
            raise Refused(f"island {island}'s outer gradient of fragment {fragment} holds NaN or Inf")
        largest, bound = float(np.max(np.abs(delta), initial=0.0)), self.max_delta_scale * self._scales[fragment]
        if largest > bound:
            raise Refused(f"island {island}'s outer gradient of fragment {fragment} reaches {largest:.3g}, more than "
                          f"{self.max_delta_scale:g} x the fragment's scale ({bound:.3g}): the island diverged")
        with self._lock:
            if island not in self.joined:
                raise Refused(f"island {island} has not joined (or was dropped): join first", kind="unknown")
            version = self.versions[fragment]
            if not 0 <= base_version <= version:
                raise Refused(f"island {island} started fragment {fragment} from version {_brief(base_version)}, "
                              f"which the syncer never had (it is at {version})", kind="version")
            if version - base_version > self.max_staleness:
                self.tokens_refused += tokens * self._share(fragment)
                raise Refused(f"island {island}'s contribution to fragment {fragment} is {version - base_version} "
                              f"versions old, more than max_staleness {self.max_staleness}", kind="version")
            if steps_per_s is not None:
                self.steps_per_s[island] = float(steps_per_s)
            now = self.clock()
            ticket = _Ticket(island, fragment, base_version, tokens, delta, now)
            late = island in self._late.setdefault(fragment, set())
            self._late[fragment].discard(island)
            window = self._windows.get(fragment)
            if window is None:
                window = self._windows[fragment] = _Window(now, [], patient=late)
            elif any(t.island == island for t in window.tickets):
                raise Refused(f"island {island} contributed to fragment {fragment} twice in one window")
            elif window.patient and not late:  # the others' next report: from now on an ordinary window
                window.opened, window.patient, window.first = now, False, len(window.tickets)
            window.tickets.append(ticket)
            self.present.add(island)
            records = self._close_ready(now)
        self._report(records)
        return ticket

    def wait(self, ticket: _Ticket, timeout: float | None = None) -> tuple[int, np.ndarray]:
        """The (version, theta_g) of the merge that took `ticket` (at most the grace window away). Raises
        `Refused` (kind "version": join again) when that merge was not applied."""
        deadline = None if timeout is None else self.clock() + timeout
        while not ticket.done.wait(0.01):
            self.poll()
            if deadline is not None and self.clock() > deadline:
                raise TimeoutError(f"no merge of fragment {ticket.fragment} within {timeout} s")
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def fragment(self, fragment: int) -> tuple[int, np.ndarray]:
        with self._lock:
            return self.versions[fragment], self.theta[fragment].copy()

    # -- windows ------------------------------------------------------------------------------------------

    def grace(self) -> float:
        """The grace window now, in seconds."""
        if self.grace_s is not None:
            return self.grace_s
        if not self._lags:
            return self.grace_max_s  # no window filled its quorum yet: wait as long as allowed
        floor = self.grace_min_s
        if self.steps_per_s:
            floor = max(floor, 2.0 / statistics.median(self.steps_per_s.values()))
        return min(self.grace_max_s, max(floor, self.grace_factor * statistics.median(self._lags)))

    def _share(self, fragment: int) -> float:
        return self.sizes[fragment] / sum(self.sizes)

    def poll(self) -> None:
        """Close every window whose quorum is in or whose grace window has passed."""
        with self._lock:
            records = self._close_ready(self.clock())
        self._report(records)

    def _close_ready(self, now: float) -> list[MergeRecord]:
        records = []
        for fragment, window in list(self._windows.items()):
            islands = {t.island for t in window.tickets}
            quorum = min(self.min_quorum, len(self.present | islands))
            full = len(islands) >= quorum
            # A patient window is bounded all the same: the others may be gone with their connections open.
            expired = now - window.opened >= (self.grace_max_s if window.patient else self.grace())
            if full or expired:
                if full:
                    self._lags.extend(t.arrived - window.opened for t in window.tickets[window.first + 1:])
                else:
                    self._late[fragment] = self.present - islands
                    self.present &= islands  # the missing islands stop holding windows open
                del self._windows[fragment]
                try:
                    records.append(self._merge(fragment, window, by_grace=not full, now=now))
                except Refused as e:  # theta_g keeps its values; every island of the window is told
                    self.tokens_refused += sum(t.tokens for t in window.tickets) * self._share(fragment)
                    for t in window.tickets:
                        t.error = e
                        t.done.set()
        return records

    @staticmethod
    def _apply(optimizer, theta, opt_state, gradient):
        updates, new_state = optimizer.update(gradient, opt_state, theta)
        new_theta = optax.apply_updates(theta, updates)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((new_theta, new_state))
                                    if jnp.issubdtype(x.dtype, jnp.inexact)]))
        return new_theta, new_state, finite

    def _merge(self, fragment: int, window: _Window, *, by_grace: bool, now: float) -> MergeRecord:
        version = self.versions[fragment]
        tickets = window.tickets
        staleness = [version - t.base_version for t in tickets]
        try:
            gradient = merge_outer_gradient([t.delta for t in tickets], [t.tokens for t in tickets], staleness)
            theta, opt_state, finite = self._update(
                jnp.asarray(self.theta[fragment]), self.opt_states[fragment], jnp.asarray(gradient))
            finite = bool(finite) and bool(np.isfinite(gradient).all())
        except Exception as e:  # noqa: BLE001 - a merge that fails must still answer every island of its window
            raise Refused(f"the merge of fragment {fragment} at version {version} failed "
                          f"({type(e).__name__}: {e}); its contributions are refused", kind="version") from None
        if not finite:
            raise Refused(f"the merge of fragment {fragment} at version {version} would make theta_g or the outer "
                          "optimizer state non-finite; its contributions are refused", kind="version")
        self.opt_states[fragment] = opt_state
        self.theta[fragment] = np.asarray(theta, np.float32)
        self._scales[fragment] = self._scale(self.theta[fragment])
        self.versions[fragment] = version + 1
        tokens = sum(t.tokens for t in tickets)
        self.tokens_merged += tokens * self._share(fragment)
        result = (version + 1, self.theta[fragment])
        for t in tickets:
            t.result = result
            t.done.set()
        record = MergeRecord(fragment, version + 1, tuple(t.island for t in tickets), tuple(staleness), tokens,
                             by_grace, now - self.started)
        self.merges.append(record)
        return record

    def _report(self, records: list[MergeRecord]) -> None:
        if self.on_merge is not None:
            for record in records:
                self.on_merge(record)

