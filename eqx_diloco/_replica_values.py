"""Read small per-replica values (losses, finite flags) on the host of every process.

In a multi-process run, reading an array whose replica rows live in other processes
normally takes a device collective (`process_allgather`). That collective would have to
wait for the devices it runs on, including the communication devices that are busy with
an overlapped sync (and gloo runs CPU collectives one at a time), so training would stall
exactly where it should overlap. Instead every process publishes the rows it holds
through the coordinator's key-value store, a host-side channel, and reads the others'.

That channel costs round trips to the coordinator over the same link as the syncs' bytes
(where a request can also wait behind an outer gradient in the link's queue). So the
exchange runs on a background thread (`ReplicaGather.submit`) and the training loop reads
its result a few steps later (`--dist.metrics-lag`) instead of waiting for it every step, and
several steps' values travel in one exchange (`submit_many`): each round costs a few
milliseconds of coordinator calls, more than a small model's step.

What a process publishes is `_wire`-encoded (raw array bytes under a JSON header), never pickled:
anyone who can reach the coordinator's port could otherwise run code in every process.
"""

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import numpy as np

from ._wire import WireFormatError, decode, encode


def replicated_value(x: jax.Array) -> np.ndarray:
    """The value of an array that every device holds in full (no communication)."""
    return np.asarray(x.addressable_shards[0].data)


def _local_rows(x: jax.Array) -> dict[int, np.ndarray]:
    rows = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        for i, row in enumerate(np.asarray(shard.data)):
            rows[start + i] = row
    return rows


class LocalRows(NamedTuple):
    """The rows of an array with a leading replica axis that this process holds, already on the host."""

    rows: dict[int, np.ndarray]  # row index -> row
    num_rows: int  # the array's leading size


def _kv_client():
    """The distributed runtime's key-value client, or None if this JAX does not expose it where we look."""
    try:
        from jax._src import distributed  # the runtime's client; no public accessor exists

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


class ReplicaGather:
    """Gathers dicts of arrays with a leading replica axis into host numpy arrays.

    Every process must call it the same number of times in the same order (the trainer's
    loop does), since calls are matched by a counter.

    **Arguments:**

    - `timeout_s`: how long to wait for another process's rows before giving up.
    """

    def __init__(self, timeout_s: int = 300):
        self.timeout_ms = timeout_s * 1000
        self.calls = 0
        self._jobs: queue.SimpleQueue | None = None  # the exchange thread's work, started on first use

    def __call__(self, arrays: dict[str, jax.Array]) -> dict[str, np.ndarray]:
        """Gather now (after every earlier `submit`)."""
        return self.submit(arrays).result()

    def read(self, arrays: dict[str, jax.Array]) -> dict[str, Any]:
        """This process's rows of `arrays`, read to the host now (waiting for them), to `submit` later.

        Read step by step, the host work is spread over the steps instead of falling on the one that
        submits a batch of them. Where the exchange is not through the key-value store (one process,
        or the device-collective fallback), `arrays` come back as they are."""
        if jax.process_count() == 1 or _kv_client() is None:
            return arrays
        return {name: x if isinstance(x, LocalRows) else LocalRows(_local_rows(x), x.shape[0])
                for name, x in arrays.items()}

    def submit(self, arrays: dict[str, jax.Array],
               per_process: dict[str, float] | None = None) -> "Future[dict[str, np.ndarray]]":
        """Start a gather; the future holds what `__call__` returns.

        This process's rows are read here (waiting for their computation); the exchange with
        the other processes runs on one background thread, in call order, so a slow link holds
        up the future, not the caller.

        **Arguments:**

        - `arrays`: per name, an array whose leading axis is the replicas (each process holds some rows),
          or what `read` returned for it.
        - `per_process`: per name, one host number of this process's own; gathered as a float64
          array with one entry per process, in process order. Names must not clash with `arrays`.
        """
        done: Future = Future()
        mine = {name: np.float64(v) for name, v in (per_process or {}).items()}
        if set(mine) & set(arrays):
            raise ValueError(f"per-process names {sorted(set(mine) & set(arrays))} are also array names")
        if jax.process_count() == 1:
            done.set_result({**{k: np.asarray(v) for k, v in arrays.items()},
                             **{k: np.array([v]) for k, v in mine.items()}})
            return done
        client = _kv_client()
        if client is None:  # a JAX without the private client: a device collective (may wait on syncs)
            from jax.experimental import multihost_utils

            done.set_result({k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                             for k, v in {**arrays, **mine}.items()})
            return done
        arrays = self.read(arrays)
        rows = {name: dict(x.rows) for name, x in arrays.items()}  # filled in with the others' rows
        num_rows = {name: x.num_rows for name, x in arrays.items()}
        for name, value in mine.items():  # one "row" per process, indexed by the process
            rows[name], num_rows[name] = {jax.process_index(): value}, jax.process_count()
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            # A daemon: a process that fails while an exchange waits on a dead peer must still exit.
            threading.Thread(target=self._work, args=(client,), name="eqx_diloco-replica-gather", daemon=True).start()
        self._jobs.put((done, self.calls, rows, num_rows))
        self.calls += 1
        return done

    def submit_many(self, batch: list[dict[str, jax.Array]],
                    per_process: dict[str, float] | None = None) -> "list[Future[dict[str, np.ndarray]]]":
        """Start the gathers of several dicts as one exchange: one round of key-value calls carries
        them all, instead of a round per dict. The futures hold what `submit` would have returned
        for each dict; every process must batch the same dicts together (the calls are matched by
        a counter, as for `submit`). `per_process` values (see `submit`) come with the last dict's."""
        if not batch:
            return []
        last, extra = len(batch) - 1, list(per_process or {})
        if not all(isinstance(x, LocalRows) for arrays in batch for x in arrays.values()):
            whole = self.submit({f"{i}/{name}": x for i, arrays in enumerate(batch) for name, x in arrays.items()},
                                per_process=per_process)
            return [_part_of(whole, lambda got, i=i, names=list(arrays): {n: got[f"{i}/{n}"] for n in names},
                             extra if i == last else []) for i, arrays in enumerate(batch)]
        # Rows read step by step: the dicts with the same names travel as one array per name, their rows
        # stacked (hundreds of small arrays cost milliseconds of encoding and decoding per exchange).
        groups: dict[tuple, list[int]] = {}
        for i, arrays in enumerate(batch):
            groups.setdefault(tuple(arrays), []).append(i)
        packed, place = {}, {}
        for g, (names, members) in enumerate(groups.items()):
            for name in names:
                parts = [batch[i][name] for i in members]
                packed[f"{g}/{name}"] = LocalRows({r: np.stack([p.rows[r] for p in parts]) for r in parts[0].rows},
                                                  parts[0].num_rows)
            place.update({i: (g, k) for k, i in enumerate(members)})
        whole = self.submit(packed, per_process=per_process)
        return [_part_of(whole, lambda got, g=place[i][0], k=place[i][1], names=list(arrays):
                         {n: got[f"{g}/{n}"][:, k] for n in names}, extra if i == last else [])
                for i, arrays in enumerate(batch)]

    def _work(self, client) -> None:
        while True:
            done, call, rows, num_rows = self._jobs.get()
            try:
                done.set_result(self._exchange(client, call, rows, num_rows))
            except BaseException as e:  # handed to whoever reads the future
                done.set_exception(e)

    def _exchange(self, client, call: int, rows: dict[str, dict[int, np.ndarray]],
                  num_rows: dict[str, int] | None = None) -> dict[str, np.ndarray]:
        """This process's `rows` (per name, row index -> row) merged with every other process's rows of
        the same call, each name stacked in row order.

        **Arguments:**

        - `client`: the distributed runtime's key-value client (`key_value_set_bytes`,
          `blocking_key_value_get_bytes` and `key_value_delete`, which all take str keys).
        - `call`: the call counter every process agrees on.
        - `rows`: this process's rows (filled in with the others' rows).
        - `num_rows`: per name, the leading size of the gathered array (then a missing row is an
          error); None skips that check.
        """
        key = f"eqx_diloco/replica_values/{call}"
        client.key_value_set_bytes(f"{key}/{jax.process_index()}", encode(_rows_payload(rows)))
        for p in range(jax.process_count()):
            if p != jax.process_index():
                source = f"the replica values of process {p} (coordinator key {key}/{p})"
                theirs = _their_rows(decode(client.blocking_key_value_get_bytes(f"{key}/{p}", self.timeout_ms),
                                            source=source), rows, source)
                for name, their_rows in theirs.items():
                    rows[name].update(their_rows)
        if call > 0:
            # Everyone has published this call, so everyone has read our previous one.
            client.key_value_delete(f"eqx_diloco/replica_values/{call - 1}/{jax.process_index()}")
        for name, n in (num_rows or {}).items():
            if sorted(rows[name]) != list(range(n)):
                raise RuntimeError(f"gathering {name!r}: the processes hold rows {sorted(rows[name])}, not 0..{n - 1}")
        return {name: np.stack([r[i] for i in sorted(r)]) for name, r in rows.items()}


def _part_of(whole: Future, pick: Callable[[dict], dict], per_process: list[str]) -> Future:
    """The future of one dict of a `submit_many` batch, resolved when the whole batch is: `pick` takes its
    values out of the batch's gathered values, to which the `per_process` values named are added."""
    part: Future = Future()

    def settle(done: Future) -> None:
        if done.exception() is not None:
            part.set_exception(done.exception())
        else:
            gathered = done.result()
            part.set_result({**pick(gathered), **{name: gathered[name] for name in per_process}})

    whole.add_done_callback(settle)
    return part


def _rows_payload(rows: dict[str, dict[int, np.ndarray]]) -> dict[str, dict[str, list]]:
    """`rows` in the form `_wire` encodes: per name, the row indices and the rows (as arrays)."""
    return {name: {"index": list(r), "rows": [np.asarray(x) for x in r.values()]} for name, r in rows.items()}


def _their_rows(payload: Any, mine: dict[str, dict[int, np.ndarray]], source: str) -> dict[str, dict[int, np.ndarray]]:
    """Another process's rows from its decoded `_rows_payload`, checked against this process's rows.

    **Arguments:**

    - `payload`: what `_wire.decode` returned for the other process's bytes.
    - `mine`: this process's rows (per name, row index -> row); theirs must have the same names
      and rows of the same shapes and dtypes.
    - `source`: where `payload` came from, for the error.
    """
    def refuse(reason: str) -> WireFormatError:
        return WireFormatError(f"{source} are malformed ({reason}); they were not used")

    if not isinstance(payload, dict) or set(payload) != set(mine):
        found = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise refuse(f"values {found}, expected {sorted(mine)}")
    theirs = {}
    for name, entry in payload.items():
        if not isinstance(entry, dict) or set(entry) != {"index", "rows"}:
            raise refuse(f"{name!r} is not an object with exactly the keys index and rows")
        index, values = entry["index"], entry["rows"]
        if not (isinstance(index, list) and isinstance(values, list) and len(index) == len(values)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in index)):
            raise refuse(f"{name!r}: index is not a list of row numbers as long as rows")
        # Every row of one gathered array has its shape and dtype (np.stack would otherwise promote or fail).
        like = {(np.shape(x), np.asarray(x).dtype) for x in mine[name].values()}
        for row in values:
            if not isinstance(row, np.ndarray) or (like and (row.shape, row.dtype) not in like):
                what = f"{row.dtype}{list(row.shape)}" if isinstance(row, np.ndarray) else type(row).__name__
                raise refuse(f"{name!r}: a row of {what}, this process's are {sorted(map(str, like))}")
        theirs[name] = dict(zip(index, values))
    return theirs
