"""What `DiLoCo`'s syncs send: bytes per sync and bits per parameter. A part of `DiLoCo` (see
`_diloco`), kept in its own file; the counts themselves are the `SyncGroup`s' (see `_sync_group`)."""

from ._errors import ConfigError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


class Traffic:
    """Byte counts of the syncs (mixed into `DiLoCo`, whose sync groups they read)."""

    @property
    def bits_per_parameter(self) -> float:
        """Payload bits one replica encodes per parameter per sync (indices and scales included;
        0 with one replica, and 32 for DDP's float32 gradient)."""
        if not self.is_diloco:
            return 32.0 if self.num_replicas > 1 else 0.0
        _require(bool(self._sync_groups), "call init(model) (or restore / abstract) before bits_per_parameter")
        return 8 * sum(g.sent_bytes for g in self._sync_groups) / sum(g.num_values for g in self._sync_groups)

    def sent_bytes_at(self, t: int) -> int:
        """Payload bytes one replica encodes for the syncs that start at step t (scales included)."""
        if not self.is_diloco:
            return self.ddp_step_bytes
        return sum(g.sent_bytes for g in self._sync_groups if g.syncs_after(t))

    def wire_bytes_at(self, t: int) -> int:
        """Bytes one replica's collectives move for the syncs that start at step t.

        A float32 psum counts as a ring all-reduce (2 (R - 1) / R of the buffer), a payload
        all-gather as R - 1 payloads, the two-phase exchange as 2 (R - 1) / R of a payload.
        """
        if not self.is_diloco:
            return self.ddp_step_wire_bytes
        return sum(g.wire_bytes for g in self._sync_groups if g.syncs_after(t))

    def wire_bytes_per_device_at(self, t: int) -> int:
        """Bytes one device's collectives move for the syncs that start at step t: `wire_bytes_at`
        over the `fsdp x tensor` devices of a sharded island (each moves its own shard)."""
        if not self.is_diloco:
            return self.ddp_step_wire_bytes // (self.fsdp * self.tensor)
        return sum(g.wire_bytes_per_device for g in self._sync_groups if g.syncs_after(t))
