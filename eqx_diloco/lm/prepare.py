"""`python -m eqx_diloco.prepare TEXT_PATH OUT --tokenizer tokenizer.json`: tokenize a corpus for `--data.source tokens`.

Reads TEXT_PATH, a file or a folder of shards in any of the formats corpora ship in: text
(one document per file), jsonl (one document per line, its `--text-field`; gzipped too) or
parquet (one document per row, with `pyarrow`). Encodes the documents in batches on the
tokenizer's own threads (`--threads`), puts an end-of-text id after each document, and writes
the token folder OUT (see `token_shards`): shards of at most `--shard-mb`, a copy of the
tokenizer, and `tokens.json`, the one metadata file the trainer reads, written last.

Every write goes to a temporary name and is renamed when complete and flushed to disk, so the
trainer never reads a half-written file. After each shard, `prepare-progress.json` records
what was written (with each shard's CRC-32C) and where reading continues: running the same
command again after an interruption keeps the shards that verify and continues from there.
Memory stays bounded by `--chunk-mb` whatever the size of the corpus. Needs `tokenizers`
(`pip install -e '.[prepare]'`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from ._corpus_readers import (FORMATS, Position, PrepareError, batches, check_parquet_schemas, list_inputs,
                              read_ahead, read_pieces)
from ._shard_writer import ShardWriter, fsynced_replace, resume_state, sha256, write_json
from .token_shards import FOLDER_META_NAME, FOLDER_TOKENIZER_NAME, PROGRESS_NAME, TOKEN_FOLDER_FORMAT

__all__ = ["PrepareError", "prepare", "main", "choose_eos", "load_tokenizer"]

# Largest piece of a text file encoded as one string: pieces are what the tokenizer's threads share out. An
# encoding holds ~300 bytes per token until its ids are copied out, so a batch of 1 MB took 70 MB; pieces of
# 8 KB encoded with no more CPU time than 64 KB ones (pieces of 64 KB: 1.1-1.5 s, 8 KB: 1.1-1.2 s per 3 MB).
PIECE_BYTES = 1 << 13
# The end-of-text tokens of common tokenizers (GPT-2 and Qwen, Llama 3, Llama 2 and Mistral, Gemma), in that order.
KNOWN_EOS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


def load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PrepareError("the `tokenizers` package is missing: pip install -e '.[prepare]'") from None
    if not path.is_file():
        raise PrepareError(f"--tokenizer does not exist: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise PrepareError(f"--tokenizer {path} is not a tokenizers JSON file: {str(e).splitlines()[0]}") from None


@dataclasses.dataclass(frozen=True)
class EndOfText:
    """The id put after each document: `token_id` (None: documents are not separated), the token's text
    (None when the id is one appended past the tokenizer's vocabulary) and the rule that chose it."""

    token_id: int | None
    token: str | None
    rule: str


def choose_eos(tokenizer, tokenizer_path: Path, eos: str | None) -> EndOfText:
    """The end-of-text id, by the first rule that gives one:

    1. `--eos TOKEN` (a token of the tokenizer), or `--eos none`: no separator;
    2. `eos_token` of a `tokenizer_config.json` beside the tokenizer (a Hugging Face model folder);
    3. the first of `KNOWN_EOS` the tokenizer has;
    4. otherwise the id one past the tokenizer's vocabulary (the token folder's vocab_size counts it).
    """
    if eos is not None:
        if eos == "none":
            return EndOfText(None, None, "--eos none: documents are not separated")
        token_id = tokenizer.token_to_id(eos)
        if token_id is None:
            raise PrepareError(f"--eos {eos!r} is not a token of {tokenizer_path}")
        return EndOfText(token_id, eos, "--eos")
    config = tokenizer_path.with_name("tokenizer_config.json")
    with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        named = json.loads(config.read_text()).get("eos_token")
        named = named.get("content") if isinstance(named, dict) else named
        if isinstance(named, str) and tokenizer.token_to_id(named) is not None:
            return EndOfText(tokenizer.token_to_id(named), named, f"eos_token of {config.name}")
    for name in KNOWN_EOS:
        if tokenizer.token_to_id(name) is not None:
            return EndOfText(tokenizer.token_to_id(name), name, "the tokenizer's own end-of-text token")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return EndOfText(size, None, "the tokenizer has no end-of-text token: the id one past its vocabulary")


def check_outputs(text_path: Path, out: Path) -> None:
    """Refuse an OUT that is a file, that lies inside TEXT_PATH (the next run would read the tokens as text), or
    that holds TEXT_PATH (writing and resuming there could replace the text), or whose metadata names are folders."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"OUT is a file: {out} (OUT names the folder the token shards go to; an existing token "
                           f"file stays readable as it is)")
    source, target = text_path.resolve(), out.resolve()
    if target == source or source in target.parents:
        raise PrepareError(f"OUT {out} {'is' if target == source else 'is inside'} TEXT_PATH {text_path}: writing "
                           f"there would mix tokens into the text; choose an OUT outside TEXT_PATH")
    if target in source.parents:
        raise PrepareError(f"TEXT_PATH {text_path} is inside OUT {out}: writing there could replace the text; "
                           f"choose an OUT outside TEXT_PATH")
    for name in (FOLDER_META_NAME, PROGRESS_NAME, FOLDER_TOKENIZER_NAME):
        if (out / name).is_dir():
            raise PrepareError(f"OUT/{name} is a folder: {out / name} (prepare writes a file there)")


def prepare(text_path: Path | str, out: Path | str, tokenizer_path: Path | str, *, text_field: str = "text",
            fmt: str = "auto", eos: str | None = None, shard_bytes: int = 256 << 20, chunk_bytes: int = 250_000,
            threads: int | None = None, progress=None) -> dict:
    """Tokenize the corpus at `text_path` into the token folder `out`. Returns its metadata (`tokens.json`), with
    `"resumed_shards"` (shards kept from an interrupted run) and `"already_complete"` added.

    `fmt`: `auto` (by file name), `text`, `jsonl` or `parquet`. `eos`: see `choose_eos`. `shard_bytes`: the
    largest shard. `chunk_bytes`: text encoded per batch. `threads`: the tokenizer's threads (it reads
    RAYON_NUM_THREADS when it first encodes in parallel: in a process that has done so already, the thread
    count is what it was). `progress`: called as `progress(done_bytes, total_bytes, documents, tokens)`.
    """
    text_path, out, tokenizer_path = Path(text_path), Path(out), Path(tokenizer_path)
    if fmt != "auto" and fmt not in FORMATS:
        raise PrepareError(f"--format must be auto, {', '.join(FORMATS)} (got {fmt})")
    inputs = list_inputs(text_path, fmt)
    check_outputs(text_path, out)
    check_parquet_schemas(inputs, text_field)
    if threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    tokenizer = load_tokenizer(tokenizer_path)
    end_of_text = choose_eos(tokenizer, tokenizer_path, eos)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if end_of_text.token_id is not None and end_of_text.token_id >= vocab_size:
        vocab_size = end_of_text.token_id + 1
    dtype_name = "uint16" if vocab_size <= 1 << 16 else "uint32"
    dtype = np.dtype(dtype_name).newbyteorder("<")
    shard_tokens = max(1, shard_bytes // dtype.itemsize)
    piece_bytes = PIECE_BYTES
    try:
        stats = [f.stat() for f, _ in inputs]
    except OSError as e:
        raise PrepareError(f"cannot read {e.filename}: {e.strerror}") from None
    sizes = [s.st_size for s in stats]
    root = text_path if text_path.is_dir() else text_path.parent
    # What the tokens depend on: a resumed run must have read the same bytes the same way.
    fingerprint = {
        "inputs": [[str(f.relative_to(root)), kind, s.st_size, s.st_mtime_ns] for (f, kind), s in zip(inputs, stats)],
        "text_field": text_field,
        "tokenizer_sha256": sha256(tokenizer_path),
        "eos_id": end_of_text.token_id,
        "dtype": dtype_name,
        "shard_tokens": shard_tokens,
        "piece_bytes": piece_bytes,
    }
    if (out / FOLDER_META_NAME).is_file():
        with contextlib.suppress(OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            meta = json.loads((out / FOLDER_META_NAME).read_text())
            if meta.get("prepare") == fingerprint:
                return {**meta, "resumed_shards": len(meta["shards"]), "already_complete": True}
        raise PrepareError(f"OUT {out} holds a finished token folder of other inputs or options: remove it, or "
                           f"choose another OUT")
    shards, start = [], {"position": Position().to_json(), "skip": 0, "documents": 0}
    if (out / PROGRESS_NAME).is_file():
        shards, start = resume_state(out, fingerprint, dtype.itemsize)
    elif out.is_dir() and any(out.iterdir()):
        raise PrepareError(f"OUT {out} is a folder holding other files: give a new or empty folder")
    resumed = len(shards)

    writer = ShardWriter(out, dtype, shard_tokens, fingerprint, shards)
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("*.partial"):  # left by an interrupted run: never renamed into place
            stale.unlink()
        copy = out / FOLDER_TOKENIZER_NAME
        if not copy.is_file() or sha256(copy) != fingerprint["tokenizer_sha256"]:
            shutil.copyfile(tokenizer_path, out / f"{FOLDER_TOKENIZER_NAME}.partial")
            fsynced_replace(out / f"{FOLDER_TOKENIZER_NAME}.partial", copy)
        # The stream from `position` on is the same however it is batched: `skip_left` of its tokens were written.
        position, skip_left = Position.from_json(start["position"]), start["skip"]
        writer.close(start)  # a progress record from the start: a run stopped before its first shard resumes too
        documents = start["documents"]
        num_tokens, total = sum(s["num_tokens"] for s in shards), sum(sizes)
        # Tokens of the document being read (a text file spans pieces): an empty document gets no end-of-text.
        document_tokens = 1 if position.offset > 0 and inputs[position.file][1] == "text" else 0
        pieces = read_pieces(inputs, sizes, position, text_field=text_field, piece_bytes=piece_bytes)
        for batch in read_ahead(batches(pieces, chunk_bytes)):
            try:
                encodings = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
            except TypeError:  # a text with a lone surrogate (JSON allows "\ud800"): not UTF-8, so not encodable
                raise _unencodable(batch, inputs) from None
            parts, ends, count = [], [], 0
            for piece, encoding in zip(batch, encodings):
                ids = encoding.ids
                parts.append(ids)
                count += len(ids)
                document_tokens += len(ids)
                if piece.document_end:
                    if document_tokens:
                        if end_of_text.token_id is not None:
                            parts.append((end_of_text.token_id,))
                            count += 1
                        ends.append(count)
                    document_tokens = 0
            ids = np.fromiter(itertools.chain.from_iterable(parts), dtype, count=count)
            del encodings, parts  # the encodings' memory goes back before the next batch is encoded
            skip = min(skip_left, count)
            skip_left -= skip
            writer.write(ids, position, skip, np.asarray(ends, np.int64), documents)
            num_tokens += count - skip
            documents += sum(1 for e in ends if e > skip)
            position = batch[-1].after
            if progress is not None:
                last = batch[-1].after.file
                progress(sum(sizes[:last]) + batch[-1].done_bytes, total, documents, num_tokens)
        if num_tokens == 0:
            raise PrepareError(f"TEXT_PATH holds no text to tokenize: {text_path}")
        writer.close({"position": position.to_json(), "skip": 0, "documents": documents})
        meta = {
            "format": TOKEN_FOLDER_FORMAT,
            "dtype": dtype_name,
            "vocab_size": vocab_size,
            "num_tokens": num_tokens,
            "num_documents": documents,
            "eos_id": end_of_text.token_id,
            "eos_token": end_of_text.token,
            "eos_rule": end_of_text.rule,
            "tokenizer": FOLDER_TOKENIZER_NAME,
            "tokenizer_source": str(tokenizer_path.absolute()),
            "source": str(text_path.absolute()),
            "shards": [{k: s[k] for k in ("file", "num_tokens", "max_id", "crc32c")} for s in writer.shards],
            "prepare": fingerprint,
        }
        write_json(out / FOLDER_META_NAME, meta)
        (out / PROGRESS_NAME).unlink()
    except PrepareError:
        writer.abandon()
        if not writer.shards:  # nothing worth resuming: leave no folder behind
            _remove_unstarted(out, created)
        raise
    except OSError as e:  # an unwritable or full output folder: one line, not a traceback
        raise PrepareError(f"cannot write OUT: {e.filename or out}: {e.strerror}") from None
    finally:
        writer.abandon()
    return {**meta, "resumed_shards": resumed, "already_complete": False}


def _unencodable(batch: list, inputs: list[tuple[Path, str]]) -> PrepareError:
    """The error naming the first piece of `batch` the tokenizer cannot take (one that is not valid Unicode)."""
    for piece in batch:
        try:
            piece.text.encode("utf-8")
        except UnicodeEncodeError as e:
            file, fmt = inputs[piece.after.file]
            where = f"row {piece.after.offset}" if fmt == "parquet" else f"line {piece.after.line - 1}"
            return PrepareError(f"{file} {where} is not UTF-8: its text holds {e.object[e.start]!r} (a lone surrogate)")
    return PrepareError(f"the tokenizer refused the text of {inputs[batch[0].after.file][0]}")


def _remove_unstarted(out: Path, created: bool) -> None:
    """Remove what a run that completed no shard wrote: the tokenizer's copy, the progress file, and OUT if it made it."""
    with contextlib.suppress(OSError):
        for written in (out / FOLDER_TOKENIZER_NAME, out / PROGRESS_NAME):
            written.unlink(missing_ok=True)
        if created:
            out.rmdir()


class _Progress:
    """A rich progress bar (documents, tokens, MB/s) on a terminal; a plain line every 10% otherwise (stderr)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.next_report = 0.1
        self.bar = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), TaskProgressColumn(),
                                TextColumn("{task.fields[line]}"), TimeRemainingColumn(),
                                console=Console(stderr=True))
            self.task = self.bar.add_task("prepare", total=None, line="")
            self.bar.start()

    def __call__(self, done: int, total: int, documents: int, num_tokens: int) -> None:
        rate = done / 1e6 / max(time.perf_counter() - self.start, 1e-9)
        line = f"{documents:,} documents, {num_tokens:,} tokens, {rate:.1f} MB/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=max(total, 1), line=line)
            return
        fraction = done / max(total, 1)
        if fraction < self.next_report and done < total:
            return
        self.next_report = (int(fraction * 10) + 1) / 10
        print(f"tokenized {done / 1e6:,.1f} / {total / 1e6:,.1f} MB ({fraction:.0%}), {line}", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _default_threads() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m eqx_diloco.prepare`."""
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.prepare",
        description="Tokenize a corpus (text, jsonl or parquet; a file or a folder of shards) with a Hugging Face "
        "tokenizers tokenizer.json into a token folder for --data.source tokens: shards, tokens.json and a copy "
        "of the tokenizer. Run the same command again to continue an interrupted run.",
    )
    parser.add_argument("text_path", type=Path, metavar="TEXT_PATH",
                        help="a text, jsonl or parquet file, or a folder of them")
    parser.add_argument("out", type=Path, metavar="OUT", help="the token folder to write (new, empty, or unfinished)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizers tokenizer.json")
    parser.add_argument("--text-field", default="text", help="the jsonl field or parquet column of the text "
                        "(default: text)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="the input format (default: auto, by file name: .parquet, .jsonl/.ndjson/.json.gz, else text)")
    parser.add_argument("--eos", default=None, help="the token put after each document (default: the tokenizer's "
                        "own end-of-text token; 'none': no separator)")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="largest shard written (default 256 MB)")
    parser.add_argument("--chunk-mb", type=float, default=0.25, help="text encoded per batch (default 0.25 MB)")
    parser.add_argument("--threads", type=int, default=None,
                        help="the tokenizer's encoding threads (default: $RAYON_NUM_THREADS if set, else the CPUs "
                             "this process may use)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Written so that NaN fails too; the upper bound keeps one batch's buffers allocatable.
    if not 0 < args.chunk_mb <= 1024:
        print(f"error: --chunk-mb must be > 0 and <= 1024 (got {args.chunk_mb})", file=sys.stderr)
        return 2
    if not 0.001 <= args.shard_mb <= 1 << 20:
        print(f"error: --shard-mb must be >= 0.001 and <= 1048576 (got {args.shard_mb})", file=sys.stderr)
        return 2
    if args.threads is not None and not 1 <= args.threads <= 1024:
        print(f"error: --threads must be >= 1 and <= 1024 (got {args.threads})", file=sys.stderr)
        return 2
    # Without --threads, a RAYON_NUM_THREADS the user set stands; else every CPU this process may use.
    threads = args.threads or (None if "RAYON_NUM_THREADS" in os.environ else _default_threads())
    progress = _Progress()
    try:
        meta = prepare(args.text_path, args.out, args.tokenizer, text_field=args.text_field, fmt=args.format,
                       eos=args.eos, shard_bytes=int(args.shard_mb * 1e6), chunk_bytes=max(1, int(args.chunk_mb * 1e6)),
                       threads=threads, progress=progress)
    except PrepareError as e:
        progress.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted: the shards written so far are kept in {args.out}; run the same command to continue",
              file=sys.stderr)
        return 130
    progress.close()
    if meta["already_complete"]:
        print(f"{args.out} is complete already: nothing to do")
    elif meta["resumed_shards"]:
        print(f"kept {meta['resumed_shards']} shards of an interrupted run, wrote the rest")
    eos = meta["eos_token"] if meta["eos_token"] is not None else "none" if meta["eos_id"] is None else "appended"
    print(f"wrote {meta['num_tokens']:,} tokens of {meta['num_documents']:,} documents ({meta['dtype']}, vocab_size "
          f"{meta['vocab_size']}, end-of-text {eos} = id {meta['eos_id']}) in {len(meta['shards'])} shards to {args.out}")
    print(f"train on them: python -m eqx_diloco.train --data.source tokens --data.path {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
