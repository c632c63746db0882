"""`DiLoCo`'s checkpoints and elastic islands. A part of `DiLoCo` (see `_diloco`), kept in its own file."""

from typing import Any, Callable

from jaxtyping import PRNGKeyArray

from ._checkpoint import Checkpointer
from ._json import json_metadata
from ._elastic import IslandSnapshots, agree_on_step, island_payload, own_replica, reform_state
from ._errors import ConfigError
from ._state import TrainState

PyTree = Any


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class Persistence:
    """Save / restore, and snapshot / re-form an island (mixed into `DiLoCo`)."""

    # -- checkpoints -------------------------------------------------------------------------

    def save(
        self, checkpointer: Checkpointer, state: TrainState, *, metadata: Any = None, force: bool = False
    ) -> TrainState:
        """Save when `checkpointer.every` says a save is due at the state's step (or `force`).

        Call it after every step: off-schedule steps return at once. A due save settles the
        in-flight syncs, then starts an asynchronous Orbax save.

        **Arguments:**

        - `checkpointer`: where and how often (`every`; 0 never saves, not even with `force`).
        - `state`: the current state (donated when a save is due: use the returned one).
        - `metadata`: JSON-able (e.g. your config), stored beside the arrays and handed to
          `restore`'s `check`.
        - `force`: save at this step even if it is off the schedule (the end of a run).

        **Returns:** the state to use from here on (settled if a save ran).
        """
        step = self._current_step(state, "save")
        if not (force or checkpointer.due(step)):
            return state
        json_metadata(metadata)  # before `settle` donates the state
        state, _ = self.settle(state)
        checkpointer.save(step, state, metadata)
        return state

    def restore(
        self,
        checkpointer: Checkpointer,
        model: PyTree,
        *,
        step: int | None = None,
        check: Callable[[dict, int], str | None] | None = None,
    ) -> TrainState | None:
        """The newest intact checkpoint's state (or checkpoint `step`), placed on the mesh; None if none.

        `model` gives the structure (its values are not used). Resuming is bit-exact: the
        data position is yours to derive from `int(state.step)`.
        """
        self._bind(model)
        restored = checkpointer.restore_latest(self.abstract_state, self.shardings, check, step=step)
        if restored is None:
            return None
        state, saved_step = restored
        self._drop_in_flight()
        self._last_state, self._next_step = state, saved_step
        return state

    # -- elastic islands (one replica per process; see `_elastic`) ------------------------------

    @property
    def settled(self) -> bool:
        """Whether no sync is in flight: right after a sync or merge, a sync boundary."""
        return all(sync_group.in_flight is None for sync_group in self._sync_groups)

    def own_replica(self) -> int:
        """The replica whose rows this process holds (an island holds exactly one)."""
        return own_replica(self.shardings.keys, self.num_replicas)

    def island_snapshot(self, state: TrainState, *, island: int) -> dict[str, Any]:
        """Host copies of what island `island` (this process) needs to come back at this step.

        Call it at a sync boundary (`settled`); blocks until `state` is computed. Write the
        result with `IslandSnapshots.write`.
        """
        _require(self.settled, "island_snapshot needs a sync boundary: no sync may be in flight")
        return island_payload(state, step=self._current_step(state), replica=self.own_replica(), island=island)

    def reform(self, snapshots: IslandSnapshots, *, island: int, key: PRNGKeyArray) -> TrainState | None:
        """The state re-formed from the live islands' newest snapshot (None if no island has one).

        Every process calls it (it agrees on the step and broadcasts theta_g and the outer
        state from an island that has them); this island keeps its own rows if it has that
        step, else starts from theta_g with a fresh inner optimizer state. `key` seeds that
        fresh PRNG stream. Needs `init`, `abstract` or `restore` first (for the shapes).
        """
        _require(self._programs is not None, "call abstract(model) (or init / restore) before reform")
        step, source = agree_on_step(snapshots)
        if step is None:
            return None
        state = reform_state(self, snapshots, step=step, source=source, island=island,
                             replica=self.own_replica(), key=key)
        self._drop_in_flight()
        self._last_state, self._next_step = state, step
        return state

    def abstract(self, model: PyTree) -> TrainState:
        """The state's shapes and dtypes (`jax.ShapeDtypeStruct` leaves) for models like `model`."""
        self._bind(model)
        return self.abstract_state
