"""Convergence of whole-round overlapped outer steps: blocking vs delayed vs eager (arXiv 2502.12996).

Every run trains the same model on the embedded corpus for the same steps and tokens; the
only difference is `--diloco.outer-overlap`. For each method and seed we report the final
eval loss of the global model; the script computes mean +- sd over seeds and the paired
gap of each method to blocking DiLoCo (same seed, same data): mean +- sd of
`loss_method / loss_blocking - 1` (`_common.paired_gap`).

Modes (one CLI convention with the other benchmarks):

- default: 4 layers, width 64, seq 64, 8 sequences per replica (512 tokens per replica
  step), R = 2, H = 20, 500 steps, seeds 0 1 2; inner AdamW peak lr 3e-3 (`--lr`: how far a
  round moves the model, which sets eager's gap); outer SGD lr 1.0, Nesterov 0.3 (the CLI's
  default; `--outer-lr 0.7 --outer-momentum 0.9` is the papers' outer optimizer).
- the final model of every method includes every inner step: blocking DiLoCo's last sync
  is at the last step, delayed / eager land their last round's exchange (`DiLoCo.drain`);
  `--no-final-sync` evaluates without it, as the papers' curves do.
- `--quick`: microscopic, for tests (numbers are meaningless).

Writes `eager.json` and `eager.md` into `--out` (default `runs/benchmarks/eager`; committed
results live in `benchmarks/results` and are only written there when asked for).
Pinned: 4 simulated CPU devices (2 replicas + 2 communication devices) in every mode.

Run `python -m benchmarks.eager --help`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

if __package__ in (None, ""):  # `python benchmarks/eager.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402

NUM_DEVICES = 4
METHODS = ("none", "delayed", "eager")


def make_config(method: str, seed: int, run_dir: pathlib.Path, args):
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    quick = args.quick
    model = TransformerConfig(num_layers=2 if quick else 4, dim=args.dim, num_heads=max(1, args.dim // 16),
                              mlp_ratio=2 if quick else 4)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=16 if quick else 64, lr=args.lr,
                        warmup_steps=2 if quick else 20, seed=seed, log_every=10, eval_every=args.steps // 5,
                        final_sync=args.final_sync,
                        eval_sequences=8 if quick else 64)
    diloco = DiLoCoConfig(num_replicas=2, sync_period=args.sync_period, num_fragments=args.fragments,
                          outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, outer_overlap=method,
                          quantize=args.quantize, error_feedback=args.quantize != "none")
    return Config(run_dir=run_dir, model=model, diloco=diloco, train=train,
                  data=DataConfig(source="corpus", max_corpus_bytes=200_000 if quick else 8_000_000),
                  checkpoint=CheckpointConfig(every=0), compile_cache=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="microscopic run for tests")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="outer-overlap modes to run (none is the baseline of every gap and always runs)")
    parser.add_argument("--steps", type=int, default=None, help="inner steps (default 500; quick 24)")
    parser.add_argument("--sync-period", type=int, default=None, help="H (default 20; quick 6)")
    parser.add_argument("--fragments", type=int, default=1, help="P (1 = plain DiLoCo)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per replica step (default 8; quick 4)")
    parser.add_argument("--dim", type=int, default=None,
                        help="model width, a multiple of 16 (one head per 16; default 64; quick 32): the gap against scale")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="peak inner (AdamW) learning rate: how far one round moves the model")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.3)
    parser.add_argument("--no-final-sync", dest="final_sync", action="store_false",
                        help="evaluate delayed / eager without landing the last round's exchange")
    parser.add_argument("--quantize", default="none", help="wire format (error feedback on when lossy)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/benchmarks/eager"))
    args = parser.parse_args(argv)
    methods = tuple(m for m in METHODS if m == "none" or m in args.methods)
    args.steps = args.steps or (24 if args.quick else 500)
    args.sync_period = args.sync_period or (6 if args.quick else 20)
    args.batch_size = args.batch_size or (4 if args.quick else 8)
    args.dim = args.dim or (32 if args.quick else 64)
    if args.lr <= 0:
        parser.error(f"--lr must be > 0 (got {args.lr})")
    if args.dim % 16:
        parser.error(f"--dim must be a multiple of 16 (got {args.dim})")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eqx_diloco_jaxcache_") as cache:
        # Seeds of one method build identical programs: they compile once (results unchanged).
        common.setup_jax(NUM_DEVICES, compile_cache=cache)
        return run(args, methods)


def run(args, methods) -> int:
    runs = args.out / "runs"
    losses: dict[str, dict[int, float]] = {m: {} for m in methods}
    total, done, start = len(methods) * len(args.seeds), 0, time.perf_counter()
    for seed in args.seeds:
        for method in methods:
            result = common.train_and_summarize(make_config(method, seed, runs / f"{method}_s{seed}", args))
            losses[method][seed] = result["eval_loss"]
            done += 1
            elapsed = time.perf_counter() - start
            print(f"[{done}/{total}] {method:<8} seed {seed}  eval {result['eval_loss']:.4f}  "
                  f"{result['elapsed_s']:.0f}s  ETA {elapsed / done * (total - done):.0f}s", flush=True)
    rows = []
    for method in methods:
        rows.append({"method": method, "eval_loss": common.mean_sd([losses[method][s] for s in args.seeds]),
                     "gap_to_blocking": common.paired_gap(losses[method], losses["none"], scale=1.0)})
    result = {
        "benchmark": "eager", "mode": "quick" if args.quick else "default", "num_devices": NUM_DEVICES,
        "seeds": args.seeds, "steps": args.steps, "sync_period": args.sync_period, "fragments": args.fragments,
        "batch_size": args.batch_size, "dim": args.dim, "lr": args.lr, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
        "quantize": args.quantize, "final_sync": args.final_sync, "rows": rows, "machine": common.machine_info(),
    }
    table = ["| outer overlap | eval loss (mean +- sd) | gap to blocking (paired, mean +- sd) | n |", "|---|---|---|---|"]
    for row in rows:
        e, g = row["eval_loss"], row["gap_to_blocking"]
        table.append(f"| {row['method']} | {common.fmt_pm(e, '.4f')} | "
                     f"{common.fmt_pm(g, '+.2f', '%', scale=100)} | {e['n']} |")
    header = (f"R = 2, H = {args.sync_period}, P = {args.fragments}, width {args.dim}, inner lr {args.lr:g}, {args.steps} steps, "
              f"{args.batch_size} x {64 if not args.quick else 16} tokens per replica step, outer SGD lr "
              f"{args.outer_lr} momentum {args.outer_momentum} (Nesterov), quantize {args.quantize}, "
              f"{'last exchange landed' if args.final_sync else 'last exchange not landed (--no-final-sync)'}, "
              f"{NUM_DEVICES} simulated CPU devices")
    common.write_json(args.out / "eager.json", result)
    common.write_text(args.out / "eager.md", header + "\n\n" + "\n".join(table) + "\n")
    print(header)
    print("\n".join(table))
    print(f"wrote {args.out / 'eager.json'} and {args.out / 'eager.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
