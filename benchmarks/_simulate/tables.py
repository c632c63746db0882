"""Markdown tables of required bandwidth: rows are methods, columns are utilization targets."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._simulate.timeline import TARGETS


def fmt_gbit(x: float | None, grid_max: float) -> str:
    if x is None:
        return f">{grid_max:g}"
    return f"{x:.1f}" if x >= 0.95 else f"{x:.3g}"


def markdown_table(
    ours: dict[str, list[float | None]],
    paper: dict[str, list[float]] | None = None,
    targets: Sequence[float] = TARGETS,
    grid_max: float = 1000.0,
) -> str:
    """Rows = methods, columns = targets; cells `ours (paper)` when the paper's numbers are given."""
    head = "| method | " + " | ".join(f"{t:.0%}" for t in targets) + " |"
    lines = [head, "|---" * (len(targets) + 1) + "|"]
    for method, row in ours.items():
        cells = []
        for i, x in enumerate(row):
            cell = fmt_gbit(x, grid_max)
            if paper and method in paper:
                cell += f" ({paper[method][i]:g})"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
