"""Convergence at a fixed token budget: data parallel vs DiLoCo vs Streaming DiLoCo.

Every run trains the same model from the same seed on the embedded corpus (the Python
standard library's sources, byte level) and is evaluated on the same held-out windows.
For each run we report the final eval loss of the *global* model (theta_g; for DDP the
replicas' common params), the bytes one replica sent over the whole run, and the peak
bytes one replica sends at a single step (the bandwidth a link must sustain if a sync has
to fit in one step). Plots: eval loss against steps and against bytes sent.

Token budget ("same total tokens"): with R replicas of per-replica batch b trained for S
steps the run consumes R * b * S * seq_len tokens. All runs keep R * b * S fixed:

- the R = 2 group (DDP, DiLoCo, Streaming DiLoCo) uses b = B and S steps;
- the R = 4 group uses b = B / 2 and the same S steps (same global batch, same number of
  steps, so the same tokens, the "scaling laws for DiLoCo" setting: more replicas at a
  fixed budget). DDP R = 4 with b = B / 2 computes the same gradient as DDP R = 2 with
  b = B; only the data order differs (each replica reads its own share of the corpus).

Whole-round overlap (`--diloco.outer-overlap`, arXiv 2502.12996): DiLoCo R = 2 with the
outer step overlapped with the next round, delayed and eager at H = 10, eager at H = 50.
Like every run here they are evaluated at their last scheduled sync (no final sync), so
their last round's exchange is not landed.

Sync periods: the model has L = 4 layers so Streaming DiLoCo with P = L + 1 = 5 fragments
(fragment 0 = embeddings/final norm/head, fragments 1..4 = one layer each) and P = 2
(fragment 1 = all layers) both divide H for H in {10, 50}, the issue's values. Streaming
runs use H = 50 (the larger H: one fragment every H / P = 10 steps for P = 5), where
tau in {0, 1, 4} is allowed (tau < H / P). DiLoCo runs use H in {10, 50}.

Modes:

- `--quick` (default): L = 4, dim 64, seq 64, B = 8, 500 steps, 16 runs, a subset of the
  streaming grid; about 5-8 minutes on 2 idle CPU cores.
- `--full`: L = 4, dim 128, seq 128, B = 8, 1000 steps, the whole streaming grid
  (P x tau x alpha, plus int4); roughly an hour or more on 2 CPU cores.
- `--smoke`: microscopic, for tests only (numbers are meaningless).

Output in `--out-dir` (default `runs/benchmarks/convergence_<mode>`; the committed results
under `benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`convergence.json` (or `--json PATH`), `convergence.md` and two PNG plots.

Run `python -m benchmarks.convergence --help`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # `python benchmarks/convergence.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Scale:
    """Model and budget shared by all runs of one mode."""

    num_layers: int
    dim: int
    num_heads: int
    mlp_ratio: int
    seq_len: int
    batch_size: int  # per replica at R = 2 (halved at R = 4)
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_sequences: int
    sync_periods: tuple[int, int]  # (small H, large H); streaming uses the large one
    overlaps: tuple[int, ...]
    max_corpus_bytes: int = 8_000_000
    outer_lr: float = 0.7
    outer_momentum: float = 0.9


SCALES = {
    "smoke": Scale(num_layers=2, dim=16, num_heads=2, mlp_ratio=2, seq_len=16, batch_size=2, steps=6, lr=1e-2,
                   warmup_steps=1, eval_every=3, eval_sequences=4, sync_periods=(2, 6), overlaps=(0, 1),
                   max_corpus_bytes=200_000),
    "quick": Scale(num_layers=4, dim=64, num_heads=4, mlp_ratio=4, seq_len=64, batch_size=8, steps=500, lr=3e-3,
                   warmup_steps=25, eval_every=25, eval_sequences=128, sync_periods=(10, 50), overlaps=(0, 1, 4)),
    "full": Scale(num_layers=4, dim=128, num_heads=4, mlp_ratio=4, seq_len=128, batch_size=8, steps=1000, lr=3e-3,
                  warmup_steps=50, eval_every=50, eval_sequences=256, sync_periods=(10, 50), overlaps=(0, 1, 4)),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run of the comparison."""

    method: str  # "ddp", "diloco" or "streaming"
    replicas: int
    batch_size: int
    sync_period: int = 1
    fragments: int = 1
    overlap: int = 0
    alpha: float = 0.0
    quantize: str = "none"
    error_feedback: bool = False
    outer_overlap: str = "none"  # "delayed" / "eager": whole-round overlap (arXiv 2502.12996)

    @property
    def name(self) -> str:
        parts = [self.method, f"R{self.replicas}"]
        if self.method != "ddp":
            parts.append(f"H{self.sync_period}")
        if self.outer_overlap != "none":
            parts.append(self.outer_overlap)
        if self.method == "streaming":
            parts += [f"P{self.fragments}", f"tau{self.overlap}", f"a{self.alpha:g}"]
        if self.quantize != "none":
            parts.append(self.quantize + ("+ef" if self.error_feedback else ""))
        return " ".join(parts)


def suite(scale: Scale, grid: str) -> list[RunSpec]:
    """The runs of one mode. `grid`: "smoke", "quick" (a subset of streaming) or "full"."""
    L = scale.num_layers
    small_h, big_h = scale.sync_periods
    b2, b4 = scale.batch_size, max(1, scale.batch_size // 2)
    stream = lambda R, b, P, tau, alpha=0.0, q="none": RunSpec(  # noqa: E731
        "streaming", R, b, big_h, P, tau, alpha, q
    )
    if grid == "smoke":
        return [RunSpec("ddp", 2, b2), stream(2, b2, 2, 0, 0.0, "int4")]
    runs = [RunSpec("ddp", 2, b2), RunSpec("diloco", 2, b2, small_h), RunSpec("diloco", 2, b2, big_h)]
    # The whole outer step overlapped with the next round: the naive and the eager variant.
    runs += [RunSpec("diloco", 2, b2, small_h, outer_overlap=mode) for mode in ("delayed", "eager")]
    runs += [RunSpec("diloco", 2, b2, big_h, outer_overlap="eager")]
    if grid == "full":
        for P in (2, L + 1):
            for tau in scale.overlaps:
                for alpha in (0.0, 0.5):
                    runs.append(stream(2, b2, P, tau, alpha))
            runs.append(stream(2, b2, P, 1, 0.0, "int4"))
    else:  # quick: both P without overlap, then tau and alpha at P = L + 1, then int4
        runs += [stream(2, b2, 2, 0), stream(2, b2, L + 1, 0)]
        runs += [stream(2, b2, L + 1, tau) for tau in scale.overlaps if tau > 0]
        runs += [stream(2, b2, L + 1, 1, 0.5), stream(2, b2, L + 1, 1, 0.0, "int4")]
    runs += [RunSpec("ddp", 4, b4), RunSpec("diloco", 4, b4, small_h), RunSpec("diloco", 4, b4, big_h)]
    runs.append(stream(4, b4, L + 1, 1, 0.0, "int4"))
    return runs


def make_config(spec: RunSpec, scale: Scale, run_dir: pathlib.Path, seed: int):
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    model = TransformerConfig(num_layers=scale.num_layers, dim=scale.dim, num_heads=scale.num_heads,
                              mlp_ratio=scale.mlp_ratio)
    train = TrainConfig(steps=scale.steps, batch_size=spec.batch_size, seq_len=scale.seq_len, lr=scale.lr,
                        warmup_steps=scale.warmup_steps, seed=seed, log_every=1, eval_every=scale.eval_every,
                        eval_sequences=scale.eval_sequences,
                        final_sync=False)  # every method is evaluated at its last scheduled sync
    if spec.method == "ddp":
        diloco = DiLoCoConfig(num_replicas=spec.replicas)
    else:
        diloco = DiLoCoConfig(num_replicas=spec.replicas, sync_period=spec.sync_period, num_fragments=spec.fragments,
                              overlap_steps=spec.overlap, alpha=spec.alpha, quantize=spec.quantize,
                              error_feedback=spec.error_feedback, outer_lr=scale.outer_lr,
                              outer_momentum=scale.outer_momentum, outer_overlap=spec.outer_overlap)
    return Config(algorithm="ddp" if spec.method == "ddp" else "diloco", run_dir=run_dir, model=model, diloco=diloco,
                  train=train, data=DataConfig(source="corpus", max_corpus_bytes=scale.max_corpus_bytes),
                  checkpoint=CheckpointConfig(every=0))


def devices_for(specs: Sequence[RunSpec]) -> int:
    """Replicas, plus one communication device per replica for overlapped syncs."""
    return max(s.replicas * (2 if s.overlap > 0 or s.outer_overlap != "none" else 1) for s in specs)


def run_suite(specs: Sequence[RunSpec], scale: Scale, *, seeds: Sequence[int] = (0,),
              runs_dir: pathlib.Path, log=None) -> list[dict[str, Any]]:
    """Train every spec for every seed; return one row per spec (seed-averaged numbers + curve)."""
    log = log or (lambda msg: print(msg, flush=True))
    rows = []
    for i, spec in enumerate(specs):
        per_seed = []
        for seed in seeds:
            run_dir = runs_dir / f"{i:02d}_{spec.name.replace(' ', '_')}_s{seed}"
            per_seed.append(common.train_and_summarize(make_config(spec, scale, run_dir, seed)))
        result = common.average_seeds(per_seed)
        row = {"name": spec.name, **dataclasses.asdict(spec), **result}
        row["tokens"] = spec.replicas * spec.batch_size * scale.steps * scale.seq_len
        rows.append(row)
        log(f"[{i + 1}/{len(specs)}] {spec.name:<40} eval_loss {row['eval_loss']:.4f}  "
            f"sent {common.fmt_bytes(row['sent_bytes']):>10}  "
            f"peak/step {common.fmt_bytes(row['peak_sync_bytes']):>10}  {row['elapsed_s']:.1f}s")
    _add_relative(rows)
    return rows


def _add_relative(rows: list[dict[str, Any]]) -> None:
    """Loss, bytes and peak relative to the DDP run with the same R (and the R = 2 DDP run)."""
    ddp = {r["replicas"]: r for r in rows if r["method"] == "ddp"}
    ref2 = ddp.get(2)
    for r in rows:
        base = ddp.get(r["replicas"], ref2)
        if base is None:
            continue
        r["loss_vs_ddp_pct"] = 100.0 * (r["eval_loss"] - base["eval_loss"]) / base["eval_loss"]
        r["bytes_vs_ddp"] = r["sent_bytes"] / base["sent_bytes"] if base["sent_bytes"] else None
        r["peak_vs_ddp"] = r["peak_sync_bytes"] / base["peak_sync_bytes"] if base["peak_sync_bytes"] else None
        if ref2 is not None:
            r["loss_vs_ddp_r2_pct"] = 100.0 * (r["eval_loss"] - ref2["eval_loss"]) / ref2["eval_loss"]


COLUMNS = [
    ("run", "name", None),
    ("R", "replicas", None),
    ("batch/replica", "batch_size", None),
    ("eval loss", "eval_loss", lambda v: f"{v:.4f}"),
    ("vs DDP (same R)", "loss_vs_ddp_pct", lambda v: f"{v:+.2f}%"),
    ("bytes sent / replica", "sent_bytes", common.fmt_bytes),
    ("bytes vs DDP", "bytes_vs_ddp", lambda v: f"{v:.4f}x" if v < 0.1 else f"{v:.3f}x"),
    ("peak bytes / step", "peak_sync_bytes", common.fmt_bytes),
    ("peak vs DDP", "peak_vs_ddp", lambda v: f"{v:.3f}x"),
    ("time", "elapsed_s", lambda v: f"{v:.0f}s"),
]


def report(rows: list[dict[str, Any]], scale: Scale, mode: str, seeds: Sequence[int]) -> str:
    L = scale.num_layers
    tokens = rows[0]["tokens"] if rows else 0
    lines = [
        f"# Convergence at a fixed token budget ({mode})",
        "",
        f"Model: {L} layers, dim {scale.dim}, {scale.num_heads} heads, byte vocab 256; seq {scale.seq_len}; "
        f"{scale.steps} steps; inner AdamW lr {scale.lr:g} (warm-up {scale.warmup_steps}, cosine to 10%); "
        f"outer SGD lr {scale.outer_lr:g}, Nesterov momentum {scale.outer_momentum:g}. "
        "Data: embedded corpus (stdlib sources, bytes). "
        f"Seeds: {', '.join(map(str, seeds))}.",
        "",
        f"Every run consumes R x batch x steps x seq = {tokens:,} tokens: R = 2 runs use batch "
        f"{scale.batch_size} per replica, R = 4 runs batch {max(1, scale.batch_size // 2)}. "
        f"Streaming runs use H = {scale.sync_periods[1]} (P = 2 or P = L + 1 = {L + 1}, so H / P is an integer "
        f"and tau < H / P holds for every tau tried).",
        "",
        "Eval loss: the global model (DDP: the shared params) on the same held-out windows, nats per byte. "
        "Bytes: what one replica sends (float32 unless quantized; payload and scales), DDP = one full gradient "
        "per step. Peak: the most bytes one replica sends at a single step.",
        "",
        common.markdown_table(rows, COLUMNS),
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out_dir: pathlib.Path, prefix: str = "convergence") -> list[pathlib.Path]:
    """Two PNGs (loss vs step, loss vs bytes), one panel per replica count."""
    panels = []
    for R in sorted({r["replicas"] for r in rows}):
        group = [r for r in rows if r["replicas"] == R]
        title = f"R = {R}, batch {group[0]['batch_size']} per replica"
        panels.append((title, [(r["name"], r["curve"]) for r in group]))
    by_step = common.plot_curves(panels, "step", out_dir / f"{prefix}_loss_vs_step.png",
                                 title="Eval loss vs inner step (same tokens per step for every run)",
                                 xlabel="inner step")
    by_bytes = common.plot_curves(panels, "sent_bytes", out_dir / f"{prefix}_loss_vs_bytes.png",
                                  title="Eval loss vs bytes sent by one replica", xlabel="bytes sent (log scale)",
                                  log_x=True)
    return [by_step, by_bytes]


def run(mode: str = "quick", *, seeds: Sequence[int] = (0,), only: str | Sequence[str] | None = None,
        out_dir: pathlib.Path | None = None, json_path: pathlib.Path | None = None, keep_runs=None,
        make_plots: bool = True, log=None, **overrides) -> dict[str, Any]:
    """Run the benchmark of `mode` and write markdown, JSON and plots. Returns the JSON dict.

    `overrides` replace fields of the mode's `Scale` (e.g. steps=200, outer_lr=0.5); None
    values are ignored. Expects the CPU device count to be set already (see `main`)."""
    scale = dataclasses.replace(SCALES[mode], **{k: v for k, v in overrides.items() if v is not None})
    specs = suite(scale, "smoke" if mode == "smoke" else mode)
    if only:
        wanted = [only] if isinstance(only, str) else list(only)
        specs = [s for s in specs if any(text in s.name for text in wanted)]
    out_dir = pathlib.Path(out_dir or common.default_out_dir("convergence", mode))
    start = time.perf_counter()
    with common.TemporaryRunDirs(keep_runs) as runs_dir:
        rows = run_suite(specs, scale, seeds=seeds, runs_dir=runs_dir, log=log)
    text = report(rows, scale, mode, seeds)
    result = {
        "benchmark": "convergence",
        "mode": mode,
        "scale": dataclasses.asdict(scale),
        "seeds": list(seeds),
        "machine": common.machine_info(),
        "total_elapsed_s": time.perf_counter() - start,
        "runs": rows,
    }
    common.write_text(out_dir / "convergence.md", text)
    common.write_json(json_path or out_dir / "convergence.json", result)
    if make_plots:
        result["plots"] = [str(p) for p in plot(rows, out_dir)]
    return result | {"markdown": text}


def replot(json_path: pathlib.Path, out_dir: pathlib.Path) -> dict[str, Any]:
    """Redraw the plots and the markdown table of a saved run."""
    import json

    result = json.loads(pathlib.Path(json_path).read_text())
    scale = Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in result["scale"].items()})
    text = report(result["runs"], scale, result["mode"], result["seeds"])
    common.write_text(out_dir / "convergence.md", text)
    plots = plot(result["runs"], out_dir)
    print(text)
    print("wrote", ", ".join(str(p) for p in [out_dir / "convergence.md", *plots]))
    return result | {"markdown": text, "plots": [str(p) for p in plots]}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="average over these seeds")
    parser.add_argument("--steps", type=int, default=None, help="override the mode's step count")
    parser.add_argument("--lr", type=float, default=None, help="override the inner AdamW peak learning rate")
    parser.add_argument("--outer-lr", type=float, default=None, help="override the outer SGD learning rate (0.7)")
    parser.add_argument("--outer-momentum", type=float, default=None, help="override the outer momentum (0.9)")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only specs whose name contains one of these texts")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="where the JSON, markdown and PNG plots go (default runs/benchmarks/convergence_<mode>; "
                             "committed results under benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default: <out-dir>/convergence.json)")
    parser.add_argument("--keep-runs", type=pathlib.Path, default=None,
                        help="keep the run folders (metrics.jsonl) here instead of a temporary folder")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--replot", type=pathlib.Path, default=None, metavar="JSON",
                        help="train nothing: redraw the plots and markdown from a saved JSON into --out-dir")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="do not share compiled programs between runs through a temporary persistent cache")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    args.out_dir = args.out_dir or common.default_out_dir("convergence", mode)
    if args.replot is not None:
        return replot(args.replot, args.out_dir)
    scale = SCALES[mode]
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_jaxcache_") as cache:
        common.setup_jax(devices_for(suite(scale, "smoke" if mode == "smoke" else mode)),
                         compile_cache=None if args.no_compile_cache else cache)
        result = run(mode, seeds=args.seeds, only=args.only, out_dir=args.out_dir, json_path=args.json,
                     keep_runs=args.keep_runs, make_plots=not args.no_plots, steps=args.steps, lr=args.lr,
                     outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    print()
    print(result["markdown"])
    written = [args.json or args.out_dir / "convergence.json", args.out_dir / "convergence.md",
               *result.get("plots", [])]
    print(f"total {result['total_elapsed_s']:.0f}s; wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
