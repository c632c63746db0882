"""`--decoupled.*`: the flags of decoupled islands (`lm/island.py`, `lm/syncer.py`) and their rules."""

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .._errors import ConfigError

if TYPE_CHECKING:
    from .config import Config


# Set by `python -m eqx_diloco.launch --decoupled` for its syncer and islands: the job its lock on the run
# folder names, so they tell their own launch's lock from another run's.
DECOUPLED_JOB_ENV = "EQX_DILOCO_DECOUPLED_JOB"


def read_token_file(path: Path) -> str:
    """The shared secret in `path`: its first line, without surrounding white space."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline(4096).strip()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class DecoupledConfig:
    """Decoupled islands: independent programs that sync through a syncer service, with no global barrier (`eqx_diloco.launch --decoupled`)."""

    role: Literal["off", "syncer", "island"] = "off"
    """run this process as the `syncer` (theta_g and the outer optimizer, a gRPC service) or as one `island` (one replica that trains on its own and syncs through the syncer); `off`: an ordinary run. `python -m eqx_diloco.launch --decoupled` sets it."""
    syncer: str = "127.0.0.1:50051"
    """HOST:PORT of the syncer: where it listens (role syncer; 0.0.0.0:PORT for every interface) and where islands reach it."""
    token: str | None = None
    """refused: a secret on the command line is visible to every user of the machine (`ps`) and was written to config.json. Set $EQX_DILOCO_SYNCER_TOKEN, or put it in a file and pass --decoupled.token-file."""
    token_file: Path | None = None
    """a file holding the shared secret every call to the syncer carries (its first line; default: $EQX_DILOCO_SYNCER_TOKEN); a call without it is refused. Make it readable by you alone."""
    island: int = 0
    """this island's id, in [0, --diloco.num-replicas): it picks the island's data share and random streams."""
    standby: bool = False
    """start as a hot spare: load and compile everything that does not depend on the island's id, then wait for one JSON line on standard input, `{"island": K, "cpus": [...]}`, naming the island to become (and the CPUs to keep to). `python -m eqx_diloco.launch --decoupled --spares N` keeps N of them ready, so a lost island's place is taken in a join's time, not a start's."""
    min_quorum: int | None = None
    """islands a merge waits for (of those present; default: all of them); the grace window bounds the wait."""
    grace_s: float | None = None
    """seconds a merge waits for missing islands after the first one reported. Unset: adaptive, --decoupled.grace-factor times the median lag of recent arrivals, within [--decoupled.grace-min-s, --decoupled.grace-max-s]."""
    grace_factor: float = 3.0
    """the adaptive grace window in medians of recent arrival lags."""
    grace_min_s: float = 0.05
    """lower bound of the adaptive grace window, in seconds."""
    grace_max_s: float = 10.0
    """upper bound of the adaptive grace window, in seconds (also the wait before the first lags are measured, and the longest a late island waits for the others' next report)."""
    max_staleness: int = 4
    """a contribution made from a theta_g more than this many versions behind is refused (its tokens are lost); fresher ones count 1 / (1 + staleness) of their tokens."""
    wait: bool = True
    """an island waits for each merge (at most the grace window) before its next step, as a synchronous sync does; `--decoupled.no-wait` pushes in the background and keeps training, and folds the merged fragment in when it comes back, keeping the steps it made meanwhile (they reach theta_g with its next push); a push due while the fragment's previous one is still open waits, with the island training on, until that merge is back. It waits only for its first merge at the run's start (islands that started apart go on in phase), and the run ends on theta_g's tokens (--train.steps of every island's, so a faster island makes more steps and a slower fewer)."""
    adaptive_h: bool = False
    """set each island's H from its measured speed (Dynamic Local Updates): the fastest island keeps --diloco.sync-period, a twice slower one syncs every H / 2 steps, so they report together."""
    retry_s: float = 120.0
    """how long an island keeps retrying (with backoff) while the syncer does not answer, e.g. while it restarts."""


def validate_decoupled(config: "Config") -> None:
    """The `--decoupled.*` rules and what decoupled islands do not combine with (one-line `ConfigError`)."""
    dc = config.decoupled
    _require(dc.token is None, "--decoupled.token would show the shared secret to every user of this machine "
             "(ps) and write it to the run's files: set $EQX_DILOCO_SYNCER_TOKEN, or put it in a file and pass "
             "--decoupled.token-file FILE")
    if dc.token_file is not None:
        _require(dc.token_file.is_file(), f"--decoupled.token-file {dc.token_file} is not a file")
        try:
            secret = read_token_file(dc.token_file)
        except OSError as e:
            raise ConfigError(f"--decoupled.token-file {dc.token_file} cannot be read ({e.strerror})") from None
        _require(bool(secret), f"--decoupled.token-file {dc.token_file} is empty: its first line is the shared secret")
    if config.decoupled.role == "off":
        return
    _require(config.algorithm == "diloco", "--decoupled.role needs --algorithm diloco (ddp averages every step)")
    dc, d = config.decoupled, config.diloco
    _require(not config.elastic.enabled, "--decoupled.role needs --elastic.no-enabled: decoupled islands are elastic "
             "by themselves (a lost island is left out of merges)")
    processes = config.dist.num_processes or 1
    _require(processes == 1 or dc.role == "island", f"--dist.num-processes must be unset or 1 for the syncer (got "
             f"{processes}): it is one process")
    devices = config.mesh.data * config.mesh.fsdp * config.mesh.tensor
    _require(devices % processes == 0, f"--mesh.data x --mesh.fsdp x --mesh.tensor = {devices} must be a multiple of "
             f"--dist.num-processes {processes}: every process of an island holds as many of its devices")
    _require(config.mesh.replicas_per_device <= 1, "--mesh.replicas-per-device must be 0 or 1 with --decoupled.role "
             f"(got {config.mesh.replicas_per_device}): an island is one replica on its own devices")
    for flag, value in [("--diloco.overlap-steps", d.overlap_steps), ("--diloco.router-sync-period", d.router_sync_period)]:
        _require(value == 0, f"{flag} must be 0 with --decoupled.role (got {value}): an island waits for its merge "
                 "(at most the grace window) and syncs every parameter with its fragment")
    _require(d.alpha == 0.0, f"--diloco.alpha must be 0 with --decoupled.role (got {d.alpha})")
    _require(d.outer_overlap == "none", f"--diloco.outer-overlap must be none with --decoupled.role (got {d.outer_overlap})")
    _require(d.topk is None, "--diloco.topk is not supported with --decoupled.role (send dense, quantized outer gradients)")
    _require(0 <= dc.island < d.num_replicas, f"--decoupled.island must be in [0, {d.num_replicas}) "
             f"(--diloco.num-replicas islands; got {dc.island})")
    _require(not dc.standby or dc.role == "island", "--decoupled.standby needs --decoupled.role island (a spare island)")
    _require(dc.min_quorum is None or 1 <= dc.min_quorum <= d.num_replicas,
             f"--decoupled.min-quorum must be in [1, {d.num_replicas}] (got {dc.min_quorum})")
    _require(dc.grace_s is None or dc.grace_s >= 0, f"--decoupled.grace-s must be >= 0 (got {dc.grace_s})")
    _require(dc.grace_factor > 0, f"--decoupled.grace-factor must be > 0 (got {dc.grace_factor})")
    _require(0 <= dc.grace_min_s <= dc.grace_max_s, "--decoupled.grace-min-s must be in [0, --decoupled.grace-max-s] "
             f"(got {dc.grace_min_s} and {dc.grace_max_s})")
    _require(dc.max_staleness >= 0, f"--decoupled.max-staleness must be >= 0 (got {dc.max_staleness})")
    _require(dc.retry_s > 0, f"--decoupled.retry-s must be > 0 (got {dc.retry_s})")
    host, _, port = dc.syncer.rpartition(":")
    _require(bool(host) and port.isdigit() and int(port) < 65536,
             f"--decoupled.syncer must be HOST:PORT (got {dc.syncer!r})")
