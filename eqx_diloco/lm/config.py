"""Configuration dataclasses (the CLI is generated from them by tyro) and their validation."""

import dataclasses
import math
from pathlib import Path
from typing import Annotated, Literal

import tyro

from models import TransformerConfig
from models._config import attention_rule

from .._arguments import check_arguments
from .._errors import ConfigError
from ._decoupled_config import DecoupledConfig, validate_decoupled
from ._hf_config import check_layout, fill_from_folder
from ._flags import FLAGS, check_backend, flag_names  # noqa: F401  (re-exported: the CLI's flag names)

Algorithm = Literal["diloco", "ddp"]
QuantizeFormat = Literal["none", "bf16", "fp8", "int8", "int4", "e3m0", "int2"]


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """Outer loop: replicas, sync period, outer optimizer, fragments, overlap, quantization."""

    num_replicas: int = 2
    """R, the number of independently training replicas ("islands")."""
    sync_period: int = 20
    """H, inner steps between two outer syncs of the same parameters."""
    outer_lr: float = 1.0
    """learning rate of the outer SGD optimizer. Default 1.0 with Nesterov momentum 0.3: at 512 tokens per replica step it beat plain averaging by 2.4 +- 0.2 points at H = 20 and tied it at H = 10 (3 seeds, benchmarks/results/outer_sweep_h20, outer_sweep.md); the papers' 0.7 with Nesterov 0.9 targets long runs at 10^5-10^6 tokens per replica step and was 5-10% behind DDP here."""
    outer_momentum: float = 0.3
    """momentum of the outer SGD optimizer (0 disables it: plain averaging at lr 1; the papers use 0.9)."""
    nesterov: bool = True
    """use Nesterov momentum in the outer optimizer."""
    num_fragments: int = 1
    """P, total number of Streaming DiLoCo fragments (1 = plain DiLoCo). Fragment 0 holds everything outside the layer stack; fragments 1..P-1 hold layers."""
    fragment_pattern: Literal["strided", "sequential", "balanced"] = "strided"
    """`strided` (fragment f holds layers f-1, f-1+(P-1), ...), `sequential` (contiguous blocks of layers) or `balanced` (strided layers, and the parameters outside the layer stack (embeddings, head, final norm) spread over all fragments, largest first onto the smallest, so fragment 0 no longer sets the peak bandwidth)."""
    overlap_steps: int = 0
    """tau, inner steps a fragment's sync overlaps before it is merged."""
    alpha: float = 0.0
    """merge weight: replica = alpha * replica + (1 - alpha) * new global."""
    quantize: QuantizeFormat = "none"
    """wire format of each replica's outer gradient (of its kept values, with --diloco.topk); int2 has four levels per block and no zero."""
    topk: float | None = None
    """send only this fraction (a density in (0, 1], e.g. 0.03) of each chunk of an outer gradient, the largest in magnitude, with their positions (SparseLoCo); needs --diloco.error-feedback, which carries the rest to the next sync. Unset: send everything."""
    topk_chunk: int = 65536
    """values per top-k chunk: a power of two from 8 to 65536 (each chunk's positions travel as one Elias-Fano code, about log2(1/density) + 2 bits each). Large chunks select nearly over a whole fragment, which trained better than small ones (benchmarks/results/compression)."""
    error_feedback: bool = False
    """keep each replica's quantization residual and add it to its next outer gradient of the same fragment."""
    error_feedback_decay: float = 1.0
    """beta in (0, 1]: the residual is multiplied by it before it is added (needs --diloco.error-feedback). Below 1 it is SparseLoCo's error-feedback accumulator, which stands in for outer momentum: pair 0.95 with --diloco.outer-momentum 0."""
    outer_overlap: Literal["none", "delayed", "eager"] = "none"
    """overlap each sync's whole exchange with the next round of that fragment (arXiv 2502.12996): `delayed` applies the averaged outer gradient one outer step late; `eager` uses each replica's fresh outer gradient in place of its own stale share and corrects with the others' when they arrive (needs --diloco.overlap-steps 0, --diloco.alpha 0; eager needs --train.on-nonfinite stop)."""
    exchange: Literal["auto", "gather", "two_phase"] = "auto"
    """collective of a quantized sync: `gather` (all-gather every replica's payload: each sends R-1 payloads), `two_phase` (packed reduce-scatter + all-gather: each sends 2(R-1)/R of a payload, like a ring all-reduce; rounds twice) or `auto` (gather at R <= 2, two_phase above; top-k payloads are gathered up to R = 8: a second top-k of the reduced sum trains worse)."""
    router_sync_period: int = 0
    """K > 0 gives MoE router parameters their own outer step every K inner steps (0 = off; router leaves then sync with their fragment)."""
    comm_device: Literal["auto", "on", "host", "off"] = "auto"
    """with overlap (tau > 0 or --diloco.outer-overlap), run each sync on devices of its own (one per replica, or per shard of a sharded island) so it really overlaps compute: `on` = extra devices of the backend, `host` = the process's CPU devices (beside a GPU or TPU: values copied there and back), `auto` = on for CPU, host for GPU and TPU, `off` = dispatch it on the compute devices (correct everywhere; on an accelerator it then waits behind the steps)."""
    outer_state_memory: Literal["device", "host"] = "device"
    """where theta_g and the outer optimizer state live between syncs: `device` memory, or the devices' `host` memory (JAX's pinned_host memory kind), which frees two parameter-sized copies per device; a sync or merge brings its fragment to the device. Needs --diloco.outer-overlap none."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The inner optimizer."""

    inner: Literal["adamw", "muon"] = "adamw"
    """`adamw`, or `muon`: optax.contrib.muon (momentum orthogonalized by Newton-Schulz) on the stacked weight matrices of the layers, AdamW (--train.lr, betas, weight decay) on embeddings, head, norms and router (MuLoCo's recipe)."""
    muon_lr: float = 0.02
    """peak learning rate of Muon's matrices (same warm-up and cosine decay as --train.lr)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Inner optimization and the loop."""

    steps: int = 200
    """total inner steps. With DiLoCo, parameters whose last outer sync is older than the last step get one final sync at the end, so every inner step reaches the global model (exported and evaluated)."""
    batch_size: int = 8
    """sequences per replica per step (split over the `data` mesh axis)."""
    seq_len: int = 128
    """tokens per sequence (each sample holds seq_len + 1 tokens for the shift)."""
    lr: float = 3e-3
    """peak learning rate of the inner AdamW."""
    warmup_steps: int = 20
    """linear warm-up steps of the inner learning rate."""
    min_lr_ratio: float = 0.1
    """final learning rate of the cosine decay, as a fraction of `lr`."""
    weight_decay: float = 0.1
    """decoupled AdamW weight decay (norm gains are not decayed)."""
    b1: float = 0.9
    """AdamW first-moment decay rate."""
    b2: float = 0.95
    """AdamW second-moment decay rate."""
    grad_clip: float = 1.0
    """global gradient norm clip (0 disables clipping)."""
    seed: int = 0
    """seed for weights, data order and dropout."""
    log_every: int = 10
    """steps between metrics lines."""
    eval_every: int = 50
    """steps between evaluations of the global model (0 = only at the end)."""
    eval_sequences: int = 32
    """held-out sequences per evaluation."""
    final_sync: bool = True
    """DiLoCo: after the last step, one blocking outer sync of every parameter group whose last sync is older than that step, so every inner step reaches the evaluated and exported global model; with `--diloco.outer-overlap` delayed / eager those groups take one more outer step and every group's last exchange is landed (`DiLoCo.drain`) (`--train.no-final-sync` evaluates the model of the last scheduled sync, as the papers' curves do)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """what to do when a replica's loss or outer gradient is NaN/Inf: `stop` with an error, or `skip` that replica's step or sync contribution."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from."""

    source: Literal["corpus", "text", "tokens", "synthetic"] = "corpus"
    """`corpus` (embedded: the Python standard library's own source, byte-level), `text` (a file or a folder of text files, byte-level), `tokens` (a token folder written by `python -m eqx_diloco.prepare`: shards of uint16 or uint32 ids read as one stream, memory-mapped, with `tokens.json` giving dtype and vocab_size; or a single such file with `<file>.json`) or `synthetic` (a learnable pattern, for tests)."""
    path: Path | None = None
    """the file or folder for `text` and `tokens`."""
    eval_fraction: float = 0.05
    """share of the tokens held out for evaluation (taken from the end)."""
    max_corpus_bytes: int = 8_000_000
    """cap on the embedded corpus size."""
    split: Literal["contiguous", "iid"] = "contiguous"
    """how replicas share the train split: `contiguous` (replica r samples only its own r-th contiguous share, like islands with their own data) or `iid` (every replica samples windows from the whole train split)."""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Multiple-choice tasks scored with each held-out evaluation (docs/evaluate.md)."""

    tasks: str | None = None
    """comma-separated jsonl files of multiple-choice questions (`context`, `choices`, `label` per line), scored on the global model at every evaluation (`--train.eval-every`) as lm-evaluation-harness scores them: `eval/<name>/acc` and `eval/<name>/acc_norm` in metrics.jsonl and TensorBoard, <name> being the file's name without `.jsonl`. Text is read as the run's data is (UTF-8 bytes, or the token file's tokenizer)."""
    max_examples: int = 0
    """questions of each task file scored at each evaluation, the first ones (0 = all)."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device layout."""

    data: int = 1
    """devices per replica on the `data` mesh axis (ordinary data parallelism inside a replica). The `diloco` axis gets one device per replica."""
    fsdp: int = 1
    """devices per replica on the `fsdp` mesh axis: parameters, inner and outer optimizer state and error-feedback residuals are sharded over them (each array's largest dimension they divide; the layer axis never) and the batch is split over `data x fsdp`. A sync sends each device's own shard."""
    tensor: int = 1
    """devices per replica on the `tensor` mesh axis: the Transformer's tensor-parallel rules (attention q/k/v and MLP up projections split by columns, their output projections by rows, MoE experts, the head over the vocabulary); arrays those rules leave whole are sharded over `fsdp x tensor`."""
    replicas_per_device: int = 0
    """K: replicas that share one device (one row of `--mesh.data` devices), stepped together under `jax.vmap`; each sync sums the K local outer gradients, then exchanges over `diloco`. Must divide the replicas of each process. 0 = 1 where the process has devices enough (CPU runs make them), else the smallest K that fits: R replicas train on one GPU. Results do not depend on K; resume may change it."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-process runs on JAX's multi-controller runtime (one or more processes per island)."""

    coordinator_address: str | None = None
    """host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS; unset = single process)."""
    num_processes: int | None = None
    """number of processes (default: $JAX_NUM_PROCESSES, else 1)."""
    process_id: int | None = None
    """this process's index (default: $JAX_PROCESS_ID)."""
    cluster: Literal["auto", "none"] = "auto"
    """with no other `--dist.*` flag and no JAX_* variable: `auto` joins the job of a cluster manager JAX detects (SLURM's `srun`, Open MPI's `mpirun`, Kubernetes, Cloud TPU) as `jax.distributed.initialize()` would; `none` runs a single process all the same."""
    heartbeat_timeout_s: int = 30
    """seconds without a heartbeat after which the other processes give up on a dead one."""
    init_timeout_s: int = 120
    """seconds every process waits at start-up for all the others to join the coordinator; then it stops with one line naming the coordinator and the processes it waited for."""
    metrics_lag: int = 8
    """steps by which reading the other processes' per-step values (losses, finite flags, stop requests) may trail training. That exchange takes round trips to the coordinator over the same link as the syncs (where it can also queue behind an outer gradient); with a lag they overlap the next steps instead of delaying each one, and the values of this many steps travel in one exchange. Non-finite checks and agreed stops act this many to twice as many steps late; evaluations, checkpoints and elastic sync boundaries still wait for everything. 0 = wait every step. Single-process runs read their values at once."""
    metrics_interval_s: float = 0.25
    """the shortest time between two exchanges of those values: where steps are shorter than `--dist.metrics-interval-s / --dist.metrics-lag`, each exchange carries more steps (up to 1024), since one costs milliseconds of host time however few steps it carries. Checks and stops then act within about twice this. 0 = always `--dist.metrics-lag` steps."""


@dataclasses.dataclass(frozen=True)
class ElasticConfig:
    """Elastic islands: losing an island (process) does not stop the run (`eqx_diloco.launch --max-restarts`)."""

    enabled: bool = False
    """snapshot each island's state at every sync boundary (asynchronously, to `<run-dir>/elastic/island-<i>`) and start from the live islands' newest snapshot; needs one replica per process and --diloco.outer-overlap none."""
    min_replicas: int = 1
    """the launcher stops the run (one line, exit 1) when fewer islands than this are live."""
    keep_snapshots: int = 2
    """snapshots each island keeps (>= 2)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints."""

    every: int = 100
    """steps between checkpoints (0 disables checkpointing)."""
    keep: int = 3
    """how many recent checkpoints to keep."""
    dir: Path | None = None
    """checkpoint folder (default: `<run-dir>/checkpoints`)."""
    restore_step: int | None = None
    """resume from the checkpoint of exactly this step instead of the newest (e.g. one saved before a divergence); newer checkpoints are moved aside to `<step>.superseded`."""


@dataclasses.dataclass(frozen=True)
class ModelFlags(TransformerConfig):
    """Shape of the model."""

    # The CLI's model flags only: None (the flag not given) becomes the token file's vocab_size, else 256, in
    # `Config.__post_init__`, which hands every reader a plain `TransformerConfig` (`models/` stays int-only).
    vocab_size: Annotated[int | None, tyro.conf.arg(
        metavar="INT", help="number of token ids.",
        help_behavior_hint="(default: the vocab_size in the token file's <file>.json with --data.source tokens, "
                           "else 256 for the byte-level sources)")] = None


def token_file_vocab(data: DataConfig) -> tuple[int, Path] | None:
    """(vocab_size, metadata path) from a `--data.source tokens` file's `<file>.json`, or None (another source,
    no metadata, or metadata without a valid vocab_size: reading the tokens then reports what is wrong)."""
    if data.source != "tokens" or data.path is None:
        return None
    from .data import read_token_meta, token_meta_path  # data imports this module

    try:
        vocab = read_token_meta(data.path).get("vocab_size")
    except (ConfigError, OSError):  # never raised from Config(): tyro would show it as a traceback
        return None
    return (vocab, token_meta_path(data.path)) if vocab is not None else None


@dataclasses.dataclass(frozen=True)
class Config:
    """eqx_diloco trainer: DiLoCo / Streaming DiLoCo / data-parallel training of a transformer LM."""

    algorithm: Algorithm = "diloco"
    """`diloco` (Streaming DiLoCo when `--diloco.num-fragments` > 1) or `ddp` (gradients averaged over all replicas every step)."""
    run_dir: Path = Path("runs/default")
    """where metrics.jsonl, config.json and checkpoints go."""
    model: TransformerConfig = ModelFlags()
    diloco: DiLoCoConfig = DiLoCoConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    dist: DistributedConfig = DistributedConfig()
    elastic: ElasticConfig = ElasticConfig()
    decoupled: DecoupledConfig = DecoupledConfig()
    eval: EvalConfig = EvalConfig()
    compile_cache: bool = True
    """keep compiled programs in JAX's persistent compilation cache ($JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/eqx_diloco/jax, else ~/.cache/eqx_diloco/jax), so the next run of the same config starts training sooner; `--no-compile-cache` compiles everything afresh."""

    def __post_init__(self):
        # Library users write Config(run_dir="runs/x"): keep paths as Paths whatever they pass.
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "model", fill_from_folder(self.model))  # --model.init-from's shape
        # `--model.vocab-size` not given: the token file's own vocabulary, so a 2,000-id tokenizer does not get
        # a 32,000-row embedding (an explicit flag smaller than the file's vocab_size is refused in `open_tokens`).
        if isinstance(self.model, ModelFlags) or self.model.vocab_size is None:
            vocab = self.model.vocab_size
            if vocab is None:
                vocab = (token_file_vocab(self.data) or (256,))[0]
            fields = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(TransformerConfig)}
            object.__setattr__(self, "model", TransformerConfig(**{**fields, "vocab_size": vocab}))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def error_feedback_argument(d: DiLoCoConfig) -> bool | float:
    """`DiLoCo`'s `error_feedback` for these flags: False, True, or the decay of the residual."""
    return d.error_feedback_decay if d.error_feedback and d.error_feedback_decay != 1 else d.error_feedback


def validate(config: Config) -> None:
    """Raise `ConfigError` with a one-line message for the first rule `config` breaks."""
    m, d, train, data = config.model, config.diloco, config.train, config.data
    for flag, value in [
        ("--model.num-layers", m.num_layers), ("--model.dim", m.dim), ("--model.num-heads", m.num_heads),
        ("--model.mlp-ratio", m.mlp_ratio), ("--model.vocab-size", m.vocab_size),
        ("--diloco.num-replicas", d.num_replicas), ("--diloco.sync-period", d.sync_period),
        ("--diloco.num-fragments", d.num_fragments), ("--train.steps", train.steps),
        ("--train.batch-size", train.batch_size), ("--train.seq-len", train.seq_len),
        ("--train.log-every", train.log_every), ("--train.eval-sequences", train.eval_sequences),
        ("--mesh.data", config.mesh.data), ("--mesh.fsdp", config.mesh.fsdp), ("--mesh.tensor", config.mesh.tensor),
        ("--data.max-corpus-bytes", data.max_corpus_bytes),
        ("--dist.heartbeat-timeout-s", config.dist.heartbeat_timeout_s),
        ("--elastic.min-replicas", config.elastic.min_replicas),
    ]:
        _require(value >= 1, f"{flag} must be >= 1 (got {value})")
    for flag, value in [
        ("--train.lr", train.lr), ("--diloco.outer-lr", d.outer_lr), ("--train.weight-decay", train.weight_decay),
        ("--train.grad-clip", train.grad_clip), ("--diloco.alpha", d.alpha), ("--model.rope-base", m.rope_base),
        ("--model.aux-loss-weight", m.aux_loss_weight), ("--diloco.error-feedback-decay", d.error_feedback_decay),
    ]:
        _require(math.isfinite(value), f"{flag} must be a finite number (got {value})")
    _require(str(config.run_dir) not in ("", "."), "--run-dir must name a folder (got an empty path or '.')")
    _require(train.seed >= 0, f"--train.seed must be >= 0 (got {train.seed})")
    _require(config.mesh.replicas_per_device >= 0,
             f"--mesh.replicas-per-device must be >= 0 (0 = automatic; got {config.mesh.replicas_per_device})")
    _require(0 <= train.b1 < 1, f"--train.b1 must be in [0, 1) (got {train.b1})")
    _require(0 <= train.b2 < 1, f"--train.b2 must be in [0, 1) (got {train.b2})")
    _require(m.rope_base > 0, f"--model.rope-base must be > 0 (got {m.rope_base})")
    for flag, value in [
        ("--train.lr", train.lr),
        ("--diloco.outer-lr", d.outer_lr),
        ("--optim.muon-lr", config.optim.muon_lr),
    ]:
        _require(value > 0, f"{flag} must be > 0 (got {value})")
    _require(0 <= config.optim.muon_momentum < 1,
             f"--optim.muon-momentum must be in [0, 1) (got {config.optim.muon_momentum})")
    for flag, value in [
        ("--train.warmup-steps", train.warmup_steps),
        ("--train.eval-every", train.eval_every),
        ("--train.weight-decay", train.weight_decay),
        ("--train.grad-clip", train.grad_clip),
        ("--diloco.overlap-steps", d.overlap_steps),
        ("--diloco.router-sync-period", d.router_sync_period),
        ("--checkpoint.every", config.checkpoint.every),
        ("--dist.metrics-lag", config.dist.metrics_lag),
    ]:
        _require(value >= 0, f"{flag} must be >= 0 (got {value})")
    _require(0 <= config.dist.metrics_interval_s < float("inf"),
             f"--dist.metrics-interval-s must be a finite number >= 0 (got {config.dist.metrics_interval_s})")
    _require(config.checkpoint.keep >= 1, f"--checkpoint.keep must be >= 1 (got {config.checkpoint.keep})")
    _require(config.checkpoint.restore_step is None or config.checkpoint.restore_step >= 1,
             f"--checkpoint.restore-step must be >= 1 (got {config.checkpoint.restore_step})")
    _require(0 <= d.outer_momentum < 1, f"--diloco.outer-momentum must be in [0, 1) (got {d.outer_momentum})")
    _require(0 <= train.min_lr_ratio <= 1, f"--train.min-lr-ratio must be in [0, 1] (got {train.min_lr_ratio})")
    _require(0 <= m.dropout < 1, f"--model.dropout must be in [0, 1) (got {m.dropout})")
    _require(m.dim % m.num_heads == 0,
             f"--model.dim must be divisible by --model.num-heads (got {m.dim} and {m.num_heads})")
    _require((m.dim // m.num_heads) % 2 == 0,
             f"--model.dim / --model.num-heads must be even for rotary embeddings (got {m.dim // m.num_heads})")
    check_layout(m)  # --model.mlp, --model.num-kv-heads, ..., --model.init-from
    _require(m.scan_unroll == "auto" or (type(m.scan_unroll) is int and m.scan_unroll >= 0),
             f"--model.scan-unroll must be auto or an int >= 0 (0 = all layers; got {m.scan_unroll})")
    if m.attention == "cudnn" and m.dtype != "auto":  # the backend's half of the rule: `check_backend`
        problem = attention_rule(m, nvidia_gpu=True, dtype=m.dtype)
        _require(problem is None, f"--model.attention cudnn {problem} (--model.dtype {m.dtype})")
    if m.kind == "moe":
        _require(m.num_experts >= 2, f"--model.num-experts must be >= 2 (got {m.num_experts})")
        _require(m.top_k in (1, 2), f"--model.top-k must be 1 or 2 (got {m.top_k})")
        _require(m.top_k <= m.num_experts, f"--model.top-k must be <= --model.num-experts (got {m.top_k})")
    split = config.mesh.data * config.mesh.fsdp
    _require(train.batch_size % split == 0,
             f"--train.batch-size must be divisible by --mesh.data x --mesh.fsdp (got {train.batch_size} and {split})")
    _require(0 < data.eval_fraction < 1, f"--data.eval-fraction must be in (0, 1) (got {data.eval_fraction})")
    _require(data.split in ("contiguous", "iid"), f"--data.split must be contiguous or iid (got {data.split})")
    if data.source in ("text", "tokens"):
        _require(data.path is not None, f"--data.path is required with --data.source {data.source}")
        _require(data.path.exists(), f"--data.path does not exist: {data.path}")
        _require(  # a folder of text files, or a token folder written by prepare
            data.path.is_file() or data.path.is_dir(),
            f"--data.path must be a regular file or a folder (not a device, FIFO or socket): {data.path}",
        )
    else:
        _require(
            data.path is None,
            f"--data.path is only read with --data.source text or tokens (got --data.source {data.source})",
        )

    nproc = config.dist.num_processes
    if nproc is not None:
        # How replicas and processes must divide is `_layout.devices_needed`'s rule (it also sees JAX_* variables).
        _require(nproc >= 1, f"--dist.num-processes must be >= 1 (got {nproc})")
        pid = config.dist.process_id
        _require(pid is None or 0 <= pid < nproc, f"--dist.process-id must be in [0, {nproc}) (got {pid})")

    if config.algorithm == "ddp":
        _require(not config.elastic.enabled, "--elastic.enabled applies to --algorithm diloco only, not ddp")
    else:
        P = d.num_fragments  # fragment count (no PartitionSpec in this module)
        if P > 1:
            _require(
                m.num_layers % (P - 1) == 0,
                f"--model.num-layers must be divisible by --diloco.num-fragments - 1 "
                f"(got {m.num_layers} layers for {P - 1} layer fragments)",
            )
    _require(not d.router_sync_period or m.kind == "moe", "--diloco.router-sync-period needs --model.kind moe")
    _require(0 < d.error_feedback_decay <= 1,
             f"--diloco.error-feedback-decay must be in (0, 1] (got {d.error_feedback_decay})")
    _require(d.error_feedback_decay == 1 or d.error_feedback,
             f"--diloco.error-feedback-decay {d.error_feedback_decay} needs --diloco.error-feedback (it decays its residual)")
    # The algorithm's own rules live in the core, written once; its messages name `DiLoCo`'s
    # arguments, which become this CLI's flags here.
    try:
        check_arguments(
            num_replicas=d.num_replicas, sync_period=d.sync_period, num_fragments=d.num_fragments,
            fragment_pattern=d.fragment_pattern, overlap_steps=d.overlap_steps, alpha=d.alpha, quantize=d.quantize,
            error_feedback=error_feedback_argument(d), outer_overlap=d.outer_overlap, exchange=d.exchange,
            router_sync_period=d.router_sync_period, has_routers=m.kind == "moe", on_nonfinite=train.on_nonfinite,
            data_parallel=config.mesh.data, comm_device=d.comm_device, algorithm=config.algorithm,
            replicas_per_device=config.mesh.replicas_per_device or None, topk=d.topk, topk_chunk=d.topk_chunk,
            fsdp=config.mesh.fsdp, tensor=config.mesh.tensor, outer_state_memory=d.outer_state_memory,
        )
    except ConfigError as e:
        raise ConfigError(flag_names(str(e))) from None
    _require(config.eval.max_examples >= 0, f"--eval.max-examples must be >= 0 (got {config.eval.max_examples})")
    if config.eval.tasks:
        _require(config.decoupled.role == "off", "--eval.tasks is scored by the trainer's evaluations; a decoupled "
                 "run evaluates in its syncer, which scores the held-out loss only: score an export with "
                 "python -m eqx_diloco.evaluate instead")
        from .tasks import read_tasks  # reads the files now, before JAX starts: a bad row fails in a second

        read_tasks(config.eval.tasks, flag="--eval.tasks")
    validate_decoupled(config)
    if config.algorithm == "ddp":
        return
    if config.elastic.enabled:
        _require(config.mesh.replicas_per_device <= 1, "--elastic.enabled needs one replica per process and device "
                 f"(--mesh.replicas-per-device 0 or 1, got {config.mesh.replicas_per_device})")
        _require(d.outer_overlap == "none", f"--elastic.enabled needs --diloco.outer-overlap none (got {d.outer_overlap}): "
                 "a whole-round exchange is always in flight, so there is no sync boundary to snapshot")
        _require(config.elastic.keep_snapshots >= 2,
                 f"--elastic.keep-snapshots must be >= 2 (got {config.elastic.keep_snapshots})")
