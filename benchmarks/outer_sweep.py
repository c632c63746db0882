"""Outer-optimizer study: outer lr x outer momentum x per-replica batch x H, DDP beside every cell.

Question: which outer SGD settings (lr, momentum, Nesterov) make DiLoCo R = 2 closest to
data-parallel training at equal tokens, and how the gap moves with the per-replica batch
(the papers run 10^5-10^6 tokens per replica step; the CLI and the benchmarks run ~10^3).

Every run trains the same model on the embedded corpus (the standard library's sources,
bytes) and is evaluated on the same held-out windows; the number is the final eval loss of
the *global* model (DDP: the shared params). For every per-replica batch b the grid holds

- DDP, R = 2, batch b (the reference: same tokens, same steps, same seed);
- DiLoCo, R = 2, batch b, for every H and every outer setting;
- at the batches in `r1_batch_sizes`: plain training (DDP with R = 1) and DiLoCo R = 1 with
  every outer setting that has momentum or lr != 1 (papers: R = 1 DiLoCo matches or beats
  plain training; with lr 1 and no momentum it *is* plain training, so that cell is skipped).

Steps are the same for every batch size: a larger batch means more tokens, never fewer
steps, so DDP and DiLoCo always compare at equal tokens and equal steps. Gaps are paired:
for each seed, 100 * (loss - loss of the reference with the same seed) / reference, then
mean, standard deviation and a 95% t-interval over seeds, all computed here from the
per-seed numbers stored in the JSON.

Data split: the study uses `--data.split contiguous` by default (replica r samples only its
own half of the train split), the CLI's default and the realistic case for islands that
hold their own data; the convergence benchmark reads the data the same way, so numbers are
comparable with it (the issue measured iid vs contiguous at 512 tokens: +8.1% vs +8.3%).
`--split iid` measures the papers' setting (every replica samples the whole train split);
the script refuses it if the trainer in use does not pass `DataConfig.split` to its batches.

Simulated devices: the CPU device count is pinned to NUM_CPU_DEVICES (2) in every mode,
before JAX starts, and recorded in the JSON (results move by ~0.5% with the device count).

Modes (each is one or more sub-studies, all written to one JSONL and one JSON):

- default (`--full`), sub-study `batch`: 4 layers, dim 64, seq 64, inner AdamW lr 3e-3
  (the convergence benchmark's quick scale), per-replica batches of 512, 2048 and 8192
  tokens (batch 8, 32, 128), H = 10, outer settings lr/momentum 1.0/0 (plain averaging),
  0.7/Nesterov 0.9 (the papers'), 1.0/Nesterov 0.3 (the issue's best single-seed result),
  R = 1 rows at 512 tokens, 3 seeds, **100 steps** for every batch. 100 and not 500 steps:
  an 8192-token step of R = 2 costs 1.6-2.4 s on one (shared) CPU core, so 500 steps would
  be ~15 minutes per run; the whole grid at 100 steps is about an hour on one idle core.
  `--steps 500` is the same study at the longer budget.
- `--full --study default_regime`: 512 tokens per replica step for 500 steps (the
  convergence benchmark's quick scale and the issue's measurements), R = 1 and R = 2.
- `--quick`: a microscopic version of both sub-studies (2 layers, dim 16, 10 steps, 2
  seeds) that exercises the whole pipeline; used by the tests, numbers are meaningless.
- `--report`: train nothing; read a saved JSON (`--from`: the file or a study folder,
  default `--out`; with a folder, runs appended to its JSONL since are included) and write
  the JSON, markdown and plots into `--out`.
- `--plan`: print the runs the chosen options would make, and exit.

Order and resuming: cells run most important first (R = 1 rows, then per outer setting the
smallest batch, the largest, the ones between), all seeds of a cell together, so a study
cut short has full seed sets for the cells it reached. Every finished run is appended to
`<out>/outer_sweep_runs.jsonl` and the JSON and markdown are rewritten; started again with
the same options, the study skips runs already there (runs made with other scale options
are ignored). Output: `<out>/outer_sweep.json`, `outer_sweep.md`,
`outer_sweep_<study>_gap_vs_batch.png`, `outer_sweep_<study>_loss_vs_step.png`. The
default `--out` is a scratch folder under runs/; committed results under benchmarks/results
are written only when `--out benchmarks/results` is given.

Run `python -m benchmarks.outer_sweep --help`.
"""

from __future__ import annotations

NUM_CPU_DEVICES = 2  # simulated CPU devices, the same in every mode (R <= 2 everywhere)

if __name__ == "__main__":  # before anything starts a JAX backend
    import jax

    jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)

import argparse
import dataclasses
import hashlib
import json
import pathlib
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/outer_sweep.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common

NAME = "outer_sweep"
REPO = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Outer:
    """One outer SGD setting."""

    lr: float
    momentum: float
    nesterov: bool

    @property
    def label(self) -> str:
        if self.momentum == 0:
            return f"lr {self.lr:g}, no momentum" + (" (plain averaging)" if self.lr == 1 else "")
        return f"lr {self.lr:g}, {'Nesterov' if self.nesterov else 'momentum'} {self.momentum:g}"

    @property
    def tag(self) -> str:
        return f"lr{self.lr:g}_m{self.momentum:g}{'n' if self.nesterov and self.momentum else ''}"


def parse_outer(text: str) -> Outer:
    """`LR:MOMENTUM` (Nesterov) or `LR:MOMENTUM:plain` (heavy-ball momentum)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("nesterov", "plain")):
        raise argparse.ArgumentTypeError(f"--outer wants LR:MOMENTUM or LR:MOMENTUM:plain (got {text})")
    return Outer(float(parts[0]), float(parts[1]), len(parts) == 2 or parts[2] == "nesterov")


@dataclasses.dataclass(frozen=True)
class Scale:
    """Model, budget and grid of one mode."""

    num_layers: int
    dim: int
    num_heads: int
    mlp_ratio: int
    seq_len: int
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_sequences: int
    batch_sizes: tuple[int, ...]  # sequences per replica per step
    sync_periods: tuple[int, ...]
    outers: tuple[Outer, ...]  # in priority order: runs of the first setting come first
    r1_batch_sizes: tuple[int, ...]  # batches with R = 1 rows (plain training vs DiLoCo R = 1)
    split: str = "contiguous"
    max_corpus_bytes: int = 8_000_000

    def batch_tokens(self, batch_size: int) -> int:
        return batch_size * self.seq_len


DEFAULT_OUTERS = (Outer(1.0, 0.0, False), Outer(0.7, 0.9, True), Outer(1.0, 0.3, True))

_TINY = {"num_layers": 2, "dim": 16, "num_heads": 2, "mlp_ratio": 2, "seq_len": 16, "lr": 1e-2,
         "eval_sequences": 8, "sync_periods": (5,), "max_corpus_bytes": 200_000}
_BASE = {"num_layers": 4, "dim": 64, "num_heads": 4, "mlp_ratio": 4, "seq_len": 64, "lr": 3e-3,
         "eval_sequences": 256, "sync_periods": (10,), "outers": DEFAULT_OUTERS}
# Each mode is one or more sub-studies, run one after the other into the same JSONL and JSON.
STUDIES = {
    "quick": {
        "default_regime": Scale(**_TINY, steps=10, warmup_steps=2, eval_every=5, batch_sizes=(),
                                outers=(Outer(1.0, 0.0, False), Outer(0.7, 0.9, True)), r1_batch_sizes=(2,)),
        "batch": Scale(**_TINY, steps=10, warmup_steps=2, eval_every=5, batch_sizes=(2, 4),
                       outers=(Outer(0.7, 0.9, True),), r1_batch_sizes=()),
    },
    "full": {
        # The batch trend: 512 to 8192 tokens per replica step, the same 100 steps for every batch,
        # with the R = 1 rows at 512 tokens.
        "batch": Scale(**_BASE, steps=100, warmup_steps=10, eval_every=25, batch_sizes=(8, 32, 128),
                       r1_batch_sizes=(8,)),
        # Only with `--study default_regime`: 512 tokens per replica step for 500 steps (the
        # convergence benchmark's quick scale), R = 1 and R = 2.
        "default_regime": Scale(**_BASE, steps=500, warmup_steps=25, eval_every=50, batch_sizes=(8,),
                                r1_batch_sizes=(8,)),
    },
}
DEFAULT_STUDIES = {"quick": ("default_regime", "batch"), "full": ("batch",)}
DEFAULT_SEEDS = {"quick": (0, 1), "full": (0, 1, 2)}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One cell of the grid (all seeds of it share this)."""

    algorithm: str  # "ddp" or "diloco"
    replicas: int
    batch_size: int
    sync_period: int = 0
    outer_lr: float = 0.0
    outer_momentum: float = 0.0
    nesterov: bool = False

    @property
    def outer(self) -> Outer | None:
        return None if self.algorithm == "ddp" else Outer(self.outer_lr, self.outer_momentum, self.nesterov)

    @property
    def cell(self) -> str:
        key = f"{self.algorithm}_R{self.replicas}_b{self.batch_size}"
        if self.algorithm == "diloco":
            key += f"_H{self.sync_period}_{self.outer.tag}"
        return key

    @property
    def reference(self) -> str:
        """The cell this one is compared with: DDP with the same R and batch (R = 1: plain training)."""
        return f"ddp_R{self.replicas}_b{self.batch_size}"

    def label(self) -> str:
        if self.algorithm == "ddp":
            return "DDP" if self.replicas > 1 else "plain training"
        return f"DiLoCo H={self.sync_period}, {self.outer.label}"


def plan(scale: Scale) -> list[Spec]:
    """Every cell, most important first, so that a study cut short loses the least: R = 1
    rows (cheap), then outer setting by outer setting (in `scale.outers` order) the smallest
    batch, the largest, then the ones between (DDP before the first DiLoCo cell of its batch).

    R = 1 DiLoCo with outer lr 1 and no momentum is plain training exactly (the outer step
    copies the replica), so that cell is not run."""
    specs: list[Spec] = []
    diloco = lambda R, b, H, o: Spec("diloco", R, b, H, o.lr, o.momentum, o.nesterov)
    for b in scale.r1_batch_sizes:
        specs.append(Spec("ddp", 1, b))
        specs += [diloco(1, b, scale.sync_periods[0], o) for o in scale.outers if (o.lr, o.momentum) != (1.0, 0.0)]
    ordered = sorted(scale.batch_sizes)
    ordered = ordered[:1] + ordered[-1:] + ordered[1:-1] if len(ordered) > 2 else ordered
    for i, outer in enumerate(scale.outers):
        for b in ordered:
            if i == 0:
                specs.append(Spec("ddp", 2, b))
            specs += [diloco(2, b, H, outer) for H in scale.sync_periods]
    return specs


def scale_id(scale: Scale) -> str:
    """Identifies the settings a run was made with (everything but the grid lists)."""
    fixed = {k: v for k, v in dataclasses.asdict(scale).items()
             if k not in ("batch_sizes", "sync_periods", "outers", "r1_batch_sizes")}
    fixed["num_cpu_devices"] = NUM_CPU_DEVICES
    return hashlib.sha1(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:12]


def make_config(spec: Spec, scale: Scale, run_dir: pathlib.Path, seed: int):
    from eqx_diloco.lm import CheckpointConfig, Config, DataConfig, DiLoCoConfig, TrainConfig
    from models import TransformerConfig

    model = TransformerConfig(num_layers=scale.num_layers, dim=scale.dim, num_heads=scale.num_heads,
                              mlp_ratio=scale.mlp_ratio)
    train = TrainConfig(steps=scale.steps, batch_size=spec.batch_size, seq_len=scale.seq_len, lr=scale.lr,
                        warmup_steps=scale.warmup_steps, seed=seed, log_every=10, eval_every=scale.eval_every,
                        eval_sequences=scale.eval_sequences)
    if spec.algorithm == "ddp":
        diloco = DiLoCoConfig(num_replicas=spec.replicas)
    else:
        diloco = DiLoCoConfig(num_replicas=spec.replicas, sync_period=spec.sync_period, outer_lr=spec.outer_lr,
                              outer_momentum=spec.outer_momentum, nesterov=spec.nesterov)
    data = DataConfig(source="corpus", max_corpus_bytes=scale.max_corpus_bytes, split=scale.split)
    return Config(algorithm=spec.algorithm, run_dir=run_dir, model=model, diloco=diloco, train=train, data=data,
                  checkpoint=CheckpointConfig(every=0))


def check_split_honoured(scale: Scale, tmp: pathlib.Path) -> None:
    """Refuse a non-default split the trainer would silently ignore."""
    if scale.split == "contiguous":
        return
    from eqx_diloco.lm import Trainer

    trainer = Trainer(make_config(Spec("ddp", 2, scale.batch_sizes[0]), scale, tmp / "split_check", 0), verbose=False)
    batches = getattr(trainer, "batches", None)
    if batches is None:
        print(f"warning: cannot check that the trainer honours --split {scale.split}", flush=True)
    elif getattr(batches, "split", "contiguous") != scale.split:
        raise SystemExit(f"--split {scale.split}: this trainer does not pass DataConfig.split to its batches")


def run_one(study: str, spec: Spec, scale: Scale, seed: int, run_dir: pathlib.Path) -> dict[str, Any]:
    """Train one run through the public API; read its final numbers and curve from metrics.jsonl."""
    from eqx_diloco.lm.trainer import train

    if run_dir.exists():  # a run killed half-way: start it again from scratch
        shutil.rmtree(run_dir)
    start = time.perf_counter()
    train(make_config(spec, scale, run_dir, seed), verbose=False)
    elapsed = time.perf_counter() - start
    steps, evals = common.read_metrics(run_dir)
    if not evals or evals[-1]["step"] != scale.steps:
        raise RuntimeError(f"{run_dir}: no final evaluation in metrics.jsonl")
    tail = [s["loss"] for s in steps[-max(1, len(steps) // 10):]]
    return {
        "key": run_key(study, spec, seed),
        "study": study,
        "cell": spec.cell,
        "spec": dataclasses.asdict(spec),
        "seed": seed,
        "scale_id": scale_id(scale),
        "eval_loss": evals[-1]["eval_loss"],
        "final_train_loss": statistics.fmean(tail) if tail else None,
        "curve": [[e["step"], e["eval_loss"]] for e in evals],
        "elapsed_s": elapsed,
    }


def run_key(study: str, spec: Spec, seed: int) -> str:
    return f"{study}/{spec.cell}_s{seed}"


def load_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """Finished runs in a JSONL log (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def matching(records: Sequence[dict[str, Any]], study: str, scale: Scale, seeds: Sequence[int]) -> list[dict]:
    """The records of `study` made with `scale`'s settings, for cells of its grid and `seeds`."""
    sid, cells = scale_id(scale), {s.cell for s in plan(scale)}
    return [r for r in records if r.get("study") == study and r.get("scale_id") == sid and r["cell"] in cells
            and r["seed"] in seeds]


class Eta:
    """Remaining time from the runs finished in this session: seconds = a + c * tokens, fitted."""

    def __init__(self):
        self.points: list[tuple[float, float]] = []

    def add(self, tokens: float, seconds: float) -> None:
        self.points.append((tokens, seconds))

    def estimate(self, tokens: float) -> float | None:
        if not self.points:
            return None
        xs, ys = zip(*self.points)
        if len(set(xs)) < 2:
            return sum(ys) / sum(xs) * tokens
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return max(0.0, my - slope * mx) + slope * tokens


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def run_studies(studies: dict[str, Scale], seeds: Sequence[int], out: pathlib.Path, log=print,
                on_record=None) -> list[dict]:
    """Run every (study, cell, seed) not already in `<out>/outer_sweep_runs.jsonl`; return all records."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"{NAME}_runs.jsonl"
    existing = load_records(jsonl)
    done = {r["key"]: r for name, scale in studies.items() for r in matching(existing, name, scale, seeds)}
    todo = [(name, spec, seed) for name, scale in studies.items() for spec in plan(scale) for seed in seeds
            if run_key(name, spec, seed) not in done]
    total = len(done) + len(todo)
    log(f"{NAME}: {total} runs ({len(done)} already in {jsonl.name}, {len(todo)} to go); "
        f"{NUM_CPU_DEVICES} simulated CPU devices; split {', '.join(sorted({s.split for s in studies.values()}))}")
    for scale in studies.values():
        check_split_honoured(scale, out / "runs")
    tokens = lambda name, spec: (spec.replicas * spec.batch_size * studies[name].seq_len
                                 * studies[name].steps)
    eta, study_start = Eta(), time.perf_counter()
    for i, (name, spec, seed) in enumerate(todo):
        record = run_one(name, spec, studies[name], seed, out / "runs" / name / f"{spec.cell}_s{seed}")
        with jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        done[record["key"]] = record
        eta.add(tokens(name, spec), record["elapsed_s"])
        left = [eta.estimate(tokens(n, s)) for n, s, _ in todo[i + 1:]]
        remaining = None if any(x is None for x in left) else sum(left)
        log(f"[{len(done)}/{total}] {record['key']:<48} eval {record['eval_loss']:.4f}  "
            f"{record['elapsed_s']:6.1f}s  elapsed {fmt_time(time.perf_counter() - study_start)}  "
            f"ETA {fmt_time(remaining)}")
        if on_record is not None:
            on_record(list(done.values()))
    return list(done.values())


# -- statistics --------------------------------------------------------------------------

mean_sd = common.mean_sd  # mean, sd and 95% t-interval over seeds (shared with the other benchmarks)


def _spec_of(row: dict[str, Any]) -> Spec:
    return Spec(**{f.name: row[f.name] for f in dataclasses.fields(Spec)})


def aggregate(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: per-seed losses, mean/sd, and gaps paired by seed with its reference."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_cell.setdefault(r["cell"], []).append(r)
    rows, by_seed = {}, {}
    for cell, runs in by_cell.items():
        runs = sorted(runs, key=lambda r: r["seed"])
        spec = Spec(**runs[0]["spec"])
        curves = [r["curve"] for r in runs]
        steps = [p[0] for p in curves[0]]
        same_steps = all([p[0] for p in c] == steps for c in curves)
        by_seed[cell] = {r["seed"]: r["eval_loss"] for r in runs}
        rows[cell] = {
            "cell": cell,
            "label": spec.label(),
            **dataclasses.asdict(spec),
            "seeds": [r["seed"] for r in runs],
            "eval_loss": mean_sd([r["eval_loss"] for r in runs]),
            "final_train_loss": mean_sd([r["final_train_loss"] for r in runs if r["final_train_loss"] is not None]),
            "elapsed_s": sum(r["elapsed_s"] for r in runs),
            "curve": [{"step": s, "eval_loss": statistics.fmean(c[j][1] for c in curves)}
                      for j, s in enumerate(steps)] if same_steps else [],
        }
    for cell, row in rows.items():
        spec = _spec_of(row)
        ref = by_seed.get(spec.reference)
        if spec.algorithm == "diloco" and ref is not None:
            row["reference"] = spec.reference
            row["gap_pct"] = common.paired_gap(by_seed[cell], ref)
    # Each outer setting against plain averaging (outer lr 1, no momentum) in the same R, batch and H:
    # per seed, its gap minus plain averaging's gap (percentage points of the reference loss).
    gaps = {cell: {sd: 100 * (by_seed[cell][sd] - by_seed[row["reference"]][sd]) / by_seed[row["reference"]][sd]
                   for sd in row["gap_pct"]["seeds"]} for cell, row in rows.items() if "gap_pct" in row}
    for cell, row in rows.items():
        spec = _spec_of(row)
        plain = dataclasses.replace(spec, outer_lr=1.0, outer_momentum=0.0, nesterov=False).cell
        if spec.algorithm == "diloco" and plain != cell and cell in gaps and plain in gaps:
            seeds = sorted(set(gaps[cell]) & set(gaps[plain]))
            row["vs_plain_averaging_pp"] = mean_sd(gaps[cell][sd] - gaps[plain][sd] for sd in seeds) | {"seeds": seeds}
    key = lambda r: (r["replicas"], r["batch_size"], r["algorithm"] != "ddp", r["sync_period"],
                     -r["outer_lr"], r["outer_momentum"])
    return sorted(rows.values(), key=key)


# -- report --------------------------------------------------------------------------------


_pm = common.fmt_pm


def render_study(name: str, study: dict[str, Any], mode: str = "full") -> list[str]:
    s, rows = study["scale"], study["cells"]
    outers = "; ".join(Outer(**o).label for o in s["outers"])
    command = f"python -m benchmarks.{NAME}" + (" --quick" if mode == "quick" else "")
    if name not in DEFAULT_STUDIES.get(mode, ()):
        command += f" --study {name}"
    lines = [
        (f"## Study `{name}`: {s['steps']} steps, "
        f"{', '.join(str(b * s['seq_len']) for b in sorted({*s['batch_sizes'], *s['r1_batch_sizes']}))} "
        "tokens per replica step"),
        "",
        (f"Model: {s['num_layers']} layers, dim {s['dim']}, {s['num_heads']} heads, byte vocab; seq {s['seq_len']}; "
        f"{s['steps']} steps for every batch size; inner AdamW lr {s['lr']:g} (warm-up {s['warmup_steps']}, "
        f"cosine to 10%); H = {', '.join(map(str, s['sync_periods']))}. Outer SGD settings: {outers}. "
        f"Data split `{s['split']}`. Eval: the global model on {s['eval_sequences']} fixed held-out windows of "
        f"{s['seq_len']} bytes after the last step, nats per byte."),
        "",
        f"Command: `{command}`.",
        "",
        "| run | R | tokens / replica step | n | eval loss | gap to reference | 95% CI of gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = r.get("gap_pct")
        ci = "-" if not gap or gap.get("ci95") is None else f"+-{gap['ci95']:.2f}%"
        lines.append(f"| {r['label']} | {r['replicas']} | {r['batch_size'] * s['seq_len']} | {r['eval_loss']['n']} | "
                     f"{_pm(r['eval_loss'], '.4f')} | {_pm(gap, '+.2f', '%')} | {ci} |")
    best_lines = []
    for R in sorted({r["replicas"] for r in rows}):
        for b in sorted({r["batch_size"] for r in rows if r["replicas"] == R}):
            for H in sorted({r["sync_period"] for r in rows if r["algorithm"] == "diloco"}):
                cands = [r for r in rows if r["replicas"] == R and r["batch_size"] == b and r["sync_period"] == H
                         and r.get("gap_pct", {}).get("mean") is not None]
                if cands:
                    best = min(cands, key=lambda r: r["gap_pct"]["mean"])
                    best_lines.append(f"- R = {R}, {b * s['seq_len']} tokens, H = {H}: {best['label']}, gap "
                                      f"{_pm(best['gap_pct'], '+.2f', '%')} (n = {best['gap_pct']['n']})")
    if best_lines:
        lines += ["", "Lowest mean gap per cell:", "", *best_lines]
    vs_plain = [r for r in rows if r.get("vs_plain_averaging_pp", {}).get("mean") is not None]
    if vs_plain:
        lines += ["", ("Against plain averaging (outer lr 1, no momentum) with the same R, batch and H: per seed, the "
                       "gap minus plain averaging's gap, in percentage points (negative: closer to the reference); "
                       "mean +- sd, n, 95% interval:"), ""]
        for r in vs_plain:
            d = r["vs_plain_averaging_pp"]
            ci = "" if d.get("ci95") is None else f", +-{d['ci95']:.2f}"
            lines.append(f"- R = {r['replicas']}, {r['batch_size'] * s['seq_len']} tokens: {r['label']}: "
                         f"{_pm(d, '+.2f')} pp (n = {d['n']}{ci})")
    if study.get("not_run"):
        lines += ["", f"Grid runs not made (the study was stopped before them): {', '.join(study['not_run'])}."]
    lines += [""]
    return lines


def render_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Outer-optimizer study ({result['mode']})",
        "",
        (f"Generated by `python -m benchmarks.{NAME}` (each sub-study's command is given with it; `--report --from "
        "<study folder>` re-renders this file) "
        f"from {result['num_runs']} runs, seeds {', '.join(map(str, result['seeds']))} (n per cell in the tables); "
        f"{result['num_cpu_devices']} simulated CPU devices; total run time {result['total_run_s'] / 60:.0f} min."),
        "",
        ("Gap: paired by seed, 100 x (loss - reference loss with the same seed) / reference loss. The reference of "
        "an R = 2 DiLoCo run is DDP with R = 2 and the same per-replica batch (equal tokens, equal steps); the "
        "reference of an R = 1 DiLoCo run is plain training (DDP with R = 1). Eval loss and gap: mean +- sample "
        "sd over seeds; last column: half-width of the 95% t-interval of the mean gap (a gap whose interval "
        "holds 0 is within seed noise)."),
        "",
    ]
    for name, study in result["studies"].items():
        lines += render_study(name, study, result["mode"])
    plots = [p for study in result["studies"].values() for p in study.get("plots", [])]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{p}`" for p in plots) + ".", ""]
    return "\n".join(lines)


def plot_gap(study: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = study["scale"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in study["cells"]:
        if r["algorithm"] == "diloco" and r["replicas"] == 2 and r.get("gap_pct"):
            series.setdefault(r["label"], []).append(r)
    for label, group in series.items():
        group = sorted(group, key=lambda r: r["batch_size"])
        xs = [r["batch_size"] * s["seq_len"] for r in group]
        ax.errorbar(xs, [r["gap_pct"]["mean"] for r in group], yerr=[r["gap_pct"]["sd"] or 0.0 for r in group],
                    marker="o", capsize=3, label=f"{label} (n = {min(r['gap_pct']['n'] for r in group)})")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.axhline(2.0, color="gray", linewidth=0.8, linestyle="--", label="2%")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per replica step (log scale)")
    ax.set_ylabel("eval loss gap to DDP at equal tokens (%)")
    ax.set_title(f"DiLoCo R = 2 vs DDP, {s['steps']} steps for every batch; mean +- sd over seeds", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(study: dict[str, Any], path: pathlib.Path) -> pathlib.Path:
    s = study["scale"]
    panels = []
    for R in sorted({r["replicas"] for r in study["cells"]}, reverse=True):
        for b in sorted({r["batch_size"] for r in study["cells"] if r["replicas"] == R}):
            group = [r for r in study["cells"] if r["replicas"] == R and r["batch_size"] == b and r["curve"]]
            panels.append((f"R = {R}, {b * s['seq_len']} tokens per replica step",
                           [(r["label"], r["curve"]) for r in group]))
    return common.plot_curves(panels, "step", path, title=f"Seed-mean eval loss vs inner step ({s['steps']} steps)",
                              xlabel="inner step")


def build_result(records: Sequence[dict[str, Any]], studies: dict[str, Scale], seeds: Sequence[int],
                 mode: str) -> dict[str, Any]:
    chosen = {name: matching(records, name, scale, seeds) for name, scale in studies.items()}
    runs = sorted((r for rs in chosen.values() for r in rs), key=lambda r: r["key"])
    return {
        "benchmark": NAME,
        "mode": mode,
        "num_cpu_devices": NUM_CPU_DEVICES,
        "seeds": sorted({r["seed"] for r in runs}),
        "num_runs": len(runs),
        "machine": common.machine_info(),
        "total_run_s": sum(r["elapsed_s"] for r in runs),
        "studies": {
            name: {"scale": dataclasses.asdict(scale), "scale_id": scale_id(scale), "data_split": scale.split,
                   "cells": aggregate(chosen[name]),
                   "not_run": [f"{spec.cell}_s{seed}" for spec in plan(scale) for seed in seeds
                               if run_key(name, spec, seed) not in {r["key"] for r in chosen[name]}]}
            for name, scale in studies.items() if chosen[name]
        },
        "runs": runs,
    }


def write_outputs(result: dict[str, Any], out: pathlib.Path, *, make_plots: bool = True) -> list[pathlib.Path]:
    written = []
    if make_plots:
        for name, study in result["studies"].items():
            paths = []
            if len(study["scale"]["batch_sizes"]) > 1:
                paths.append(plot_gap(study, out / f"{NAME}_{name}_gap_vs_batch.png"))
            paths.append(plot_loss(study, out / f"{NAME}_{name}_loss_vs_step.png"))
            study["plots"] = [p.name for p in paths]
            written += paths
    text = render_markdown(result)
    return [common.write_json(out / f"{NAME}.json", result), common.write_text(out / f"{NAME}.md", text), *written]


def report(source: pathlib.Path, out: pathlib.Path, *, make_plots: bool = True) -> dict[str, Any]:
    """Render JSON, markdown and plots from a saved JSON (a file, or `<folder>/outer_sweep.json`);
    with a folder, runs appended to its JSONL since that JSON was written are included."""
    path = source / f"{NAME}.json" if source.is_dir() else source
    if not path.exists():
        raise SystemExit(f"--report: {path} does not exist (run the study first, or point --from at its JSON)")
    saved = json.loads(path.read_text())
    records = list(saved["runs"])
    if source.is_dir():
        keys = {r["key"] for r in records}
        records += [r for r in load_records(source / f"{NAME}_runs.jsonl") if r["key"] not in keys]
    # The saved JSON's sub-studies, plus the mode's other sub-studies that have runs in the
    # folder's JSONL (made by a later invocation with `--study`, which rewrote the JSON).
    scales = {name: scale_from_dict(st["scale"]) for name, st in saved["studies"].items()}
    for name, scale in STUDIES.get(saved["mode"], {}).items():
        if name not in scales and any(r.get("study") == name and r.get("scale_id") == scale_id(scale)
                                      for r in records):
            scales[name] = scale
    order = list(STUDIES.get(saved["mode"], {}))
    studies = {}
    for name, scale in sorted(scales.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        studies[name] = widen(scale, [r for r in records if r.get("study") == name
                                      and r.get("scale_id") == scale_id(scale)])
    result = build_result(records, studies, saved["seeds"], saved["mode"])
    result["machine"] = saved.get("machine", result["machine"])
    write_outputs(result, out, make_plots=make_plots)
    return result


def widen(scale: Scale, records: Sequence[dict[str, Any]]) -> Scale:
    """`scale` with its grid lists grown to hold every cell in `records` (runs made with the
    same settings by invocations with narrower grids, e.g. `--batch-sizes 32` to finish a cell)."""
    specs = [Spec(**r["spec"]) for r in records]
    outers = list(scale.outers) + [o for o in dict.fromkeys(s.outer for s in specs if s.outer)
                                   if o not in scale.outers]
    return dataclasses.replace(
        scale,
        batch_sizes=tuple(sorted({*scale.batch_sizes, *(s.batch_size for s in specs if s.replicas == 2)})),
        r1_batch_sizes=tuple(sorted({*scale.r1_batch_sizes, *(s.batch_size for s in specs if s.replicas == 1)})),
        sync_periods=tuple(sorted({*scale.sync_periods, *(s.sync_period for s in specs if s.sync_period)})),
        outers=tuple(outers),
    )


def scale_from_dict(d: dict[str, Any]) -> Scale:
    d = dict(d)
    d["outers"] = tuple(Outer(**o) for o in d["outers"])
    for k in ("batch_sizes", "sync_periods", "r1_batch_sizes"):
        d[k] = tuple(d[k])
    return Scale(**d)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="the real study (the default): see Modes above")
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="microscopic, < 1 minute, for the test suite (numbers are meaningless)")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: render JSON, markdown and plots into --out from --from")
    parser.add_argument("--from", dest="source", type=pathlib.Path, default=None,
                        help="with --report: a study folder or a saved outer_sweep.json (default: --out)")
    parser.add_argument("--plan", action="store_true", help="print the runs of the chosen options and exit")
    parser.add_argument("--study", nargs="+", default=None,
                        help="sub-studies to run (default: full: batch; quick: default_regime batch; "
                             "full also has default_regime)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds run for every cell (default: 0 1 2; --quick: 0 1)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="output folder (default: runs/outer_sweep_<mode>; results under benchmarks/results "
                             "are written only when it is given explicitly)")
    parser.add_argument("--steps", type=int, default=None,
                        help="inner steps of every run of every sub-study (same for every batch)")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=None,
                        help="sequences per replica per step (tokens = batch x seq len) of the R = 2 cells, every "
                             "sub-study; given with no value: no R = 2 cells (only the R = 1 rows)")
    parser.add_argument("--r1-batch-sizes", type=int, nargs="*", default=None,
                        help="batches of the R = 1 rows (plain training and DiLoCo R = 1), every sub-study; given "
                             "with no value: no R = 1 rows (they can be added later into the same --out)")
    parser.add_argument("--sync-periods", type=int, nargs="+", default=None, help="H values, every sub-study")
    parser.add_argument("--outer", type=parse_outer, nargs="+", default=None, metavar="LR:MOMENTUM[:plain]",
                        help="outer settings in priority order (Nesterov unless ':plain'), every sub-study")
    parser.add_argument("--split", choices=("contiguous", "iid"), default=None,
                        help="--data.split of every run (default contiguous, see above)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    mode_name = args.mode or "full"
    out = args.out or REPO / "runs" / f"{NAME}_{mode_name}"
    if args.report:
        result = report(args.source or out, out, make_plots=not args.no_plots)
        print(render_markdown(result))
        return result
    overrides = {"steps": args.steps, "split": args.split,
                 "batch_sizes": tuple(args.batch_sizes) if args.batch_sizes is not None else None,
                 "r1_batch_sizes": tuple(args.r1_batch_sizes) if args.r1_batch_sizes is not None else None,
                 "sync_periods": tuple(args.sync_periods) if args.sync_periods else None,
                 "outers": tuple(args.outer) if args.outer else None}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    chosen = args.study or DEFAULT_STUDIES[mode_name]
    studies = {name: dataclasses.replace(scale, **overrides) for name, scale in STUDIES[mode_name].items()
               if name in chosen}
    if not studies:
        raise SystemExit(f"--study: none of {args.study} in {list(STUDIES[mode_name])}")
    seeds = tuple(args.seeds) if args.seeds else DEFAULT_SEEDS[mode_name]
    if args.plan:
        for name, scale in studies.items():
            for spec in plan(scale):
                print(f"{name:<16} {spec.cell:<36} {spec.label():<50} seeds {list(seeds)}")
        return {}
    import jax

    cache = out / "jax_cache"  # identical programs (seeds of one cell) compile once; results unchanged
    cache.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if len(jax.devices()) != NUM_CPU_DEVICES:
        raise SystemExit(f"expected {NUM_CPU_DEVICES} CPU devices, JAX has {len(jax.devices())} "
                         "(run this file as a script, not imported after JAX started)")
    def checkpoint(records):  # JSON and markdown after every run, so a cut study still has them
        write_outputs(build_result(records, studies, seeds, mode_name), out, make_plots=False)

    records = run_studies(studies, seeds, out, log=lambda msg: print(msg, flush=True), on_record=checkpoint)
    result = build_result(records, studies, seeds, mode_name)
    written = write_outputs(result, out, make_plots=not args.no_plots)
    print()
    print(render_markdown(result))
    print(f"total run time {result['total_run_s']:.0f}s; wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
