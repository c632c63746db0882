"""The convergence benchmark's markdown table (each run against DDP with the same R) and plots."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from benchmarks import _common as common
from benchmarks._convergence.suite import Scale


def add_relative(rows: list[dict[str, Any]]) -> None:
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
