"""`python -m eqx_diloco.prepare TEXT_PATH OUT --tokenizer tokenizer.json`: tokenize text for `--data.source tokens`.

Reads TEXT_PATH (a UTF-8 file, or every file of a folder in sorted order) in chunks of
whole lines, encodes each chunk with a Hugging Face `tokenizers` tokenizer (a
`tokenizer.json`, loaded from disk: nothing is downloaded), and writes

- `OUT`: the token ids as a flat little-endian array, uint16 when every id fits in 16 bits
  (vocabulary <= 65,536) and uint32 otherwise;
- `OUT.json`: `{"format", "dtype", "vocab_size", "num_tokens", "tokenizer", "source"}`,
  read by the trainer for the dtype and the vocabulary size;
- `OUT.scan.json`: the largest id, so that the trainer's first start need not scan OUT for it.

Memory stays bounded by the chunk size whatever the size of the text. The output is
written under a temporary name and renamed when complete, so an interrupted run never
leaves a partial file that looks finished. Needs `tokenizers` (`pip install -e '.[prepare]'`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from .data import TOKENS_FORMAT, token_meta_path, write_scan_cache


class PrepareError(ValueError):
    """A one-line, user-facing reason why the text cannot be prepared."""


def text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise PrepareError(f"TEXT_PATH does not exist: {path}")
    if not (path.is_file() or path.is_dir()):  # /dev/zero never ends, a FIFO without a writer blocks for ever
        raise PrepareError(f"TEXT_PATH must be a regular file or a folder (not a device, FIFO or socket): {path}")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise PrepareError(f"TEXT_PATH holds no files: {path}")
    return files


def chunks(file: Path, chunk_bytes: int) -> Iterator[tuple[str, int]]:
    """(text, its size in bytes) pieces of `file` of about `chunk_bytes`, cut after a newline, else after a
    space (a word is never split unless a line has no space for 4 chunks), never inside a UTF-8 character."""
    with file.open("rb") as f:
        carry = b""
        while block := f.read(chunk_bytes):
            data = carry + block
            cut = data.rfind(b"\n") + 1 or data.rfind(b" ") + 1
            if cut == 0:
                if len(data) < 4 * chunk_bytes:  # read on for a place to cut (bounded)
                    carry = data
                    continue
                cut = len(data) - 1  # before the last character, which may be incomplete
                while cut > 0 and data[cut] & 0xC0 == 0x80:  # a continuation byte: back to its lead byte
                    cut -= 1
                cut = cut or len(data)
            carry = data[cut:]
            yield data[:cut].decode("utf-8", errors="replace"), cut
        if carry:
            yield carry.decode("utf-8", errors="replace"), len(carry)


def check_outputs(text_path: Path, out: Path) -> None:
    """Refuse an OUT whose files (OUT, OUT.json, OUT.partial) would overwrite TEXT_PATH or land inside it: the
    output is renamed over OUT at the end, so `prepare corpus.txt corpus.txt` would replace the text by its ids,
    and tokens written into a TEXT_PATH folder would be read as text by the next run."""
    if out.is_dir():
        raise PrepareError(f"OUT is a folder: {out} (name the token file, e.g. {out / 'tokens.bin'})")
    source = text_path.resolve()
    for name, target in (("OUT", out), ("OUT.json", token_meta_path(out)), ("OUT.partial", _partial(out))):
        resolved = target.resolve()
        same = resolved == source or (target.exists() and text_path.is_file() and os.path.samefile(target, text_path))
        if same or source in resolved.parents:
            raise PrepareError(f"{name} {target} {'is' if same else 'is inside'} TEXT_PATH {text_path}: writing it "
                               f"would {'destroy the text' if same else 'mix tokens into the text'}; "
                               f"choose an OUT outside TEXT_PATH")


def _partial(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


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


def prepare(text_path: Path | str, out: Path | str, tokenizer_path: Path | str, *, chunk_bytes: int = 1 << 20,
            eos: str | None = None, progress=None) -> dict:
    """Tokenize `text_path` into `out` and `out.json`. Returns the metadata written.

    `eos`: a token (e.g. `<|endoftext|>`) appended after each file's text. `progress`: called as
    `progress(bytes_read, total_bytes, num_tokens)` after each chunk.
    """
    text_path, out, tokenizer_path = Path(text_path), Path(out), Path(tokenizer_path)
    files = text_files(text_path)
    check_outputs(text_path, out)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype_name = "uint16" if vocab_size <= 1 << 16 else "uint32"
    dtype = np.dtype(dtype_name).newbyteorder("<")
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise PrepareError(f"--eos {eos!r} is not a token of {tokenizer_path}")
    total = sum(f.stat().st_size for f in files)
    partial = _partial(out)
    num_tokens, done, largest = 0, 0, 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with partial.open("wb") as sink:
            for file in files:
                for text, nbytes in chunks(file, chunk_bytes):
                    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=dtype)
                    ids.tofile(sink)
                    num_tokens += len(ids)
                    largest = max(largest, int(ids.max(initial=0)))
                    done += nbytes
                    if progress is not None:
                        progress(done, total, num_tokens)
                if eos_id is not None:
                    np.asarray([eos_id], dtype=dtype).tofile(sink)
                    num_tokens += 1
                    largest = max(largest, eos_id)
        if num_tokens == 0:
            raise PrepareError(f"TEXT_PATH holds no text to tokenize: {text_path}")
        os.replace(partial, out)
        meta = {
            "format": TOKENS_FORMAT,
            "dtype": dtype_name,
            "vocab_size": vocab_size,
            "num_tokens": num_tokens,
            "tokenizer": str(tokenizer_path.absolute()),
            "source": str(text_path.absolute()),
        }
        token_meta_path(out).write_text(json.dumps(meta, indent=2) + "\n")
    except OSError as e:  # an unwritable or full output folder: one line, not a traceback
        raise PrepareError(f"cannot write OUT: {e.filename or out}: {e.strerror}") from None
    finally:
        with contextlib.suppress(OSError):  # e.g. OUT's folder could not be made: there is nothing to remove
            partial.unlink(missing_ok=True)
    # The largest id is known here: the trainer's first start need not scan the file for it.
    write_scan_cache(out, dtype_name, largest)
    return meta


class _Progress:
    """One status line, rewritten in place on a terminal, every 10% otherwise (stderr)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.next_report = 0.1

    def __call__(self, done: int, total: int, num_tokens: int) -> None:
        fraction = done / max(total, 1)
        if not self.tty and fraction < self.next_report and done < total:
            return
        self.next_report = (int(fraction * 10) + 1) / 10
        rate = done / 1e6 / max(time.perf_counter() - self.start, 1e-9)
        line = f"tokenized {done / 1e6:,.1f} / {total / 1e6:,.1f} MB ({fraction:.0%}), {num_tokens:,} tokens, {rate:.1f} MB/s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eqx_diloco.prepare",
        description="Tokenize a text file (or a folder of text files) with a Hugging Face tokenizers "
        "tokenizer.json into a flat token file for --data.source tokens, plus OUT.json (dtype, vocab_size).",
    )
    parser.add_argument("text_path", type=Path, metavar="TEXT_PATH", help="a UTF-8 text file or a folder of them")
    parser.add_argument("out", type=Path, metavar="OUT", help="output token file; its metadata goes to OUT.json")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizers tokenizer.json")
    parser.add_argument("--eos", default=None, help="a token appended after each file (e.g. '<|endoftext|>')")
    parser.add_argument("--chunk-mb", type=float, default=1.0, help="text read and encoded per piece (default 1 MB)")
    args = parser.parse_args(argv)
    # Written so that NaN fails too; the upper bound keeps one read's buffer allocatable.
    if not 0 < args.chunk_mb <= 1024:
        print(f"error: --chunk-mb must be > 0 and <= 1024 (got {args.chunk_mb})", file=sys.stderr)
        return 2
    progress = _Progress()
    try:
        meta = prepare(args.text_path, args.out, args.tokenizer, chunk_bytes=max(1, int(args.chunk_mb * 1e6)),
                       eos=args.eos, progress=progress)
    except PrepareError as e:
        progress.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        progress.close()
        print("interrupted (no output written)", file=sys.stderr)
        return 130
    progress.close()
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, vocab_size {meta['vocab_size']}) to {args.out} "
          f"and {token_meta_path(args.out)}")
    print(f"train on them: python -m eqx_diloco.train --data.source tokens --data.path {args.out} "
          f"--model.vocab-size {meta['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
