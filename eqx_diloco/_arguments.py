"""The rules of `DiLoCo`'s arguments, written once. Errors name the argument; the CLI maps the
names to its flags (`eqx_diloco.lm.config.validate`)."""

import math
from typing import Any

from ._errors import ConfigError
from ._formats import FORMATS

# No JAX at import: the CLI checks its flags with `check_arguments` before JAX (seconds) is imported.

PyTree = Any


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_int(value: Any) -> bool:
    """A count: an int, but not True or False (which Python counts as 1 and 0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_topk(topk: float | None, chunk: int) -> str | None:
    """What is wrong with a top-k density and chunk size, naming the arguments (None if fine)."""
    if not (isinstance(chunk, int) and 8 <= chunk <= 65536 and 65536 % chunk == 0):
        return f"topk_chunk must divide 65536 and be >= 8 (a power of two; got {chunk!r})"
    if topk is None:
        return None
    if isinstance(topk, bool) or not (isinstance(topk, (int, float)) and math.isfinite(topk) and 0 < topk <= 1):
        return f"topk must be a density in (0, 1] (got {topk!r})"
    return None


def check_error_feedback(error_feedback: bool | float) -> str | None:
    """What is wrong with an `error_feedback` argument (None if nothing): True, False or a decay in (0, 1]."""
    if isinstance(error_feedback, bool) or (isinstance(error_feedback, (int, float)) and 0 < error_feedback <= 1):
        return None
    return f"error_feedback must be True, False or a decay in (0, 1] (got {error_feedback!r})"


def error_feedback_decay(error_feedback: bool | float) -> float:
    """The factor on the residual an `error_feedback` argument carries: the decay itself, 1 for True."""
    return 1.0 if isinstance(error_feedback, bool) else float(error_feedback)


def processes_per_island(num_replicas: int, num_processes: int) -> int:
    """1 where every process holds whole replicas (the process count divides R), else S, the processes
    each island spans (R divides the process count: island i is processes i S .. i S + S - 1)."""
    if num_replicas % num_processes == 0:
        return 1
    _require(num_processes % num_replicas == 0,
             f"num_replicas and the process count must divide one another: every process holds whole replicas, "
             f"or every island spans whole processes (got {num_replicas} replicas and {num_processes} processes)")
    return num_processes // num_replicas


def check_replicas_per_process(num_replicas: int, num_processes: int, replicas_per_device: int | None) -> None:
    """`replicas_per_device` (None: automatic) must divide each process's R / processes replicas; an
    island spanning processes holds one replica per row."""
    if processes_per_island(num_replicas, num_processes) > 1:
        _require(replicas_per_device in (None, 1), f"replicas_per_device must be 1 when an island spans processes "
                 f"({num_replicas} replicas on {num_processes} processes; got {replicas_per_device})")
        return
    local_replicas = num_replicas // num_processes
    _require(replicas_per_device is None or local_replicas % replicas_per_device == 0,
             f"replicas_per_device must divide the replicas of each process (got {replicas_per_device} and "
             f"{local_replicas} = num_replicas {num_replicas} / {num_processes} processes)")


def check_arguments(
    *,
    num_replicas: int,
    sync_period: int,
    num_fragments: int,
    fragment_pattern: str,
    overlap_steps: int,
    alpha: float,
    quantize: str,
    error_feedback: bool | float,
    outer_overlap: str,
    exchange: str,
    router_sync_period: int,
    has_routers: bool,
    on_nonfinite: str,
    data_parallel: int,
    comm_device: str,
    algorithm: str,
    replicas_per_device: int | None = None,
    topk: float | None = None,
    topk_chunk: int = 65536,
    fsdp: int = 1,
    tensor: int = 1,
    outer_state_memory: str = "device",
    param_specs: Any = None,
    sync_compiler_options: Any = None,
    check_losses: bool = True,
) -> None:
    """Raise `ConfigError` naming the argument for the first rule these `DiLoCo` arguments break.

    The arguments are `DiLoCo`'s (see its docstring); `has_routers` says whether a `routers`
    selector was given.
    """
    for name, value in [("num_replicas", num_replicas), ("sync_period", sync_period),
                        ("num_fragments", num_fragments), ("data_parallel", data_parallel), ("fsdp", fsdp),
                        ("tensor", tensor)]:
        _require(_is_int(value) and value >= 1, f"{name} must be an int >= 1 (got {value!r})")
    _require(isinstance(check_losses, bool), f"check_losses must be True or False, got {check_losses!r}")
    _require(replicas_per_device is None or (_is_int(replicas_per_device) and replicas_per_device >= 1),
             f"replicas_per_device must be an int >= 1 or None (got {replicas_per_device!r})")
    _require(replicas_per_device is None or num_replicas % replicas_per_device == 0,
             f"replicas_per_device must divide num_replicas (got K={replicas_per_device}, R={num_replicas})")
    _require(_is_int(overlap_steps) and overlap_steps >= 0, f"overlap_steps must be an int >= 0 (got {overlap_steps!r})")
    _require(_is_int(router_sync_period) and router_sync_period >= 0,
             f"router_sync_period must be an int >= 0 (got {router_sync_period!r})")
    _require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha),
             f"alpha must be a number in [0, 1] (got {alpha!r})")
    _require(algorithm in ("diloco", "ddp"), f"algorithm must be diloco or ddp (got {algorithm!r})")
    _require(on_nonfinite in ("stop", "skip"), f"on_nonfinite must be stop or skip (got {on_nonfinite!r})")
    _require(comm_device in ("auto", "on", "host", "off"),
             f"comm_device must be auto, on, host or off (got {comm_device!r})")
    _require(quantize in FORMATS, f"quantize must be one of {', '.join(FORMATS)} (got {quantize!r})")
    topk_problem = check_topk(topk, topk_chunk)
    _require(topk_problem is None, str(topk_problem))
    _require(exchange in ("auto", "gather", "two_phase"), f"exchange must be auto, gather or two_phase (got {exchange!r})")
    _require(fragment_pattern in ("strided", "sequential", "balanced"),
             f"fragment_pattern must be strided, sequential or balanced (got {fragment_pattern!r})")
    _require(outer_overlap in ("none", "delayed", "eager"),
             f"outer_overlap must be none, delayed or eager (got {outer_overlap!r})")
    _require(fsdp * tensor == 1 or replicas_per_device in (None, 1),
             f"replicas_per_device must be 1 with fsdp or tensor > 1 (got {replicas_per_device}): an island spans "
             f"devices, replicas do not share them")
    _require(param_specs is None or callable(param_specs),
             "param_specs must be a callable: param_specs(abstract_model) -> tree of PartitionSpec, or None")
    _require(sync_compiler_options is None or isinstance(sync_compiler_options, dict),
             f"sync_compiler_options must be a dict of XLA compiler options, or None (got {sync_compiler_options!r})")
    _require(outer_state_memory in ("device", "host"),
             f"outer_state_memory must be device or host (got {outer_state_memory!r})")
    if outer_state_memory == "host":
        _require(algorithm == "diloco", "outer_state_memory host applies to algorithm diloco only, not ddp")
        _require(outer_overlap == "none", f"outer_state_memory host needs outer_overlap none (got {outer_overlap})")
    if algorithm == "ddp":
        for name, off in [("num_fragments", num_fragments == 1), ("overlap_steps", overlap_steps == 0),
                          ("alpha", alpha == 0), ("quantize", quantize == "none"), ("error_feedback", not error_feedback),
                          ("exchange", exchange == "auto"), ("outer_overlap", outer_overlap == "none"),
                          ("router_sync_period", router_sync_period == 0), ("topk", topk is None)]:
            _require(off, f"{name} applies to algorithm diloco only, not ddp")
        return
    H, P = sync_period, num_fragments
    _require(H % P == 0, f"sync_period must be divisible by num_fragments (got H={H}, P={P})")
    _require(overlap_steps < H // P,
             f"overlap_steps must be < sync_period / num_fragments (got tau={overlap_steps}, H/P={H // P})")
    _require(0 <= alpha <= 1, f"alpha must be in [0, 1] (got {alpha})")
    if outer_overlap != "none":
        o = outer_overlap
        _require(overlap_steps == 0, f"outer_overlap {o} overlaps a whole round; it does not combine with overlap_steps > 0")
        _require(alpha == 0, f"outer_overlap {o} restarts replicas from the new anchor; it does not combine with alpha > 0")
        _require(router_sync_period == 0, f"outer_overlap {o} does not combine with router_sync_period")
        _require(o != "eager" or on_nonfinite == "stop",
                 "outer_overlap eager needs on_nonfinite stop (a skipped replica cannot be taken out of proxies the "
                 "others already applied)")
    ef_problem = check_error_feedback(error_feedback)
    _require(ef_problem is None, str(ef_problem))
    _require(not error_feedback or quantize != "none" or topk is not None,
             "error_feedback needs a lossy quantize format or topk (got quantize none)")
    _require(topk is None or error_feedback,
             f"topk needs error_feedback (the entries a top-k leaves out are carried to the next sync; got topk={topk})")
    if router_sync_period:
        _require(has_routers, "router_sync_period needs a routers selector")
        _require(H % router_sync_period == 0,
                 f"router_sync_period must divide sync_period (got K={router_sync_period}, H={H})")


def check_batch(batch: PyTree, num_replicas: int, split: int = 1) -> None:
    """Every leaf of `batch` needs the leading replica axis of size R and a batch axis after it,
    divisible by `split` (the devices a replica's batch is split over: data x fsdp)."""
    import jax  # noqa: PLC0415  (see the note on imports above)

    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = getattr(leaf, "shape", ())
        if len(shape) < 2 or shape[0] != num_replicas:
            raise ConfigError(
                f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has shape {tuple(shape)}: every leaf needs a "
                f"leading replica axis of size num_replicas={num_replicas}, then the replica's batch axis"
            )
        if shape[1] % split:
            raise ConfigError(
                f"batch leaf {jax.tree_util.keystr(path) or 'batch'} has {shape[1]} examples per replica: the batch "
                f"axis must be divisible by data_parallel x fsdp = {split}"
            )


def check_not_donated(state: PyTree, call: str) -> None:
    """`state` must still hold its arrays: `step`, `finish` and a due `save` donate the state they
    are given (XLA reuses its buffers), and only the state they return may be used again."""
    import jax  # noqa: PLC0415  (see the note on imports above)

    if any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(state)):
        raise ConfigError(f"{call}: this state was donated to an earlier step, finish or save, which deleted its "
                          f"arrays: pass the state that call returned")
