"""What the CLI prints around a run: the resolved setup before anything compiles, and the
summary at the end (what the run did, where its files are, what to run next)."""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path
from typing import Any

from ._layout import process_layout
from ._processes import GENERATION_ENV, LINK_LIMIT_ENV
from .config import token_file_vocab


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def format_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _quote(path: Path | str) -> str:
    return shlex.quote(str(path))


def model_size(config) -> tuple[int, int]:
    """(parameter count, bytes) of the model, from its config alone (float32 parameters)."""
    count = config.model.num_params()
    return count, 4 * count


def algorithm_line(config) -> str:
    d = config.diloco
    if config.algorithm == "ddp":
        return f"DDP (gradients averaged over all replicas every step), R={d.num_replicas} replicas"
    name = "Streaming DiLoCo" if d.num_fragments > 1 else "DiLoCo"
    parts = [f"{name}, R={d.num_replicas} replicas", f"H={d.sync_period}",
             f"P={d.num_fragments} fragment{'s' if d.num_fragments > 1 else ''}", f"tau={d.overlap_steps}"]
    if d.outer_overlap != "none":
        parts.append(f"outer overlap {d.outer_overlap}")
    if d.router_sync_period:
        parts.append(f"routers synced every {d.router_sync_period} steps")
    if d.alpha:
        parts.append(f"alpha={d.alpha}")
    sparse = f"top-{100 * d.topk:g}% of {d.topk_chunk}-value chunks in " if d.topk is not None else ""
    parts.append(f"{sparse}quantize {d.quantize}" + (" + error feedback" if d.error_feedback else "")
                 + (f" (decay {d.error_feedback_decay})" if d.error_feedback and d.error_feedback_decay != 1 else ""))
    if config.optim.inner == "muon":
        parts.append(f"inner Muon (lr {config.optim.muon_lr:g}) + AdamW")
    return ", ".join(parts)


def recommended_lr(dim: int) -> float:
    """The inner AdamW learning rate recommended for width `dim`: 0.5 / dim, to two digits.

    Adam's stable learning rate falls about as 1/width. The default 3e-3 is 0.38/width at the
    default width 128; GPT-3's table used 6e-4 at width 768 (0.46/width) and 2e-4 at 2048
    (0.41/width); 24 layers x 2048 diverged at the default 3e-3 (6.1/width) on one H200."""
    return float(f"{0.5 / dim:.2g}")


def lr_warning(config) -> list[str]:
    """A setup line when `--train.lr` is above 1/width (twice `recommended_lr`), else nothing."""
    lr, dim = config.train.lr, config.model.dim
    if lr <= 1.0 / dim:
        return []
    line = (f"  warning      --train.lr {lr:g} is above 1/width ({1.0 / dim:.2g}) at --model.dim {dim}: wide models "
            f"diverge there (24 layers x 2048 did at 0.003); try --train.lr {recommended_lr(dim):g}")
    return [line]


def setup_lines(config) -> list[str]:
    """What the flags alone say about the run (no JAX needed): algorithm, model size, mesh, data,
    run folder, checkpoints. Printed within a second of starting."""
    d, t, m = config.diloco, config.train, config.model
    count, nbytes = model_size(config)
    kind = "mixture-of-experts" if m.kind == "moe" else "dense"
    if m.mlp == "swiglu" or m.kv_heads != m.num_heads:  # the Llama layout
        kind += f" {m.mlp}, {m.kv_heads} key/value heads of {m.num_heads}"
    weights = [] if m.init_from is None else [f"  weights      from {m.init_from} (--model.init-from; its config.json "
                                              "set the model's shape)"]
    K = config.mesh.replicas_per_device
    shared = f", {K} replicas per device (vmapped)" if K > 1 else ""
    inner = "".join(f" x {axis}={n}" for axis, n in (("fsdp", config.mesh.fsdp), ("tensor", config.mesh.tensor)) if n > 1)
    island = config.mesh.data * config.mesh.fsdp * config.mesh.tensor
    sharded = f" (an island of {island} devices per replica; parameters sharded over{inner.replace(' x', '')})" if inner else ""
    mesh = f"diloco={d.num_replicas} x data={config.mesh.data}{inner}{shared}{sharded}"
    tokens_per_step = d.num_replicas * t.batch_size * t.seq_len
    data = {"corpus": "embedded corpus (stdlib source, bytes)", "synthetic": "synthetic pattern"}.get(
        config.data.source, f"{config.data.source} {config.data.path}")
    ck = config.checkpoint
    if ck.every > 0:
        checkpoints = f"every {ck.every} steps in {ck.dir or Path(config.run_dir) / 'checkpoints'} (reruns resume)"
    else:
        checkpoints = "off (--checkpoint.every 0)"
    file_vocab = token_file_vocab(config.data)  # where the vocabulary comes from, when a token file says
    vocab = [] if file_vocab is None else [f"  vocab        {m.vocab_size}, " + (
        f"the vocab_size of {file_vocab[1]}" if file_vocab[0] == m.vocab_size
        else f"from --model.vocab-size ({file_vocab[1]} gives {file_vocab[0]})")]
    return [
        f"eqx_diloco: {algorithm_line(config)}",
        f"  model        {kind}, {m.num_layers} layers, width {m.dim}, vocab {m.vocab_size}: "
        f"{_count(count)} parameters ({format_bytes(nbytes)})",
        *vocab,
        *weights,
        f"  mesh         {mesh}",
        *_link_lines(),
        f"  data         {data}; {d.num_replicas} x {t.batch_size} sequences x {t.seq_len} tokens "
        f"= {tokens_per_step:,} tokens/step, {t.steps} steps",
        f"  run dir      {config.run_dir} (metrics.jsonl, config.json, TensorBoard events)",
        f"  checkpoints  {checkpoints}",
        *lr_warning(config),
    ]


def _link_lines() -> list[str]:
    """The launcher's `--bandwidth`, if it set one (it says so in `$EQX_DILOCO_LINK_LIMIT`)."""
    rate = os.environ.get(LINK_LIMIT_ENV)
    return [f"  link         {rate} between the processes (launcher --bandwidth: a rate-limited loopback)"] \
        if rate else []


def runtime_lines(config) -> list[str]:
    """What JAX says once it has started: the devices (and communication devices), the
    processes and the compilation cache. Call after the devices are set up."""
    import jax

    from ._cache import every_process_writes
    from ._compile_share import sharing_compiles

    d = config.diloco
    devices = jax.devices()
    platform = devices[0].platform if devices else "none"
    mesh, comm_mesh = _meshes(config)
    # Communication devices among the backend's devices (the host's CPU devices beside an accelerator are not).
    comm = 0 if comm_mesh is None or comm_mesh.devices.flat[0].platform != platform else comm_mesh.devices.size
    extra = f" ({comm} of them communication devices for overlapped syncs)" if comm else ""
    num_processes = jax.process_count()
    procs, islands = "", []
    if num_processes > 1:
        cluster = process_layout(config).cluster
        found = f" ({cluster.job}, found by JAX's cluster detection)" if cluster is not None else ""
        procs = f", {num_processes} processes{found}"
        from ._gloo_loop import idled_gloo_threads

        idled = idled_gloo_threads()  # None: left at normal priority (overlapped syncs, or no CPU run)
        if idled is not None:
            procs += ("; gloo's network thread at idle priority" if idled else
                      "; gloo's network thread not found (a blocking sync may wait for the kernel's timer tick)")
        islands = [f"  islands      {island_map(d.num_replicas, num_processes)}"]
    cache_dir = jax.config.jax_compilation_cache_dir if getattr(config, "compile_cache", True) else None
    cache = f"cached in {cache_dir}" if cache_dir else "persistent cache off"
    if cache_dir and num_processes > 1 and platform == "cpu" and not every_process_writes():
        # JAX writes entries from process 0 only, and CPU cache keys differ per process (see _cache).
        cache += " (read back by process 0 only: on CPU the other processes compile every run)"
    elif cache_dir and num_processes > 1 and sharing_compiles():
        cache += "; process 0 compiles the programs of several processes for all of them"
    return [f"  devices      {len(devices)} x {platform}{procs}{extra}", *islands, *_packing_lines(config, mesh),
            *sync_lines(config, mesh, comm_mesh), *_compute_lines(config), f"  compilation  {cache}"]


def sync_lines(config, mesh, comm_mesh) -> list[str]:
    """Where the run's syncs run and whether they overlap the inner steps (nothing for ddp, or where the
    flags do not fit the devices: `mesh` None)."""
    from ._layout import overlapped_syncs

    d = config.diloco
    if config.algorithm != "diloco" or mesh is None:
        return []
    if not overlapped_syncs(config):
        return ["  syncs        blocking, on the compute devices "
                "(--diloco.overlap-steps 0, --diloco.outer-overlap none)"]
    platform = mesh.devices.flat[0].platform
    if comm_mesh is None:
        return [f"  syncs        on the compute devices, after the steps in each {platform} device's queue: they do "
                f"not overlap compute (--diloco.comm-device {d.comm_device})"]
    count = comm_mesh.devices.size
    where = f"{count} communication device{'s' if count > 1 else ''}"
    if comm_mesh.devices.flat[0].platform != platform:
        where = f"{count} CPU device{'s' if count > 1 else ''} of the host, copied there and back"
    return [f"  syncs        on {where}: they overlap the steps (--diloco.comm-device {d.comm_device})"]


def _meshes(config) -> tuple:
    """The run's (compute mesh, communication mesh or None); (None, None) where the flags do not fit
    the devices (the trainer's own set-up reports it)."""
    from .._errors import ConfigError
    from ._devices import make_meshes

    try:
        return make_meshes(config)
    except ConfigError:
        return None, None


def _packing_lines(config, mesh) -> list[str]:
    """A line when `--mesh.replicas-per-device 0` packs several replicas onto each device of `mesh`
    (too few devices for one each)."""
    if config.mesh.replicas_per_device or mesh is None:
        return []  # the mesh line says it, or the trainer reports what does not fit
    K = config.diloco.num_replicas // mesh.shape["diloco"]
    line = (f"  packing      {K} replicas per device (vmapped), too few devices for one each "
            "(--mesh.replicas-per-device 0)")
    return [line] if K > 1 else []


def _compute_lines(config) -> list[str]:
    """How the bundled model computes once the backend is known: dtype, attention kernel, layers."""
    m = config.model
    try:
        attention = m.attention_impl()
    except ValueError:
        return []  # the trainer refuses it with its own line
    per_iteration = m.layers_per_iteration()
    unroll = "all layers unrolled" if per_iteration == m.num_layers else f"scan unroll {per_iteration}"
    line = (f"  compute      {m.compute_dtype()} matmuls, float32 parameters; {attention} attention; "
            f"remat {m.remat}; {unroll}")
    return [line]


def island_map(num_replicas: int, num_processes: int) -> str:
    """Which processes hold which replicas: contiguous blocks of R / P replicas, in process order, or
    each replica over a block of P / R processes (`build_meshes` lays the `diloco` axis out so)."""
    if num_processes > num_replicas:
        S = num_processes // num_replicas
        return ", ".join(f"replica {r} on processes {r * S}-{r * S + S - 1}" for r in range(num_replicas))
    per = num_replicas // num_processes

    def replicas(p: int) -> str:
        first, last = p * per, (p + 1) * per - 1
        return f"replica {first}" if per == 1 else f"replicas {first}-{last}"

    return ", ".join(f"{replicas(p)} on process {p}" for p in range(num_processes))


def describe_setup(config) -> str:
    """The resolved setup: `setup_lines` then `runtime_lines` (the CLI prints them as they are known)."""
    return "\n".join(setup_lines(config) + runtime_lines(config))


def finished_message(config, step: int) -> str:
    """What to say when a run that already reached `--train.steps` is started again."""
    run_dir = _quote(config.run_dir)
    return (
        f"run in {config.run_dir} already finished at step {step} (--train.steps {config.train.steps}); "
        f"nothing to do.\n"
        f"  to train further: the same command with a larger --train.steps (e.g. --train.steps {2 * step}), "
        f"which resumes from the newest checkpoint\n"
        f"  to start over: a new --run-dir, or remove {run_dir}"
    )


def format_summary(summary: dict[str, Any], config) -> str:
    """The end-of-run summary.

    `summary` keys (all optional but `step`): `eval_loss` (final, of the global model),
    `tokens` (trained so far, all replicas), `sent_bytes` (per replica), `ddp_bytes` (what DDP
    would have sent per replica for the same steps), `wall_time_s`, `run_dir`,
    `checkpoint_dir`. Missing `tokens` and `ddp_bytes` are computed from the config.
    """
    d, t = config.diloco, config.train
    step = int(summary.get("step", t.steps))
    run_dir = Path(summary.get("run_dir") or config.run_dir)
    ck_dir = Path(summary.get("checkpoint_dir") or config.checkpoint.dir or run_dir / "checkpoints")
    tokens = summary.get("tokens")
    if tokens is None:
        tokens = step * d.num_replicas * t.batch_size * t.seq_len
    ddp_bytes = summary.get("ddp_bytes")
    if ddp_bytes is None:
        ddp_bytes = step * model_size(config)[1]  # one float32 gradient per step
    head = f"done: {step} steps"
    generation = _elastic_generation(config)
    if generation:  # this process saw one generation: its time, and every step at the last one's island count
        head += (f" (generation {generation} of an elastic run: the launcher's summary below gives the time and "
                 f"tokens of every generation)")
    else:
        if summary.get("wall_time_s") is not None:
            head += f" in {summary['wall_time_s']:.1f} s"
        head += f", {tokens:,} tokens"
    if summary.get("eval_loss") is not None:
        head += f"; final eval loss {summary['eval_loss']:.4f} (global model, held-out data)"
    lines = [head]
    sent = summary.get("sent_bytes")
    if sent is not None:
        if config.diloco.num_replicas == 1:
            lines.append("  sent         nothing: one replica has no peer to sync with (--diloco.num-replicas 1)")
        elif config.algorithm == "ddp" or not ddp_bytes:
            lines.append(f"  sent         {format_bytes(sent)} per replica (DDP: a float32 gradient every step)")
        else:
            ratio = ddp_bytes / sent if sent else math.inf
            lines.append(f"  sent         {format_bytes(sent)} per replica for synchronisation; DDP would have sent "
                         f"{format_bytes(ddp_bytes)} ({ratio:,.0f}x more)")
            shards = config.mesh.fsdp * config.mesh.tensor
            if shards > 1:
                lines.append(f"               each of the {shards} devices of an island sent its own shard: about "
                             f"{format_bytes(sent // shards)}")
            if summary.get("bits_per_parameter") is not None:
                lines.append(f"  compression  {summary['bits_per_parameter']:.3g} bits per parameter per sync "
                             "(indices and scales included; float32: 32)")
    lines.append(f"  metrics      {run_dir / 'metrics.jsonl'} "
                 f"(TensorBoard: tensorboard --logdir {_quote(run_dir.parent)})")
    has_checkpoints = config.checkpoint.every > 0
    if has_checkpoints:
        lines.append(f"  checkpoints  {ck_dir}")
    q = _quote(run_dir)
    lines.append("next:")
    lines.append(f"  python -m eqx_diloco.plot {q} --out {_quote(run_dir / 'loss.png')}    # loss vs step and bytes")
    if has_checkpoints:
        model = _quote(run_dir / "model.eqx")
        lines.append(f"  python -m eqx_diloco.export {q}    # the global model alone, to {model}")
        lines.append(f"  python -m eqx_diloco.sample {model}{_sample_prompt(config)}")
        lines.append(f"  more steps: the same command with --train.steps {2 * step} (resumes from the checkpoint)")
    return "\n".join(lines)


def _elastic_generation(config) -> int:
    """Which generation of an elastic run this process belongs to (0 outside one; see `elastic`)."""
    value = os.environ.get(GENERATION_ENV, "")
    return int(value) if config.elastic.enabled and value.isdigit() else 0


def _sample_prompt(config) -> str:
    """The sample hint's `--prompt`: text for a byte-level model (its default, a newline, also works);
    for a larger vocabulary `sample` reads whitespace-separated token ids, here the training data's first."""
    if config.model.vocab_size <= 256:
        return ' --prompt "def "' if config.data.source == "corpus" else ""
    if config.data.source == "tokens" and config.data.path is not None and _names_a_tokenizer(config.data.path):
        return ""  # sample reads and prints text with the tokens' own tokenizer
    return f" --prompt {_first_token(config)}    # token ids in, token ids out"


def _names_a_tokenizer(data_path) -> bool:
    from .._errors import ConfigError
    from .token_shards import tokenizer_for_tokens

    try:
        return tokenizer_for_tokens(data_path) is not None
    except ConfigError:
        return False


def _first_token(config) -> int:
    """The first token id of a `--data.source tokens` file (0 when there is none to read)."""
    if config.data.source == "tokens" and config.data.path is not None:
        import numpy as np

        from .data import read_token_meta

        try:
            meta = read_token_meta(Path(config.data.path))
            first_file = Path(config.data.path) / meta["shards"][0]["file"] if "shards" in meta else config.data.path
            first = np.fromfile(first_file, dtype=meta["dtype"], count=1)
        except (OSError, ValueError):  # ConfigError too: the run read the file, so this is most unlikely
            return 0
        if first.size and int(first[0]) < config.model.vocab_size:
            return int(first[0])
    return 0
