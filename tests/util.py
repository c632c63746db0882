import json
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
