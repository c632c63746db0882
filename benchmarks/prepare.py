"""`python -m eqx_diloco.prepare` against a plain loop, and its memory at several corpus sizes.

Everything is made here: a byte-level BPE tokenizer (vocabulary 8,192) trained with
`tokenizers` on the Python standard library's source, and corpora of that source repeated with
a per-copy perturbation (in each copy, one 64 KB block in four has its lowercase letters
rotated, so the copies are not byte-identical), up to 2 GB. Nothing is downloaded.

1. Rate. The same text file, three ways, each in a fresh process, alternating, `--repeats`
   times: a plain loop (`for line in file: tokenizer.encode(line)`, the ids written to a file),
   and `prepare` with `--threads 1` and `--threads 2`. Reported: tokens/s (each way's own token
   count: a loop over lines makes more tokens, because BPE merges a newline with the next line's
   indentation only when it sees both), MB/s of text, and the ratios to the loop.
2. Memory. `prepare --threads 2` on folders of 64 MB jsonl shards (documents of 2-6 KB) of
   growing size: the peak resident memory of its process (VmHWM), which should not grow
   with the corpus, and its resident memory sampled every second against the bytes it has read
   (`/proc/PID/io` rchar). A point that outlasts its time box is stopped with SIGINT (prepare
   keeps its shards) and reported as stopped, with the bytes it had read.

The machine may be shared: the load average before and after each run is recorded beside it.

    python -m benchmarks.prepare                       # 8 MB for the rate; 32 MB, 128 MB for memory
    python -m benchmarks.prepare --full                # 8 MB for the rate; 128 MB and 2 GB for memory
    python -m benchmarks.prepare --smoke               # seconds (tests)

Results: `--out-dir` (default runs/benchmarks/prepare_<mode>), prepare.json and prepare.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import _common as common

MODES = {  # (MB of text for the rate, MB of text per memory point, repeats, time box of a memory point in s)
    "smoke": (1, (2, 4), 1, 600),
    "quick": (8, (32, 128), 2, 600),
    "full": (8, (128, 2048), 3, 2700),
}
SHARD_BYTES = 64 << 20
BLOCK = 1 << 16


def train_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from eqx_diloco.lm.data import corpus_bytes

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([corpus_bytes(3_000_000).decode("utf-8", errors="replace")], trainer=trainer)
    tok.save(str(path))


def perturbed_copies(total: int):
    """Blocks of text adding up to `total` bytes: the stdlib's source, copy after copy, each copy with a
    different quarter of its 64 KB blocks letter-rotated (cut at newlines, so every block is valid UTF-8)."""
    from eqx_diloco.lm.data import corpus_bytes

    base = corpus_bytes(8_000_000).decode("utf-8", errors="replace").encode()
    blocks, start = [], 0
    while start < len(base):
        end = base.rfind(b"\n", start, start + BLOCK) + 1 or min(len(base), start + BLOCK)
        blocks.append(base[start:end])
        start = end
    lower = bytes(range(ord("a"), ord("z") + 1))
    done, copy = 0, 0
    while done < total:
        shift = copy % 25 + 1
        table = bytes.maketrans(lower, lower[shift:] + lower[:shift])
        for i, block in enumerate(blocks):
            block = block.translate(table) if (i + copy) % 4 == 0 else block
            block = block[: total - done]
            yield block
            done += len(block)
            if done >= total:
                return
        copy += 1


def write_text_corpus(path: Path, total: int) -> None:
    with path.open("wb") as f:
        for block in perturbed_copies(total):
            f.write(block)


def write_jsonl_corpus(folder: Path, total: int) -> None:
    """Shards of SHARD_BYTES of text as jsonl documents of 2-6 KB, cut at newlines."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shard, written, f = 0, 0, None
    for block in perturbed_copies(total):
        text = block.decode()
        start = 0
        while start < len(text):
            end = text.find("\n", start + int(rng.integers(2000, 6000))) + 1 or len(text)
            if f is None or written >= SHARD_BYTES:
                if f is not None:
                    f.close()
                f = (folder / f"shard-{shard:05d}.jsonl").open("w")
                shard, written = shard + 1, 0
            line = json.dumps({"text": text[start:end], "id": f"{shard}-{start}"}) + "\n"
            f.write(line)
            written += end - start
            start = end
    f.close()


def child(mode: str, source: str, tokenizer: str, out: str, threads: int) -> None:
    """Run one way in this process and print {"tokens", "seconds", "cpu_seconds", "max_rss_bytes"} as JSON (the
    seconds of the work alone: the imports are not counted; CPU seconds are those of all the process's threads)."""
    if mode == "loop":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer)
        tokens = 0
        start, start_cpu = time.perf_counter(), time.process_time()
        with open(source, encoding="utf-8") as text, open(out, "wb") as sink:
            for line in text:
                ids = tok.encode(line, add_special_tokens=False).ids
                np.asarray(ids, np.uint16).tofile(sink)
                tokens += len(ids)
        seconds = time.perf_counter() - start
    else:
        from eqx_diloco.lm.prepare import prepare

        start, start_cpu = time.perf_counter(), time.process_time()
        meta = prepare(source, out, tokenizer, threads=threads)
        seconds = time.perf_counter() - start
        tokens = meta["num_tokens"]
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over an exec, so a child would report its parent's peak.
    me = os.getpid()
    print(json.dumps({"tokens": tokens, "seconds": seconds, "cpu_seconds": time.process_time() - start_cpu,
                      "max_rss_bytes": _proc_value(me, "status", "VmHWM"),
                      "final": {"seconds": seconds, "rss_bytes": _proc_value(me, "status", "VmRSS"),
                                "peak_rss_bytes": _proc_value(me, "status", "VmHWM"),
                                "read_bytes": _proc_value(me, "io", "rchar")}}))


def run_child(mode: str, source: Path, tokenizer: Path, out: Path, threads: int = 1) -> dict:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    before = os.getloadavg()
    result = subprocess.run([sys.executable, "-m", "benchmarks.prepare", "--child", mode, str(source), str(tokenizer),
                             str(out), str(threads)], capture_output=True, text=True, check=True, cwd=common.REPO)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    del record["final"]
    record.update(mode=mode, threads=threads, load_before=list(before), load_after=list(os.getloadavg()))
    return record


def _proc_value(pid: int, name: str, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * (1024 if name == "status" else 1)
    except (OSError, ValueError):
        return None
    return None


def sampled_child(source: Path, tokenizer: Path, out: Path, time_box_s: float) -> dict:
    """`prepare --threads 2` in a child, its resident memory and bytes read sampled every second, stopped with SIGINT
    after `time_box_s`."""
    if out.exists():
        shutil.rmtree(out)
    before = os.getloadavg()
    child_process = subprocess.Popen([sys.executable, "-m", "benchmarks.prepare", "--child", "prepare", str(source),
                                      str(tokenizer), str(out), "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=common.REPO)
    start, samples, stopped = time.perf_counter(), [], False
    while child_process.poll() is None:
        time.sleep(1)
        elapsed = time.perf_counter() - start
        rss, peak = _proc_value(child_process.pid, "status", "VmRSS"), _proc_value(child_process.pid, "status", "VmHWM")
        read = _proc_value(child_process.pid, "io", "rchar")
        if rss is not None and read is not None:
            samples.append({"seconds": round(elapsed, 1), "rss_bytes": rss, "peak_rss_bytes": peak, "read_bytes": read})
        if elapsed > time_box_s and not stopped:
            child_process.send_signal(signal.SIGINT)
            stopped = True
    stdout, stderr = child_process.communicate()
    record = {"completed": not stopped, "samples": samples, "load_before": list(before),
              "load_after": list(os.getloadavg()), "seconds": time.perf_counter() - start}
    if not stopped:
        if child_process.returncode != 0:
            raise RuntimeError(f"prepare failed: {stderr[-2000:]}")
        record.update(json.loads(stdout.strip().splitlines()[-1]))
        samples.append(record.pop("final"))  # a short run may end before the first sample
    else:
        record.update(max_rss_bytes=max(s["peak_rss_bytes"] for s in samples), tokens=None)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_mode_flags(parser)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="where corpora are written (default: a temp dir)")
    parser.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        mode, source, tokenizer, out, threads = args.child
        child(mode, source, tokenizer, out, int(threads))
        return 0
    mode = args.mode or "quick"
    rate_mb, memory_mb, repeats, time_box_s = MODES[mode]
    out_dir = args.out_dir or common.default_out_dir("prepare", mode)
    revision = common.revision()  # the code that runs, read before the runs (they take minutes)
    work = Path(tempfile.mkdtemp(prefix="prepare-bench-", dir=args.work_dir))
    try:
        tokenizer = work / "tokenizer.json"
        train_tokenizer(tokenizer)
        text = work / "rate.txt"
        write_text_corpus(text, rate_mb * 1_000_000)
        size = text.stat().st_size
        runs = []
        for repeat in range(repeats):
            for way, threads in (("loop", 1), ("prepare", 1), ("prepare", 2)):
                record = run_child(way, text, tokenizer, work / f"out-{way}-{threads}", threads)
                record.update(repeat=repeat, text_bytes=size)
                runs.append(record)
                print(f"{way} threads={threads}: {record['tokens'] / record['seconds']:,.0f} tokens/s, "
                      f"{size / 1e6 / record['seconds']:.2f} MB/s (load {record['load_before'][0]:.1f})", flush=True)
        memory = []
        for mb in memory_mb:
            folder = work / f"jsonl-{mb}"
            write_jsonl_corpus(folder, mb * 1_000_000)
            corpus = sum(p.stat().st_size for p in folder.iterdir())
            record = sampled_child(folder, tokenizer, work / "out-memory", time_box_s)
            record.update(corpus_mb=mb, jsonl_bytes=corpus, read_bytes=max(s["read_bytes"] for s in record["samples"]))
            memory.append(record)
            print(f"memory at {mb} MB of text ({corpus / 1e6:,.0f} MB of jsonl): peak RSS "
                  f"{record['max_rss_bytes'] / 1e6:.0f} MB, {record['seconds']:.0f} s"
                  f"{'' if record['completed'] else ' (stopped by its time box)'}", flush=True)
            shutil.rmtree(folder)
            shutil.rmtree(work / "out-memory")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(runs)
    result = {"benchmark": "prepare", "mode": mode, "revision": revision, "machine": machine(),
              "rate_text_bytes": size, "summary": summary, "runs": runs, "memory": memory}
    common.write_json(out_dir / "prepare.json", result)
    common.write_text(out_dir / "prepare.md", markdown(result))
    print(f"wrote {out_dir / 'prepare.json'} and {out_dir / 'prepare.md'}")
    return 0


def machine() -> dict:
    from importlib.metadata import version

    return {"cpus": len(os.sched_getaffinity(0)), "platform": "-".join(os.uname()[i] for i in (0, 2, 4)),
            "python": sys.version.split()[0], "tokenizers": version("tokenizers"),
            "load_average_at_end": list(os.getloadavg())}


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    loop = [r["tokens"] / r["seconds"] for r in runs if r["mode"] == "loop"]
    loop_mb = [r["text_bytes"] / r["seconds"] for r in runs if r["mode"] == "loop"]
    for way, threads in (("loop", 1), ("prepare", 1), ("prepare", 2)):
        mine = [r for r in runs if r["mode"] == way and r["threads"] == threads]
        rate = [r["tokens"] / r["seconds"] for r in mine]
        mbs = [r["text_bytes"] / r["seconds"] for r in mine]
        # Paired by repeat: each prepare run against the loop run just before it.
        ratio = [a / b for a, b in zip(rate, loop)]
        ratio_mb = [a / b for a, b in zip(mbs, loop_mb)]
        per_cpu = [r["tokens"] / r["cpu_seconds"] for r in mine]
        loop_per_cpu = [r["tokens"] / r["cpu_seconds"] for r in runs if r["mode"] == "loop"]
        rows.append({"way": way, "threads": threads, "tokens": mine[0]["tokens"],
                     "tokens_per_cpu_s": statistics.mean(per_cpu),
                     "ratio_tokens_per_cpu_s": statistics.mean(a / b for a, b in zip(per_cpu, loop_per_cpu)),
                     "tokens_per_s": statistics.mean(rate), "tokens_per_s_sd": _sd(rate),
                     "mb_per_s": statistics.mean(mbs) / 1e6, "ratio_tokens_per_s": statistics.mean(ratio),
                     "ratio_tokens_per_s_range": [min(ratio), max(ratio)], "ratio_mb_per_s": statistics.mean(ratio_mb),
                     "cpu_seconds": statistics.mean(r["cpu_seconds"] for r in mine),
                     "seconds": statistics.mean(r["seconds"] for r in mine),
                     "load_before": statistics.mean(r["load_before"][0] for r in mine)})
    return rows


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def markdown(result: dict) -> str:
    rate = common.markdown_table(result["summary"], [
        ("way", "way", None), ("threads", "threads", None), ("tokens", "tokens", lambda v: f"{v:,}"),
        ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"), ("sd", "tokens_per_s_sd", lambda v: f"{v:,.0f}"),
        ("MB/s of text", "mb_per_s", lambda v: f"{v:.2f}"),
        ("tokens/s vs loop", "ratio_tokens_per_s", lambda v: f"{v:.2f}x"),
        ("range", "ratio_tokens_per_s_range", lambda v: f"{v[0]:.2f}-{v[1]:.2f}"),
        ("MB/s vs loop", "ratio_mb_per_s", lambda v: f"{v:.2f}x"),
        ("wall s", "seconds", lambda v: f"{v:.1f}"), ("CPU s", "cpu_seconds", lambda v: f"{v:.1f}"),
        ("tokens per CPU s vs loop", "ratio_tokens_per_cpu_s", lambda v: f"{v:.2f}x"),
        ("1-min load before", "load_before", lambda v: f"{v:.1f}"),
    ])
    rows = []
    for r in result["memory"]:
        # Resident memory when a quarter, half, three quarters and all of what was read had been read.
        marks = []
        for fraction in (0.25, 0.5, 0.75, 1.0):
            sample = next(x for x in r["samples"] if x["read_bytes"] >= fraction * r["read_bytes"])
            marks.append(f"{sample['rss_bytes'] / 1e6:.0f}")
        rows.append({**r, "read_mb_per_s": r["read_bytes"] / 1e6 / r["seconds"], "marks": " / ".join(marks),
                     "state": "complete" if r["completed"] else f"stopped at {r['read_bytes'] / 1e9:.2f} GB read",
                     "load": f"{r['load_before'][0]:.1f} / {r['load_after'][0]:.1f}"})
    memory = common.markdown_table(rows, [
        ("text", "corpus_mb", lambda v: f"{v:,} MB"), ("jsonl on disk", "jsonl_bytes", common.fmt_bytes),
        ("run", "state", None), ("tokens", "tokens", lambda v: f"{v:,}"),
        ("peak RSS", "max_rss_bytes", common.fmt_bytes),
        ("RSS (MB) at 1/4, 1/2, 3/4, all read", "marks", None),
        ("wall s", "seconds", lambda v: f"{v:.0f}"), ("MB/s read", "read_mb_per_s", lambda v: f"{v:.2f}"),
        ("1-min load before / after", "load", None),
    ])
    m = result["machine"]
    return "\n".join([
        f"# prepare ({result['mode']})", "",
        f"Rate on {result['rate_text_bytes'] / 1e6:.0f} MB of text, each way in a fresh process, "
        f"{len(result['runs']) // 3} alternating repeats:", "", rate, "",
        "Peak resident memory of `prepare --threads 2` on folders of 64 MB jsonl shards:", "", memory, "",
        f"{m['cpus']} CPUs, {m['platform']}, Python {m['python']}, tokenizers {m['tokenizers']}; revision "
        f"{result['revision']}; load average at the end {[round(x, 2) for x in m['load_average_at_end']]} "
        f"(a shared machine: the load beside each run is the other work running then).", "",
    ])


if __name__ == "__main__":
    sys.exit(main())
