"""`DiLoCo`'s end of the pipeline: settling syncs in flight, finishing a run, non-finite
policy, and reading the global model. A part of `DiLoCo` (see `_diloco`), kept in its own file."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._arguments import check_not_donated
from ._errors import ConfigError, NonFiniteError
from ._outer import move_to_mesh
from ._state import TrainState

PyTree = Any


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _bad_rows(finite: Array) -> list[int]:
    """The replicas whose flag in `finite` (R,) is False, among the rows this process holds."""
    rows = {}
    for shard in finite.addressable_shards:
        start = shard.index[0].start or 0
        for offset, ok in enumerate(np.asarray(shard.data)):
            rows[start + offset] = bool(ok)
    return sorted(r for r, ok in rows.items() if not ok)


class Results:
    """Settle, finish and read the global model (mixed into `DiLoCo`, whose host state it uses)."""

    def settle(self, state: TrainState) -> tuple[TrainState, list[Array]]:
        """Wait for every in-flight sync and put its result into the state (merges stay scheduled).

        The global params then read as if the syncs had been blocking, which is what an
        evaluation or a checkpoint must see. Returns (state, finite flags of those syncs).
        """
        finished = []
        for sync_group in self._sync_groups:
            state, finite = sync_group.settle(state)
            if finite is not None:
                finished.append(finite)
                self._unchecked.append((self._next_step, finite))
        if self._last_state is not None:
            self._last_state = state
        return state, finished

    def sync_now(self, state: TrainState, group: int) -> TrainState:
        """Outside the schedule: the outer step of `group` now, with `outer_overlap` delayed / eager.

        For the end of training (the trainer's final sync): a group whose last scheduled sync
        is older than the last step takes one more outer step, so its inner steps since then
        are sent too; `drain` then lands that exchange. Needs nothing of `group` in flight
        (`settle` first).
        """
        _require(self.outer_overlap != "none", "sync_now is for outer_overlap='delayed' or 'eager'")
        sync_group = self._sync_groups[group]
        _require(sync_group.in_flight is None, f"group {group} has an exchange in flight: settle first")
        state = sync_group.launch(state)
        if self._last_state is not None:
            self._last_state = state
        return state

    def drain(self, state: TrainState) -> TrainState:
        """When training is over: land every exchange still on its way in the global model.

        `outer_overlap` delayed / eager: the last round's exchange has no next sync to be used
        at; this waits for it and applies the share no outer step has used yet (the part of
        an outer step that share is responsible for, see `_eager`), restarts the replicas from
        the new anchors and empties the mailbox (a second drain does nothing). Otherwise it is
        `settle`. Returns the state to evaluate, export or save.
        """
        state, _ = self.settle(state)
        if self.overlapped is not None:
            for sync_group in self._sync_groups:
                state = self.overlapped.drain(state, sync_group.index)
            if self._last_state is not None:
                self._last_state = state
        return state

    def finish(self, state: TrainState) -> TrainState:
        """End of training: after it, `global_model(state)` includes every inner step taken.

        Settles the syncs in flight, gives every parameter group whose last sync is older than
        the last step one more outer step (with Streaming DiLoCo every fragment but the one
        that synced last; with any `sync_period` that does not divide the step count, all of
        them), and lands the exchanges still on their way (`outer_overlap` delayed / eager).
        The replicas are not merged: training is over. Call it after the last `step`; a second
        call on the state it returned returns that state unchanged (another outer step there
        would move theta_g again with the outer momentum). Data-parallel training has nothing
        to finish.

        **Arguments:**

        - `state`: the state after the last step (donated: use the returned one).

        **Returns:** the finished state, to evaluate, export or save.

        **Raises:** `NonFiniteError` as `step` does, for every sync it ran or settled.
        """
        if not self.is_diloco:
            return state
        t = self._current_step(state, "finish")
        if state is self._finished_state:
            return state
        state, _ = self.settle(state)
        stale = self.stale_groups(t)
        if self.overlapped is not None:
            for group in stale:
                state = self.sync_now(state, group)
            state, _ = self.settle(state)  # their flags are checked before the exchanges land
            self._check_nonfinite(state, t)
            state = self.drain(state)
        else:
            for group in stale:
                state, finite = self.outer.sync(state, group)
                self._unchecked.append((t, finite))
        self._check_nonfinite(state, t)
        self._last_state, self._next_step, self._finished_state = state, t, state
        return state

    def stale_groups(self, t: int) -> list[int]:
        """The parameter groups whose last scheduled sync is older than step `t` (see `finish`)."""
        return [sync_group.index for sync_group in self._sync_groups if sync_group.last_sync(t) < t]

    def _current_step(self, state: TrainState, call: str = "step") -> int:
        if state is self._last_state:
            return self._next_step
        check_not_donated(state, call)
        return int(jax.device_get(state.step))  # a state we did not hand out: ask the device

    def _check_flags(self, state: TrainState, t: int, finite: Array) -> None:
        """In step `t`, once its inner step is dispatched (the devices keep working while the host
        waits): check the flags of the syncs that finished before it and of the step before, then
        queue this step's `finite` flags (R,) of loss and gradients, with `check_losses`."""
        if self._unchecked or self._unchecked_losses:
            self._check_nonfinite(state, t)
        if self.check_losses:
            self._unchecked_losses.append((t, finite))

    def _check_nonfinite(self, state: TrainState, t: int) -> None:
        """Raise `NonFiniteError` for the first unread flags (of inner steps or syncs, by step) that
        the policy does not accept, carrying `state` (at step `t`), whose theta_g is still finite.

        A process reads the rows of the replicas it holds (no collective); in a multi-process
        run the process holding a bad replica raises.
        """
        # An inner step's flags before the sync after that step: the order things went wrong in.
        unchecked = sorted([(step, 0, finite) for step, finite in self._unchecked_losses] +
                           [(step, 1, finite) for step, finite in self._unchecked], key=lambda entry: entry[:2])
        self._unchecked, self._unchecked_losses = [], []
        for step, is_sync, finite in unchecked:
            bad = _bad_rows(finite)
            if not bad or (self.on_nonfinite == "skip" and len(bad) < self.num_replicas):
                continue
            self._last_state, self._next_step = state, t  # the state passed in was donated
            what = "outer gradient (or outer step)" if is_sync else "loss (or gradient)"
            when = f"the sync after step {step}" if is_sync else f"step {step}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite {what} of replica {bad[0]} at {when}; the global model keeps its last finite "
                    f"values, in this error's state (on_nonfinite='stop'; 'skip' leaves such a replica out)",
                    state=state)
            raise NonFiniteError(
                f"non-finite {what} in every replica at {when}: on_nonfinite='skip' has nothing left to "
                f"{'average' if is_sync else 'train on'}", state=state)

    def global_params(self, state: TrainState) -> PyTree:
        """theta_g with in-flight results included (the state is not consumed); ddp: replica 0."""
        if not self.is_diloco:
            return jax.tree.map(lambda x: x[0], state.params)
        if self.outer_overlap == "eager":  # per-replica anchors: their mean
            return jax.tree.map(lambda x: jnp.mean(x, axis=0), state.global_params)
        if self.overlapped is not None:  # delayed: theta_g only moves at its syncs
            return state.global_params
        global_params = state.global_params
        for sync_group in self._sync_groups:
            if sync_group.in_flight is None:
                continue
            new_values = sync_group.in_flight.outputs[0]
            if self.comm_mesh is not None:
                new_values = move_to_mesh(new_values, self.comm_mesh, self.mesh)
            global_params = self.groups[sync_group.index].put(global_params, new_values)
        if self.outer_state_memory == "host":  # a copy in device memory, where models are computed with
            global_params = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")),
                                         global_params)
        return global_params

    def global_model(self, state: TrainState) -> PyTree:
        """The model to evaluate or export: theta_g (replica 0 for ddp), an instance of your model class.

        In-flight syncs are included without consuming `state`; the arrays are a copy, in the
        dtypes of the model that was bound (theta_g itself is float32 for bfloat16 parameters).
        """
        _require(self._programs is not None, "call init(model) (or restore) before global_model")
        if state is not self._last_state:
            check_not_donated(state, "global_model")
        # A copy: the next step donates the state, and the model handed out must outlive it. In the
        # model's own dtypes: theta_g is float32 where the model's parameters are narrower.
        model_dtypes = jax.tree.map(lambda x: x.dtype, self.abstract_state.params)
        params = jax.tree.map(lambda x, dtype: jnp.astype(x, dtype, copy=True), self.global_params(state), model_dtypes)
        return eqx.combine(params, self.static)

