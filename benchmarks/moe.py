"""MoE vs dense DiLoCo at equal steps, and how far replicas' routers drift with and without router sync.

    python -m benchmarks.moe --quick --out-dir benchmarks/results

Three runs on the embedded corpus with the same seed, steps and replicas: a dense model,
an MoE model (4 experts, top-2) whose routers sync with their fragment every H steps, and
the same MoE model with `--diloco.router-sync-period K`. Reported: final eval loss of
the global model, the mean router drift (cosine distance between replicas' router weights,
measured just before each sync at an H boundary, i.e. after the replicas trained apart),
the mean expert balance (normalized usage entropy, 1 = balanced) and the bytes sent.

Output in `--out-dir` (default `runs/benchmarks/moe_<quick|full>`; the committed results under
`benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`moe.json` (or `--json PATH`) and a markdown table beside the JSON.
"""

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from benchmarks._common import (
    TemporaryRunDirs,
    default_out_dir,
    machine_info,
    markdown_table,
    read_metrics,
    setup_jax,
    train_and_summarize,
    write_json,
    write_text,
)


def configs(quick: bool, run_root: Path):
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    H, K = 20, 5
    steps = 200 if quick else 600
    model = TransformerConfig(num_layers=3, dim=64, num_heads=4, mlp_ratio=4)
    moe = dataclasses.replace(model, kind="moe", num_experts=4, top_k=2, mlp_ratio=2)
    base = Config(
        model=model,
        diloco=DiLoCoConfig(num_replicas=2, sync_period=H),
        train=TrainConfig(steps=steps, batch_size=8, seq_len=64, lr=3e-3, log_every=10, eval_every=steps // 4,
                          eval_sequences=64),
        data=DataConfig(source="corpus"),
        checkpoint=CheckpointConfig(every=0),
    )
    return {
        "dense": dataclasses.replace(base, run_dir=run_root / "dense"),
        "moe": dataclasses.replace(base, model=moe, run_dir=run_root / "moe"),
        f"moe_router_sync_K{K}": dataclasses.replace(
            base, model=moe, run_dir=run_root / "moe_router",
            diloco=dataclasses.replace(base.diloco, router_sync_period=K),
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 steps per run (a few minutes on 2 cores)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="output folder (default runs/benchmarks/moe_<quick|full>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=Path, default=None, help="JSON output (default <out-dir>/moe.json)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or default_out_dir("moe", "quick" if args.quick else "full")
    args.json = args.json or out_dir / "moe.json"
    setup_jax(2)
    rows = []
    with TemporaryRunDirs() as root:
        for name, config in configs(args.quick, root).items():
            result = train_and_summarize(config)
            steps, _ = read_metrics(config.run_dir)
            H = config.diloco.sync_period
            drift = [s["router_drift"] for s in steps if "router_drift" in s and s["step"] % H == 0]
            balance = [statistics.fmean(s["expert_balance"]) for s in steps if "expert_balance" in s]
            row = {
                "name": name,
                "eval_loss": result["eval_loss"],
                "router_drift_at_H": statistics.fmean(drift) if drift else None,
                "expert_balance": statistics.fmean(balance) if balance else None,
                "sent_bytes": result["sent_bytes"],
                "elapsed_s": result["elapsed_s"],
            }
            rows.append(row)
            print(f"  {name:<22} eval {row['eval_loss']:.4f}  ({row['elapsed_s']:.0f} s)", flush=True)
    table = markdown_table(rows, [
        ("run", "name", None),
        ("final eval loss", "eval_loss", lambda v: f"{v:.4f}"),
        ("router drift before H-syncs", "router_drift_at_H", lambda v: f"{v:.2e}"),
        ("expert balance", "expert_balance", lambda v: f"{v:.3f}"),
        ("MB sent", "sent_bytes", lambda v: f"{v / 1e6:.1f}"),
    ])
    print("\n" + table)
    write_json(args.json, {"machine": machine_info(), "quick": args.quick, "runs": rows})
    write_text(args.json.with_suffix(".md"), table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
