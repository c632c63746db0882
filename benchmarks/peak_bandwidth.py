"""Peak bandwidth out of the box: `python -m eqx_diloco.train` with and without `--diloco.num-fragments 4`.

Runs the CLI exactly as a user would, each command as its own process in its own run
dir: the default config (DiLoCo, R = 2, H = 20, the default model: 6 layers, width 128)
and the same with `--diloco.num-fragments 4` (Streaming DiLoCo: fragment 0 holds the
embeddings, final norm and head, fragments 1-3 two layers each, strided). Only
`--run-dir`, `--train.steps` and `--train.seed` are added to each command. From each run's
metrics.jsonl it reads the eval loss of the global model at the last step, and from the
last step's line `sent_bytes` (payload one replica encoded over the run), `wire_bytes`
(what its collectives moved) and `peak_sync_bytes` (the most one replica sends at a single
step: the bandwidth a link needs if a sync must fit in one step).

Note: the per-step lines of metrics.jsonl end at the last step, before the trainer's final
sync (`--train.final-sync`, on by default), so `sent_bytes` / `wire_bytes` here count the
scheduled syncs only; the fragments the final sync ships are named in the run's stdout
(kept as `final_sync_line` and `sent_summary_line` in the JSON).

Modes (`_common.add_mode_flags`):

- `--quick` (default): the default config, 200 steps (the CLI default), seed 0.
- `--full`: the same two commands with seeds 0, 1, 2 (the loss difference then gets a
  paired mean +- sd; the byte columns do not depend on the seed).
- `--smoke`: a tiny model (3 layers, width 16, H = 4, 8 steps, synthetic data), for the
  test suite; numbers are meaningless.

Output in `--out-dir` (default `runs/benchmarks/peak_bandwidth_<mode>`; the committed results
under `benchmarks/results` are written only when `--out-dir benchmarks/results` is given):
`peak_bandwidth.json` (or `--json PATH`) and `peak_bandwidth.md`. Run dirs go to a temporary
folder unless `--keep-runs DIR` is given.

Run `python -m benchmarks.peak_bandwidth --help`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/peak_bandwidth.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common

NAME = "peak_bandwidth"
REPO = pathlib.Path(__file__).resolve().parents[1]

# (name, extra CLI flags): the rows of the table, in order; the first is the reference.
COMMANDS = (
    ("default", []),
    ("fragments4", ["--diloco.num-fragments", "4"]),
)
SMOKE_FLAGS = ["--model.num-layers", "3", "--model.dim", "16", "--model.num-heads", "2", "--train.seq-len", "16",
               "--train.batch-size", "2", "--train.eval-sequences", "4", "--train.warmup-steps", "1",
               "--diloco.sync-period", "4", "--data.source", "synthetic"]
MODES = {  # steps, seeds, flags added to every command
    "quick": (200, (0,), []),
    "full": (200, (0, 1, 2), []),
    "smoke": (8, (0,), SMOKE_FLAGS),
}


def command_for(extra: Sequence[str], mode_flags: Sequence[str], run_dir: pathlib.Path, steps: int,
                seed: int) -> list[str]:
    """The CLI invocation of one run (argv after `python`)."""
    return ["-m", "eqx_diloco.train", *mode_flags, *extra, "--run-dir", str(run_dir), "--train.steps", str(steps),
            "--train.seed", str(seed)]


def display_command(extra: Sequence[str], mode_flags: Sequence[str]) -> str:
    """The command as the table shows it (run dir, steps and seed left out)."""
    return " ".join(["python -m eqx_diloco.train", *mode_flags, *extra])


def read_run(run_dir: pathlib.Path, steps: int) -> dict[str, Any]:
    """Eval loss at `steps` and the byte counters of step `steps` from `<run_dir>/metrics.jsonl`."""
    step_lines, evals = common.read_metrics(run_dir)
    last_eval = [e for e in evals if e["step"] == steps]
    last_step = [s for s in step_lines if s["step"] == steps]
    if not last_eval or not last_step:
        raise RuntimeError(f"{run_dir}/metrics.jsonl: no eval or step line at step {steps}")
    line = last_step[-1]
    return {"eval_loss": last_eval[-1]["eval_loss"], "sent_bytes": line["sent_bytes"],
            "wire_bytes": line.get("wire_bytes"), "peak_sync_bytes": line["peak_sync_bytes"]}


def stdout_lines(text: str) -> dict[str, str | None]:
    """The CLI's own lines about the final sync and the total sent (for the record, not parsed further)."""
    final = re.search(r"final sync of parameter group\(s\) \[[^\]]*\]", text)
    sent = re.search(r"^\s*sent\s+[^\n]*per replica[^\n]*", text, re.MULTILINE)
    return {"final_sync_line": final.group(0).strip() if final else None,
            "sent_summary_line": sent.group(0).strip() if sent else None}


def train_one(name: str, extra: Sequence[str], mode_flags: Sequence[str], work: pathlib.Path, steps: int,
              seed: int, log) -> dict[str, Any]:
    run_dir = work / f"{name}_s{seed}"
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists: give an empty --keep-runs folder (the CLI would resume from it)")
    argv = command_for(extra, mode_flags, run_dir, steps, seed)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    (work / f"{name}_s{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    record = {"name": name, "seed": seed, "command": display_command(extra, mode_flags),
              **read_run(run_dir, steps), **stdout_lines(proc.stdout + proc.stderr), "elapsed_s": elapsed}
    log(f"  {name:<12} seed {seed}: eval {record['eval_loss']:.4f}  sent {common.fmt_bytes(record['sent_bytes'])}  "
        f"peak {common.fmt_bytes(record['peak_sync_bytes'])}  ({elapsed:.0f} s)")
    return record


def machine() -> dict[str, Any]:
    try:
        jax_version = version("jax")
    except PackageNotFoundError:
        jax_version = None
    return {"jax": jax_version, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def build_result(records: Sequence[dict[str, Any]], mode: str, steps: int, seeds: Sequence[int],
                 mode_flags: Sequence[str], command: str) -> dict[str, Any]:
    """Per command: eval loss over seeds, byte counters (checked equal over seeds); the peak
    and loss of every command against the first one's."""
    rows = []
    for name, extra in COMMANDS:
        recs = sorted((r for r in records if r["name"] == name), key=lambda r: r["seed"])
        if not recs:
            continue
        counters = {k: sorted({r[k] for r in recs}, key=lambda v: (v is None, v))
                    for k in ("sent_bytes", "wire_bytes", "peak_sync_bytes")}
        rows.append({"name": name, "command": display_command(extra, mode_flags), "seeds": [r["seed"] for r in recs],
                     "eval_loss": common.mean_sd(r["eval_loss"] for r in recs),
                     **{k: v[0] if len(v) == 1 else v for k, v in counters.items()},
                     "bytes_same_for_every_seed": all(len(v) == 1 for v in counters.values()),
                     "final_sync_line": recs[0]["final_sync_line"],
                     "sent_summary_line": recs[0]["sent_summary_line"]})
    ref = rows[0] if rows else None
    for row in rows:
        if ref is None or row is ref:
            continue
        if isinstance(row["peak_sync_bytes"], int) and isinstance(ref["peak_sync_bytes"], int):
            row["peak_vs_reference"] = row["peak_sync_bytes"] / ref["peak_sync_bytes"]
        by_seed = lambda name: {r["seed"]: r["eval_loss"] for r in records if r["name"] == name}
        row["loss_gap_vs_reference_pct"] = common.paired_gap(by_seed(row["name"]), by_seed(ref["name"]))
    return {"benchmark": NAME, "mode": mode, "command": command, "revision": common.revision(), "steps": steps,
            "seeds": list(seeds), "machine": machine(), "rows": rows,
            "records": sorted(records, key=lambda r: (r["name"], r["seed"])),
            "total_run_s": sum(r["elapsed_s"] for r in records)}


def render_markdown(result: dict[str, Any]) -> str:
    seeds = result["seeds"]
    lines = [
        f"# Peak bandwidth out of the box ({result['mode']})",
        "",
        (f"Generated by `{result['command']}` (`benchmarks/peak_bandwidth.py`) at revision "
         f"`{result['revision'] or 'unknown'}`; {len(seeds)} seed{'s' if len(seeds) > 1 else ''} "
         f"({', '.join(map(str, seeds))}); {result['steps']} steps per run; total run time "
         f"{result['total_run_s'] / 60:.1f} min. Each command ran as its own process in its own run dir (only "
         "`--run-dir`, `--train.steps` and `--train.seed` added). Numbers read from metrics.jsonl: eval loss of "
         f"the global model at step {result['steps']}; bytes per replica from the step-{result['steps']} line, "
         "which is written before the final sync (the fragments it ships are not counted; see the stdout line "
         "below the table)."),
        "",
        f"| command | n | eval loss @{result['steps']} (mean +- sd) | sent_bytes | wire_bytes | peak_sync_bytes |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda v: common.fmt_bytes(v) if not isinstance(v, list) else " / ".join(map(common.fmt_bytes, v))
    for row in result["rows"]:
        peak = fmt(row["peak_sync_bytes"])
        if "peak_vs_reference" in row:
            peak += f" ({row['peak_vs_reference']:.2f}x)"
        lines.append(f"| `{row['command']}` | {row['eval_loss']['n']} | {common.fmt_pm(row['eval_loss'], '.4f')} | "
                     f"{fmt(row['sent_bytes'])} | {fmt(row['wire_bytes'])} | {peak} |")
    lines.append("")
    for row in result["rows"]:
        gap = row.get("loss_gap_vs_reference_pct")
        if gap is None:
            continue
        if gap["n"] >= 2:
            lines.append(f"Eval loss of `{row['command']}` against the first row, paired by seed: "
                         f"{common.fmt_pm(gap, '+.2f', '%')} (n = {gap['n']}, 95% interval +-{gap['ci95']:.2f}%).")
        else:
            lines.append(f"Eval loss of `{row['command']}` against the first row: {gap['mean']:+.2f}% with one seed: "
                         "no noise estimate, not a claim that either is better.")
    lines.append("")
    for row in result["rows"]:
        lines.append(f"- `{row['command']}`: {row['final_sync_line'] or 'no final sync needed'}; "
                     f"stdout: `{row['sent_summary_line'] or '-'}`")
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: quick 0; full 0 1 2)")
    parser.add_argument("--steps", type=int, default=None, help="override the mode's step count")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="output folder (default runs/benchmarks/peak_bandwidth_<mode>; committed results under "
                             "benchmarks/results only when given explicitly)")
    parser.add_argument("--json", type=pathlib.Path, default=None,
                        help="JSON output (default <out-dir>/peak_bandwidth.json)")
    parser.add_argument("--keep-runs", type=pathlib.Path, default=None,
                        help="keep the run dirs and their stdout logs here instead of a temporary folder")
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    steps, seeds, mode_flags = MODES[mode]
    steps = args.steps or steps
    seeds = tuple(args.seeds) if args.seeds else seeds
    out_dir = args.out_dir or common.default_out_dir(NAME, mode)
    json_path = args.json or out_dir / f"{NAME}.json"
    command = " ".join(["python -m benchmarks.peak_bandwidth", f"--{mode}"]
                       + (["--seeds", *map(str, seeds)] if args.seeds else [])
                       + (["--steps", str(steps)] if args.steps else []))
    log = lambda msg: print(msg, flush=True)
    log(f"{NAME} ({mode}): {len(COMMANDS)} commands x seeds {list(seeds)}, {steps} steps each")
    records = []
    with common.TemporaryRunDirs(args.keep_runs) as work:
        for seed in seeds:
            for name, extra in COMMANDS:
                records.append(train_one(name, extra, mode_flags, work, steps, seed, log))
    result = build_result(records, mode, steps, seeds, mode_flags, command)
    text = render_markdown(result)
    written = [common.write_json(json_path, result), common.write_text(out_dir / f"{NAME}.md", text)]
    print()
    print(text)
    print(f"wrote {', '.join(map(str, written))}")
    return result


if __name__ == "__main__":
    main()
