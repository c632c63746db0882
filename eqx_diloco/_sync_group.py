"""The host side of one parameter group: when it syncs, what it sends, and its exchange in flight.

`DiLoCo` holds one `SyncGroup` per parameter group (fragments 0..P-1, then the router group
if it has its own period), as torchft holds one object per fragment: the group's schedule,
its payload sizes and its in-flight exchange live together instead of in dicts and lists
keyed by the group's index. The device-side state and the jitted programs stay where they
are (`TrainState`, `OuterSync` / `OverlappedOuter`); a group reaches its programs by index.
"""

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from jaxtyping import Array

from ._eager import InFlightExchange
from ._outer import InFlightSync, sync_nbytes, sync_wire_nbytes
from ._sharding import local_shape, payload_parts
from ._state import TrainState

if TYPE_CHECKING:
    from ._diloco import DiLoCo
    from ._programs import Programs

PyTree = Any


@dataclasses.dataclass(eq=False)
class SyncGroup:
    """One parameter group's schedule, payload sizes and in-flight exchange.

    **Arguments:**

    - `index`: the group's index: its slot in `state.outer_states` and in the programs' tables.
    - `first_sync`: the first step after which the group syncs.
    - `period`: inner steps between two of its syncs (H for a fragment, K for the routers).
    - `sent_bytes`: payload bytes one replica encodes per sync of the group (scales included).
    - `wire_bytes`: bytes one replica's collectives move per sync of the group (the sum over
      its devices: a sharded island's devices each move their own shard).
    - `wire_bytes_per_device`: bytes one device's collectives move per sync of the group.
    - `num_values`: parameters in the group (the denominator of bits per parameter).
    - `programs`: the `Programs` whose `outer` or `overlapped` runs its exchange.
    - `in_flight`: its launched exchange whose result is not installed yet, or None.
    """

    index: int
    first_sync: int
    period: int
    sent_bytes: int
    wire_bytes: int
    wire_bytes_per_device: int
    num_values: int
    programs: "Programs" = dataclasses.field(repr=False)
    in_flight: InFlightSync | InFlightExchange | None = None

    def syncs_after(self, t: int) -> bool:
        """Whether the group's sync starts after inner step `t`."""
        return t >= self.first_sync and (t - self.first_sync) % self.period == 0

    def last_sync(self, t: int) -> int:
        """The last step <= `t` after which the group synced (0 if none)."""
        if t < self.first_sync:
            return 0
        return t - (t - self.first_sync) % self.period

    def launch(self, state: TrainState) -> TrainState:
        """Start the group's exchange without waiting for it; it stays in flight until `settle`.

        With `outer_overlap` delayed / eager this is the group's outer step with the arrived
        mean (so the state changes); otherwise the sync is dispatched on the communication
        devices and the state is unchanged until its result is installed.
        """
        assert self.in_flight is None, f"group {self.index} already has an exchange in flight"
        overlapped, outer = self.programs.overlapped, self.programs.outer
        if overlapped is not None:
            state, self.in_flight = overlapped.sync(state, self.index)
        else:
            self.in_flight = outer.launch(state, self.index)
        return state

    def settle(self, state: TrainState) -> tuple[TrainState, Array | None]:
        """Wait for the exchange in flight (if any) and install its result.

        **Returns:** `(state, finite)`: `finite` (R,) of that exchange, or None if nothing was in flight.
        """
        if self.in_flight is None:
            return state, None
        programs = self.programs.overlapped or self.programs.outer
        state, finite = programs.install(state, self.in_flight)
        self.in_flight = None
        return state, finite


def make_sync_groups(d: "DiLoCo", programs: "Programs", params: PyTree) -> tuple[SyncGroup, ...]:
    """The `SyncGroup`s of `DiLoCo` `d` for its bound `programs` and the model's trainable `params`.

    Fragment p syncs after steps (p + 1) H / P + k H (`schedule.synced_fragment` in closed
    form); the router group after every K steps.
    """
    H, P = d.sync_period, d.num_fragments
    island = d.fsdp * d.tensor  # devices that each send their own shard of the replica's values
    sizes = {"fsdp": d.fsdp, "tensor": d.tensor}
    sync_groups = []
    for index, group in enumerate(programs.groups):
        shapes = [v.shape for v in group.get(params)]
        specs = None if programs.value_specs is None else programs.value_specs[index]
        # One device's payloads: its shard of each value, one payload per layout (see `payload_parts`).
        parts = [[local_shape(shapes[i], specs[i], sizes) if specs else shapes[i] for i in part]
                 for part in payload_parts(specs, len(shapes))]
        sent = sum(sync_nbytes(part, d.wire, d.num_replicas, d.exchange) for part in parts)
        wire = sum(sync_wire_nbytes(part, d.wire, d.num_replicas, d.exchange) for part in parts)
        if index == programs.router_group:
            first_sync, period = d.router_sync_period, d.router_sync_period
        else:
            first_sync, period = (index + 1) * (H // P), H
        sync_groups.append(SyncGroup(
            index=index, first_sync=first_sync, period=period,
            # One replica has no peer: its syncs stay on the device.
            sent_bytes=island * sent if d.num_replicas > 1 else 0,
            wire_bytes=island * wire, wire_bytes_per_device=wire,
            num_values=sum(math.prod(s) for s in shapes),
            programs=programs,
        ))
    return tuple(sync_groups)
