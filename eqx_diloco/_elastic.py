"""Elastic islands: each island snapshots its share of the state at sync boundaries, and a run
re-formed over whichever islands are live starts from the newest snapshot.

An *island* is one process holding one replica. At a sync boundary (a step after which no sync
is in flight) the state splits cleanly into a part every island holds alike (theta_g, the outer
optimizer state and, with `outer_overlap="delayed"`, the arrived mailbox) and the island's own
rows (its replica's parameters, inner optimizer state, PRNG key and quantization residual). Each
island writes both to its own folder, asynchronously, so a snapshot needs no other process: an
island that dies while the others are mid-save cannot leave them without the newest sync.

Re-forming (see `reform_state`): the live islands agree on the newest step any of them has a
snapshot of; the shared part comes from one island that has it (a device broadcast: no shared
disk is needed); an island that has its own rows of that step keeps them, any other (one that
rejoins, or one whose snapshot of that step is missing) starts from theta_g with a fresh inner
optimizer state and a zero residual. The outer average of the re-formed run is then simply over
the R' islands that are live.

Eager outer updates keep a per-replica anchor (no shared theta_g), so they are not elastic.

A snapshot file is `_wire`-encoded (raw array bytes under a JSON header), never pickled: whoever can
write to the run folder could otherwise run code in every island that re-forms from it.
"""

import os
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from ._errors import ConfigError
from ._state import REPLICA_FIELDS, TrainState
from ._wire import WireFormatError, decode, encode_chunks

SHARED_FIELDS = ("global_params", "outer_states", "mail_mean")
REFORM_EXIT_CODE = 75  # an island that stopped at a sync boundary so the run can re-form (a rejoin)
_SUFFIX = ".snapshot"


def _leaves(tree: Any) -> list:
    return jax.tree.leaves(tree)


class IslandSnapshots:
    """The sync-boundary snapshots of one island, one file per step in `directory`.

    **Arguments:**

    - `directory`: the island's own folder (local disk is enough).
    - `keep`: how many of the newest snapshots to keep (at least 2: the newest may be the one a
      kill interrupted, which is never visible, since files appear by an atomic rename).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 2):
        self.directory = Path(directory)
        self.keep = max(2, keep)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def steps(self) -> list[int]:
        """Steps with a complete snapshot, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name[: -len(_SUFFIX)]) for p in self.directory.glob(f"*{_SUFFIX}")
                      if p.name[: -len(_SUFFIX)].isdigit())

    def newest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def load(self, step: int) -> dict[str, Any]:
        """The snapshot of `step` (see `island_payload`); its arrays are writable host arrays.

        Raises `WireFormatError` (a `ConfigError`) naming the file if it is not a well-formed snapshot.
        """
        path = self.directory / f"{step}{_SUFFIX}"
        with path.open("rb") as f:
            # One writable buffer the arrays are views of: no second copy of a large state.
            buffer = bytearray(os.fstat(f.fileno()).st_size)
            read = f.readinto(buffer)
        if read != len(buffer):
            raise WireFormatError(f"the island snapshot {path} changed size while it was read; it was not loaded")
        payload = decode(buffer, source=f"the island snapshot {path}")
        _check_payload(payload, step, path)
        return payload

    def write(self, payload: dict[str, Any], *, wait: bool = False) -> None:
        """Write `payload` (host arrays, see `island_payload`) in a background thread.

        A previous write is finished first; an error of a previous write is raised here. A payload
        that cannot be encoded (see `_wire.encode_chunks`) raises here, before anything is written.

        **Arguments:**

        - `payload`: `{"step": int, "island": int, "shared": {field: [array, ...]}, "own": {...}}`.
        - `wait`: return only once it is on disk.
        """
        self.wait()
        # Encoded in the caller: cheap (a header and views of the arrays), and a bad payload fails here.
        chunks = encode_chunks(payload)
        self.directory.mkdir(parents=True, exist_ok=True)
        for torn in self.directory.glob(f"*{_SUFFIX}.tmp"):  # a write a kill interrupted
            torn.unlink(missing_ok=True)

        def work():
            try:
                final = self.directory / f"{payload['step']}{_SUFFIX}"
                tmp = final.with_name(final.name + ".tmp")
                with tmp.open("wb") as f:
                    for chunk in chunks:
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, final)
                for old in self.steps()[: -self.keep]:
                    (self.directory / f"{old}{_SUFFIX}").unlink(missing_ok=True)
            except BaseException as e:  # reported by the next write or wait
                self._error = e

        self._thread = threading.Thread(target=work, name="island-snapshot", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until the last write is on disk; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"writing an island snapshot in {self.directory} failed: {error}") from error


def island_payload(state: TrainState, *, step: int, replica: int, island: int) -> dict[str, Any]:
    """Host copies of what island `island` (replica `replica` of `state`) needs to come back at `step`.

    Blocks until `state` is computed. Every field is put together from this process's shards:
    an island's devices all live in its process, so a sharded island (fsdp / tensor) writes the
    same whole arrays as a replicated one, and any island layout can re-form from them. Shared
    fields are whole; own fields are the island's replica's rows.
    """
    if state.mail_own is not None:
        raise ConfigError("elastic islands need a shared theta_g: --diloco.outer-overlap eager is not elastic")
    shared = {name: [_host_copy(x) for x in _leaves(getattr(state, name))] for name in SHARED_FIELDS}
    own = {name: [_host_copy(x, replica) for x in _leaves(getattr(state, name))] for name in REPLICA_FIELDS}
    return {"step": step, "island": island, "shared": shared, "own": own}


def _host_copy(x: jax.Array, replica: int | None = None) -> np.ndarray:
    """`x` (with `replica`: its row `replica` of the leading replica axis) on the host, from this process's
    shards; each distinct shard is copied once. Raises if this process does not hold all of it."""
    shape = x.shape if replica is None else x.shape[1:]
    out, filled, seen = np.empty(shape, x.dtype), 0, set()
    for shard in x.addressable_shards:
        index = shard.index
        if replica is not None:
            start, stop, _ = index[0].indices(x.shape[0])
            if not start <= replica < stop:
                continue
            index = index[1:]
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if key in seen:
            continue
        seen.add(key)
        data = np.asarray(shard.data)
        out[index] = data if replica is None else data[replica - start]
        filled += int(np.prod([b - a for a, b in key]))
    if filled != out.size:
        raise ConfigError("elastic islands need each island's devices in one process (this process holds part of "
                          "an island's arrays)")
    return out


def agree_on_step(snapshots: IslandSnapshots) -> tuple[int | None, int]:
    """(the newest step any live island has a snapshot of, the first process that has it).

    Every process must call it at the same point (a collective over processes).
    """
    mine = snapshots.newest()
    steps = np.asarray(multihost_utils.process_allgather(np.int64(-1 if mine is None else mine)))
    steps = steps.reshape(-1)
    newest = int(steps.max())
    if newest < 0:
        return None, 0
    return newest, int(np.flatnonzero(steps == newest)[0])


def reform_state(
    diloco,
    snapshots: IslandSnapshots,
    *,
    step: int,
    source: int,
    island: int,
    replica: int,
    key: jax.Array,
) -> TrainState:
    """The state of a run re-formed at `step` (see the module docstring), placed on `diloco`'s mesh.

    **Arguments:**

    - `diloco`: the `DiLoCo` core of the re-formed run (its R is the number of live islands),
      bound to a model (`init`, `abstract` or `restore` called).
    - `snapshots`: this island's snapshots.
    - `step`, `source`: from `agree_on_step` (called by every process).
    - `island`: this process's island id; `replica`: its replica index in the re-formed run.
    - `key`: seeds the PRNG stream of an island that starts afresh.
    """
    abstract = diloco.abstract_state
    if abstract.mail_own is not None:
        raise ConfigError("elastic islands need a shared theta_g: --diloco.outer-overlap eager is not elastic")
    mine = snapshots.load(step) if step in snapshots.steps() else None
    template = {name: [np.zeros(x.shape, x.dtype) for x in _leaves(getattr(abstract, name))]
                for name in SHARED_FIELDS}
    if mine is not None:
        _check_shapes(mine, template, abstract, snapshots.directory)
    is_source = jax.process_index() == source
    shared = mine["shared"] if is_source else template
    shared = multihost_utils.broadcast_one_to_all(shared, is_source=is_source)
    own = mine["own"] if mine is not None else _fresh_rows(diloco, shared, key, step)

    step_value = np.asarray(step, np.int32)
    fields = {"step": jax.make_array_from_callback((), diloco.shardings.step, lambda index: step_value)}
    for name in SHARED_FIELDS + REPLICA_FIELDS:
        value = getattr(abstract, name)
        leaves, treedef = jax.tree.flatten(value)
        shardings = jax.tree.leaves(getattr(diloco.shardings, name))
        placed = []
        for i, (leaf, sharding) in enumerate(zip(leaves, shardings)):
            if name in SHARED_FIELDS:
                host = np.asarray(shared[name][i])
                placed.append(jax.make_array_from_callback(leaf.shape, sharding, lambda index, h=host: h[index]))
            else:
                row = np.asarray(own[name][i])
                placed.append(jax.make_array_from_callback(
                    leaf.shape, sharding, lambda index, r=row, n=leaf.shape[0]: _row_for(index, r, replica, n)))
        fields[name] = jax.tree.unflatten(treedef, placed) if value is not None else None
    return TrainState(**fields, mail_own=None)


def _check_payload(payload: Any, step: int, path: Path) -> None:
    """Refuse a decoded snapshot that is not what `island_payload` writes (for `step`, from `path`)."""
    def refuse(reason: str) -> WireFormatError:
        return WireFormatError(f"the island snapshot {path} is not a snapshot of step {step} ({reason}); "
                               f"it was not loaded")

    if not isinstance(payload, dict) or set(payload) != {"step", "island", "shared", "own"}:
        raise refuse("not an object with exactly the keys step, island, shared and own")
    if payload["step"] != step or not isinstance(payload["step"], int) or isinstance(payload["step"], bool):
        raise refuse(f"its step is {payload['step']!r}")
    if not isinstance(payload["island"], int) or isinstance(payload["island"], bool):
        raise refuse(f"its island is {payload['island']!r}")
    for part in ("shared", "own"):
        fields = payload[part]
        if not isinstance(fields, dict) or not all(
                isinstance(leaves, list) and all(isinstance(x, np.ndarray) for x in leaves)
                for leaves in fields.values()):
            raise refuse(f"its {part} part is not fields of array lists")


def _check_shapes(payload: dict, template: dict, abstract: TrainState, where: Path) -> None:
    """Refuse a snapshot written by a run of another shape (every island checks its own)."""
    expected = {**{name: [(x.shape, x.dtype) for x in leaves] for name, leaves in template.items()},
                **{name: [(x.shape[1:], x.dtype) for x in _leaves(getattr(abstract, name))] for name in REPLICA_FIELDS}}
    found = {name: [(np.shape(x), np.asarray(x).dtype) for x in leaves]
             for part in ("shared", "own") for name, leaves in payload[part].items()}
    if found != expected:
        raise ConfigError(
            f"the island snapshots in {where} were written by a run of another shape (model, fragments, "
            f"quantization or optimizer changed): use a new --run-dir, or the flags of that run")


def _row_for(index: tuple, row: np.ndarray, replica: int, num_rows: int) -> np.ndarray:
    start, stop, _ = index[0].indices(num_rows)
    if (start, stop) != (replica, replica + 1):
        raise RuntimeError(f"elastic islands need one replica per process (this process holds rows {start}:{stop})")
    return row[None][(slice(None), *index[1:])]


def schedules_at(opt_state: Any, step: int) -> Any:
    """`opt_state` with every optax learning-rate schedule's counter (`ScaleByScheduleState`) at `step`.

    A fresh inner optimizer state of a rejoining island keeps its moments and Adam's bias
    correction fresh, but its learning rate must follow the run's schedule (warm-up and decay
    are functions of the step), not start the warm-up again. Schedules injected another way
    (`optax.inject_hyperparams`) are not moved.
    """
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree.map(lambda n: n._replace(count=jnp.full_like(n.count, step)) if is_schedule(n) else n,
                        opt_state, is_leaf=is_schedule)


def _fresh_rows(diloco, shared: dict[str, list], key: jax.Array, step: int) -> dict[str, list]:
    """Own rows of an island that (re)joins: theta_g, a fresh inner optimizer state (its learning-rate
    schedule at `step`), a zero residual."""
    abstract = diloco.abstract_state
    params = [np.asarray(x).astype(p.dtype) for x, p in zip(shared["global_params"], _leaves(abstract.params))]
    # On the host's CPU device: a whole replica may not fit one accelerator (a sharded island), and
    # only this process runs it (a program over the run's mesh would need every process).
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        params_tree = jax.tree.unflatten(jax.tree.structure(abstract.global_params), [jnp.asarray(p) for p in params])
        fresh = schedules_at(jax.jit(diloco.inner_optimizer.init)(params_tree), step)
        opt_state = [np.asarray(x) for x in _leaves(fresh)]
    keys = [np.asarray(jax.random.key_data(key))]
    residuals = [np.zeros(x.shape[1:], x.dtype) for x in _leaves(abstract.residuals)]
    return {"params": params, "opt_state": opt_state, "keys": keys, "residuals": residuals}


def own_replica(replica_sharding: jax.sharding.Sharding, num_replicas: int) -> int:
    """The replica whose rows this process holds under `replica_sharding` (an island holds exactly one)."""
    indices = replica_sharding.addressable_devices_indices_map((num_replicas, 2))
    starts = {(index[0].start or 0) for index in indices.values()}
    held = {(index[0].stop or num_replicas) - (index[0].start or 0) for index in indices.values()}
    if len(starts) != 1 or held != {1}:
        raise ConfigError(
            f"elastic islands need one replica per process (this process holds replicas {sorted(starts)}): "
            f"run as many processes as --diloco.num-replicas")
    return starts.pop()
