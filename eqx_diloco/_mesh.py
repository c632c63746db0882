"""Devices, processes and the ("diloco", "data", "fsdp", "tensor") meshes.

Each row of the compute mesh owns `data x fsdp x tensor` compute devices (one island: its
parameters are sharded over `fsdp` and `tensor`, see `_sharding`) and holds K replicas
(`replicas_per_device`, 1 unless a process has fewer devices than replicas); when syncs
overlap compute, each row has its own *communication devices* (its row of the communication mesh, shape
(1, fsdp, tensor): one partner for each shard of the island, so a sync gathers nothing).
On CPU hosts a collective inside the compute program, or a second program on the same
device, blocks compute; a program on a second local device runs beside it. All devices
of a row live in one process, so moving data between its compute and communication
devices is a local copy. Beside a GPU or TPU the communication devices are the process's CPU
devices (`comm_device="host"`, see `_host`).
"""

from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from ._arguments import check_replicas_per_process, processes_per_island
from ._errors import ConfigError
from . import _host
from ._host import sync_placement, too_few_host_devices

AXES = ("diloco", "data", "fsdp", "tensor")
INNER = ("data", "fsdp", "tensor")  # the axes inside one row (replica)
# Batches (R, B, ...) as placed: replica r's rows on mesh row r, its B examples split over `data`
# (the inner step of a sharded island splits them further over `fsdp`, see `_step`).
BATCH_SPEC = PartitionSpec("diloco", "data")


def use_cpu_devices(count: int) -> None:
    """Ask XLA for `count` simulated CPU devices; call it before any JAX computation.

    A CPU-only machine has one device by default, and `DiLoCo` wants R x `data_parallel`
    devices (plus one communication device per shard of each replica when syncs overlap
    compute; with fewer it packs replicas onto devices). Beside a GPU or TPU it sets the CPU
    devices that syncs with `comm_device="host"` run on. This sets JAX's global `jax_num_cpu_devices`, which can
    only change before JAX creates its backends: `DiLoCo` never calls it for you.

    **Arguments:**

    - `count`: the number of CPU devices this process should have (a smaller request than the
      current setting changes nothing).

    Raises `ConfigError` if JAX has already started with fewer devices.
    """
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        raise ConfigError(
            f"use_cpu_devices({count}) must run before JAX starts (it already has {jax.config.jax_num_cpu_devices} "
            f"CPU devices); call it first thing, or set XLA_FLAGS=--xla_force_host_platform_device_count={count}"
        ) from None


def ensure_cpu_devices(count: int) -> None:
    """`use_cpu_devices` where JAX may have started already (tests, the CLI): then a later
    mesh check reports what is missing instead."""
    try:
        use_cpu_devices(count)
    except ConfigError:
        pass


def too_few_devices(
    need: int, *, process: int, have: int, platform: str, comm: bool, local_replicas: int, per_device: int = 1,
    row: str = "data_parallel", comm_per_row: int = 1,
) -> ConfigError:
    """The one-line error for a process with `have` devices where the mesh needs `need`; what to do
    differs between a CPU (simulate more) and an accelerator (share the devices). `per_device`
    is the K that did not fit: once it holds all `local_replicas`, only fewer devices per row help.
    `row` names the devices of one row (`data_parallel x fsdp x tensor` for a sharded island), which
    has `comm_per_row` communication devices (`fsdp x tensor`) where `comm`."""
    comm_part = f" + {comm_per_row} communication device{'s' if comm_per_row > 1 else ''}" if comm else ""
    if platform == "cpu":
        hint = f"on CPU call eqx_diloco.use_cpu_devices({need}) before JAX starts"
    elif per_device >= local_replicas:
        hint = f"lower data_parallel{' or set comm_device off' if comm else ''} to fit the {have} {platform} devices"
    else:
        hint = (f"lower data_parallel{', set comm_device off' if comm else ''} or raise replicas_per_device "
                f"(a divisor of {local_replicas}) so that the replicas share the {have} {platform} devices")
    return ConfigError(f"(num_replicas / replicas_per_device) x ({row}{comm_part}) needs {need} devices per "
                       f"process, process {process} has {have} ({platform}); {hint}")


def as_full_mesh(mesh: Mesh) -> Mesh:
    """A user's ("diloco", "data") mesh as a mesh over all four axes (fsdp = tensor = 1)."""
    if mesh.axis_names == AXES:
        return mesh
    if mesh.axis_names != AXES[:2]:
        raise ConfigError(f"mesh axes must be {AXES} or {AXES[:2]} (got {mesh.axis_names})")
    return Mesh(mesh.devices[..., None, None], AXES, axis_types=(AxisType.Auto,) * len(AXES))


def check_comm_mesh(mesh: Mesh, comm_mesh: Mesh | None) -> None:
    """Refuse a communication mesh that is not one partner device for each shard of each row of `mesh`."""
    if comm_mesh is None:
        return
    want = {"diloco": mesh.shape["diloco"], "data": 1, "fsdp": mesh.shape["fsdp"], "tensor": mesh.shape["tensor"]}
    if dict(comm_mesh.shape) != want:
        raise ConfigError(f"comm_mesh must have the shape {want} (a partner device for each shard of a row of mesh; "
                          f"got {dict(comm_mesh.shape)})")
    if set(comm_mesh.devices.flat) & set(mesh.devices.flat):
        raise ConfigError("comm_mesh must not share devices with mesh: syncs overlap compute on devices of their own")
    partners = comm_mesh.devices[:, 0]  # the partner of every (row, fsdp, tensor) shard
    if any(p.process_index != d.process_index for p, d in zip(partners.flat, mesh.devices[:, 0].flat)):
        raise ConfigError("comm_mesh must put each partner device in the process of the compute devices it partners "
                          "(values move between them by local copies)")


def build_meshes(
    num_replicas: int,
    data: int = 1,
    *,
    comm_device: Literal["auto", "on", "host", "off"] = "off",
    replicas_per_device: int | None = None,
    fsdp: int = 1,
    tensor: int = 1,
) -> tuple[Mesh, Mesh | None]:
    """The compute mesh (R / K, data, fsdp, tensor) and, if asked for, the communication mesh (R / K, 1, fsdp, tensor).

    **Arguments:**

    - `num_replicas`: R, replicas in all. The process count divides it (every process holds
      R / processes whole replicas), or it divides the process count: then each island spans
      S = processes / R processes, `data x fsdp x tensor / S` devices of each (island i on
      processes i S .. i S + S - 1), and has no communication device.
    - `data`: devices per row on the `data` axis.
    - `fsdp`, `tensor`: devices per row on the `fsdp` and `tensor` axes (a sharded island);
      with either above 1 a row holds one replica.
    - `comm_device`: `on` gives every row `fsdp x tensor` extra communication devices (one
      for each shard of its island; one for an unsharded row) of the compute backend; `host`
      takes them from the process's CPU devices (`_host.host_devices`: beside a GPU or TPU,
      the CPU client's devices; on a CPU backend, the devices the compute mesh leaves);
      `auto` is `on` on a CPU backend (where a second program on the same device would not
      overlap) and `host` on a GPU or TPU (where it would queue behind the steps), each only
      where the process has the devices for it; `off`. An island that spans processes has none.
    - `replicas_per_device`: K, replicas held (and vmapped) by each row of the mesh; must
      divide each process's R / process-count replicas. None picks the smallest K for which
      the process has enough devices (1 where it has one row per replica).

    Row i of the mesh holds replicas i K .. i K + K - 1. Axis types are Auto so jit
    propagates shardings (shard_map then accepts inputs that are not already laid out on the
    mesh).
    """
    sharded = fsdp * tensor > 1
    if sharded and replicas_per_device not in (None, 1):
        raise ConfigError(f"replicas_per_device must be 1 with fsdp or tensor > 1 (got {replicas_per_device}): an "
                          f"island spans devices, replicas do not share them")
    if sharded:
        replicas_per_device = 1
    R, D, C = num_replicas, data * fsdp * tensor, fsdp * tensor  # C: communication devices of a row
    num_processes = jax.process_count()
    check_replicas_per_process(R, num_processes, replicas_per_device)
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in range(num_processes)]
    if (S := processes_per_island(R, num_processes)) > 1:
        return _island_over_processes(by_process, S, data, fsdp, tensor, comm_device), None
    local_replicas = R // num_processes
    have = min(len(devices) for devices in by_process)
    platform = by_process[0][0].platform
    placement = sync_placement(comm_device, platform)
    comm_wanted = placement != "off"
    # The host's CPU devices beside an accelerator are another client's: not counted against its devices.
    beside = placement == "host" and platform != "cpu"
    own = 0 if beside else C  # communication devices per row taken from the compute backend's devices
    host_have = min(len(_host.host_devices(p)) for p in range(num_processes)) if beside else 0

    def fits(k: int, comm: bool) -> bool:
        rows = local_replicas // k
        return rows * (D + own * int(comm)) <= have and (not (comm and beside) or rows * C <= host_have)

    divisors = [k for k in range(1, local_replicas + 1) if local_replicas % k == 0]
    K, comm = replicas_per_device, comm_wanted
    if K is None:
        # Fewest replicas per device first; an automatic communication device is dropped
        # before replicas are packed onto a device for it.
        comm_options = [comm_wanted, False] if comm_device == "auto" and comm_wanted else [comm_wanted]
        options = [(k, c) for k in divisors for c in comm_options]
        # Nothing fits: report the smallest need (every replica on one row, no automatic comm device).
        fallback = (local_replicas, comm_wanted and comm_device != "auto")
        K, comm = next((option for option in options if fits(*option)), fallback)
    elif comm_device == "auto" and not fits(K, comm):
        comm = False
    rows = local_replicas // K
    per_process = rows * (D + own * int(comm))
    for p, devices in enumerate(by_process):
        if len(devices) < per_process:
            raise too_few_devices(per_process, process=p, have=len(devices), platform=platform, comm=comm and own > 0,
                                  local_replicas=local_replicas, per_device=K, comm_per_row=C,
                                  row="data_parallel x fsdp x tensor" if sharded else "data_parallel")
    compute_rows, comm_rows = [], []
    for p, devices in enumerate(by_process):
        compute_rows.append(np.asarray(devices[: rows * D]).reshape(rows, data, fsdp, tensor))
        partners = devices[rows * D : per_process]
        if comm and placement == "host":
            partners = _host.host_devices(p, frozenset(devices[: rows * D]))[: rows * C]
            if len(partners) < rows * C:
                raise too_few_host_devices(rows * C, process=p, have=len(partners))
        comm_rows.append(np.asarray(partners).reshape(rows, int(comm), fsdp, tensor))
    auto = (AxisType.Auto,) * len(AXES)
    mesh = Mesh(np.concatenate(compute_rows), AXES, axis_types=auto)
    comm_mesh = Mesh(np.concatenate(comm_rows), AXES, axis_types=auto) if comm else None
    return mesh, comm_mesh


def _island_over_processes(by_process: list[list], S: int, data: int, fsdp: int, tensor: int,
                           comm_device: str) -> Mesh:
    """The compute mesh when each island spans `S` processes: row i is the first devices of processes
    i S .. i S + S - 1, in process order (so a process holds one contiguous block of the row)."""
    D, platform = data * fsdp * tensor, by_process[0][0].platform
    if D % S:
        raise ConfigError(f"an island spanning {S} processes needs data_parallel x fsdp x tensor divisible by {S} "
                          f"(got {D}): each process holds an equal share of its island's devices")
    if comm_device in ("on", "host"):
        raise ConfigError(f"comm_device {comm_device} needs whole islands per process (each island spans {S} "
                          f"processes): it runs its syncs on its own devices")
    for p, devices in enumerate(by_process):
        if len(devices) < D // S:
            raise too_few_devices(D // S, process=p, have=len(devices), platform=platform, comm=False,
                                  local_replicas=1, row=f"data_parallel x fsdp x tensor / {S} processes")
    rows = [np.concatenate([by_process[i * S + j][: D // S] for j in range(S)]).reshape(1, data, fsdp, tensor)
            for i in range(len(by_process) // S)]
    return Mesh(np.concatenate(rows), AXES, axis_types=(AxisType.Auto,) * len(AXES))
