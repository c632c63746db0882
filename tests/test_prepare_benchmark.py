"""benchmarks/prepare.py on its smoke setting: the artifact's structure and that its numbers are finite. Numbers
from these settings mean nothing and timings are never asserted."""

import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import prepare as bench  # noqa: E402


def test_perturbed_copies_differ_and_add_up(tmp_path):
    blocks = list(bench.perturbed_copies(20_000_000))
    assert sum(len(b) for b in blocks) == 20_000_000
    text = b"".join(blocks)
    first, second = text[: len(text) // 2], text[len(text) // 2 :]
    assert first != second and all(b.decode() is not None for b in blocks)  # each block is whole UTF-8


@pytest.mark.slow
def test_prepare_benchmark_smoke(tmp_path):
    assert bench.main(["--smoke", "--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "out" / "prepare.json").read_text())
    ways = [(row["way"], row["threads"]) for row in result["summary"]]
    assert ways == [("loop", 1), ("prepare", 1), ("prepare", 2)]
    for row in result["summary"]:
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0 and row["tokens"] > 0
    assert [m["corpus_mb"] for m in result["memory"]] == [2, 4]
    for point in result["memory"]:
        assert point["completed"] and point["max_rss_bytes"] > 0 and point["samples"]
    assert "| prepare | 2 |" in (tmp_path / "out" / "prepare.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("prepare-bench-")]  # the corpora are removed
