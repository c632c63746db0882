"""`python -m eqx_diloco.plot RUN_DIR [RUN_DIR ...] --out FILE.png`: loss curves of one or more runs.

Two panels: the held-out loss of the global model (solid, with markers) and the training
loss (mean over replicas, faint) against the inner step, and the same against the bytes one
replica has sent for synchronisation (`sent_bytes` in metrics.jsonl): the panel that shows
what DiLoCo buys over DDP. Each run is labelled from its config.json (algorithm, R, H, P,
tau, quantization); runs whose labels would be equal get the config fields that tell them
apart, or their folder name when their configs are equal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PlotError(ValueError):
    """A one-line, user-facing reason why a run cannot be plotted."""


@dataclass
class Run:
    """One run's curves, read from its folder."""

    run_dir: Path
    config: dict[str, Any] | None
    train: list[tuple[int, float, int]] = field(default_factory=list)  # (step, loss, sent_bytes)
    evals: list[tuple[int, float, int]] = field(default_factory=list)  # (step, eval_loss, sent_bytes)
    label: str = ""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(record: dict[str, Any], key: str, path: Path, line: int) -> int:
    """`record[key]` (a JSON number) as the whole, non-negative number a step or byte count is, else a
    `PlotError` naming the line (JSON's 1e400 reads as infinity)."""
    value = record[key]
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise PlotError(f"{path} line {line}: \"{key}\" must be a whole number >= 0 (got {json.dumps(value)})")
    return int(value)


# The config.json fields a label is made of, and the JSON type each must have (when present; missing ones
# take the trainer's defaults, so configs written before a field existed still plot).
_LABEL_FIELDS = {
    "algorithm": (str, "a string"),
    "diloco.num_replicas": (int, "an integer"),
    "diloco.sync_period": (int, "an integer"),
    "diloco.num_fragments": (int, "an integer"),
    "diloco.overlap_steps": (int, "an integer"),
    "diloco.alpha": ((int, float), "a number"),
    "diloco.quantize": (str, "a string"),
    "diloco.error_feedback": (bool, "true or false"),
}


def check_config(config: Any, path: Path) -> dict[str, Any]:
    """`config` (parsed from `path`) if it has the shape of a trainer's config.json, else a `PlotError` naming
    the file and the first field of the wrong type (a label would otherwise fail with a traceback)."""
    if not isinstance(config, dict):
        raise PlotError(f"{path} is not a run config: expected a JSON object, got {type(config).__name__}")
    if not isinstance(config.get("diloco", {}), dict):
        raise PlotError(f"{path}: \"diloco\" must be a JSON object (got {json.dumps(config['diloco'])})")
    for key, (kind, words) in _LABEL_FIELDS.items():
        *parent, name = key.split(".")
        holder = config.get(parent[0], {}) if parent else config
        if name not in holder:
            continue
        value = holder[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise PlotError(f"{path}: {key} must be {words} (got {json.dumps(value)})")
    return config


def read_run(run_dir: Path | str) -> Run:
    """The train and eval curves of `run_dir` (its metrics.jsonl) and its config.json, if any."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise PlotError(f"RUN_DIR is not a folder: {run_dir} (give the run's --run-dir)")
    if not run_dir.is_dir():
        raise PlotError(f"run folder does not exist: {run_dir}")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(f"no metrics.jsonl in {run_dir} (is it a run folder? train with --run-dir {run_dir})")
    config = None
    config_path = run_dir / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            config = None  # a torn or overwritten file: labels fall back to the folder name
        except OSError as e:
            raise PlotError(f"cannot read {config_path}: {e.strerror}") from None
        else:
            config = check_config(config, config_path)
    try:
        # Undecodable bytes become U+FFFD: such a line is then not JSON and is skipped like a torn one.
        text = metrics.read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise PlotError(f"cannot read {metrics}: {e.strerror}") from None
    run = Run(run_dir, config)
    sent_at: dict[int, int] = {0: 0}
    eval_lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
        if not isinstance(record, dict) or not _number(record.get("step")):
            continue
        step = _count(record, "step", metrics, number)
        if _number(record.get("sent_bytes")):
            sent_at[step] = _count(record, "sent_bytes", metrics, number)
        if _number(record.get("loss")):
            run.train.append((step, float(record["loss"]), sent_at.get(step, 0)))
        if _number(record.get("eval_loss")):
            eval_lines.append((step, float(record["eval_loss"])))
    if not run.train and not eval_lines:
        raise PlotError(f"{metrics} holds no loss values (the run has not logged a step yet)")
    # An evaluation at step s sees the bytes sent up to step s (the newest training line at or before s).
    known = sorted(sent_at)
    for step, value in eval_lines:
        before = [s for s in known if s <= step]
        run.evals.append((step, value, sent_at[before[-1]] if before else 0))
    return run


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def describe(config: dict[str, Any] | None) -> str | None:
    """A short label from a run's config: algorithm, R, H, P, tau, quantization."""
    if not config:
        return None
    d = config.get("diloco", {})
    R = d.get("num_replicas")
    if config.get("algorithm") == "ddp":
        return f"DDP R{R}"
    P, tau = d.get("num_fragments", 1), d.get("overlap_steps", 0)
    parts = ["Streaming DiLoCo" if P > 1 else "DiLoCo", f"R{R}", f"H{d.get('sync_period')}"]
    if P > 1:
        parts.append(f"P{P}")
    if tau:
        parts.append(f"tau{tau}")
    if d.get("alpha"):
        parts.append(f"alpha{d['alpha']}")
    if d.get("quantize", "none") != "none":
        parts.append(d["quantize"] + ("+EF" if d.get("error_feedback") else ""))
    return " ".join(parts)


_NOT_A_DIFFERENCE = ("run_dir", "checkpoint.dir", "checkpoint.every", "checkpoint.keep")


def label_runs(runs: list[Run]) -> None:
    """Set every run's label, so that no two runs of the plot share one."""
    for run in runs:
        run.label = describe(run.config) or run.run_dir.name
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    for label, same in groups.items():
        if len(same) < 2:
            continue
        flat = [_flatten(r.config) if r.config else {} for r in same]
        keys = sorted(set().union(*flat))
        differing = [k for k in keys if k not in _NOT_A_DIFFERENCE and len({json.dumps(f.get(k)) for f in flat}) > 1]
        for run, f in zip(same, flat):
            extra = ", ".join(f"{k.split('.')[-1]}={f.get(k)}" for k in differing[:3])
            run.label = f"{label} ({extra})" if extra else f"{label} ({run.run_dir.name})"
        if len({r.label for r in same}) < len(same):  # still equal (e.g. identical configs): folder names
            for run in same:
                run.label = f"{label} ({run.run_dir})"


def _format_bytes(x: float, _pos=None) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:g} {unit}"
    return f"{x:g} B"


def plot_runs(runs: list[Run], out: Path | str, *, title: str | None = None) -> Path:
    """Draw the two panels for `runs` (already read) into `out` (PNG, or any format matplotlib knows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    out = Path(out)
    if out.is_dir():
        raise PlotError(f"--out is a folder: {out} (name the image, e.g. {out / 'loss.png'})")
    if not out.suffix:  # matplotlib would add ".png" itself: add it here, so the path reported is the one written
        out = out.with_name(out.name + ".png")
    label_runs(runs)
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    finals = [max((b for *_, b in r.train + r.evals), default=0) for r in runs]
    positive = [b for b in finals if b > 0]
    log_bytes = len(positive) >= 2 and max(positive) / min(positive) >= 10
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        if run.train:
            steps, losses, sent = zip(*run.train)
            faint = dict(color=color, alpha=0.25 if run.evals else 0.9, linewidth=1)
            by_step.plot(steps, losses, **faint)
            keep = [(b, v) for b, v in zip(sent, losses) if b > 0 or not log_bytes]
            if keep:
                by_bytes.plot(*zip(*keep), **faint)
        if run.evals:
            steps, losses, sent = zip(*run.evals)
            solid = dict(color=color, linewidth=2, marker="o", markersize=3.5)
            by_step.plot(steps, losses, label=run.label, **solid)
            keep = [(b, v) for b, v in zip(sent, losses) if b > 0 or not log_bytes]
            if keep:
                by_bytes.plot(*zip(*keep), label=run.label, **solid)
        else:  # no evaluation logged: the training curve carries the label
            by_step.plot([], [], color=color, label=f"{run.label} (train)")
            by_bytes.plot([], [], color=color, label=f"{run.label} (train)")
    by_step.set_xlabel("inner step")
    by_bytes.set_xlabel("bytes sent per replica" + (" (log scale)" if log_bytes else ""))
    if log_bytes:
        by_bytes.set_xscale("log")
    by_bytes.xaxis.set_major_formatter(FuncFormatter(_format_bytes))
    for ax in (by_step, by_bytes):
        ax.set_ylabel("loss (nats/token)")
        ax.grid(True, alpha=0.3)
    by_step.set_title("held-out loss (solid) and training loss (faint) vs step")
    by_bytes.set_title("... vs bytes sent for synchronisation")
    by_step.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=120)
    except OSError as e:  # a read-only or full folder: one line, not matplotlib's traceback
        raise PlotError(f"cannot write --out {out}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.plot",
        description="Plot held-out and training loss of one or more runs against step and against bytes sent.",
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run folders (their --run-dir)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output image (default: <first RUN_DIR>/loss.png); .png, .pdf or .svg")
    parser.add_argument("--title", default=None, help="a title above both panels")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(d) for d in args.run_dirs]
        out = plot_runs(runs, args.out or args.run_dirs[0] / "loss.png", title=args.title)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # matplotlib: an output format it does not know
        print(f"error: --out: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''}: {'; '.join(r.label for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
