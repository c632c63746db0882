"""Islands that use the accelerators they are given: with the `--mesh.*` flags at their defaults, a
process with more GPUs or TPU chips than its replicas spreads each island over its share of them.

A CPU run is left as its flags say: the trainer simulates exactly the CPU devices the flags need
(`_layout.devices_needed`), so there are none to spare."""

import dataclasses
from typing import TYPE_CHECKING

from .._arguments import processes_per_island
from ._layout import wants_comm_device

if TYPE_CHECKING:
    from .config import Config

# A replica "fits one device" where its train state (float32 parameters, AdamW's two moments, theta_g,
# the outer momentum: five parameter-sized copies) takes at most this share of the device's memory; the
# rest is left to the activations. `_fit` then checks the chosen layout against the compiled step.
STATE_SHARE_OF_DEVICE = 0.5
STATE_COPIES = 5


@dataclasses.dataclass(frozen=True)
class Spread:
    """What the trainer did with a process's devices.

    - `config`: the run's config, with `--mesh.data` or `--mesh.fsdp` raised where islands spread.
    - `devices`: the process's devices; `per_island`: how many each of its islands uses.
    - `axis`: `data` (a replica fits one device), `fsdp` (it does not), or None (nothing spread).
    - `idle`: devices of this process no island uses.
    """

    config: "Config"
    devices: int
    per_island: int
    axis: str | None
    idle: int

    def lines(self) -> list[str]:
        """The banner's lines: the devices each island uses, and one line if some sit idle."""
        if self.axis is None and not self.idle:
            return []
        lines = []
        if self.axis is not None:
            why = ("data parallel: a replica fits one device" if self.axis == "data" else
                   "fsdp: a replica's train state does not fit one device")
            lines.append(f"  islands      each on {self.per_island} devices (--mesh.{self.axis} {self.per_island}, "
                         f"{why})")
        if self.idle:
            lines.append(f"  idle         {self.idle} of this process's {self.devices} devices train nothing "
                         f"(see --mesh.data, --mesh.fsdp and --train.batch-size, which the devices of an island "
                         f"divide)")
        return lines


def default_mesh_flags(config: "Config") -> bool:
    """Whether every `--mesh.*` flag is at its default (nothing says how islands use devices)."""
    m = config.mesh
    return (m.data, m.fsdp, m.tensor, m.replicas_per_device) == (1, 1, 1, 0)


def spread_over_devices(config: "Config", *, devices: int, platform: str, num_processes: int,
                        device_memory: int | None) -> Spread:
    """Spread each island of `config` over this process's `devices` (of `platform`, each with
    `device_memory` bytes, None if unknown) where no `--mesh.*` flag is given and the platform is not
    the CPU: data parallel where a replica's train state fits a device (see `STATE_SHARE_OF_DEVICE`),
    fsdp where it does not. An island takes the most devices of its share that divide
    `--train.batch-size`; the rest stay idle, and `Spread.lines` says so."""
    R, m = config.diloco.num_replicas, config.mesh
    local = R // num_processes if processes_per_island(R, num_processes) == 1 else 0
    island = m.data * m.fsdp * m.tensor
    rows = local // (m.replicas_per_device or 1)
    comm = m.fsdp * m.tensor if wants_comm_device(config) and config.diloco.comm_device == "on" else 0
    used = rows * (island + comm) if local else island // (num_processes // R)
    # On CPU the trainer made exactly the devices it needs: none is idle.
    unchanged = Spread(config, devices, island, None, 0 if platform == "cpu" else max(0, devices - used))
    if platform == "cpu" or not default_mesh_flags(config) or not local or devices < 2 * local:
        return unchanged
    share = devices // local
    batch = config.train.batch_size
    per_island = max(n for n in range(1, share + 1) if batch % n == 0)
    if per_island == 1:
        return unchanged
    state_bytes = STATE_COPIES * 4 * config.model.num_params()
    fits = device_memory is None or state_bytes <= STATE_SHARE_OF_DEVICE * device_memory
    axis = "data" if fits else "fsdp"
    mesh = dataclasses.replace(config.mesh, **{axis: per_island})
    return Spread(dataclasses.replace(config, mesh=mesh), devices, per_island, axis, devices - local * per_island)


def device_memory_bytes(device) -> int | None:
    """The memory JAX may allocate on `device` (its allocator's limit), or None where it keeps no such
    figure (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def device_facts() -> dict:
    """This process's devices as `spread_over_devices` and `_fit.fit_on_device` read them: how many, the
    platform (`models._config.target_platform`), the process count and one device's memory (None on CPU).
    Tests replace it to see what a GPU or TPU machine would get."""
    import jax

    from models._config import target_platform

    devices = jax.local_devices()
    return dict(devices=len(devices), platform=target_platform(), num_processes=jax.process_count(),
                device_memory=device_memory_bytes(devices[0]))
