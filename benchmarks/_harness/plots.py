"""Eval-loss curves of several methods as one PNG (matplotlib, imported only when plotting)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any


def plot_curves(
    panels: Sequence[tuple[str, Sequence[tuple[str, list[dict[str, Any]]]]]],
    x_key: str,
    path: str | os.PathLike,
    *,
    title: str,
    xlabel: str,
    log_x: bool = False,
    skip_first: int = 1,
) -> pathlib.Path:
    """Eval loss against `x_key`, one subplot per (panel title, [(label, curve), ...]), as PNG.

    The first `skip_first` points of each curve (the untrained model's loss, far above the
    rest) are left out so the differences between methods stay visible. Subplots share y.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), sharey=True, squeeze=False)
    styles = ["-", "--", "-.", ":"]
    for ax, (panel_title, series) in zip(axes[0], panels):
        for i, (label, curve) in enumerate(series):
            points = [p for p in curve[skip_first:] if not (log_x and p[x_key] <= 0)]
            if points:
                ax.plot([p[x_key] for p in points], [p["eval_loss"] for p in points], styles[(i // 10) % 4],
                        label=label, linewidth=1.4)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(panel_title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    # Zoom on the last three quarters of training: early points (a global model that has not
    # synced yet sits at the initial loss) would squeeze the interesting range flat.
    tails = [p["eval_loss"] for _, series in panels for _, curve in series for p in curve[len(curve) // 4 :]]
    if tails:
        low, high = min(tails), max(tails)
        pad = 0.05 * max(high - low, 1e-3)
        axes[0][0].set_ylim(low - pad, high + 4 * pad)
    axes[0][0].set_ylabel("eval loss (global model, nats/byte)")
    fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
