"""Helpers shared by the benchmark scripts: device set-up, running the trainer, reading
metrics.jsonl, markdown tables, JSON and plots.

Nothing here touches JAX devices at import time, so a benchmark's `main` can still call
`setup_jax` (which sets the simulated CPU device count) before anything else does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
REPO = RESULTS_DIR.parents[1]


def default_out_dir(name: str, mode: str) -> pathlib.Path:
    """Where a benchmark writes when no output folder is given: `runs/benchmarks/<name>_<mode>`
    (not committed). Committed results under `benchmarks/results` are only written when a
    script is given that folder explicitly (`--out-dir benchmarks/results`)."""
    return REPO / "runs" / "benchmarks" / f"{name}_{mode}"


def setup_jax(num_devices: int, *, compile_cache: str | os.PathLike | None = None) -> None:
    """Ask for `num_devices` simulated CPU devices (before JAX starts its backend) and
    optionally turn on JAX's persistent compilation cache in `compile_cache`.

    The cache only saves compile time: runs of a benchmark that build identical programs
    (same shapes, same sync functions) compile once. It never changes results.
    """
    from eqx_diloco._mesh import ensure_cpu_devices

    ensure_cpu_devices(num_devices)
    if compile_cache is not None:
        import jax

        pathlib.Path(compile_cache).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def add_mode_flags(parser) -> None:
    """--quick (the default) / --full / --smoke, stored in `args.mode`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", dest="mode", action="store_const", const="quick", help="the default")
    group.add_argument("--full", dest="mode", action="store_const", const="full")
    group.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="tests only")


def revision() -> str | None:
    """The git commit of the code that ran (with `-dirty` for local changes), if known."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10,
                             check=False)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10, check=False)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import jax

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(),
        # Not platform.platform(): it starts `uname -p` in a subprocess.
        "platform": "-".join(os.uname()[i] for i in (0, 2, 4)),
        "python": platform.python_version(),
    }


# -- running the trainer ---------------------------------------------------------------


def read_metrics(run_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(per-step lines, eval lines) of `<run_dir>/metrics.jsonl`."""
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "eval_loss" in record:
            evals.append(record)
        elif "loss" in record:
            steps.append(record)
    return steps, evals


def summarize_run(run_dir: pathlib.Path, summary: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """Final numbers and curves of one finished run, from the trainer's summary and metrics.jsonl.

    `curve` holds one point per evaluation: step, eval loss of the global model, bytes one
    replica had sent by then, and tokens consumed by all replicas together.
    """
    steps, evals = read_metrics(run_dir)
    sent_at = {s["step"]: s["sent_bytes"] for s in steps}
    curve = []
    for e in evals:
        t = e["step"]
        # With log_every=1 every step has a line; otherwise use the latest logged step before t.
        sent = sent_at.get(t, max([v for k, v in sent_at.items() if k <= t], default=0))
        curve.append({"step": t, "eval_loss": e["eval_loss"], "sent_bytes": sent, "tokens": t * tokens_per_step})
    last = steps[-1] if steps else {}
    train_tail = [s["loss"] for s in steps[-max(1, len(steps) // 10) :]]
    return {
        "eval_loss": summary.get("eval_loss", evals[-1]["eval_loss"] if evals else None),
        "sent_bytes": summary.get("sent_bytes", last.get("sent_bytes")),
        "peak_sync_bytes": summary.get("peak_sync_bytes", last.get("peak_sync_bytes")),
        "wire_bytes": summary.get("wire_bytes", last.get("wire_bytes")),
        "metrics_sent_bytes": last.get("sent_bytes"),
        "metrics_peak_sync_bytes": last.get("peak_sync_bytes"),
        "final_train_loss": statistics.fmean(train_tail) if train_tail else None,
        "curve": curve,
    }


def train_and_summarize(config, *, fresh: bool = True) -> dict[str, Any]:
    """Run the trainer on `config` (its run_dir is wiped first: a leftover checkpoint
    would make the trainer resume) and return `summarize_run`'s dict plus `elapsed_s`."""
    from eqx_diloco.lm.trainer import Trainer

    if fresh and config.run_dir.exists():
        shutil.rmtree(config.run_dir)
    start = time.perf_counter()
    summary = Trainer(config, verbose=False).run()
    elapsed = time.perf_counter() - start
    tokens_per_step = config.diloco.num_replicas * config.train.batch_size * config.train.seq_len
    out = summarize_run(config.run_dir, summary, tokens_per_step)
    out["elapsed_s"] = elapsed
    return out


def average_seeds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of the final numbers and of the curves (same eval steps); std of eval loss."""
    first = dict(results[0])
    if len(results) == 1:
        first["eval_loss_std"] = 0.0
        first["seed_eval_losses"] = [first["eval_loss"]]
        return first
    losses = [r["eval_loss"] for r in results]
    out = dict(first)
    out["eval_loss"] = statistics.fmean(losses)
    out["eval_loss_std"] = statistics.stdev(losses)
    out["seed_eval_losses"] = losses
    out["final_train_loss"] = statistics.fmean(r["final_train_loss"] for r in results)
    out["elapsed_s"] = sum(r["elapsed_s"] for r in results)
    out["curve"] = [
        {**points[0], "eval_loss": statistics.fmean(p["eval_loss"] for p in points)}
        for points in zip(*(r["curve"] for r in results))
    ]
    return out


# -- statistics over seeds ----------------------------------------------------------------

# Two-sided 95% quantiles of Student's t by degrees of freedom (1.96 beyond the table).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def mean_sd(values: Iterable[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None below 2 values) and half-width of the 95%
    t-interval of the mean (None below 2 values), with the values themselves."""
    values = list(values)
    n = len(values)
    mean = statistics.fmean(values) if n else None
    sd = statistics.stdev(values) if n >= 2 else None
    ci = _T975.get(n - 1, 1.96) * sd / math.sqrt(n) if sd is not None else None
    return {"n": n, "mean": mean, "sd": sd, "ci95": ci, "values": values}


def paired_gap(losses: dict[int, float], reference: dict[int, float], *, scale: float = 100.0) -> dict[str, Any]:
    """Gap of a method to its reference, paired by seed: for every seed both have,
    `scale * (loss - reference) / reference` (scale 100: percent; 1: a fraction), then
    `mean_sd` of those per-seed gaps, plus the seeds used. `losses` and `reference` map
    seed -> final eval loss."""
    seeds = sorted(set(losses) & set(reference))
    gaps = [scale * (losses[s] - reference[s]) / reference[s] for s in seeds]
    return mean_sd(gaps) | {"seeds": seeds}


def fmt_pm(stat: dict[str, Any] | None, fmt: str, unit: str = "", *, scale: float = 1.0) -> str:
    """`mean +- sd` of a `mean_sd` dict (`-` without a mean; no sd part without an sd),
    each multiplied by `scale` and formatted with `fmt` (the sd without a sign)."""
    if not stat or stat.get("mean") is None:
        return "-"
    text = format(scale * stat["mean"], fmt) + unit
    if stat.get("sd") is not None:
        text += " +- " + format(scale * stat["sd"], fmt.replace("+", "")) + unit
    return text


class TemporaryRunDirs:
    """A folder for run directories: a temporary one (deleted on exit) unless `keep` is given."""

    def __init__(self, keep: str | os.PathLike | None = None):
        self.keep = None if keep is None else pathlib.Path(keep)
        self._tmp = None

    def __enter__(self) -> pathlib.Path:
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            return self.keep
        self._tmp = tempfile.TemporaryDirectory(prefix="eqx_diloco_bench_")
        return pathlib.Path(self._tmp.name)

    def __exit__(self, *exc):
        if self._tmp is not None:
            self._tmp.cleanup()


# -- output ---------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def markdown_table(
    rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, Callable[[Any], str] | None]]
) -> str:
    """A GitHub markdown table. `columns` holds (header, key, formatter or None for str)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else (fmt(value) if fmt else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, pathlib.Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / jax scalars
        return jsonable(obj.item())
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=2) + "\n")
    return path


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


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
