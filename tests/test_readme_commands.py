"""The README's commands work when typed in order.

Every `python -m eqx_diloco.{train,launch,plot,export,sample}` command of the code blocks marked
`<!-- cli-runs -->` in README.md runs, in README order, in one fresh folder (the cwd), as written.
Training commands get tiny-model flags appended (the README's flags stay and come first; a flag
given twice takes the last value), so the sequence checks the commands' wiring (run folders that
do not collide, plot/export/sample reading what the training commands wrote), not their numbers.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
MODULES = ("train", "launch", "plot", "export", "sample")
# Small enough to compile and run in seconds on 2 CPU cores; valid with every README flag
# (the default 6 layers: P - 1 = 3 divides them; H = 20 stays, so 8 steps end with the final sync).
TINY = ["--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16", "--train.batch-size", "2",
        "--train.steps", "8", "--train.eval-every", "0", "--train.eval-sequences", "4",
        "--data.max-corpus-bytes", "200000"]
STEPS = 8


def readme_commands(text: str) -> list[list[str]]:
    """The eqx_diloco commands of the marked blocks, in order, as argument lists."""
    blocks = re.findall(r"<!-- cli-runs -->\s*```(?:bash|sh)?\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                args = shlex.split(part, comments=True)
                if args[:2] == ["python", "-m"] and args[2] in {f"eqx_diloco.{m}" for m in MODULES}:
                    commands.append(args)
    return commands


def run_dir(args: list[str]) -> str:
    return args[args.index("--run-dir") + 1] if "--run-dir" in args else "runs/default"


def test_readme_has_its_command_sequence():
    commands = readme_commands(README.read_text())
    modules = {args[2].split(".")[1] for args in commands}
    assert modules == set(MODULES), f"marked README blocks lost a command kind: {sorted(modules)}"
    training = [args for args in commands if args[2] in ("eqx_diloco.train", "eqx_diloco.launch")]
    dirs = [run_dir(args) for args in training]
    assert len(set(dirs)) == len(dirs), f"two README training commands share a run folder: {dirs}"


def _bandwidth_unavailable() -> str | None:
    from eqx_diloco.lm.launch import LinkLimit

    return LinkLimit.check()


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path):
    commands = readme_commands(README.read_text())
    assert commands, "README.md has no marked <!-- cli-runs --> block"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    trained, skipped = [], []
    for args in commands:
        module = args[2].split(".")[1]
        if "--bandwidth" in args:
            reason = _bandwidth_unavailable()
            if reason is not None:  # a rate-limited link needs root and iproute2 (`ip netns`, `tc`)
                assert "--bandwidth needs" in reason, reason
                skipped.append((args, reason))
                continue
        cmd = [sys.executable, *args[1:]] + (TINY if module in ("train", "launch") else [])
        result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{shlex.join(args)} exited {result.returncode}:\n" + (
            result.stdout[-3000:] + result.stderr[-3000:])
        if module in ("train", "launch"):
            trained.append(run_dir(args))
            lines = [json.loads(line) for line in (tmp_path / run_dir(args) / "metrics.jsonl").read_text().splitlines()]
            steps = [line["step"] for line in lines if "loss" in line]
            assert steps and max(steps) == STEPS, f"{shlex.join(args)} did not train {STEPS} steps: {steps}"
        if module == "plot" and "--out" in args:
            assert (tmp_path / args[args.index("--out") + 1]).stat().st_size > 0
        if module == "export" and "--out" not in args:
            assert (tmp_path / args[3] / "model.eqx").exists()
    assert len(trained) >= 2, trained
    for args, reason in skipped:
        print(f"skipped (needs root): {shlex.join(args)}: {reason}")
