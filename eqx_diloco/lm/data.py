"""Token streams: the embedded corpus, text files, token files and a synthetic pattern.

Each replica samples windows from its own contiguous, disjoint share of the training
tokens. The batch of step t is a pure function of (seed, replica, t), so a resumed run
sees exactly the batches an uninterrupted run would have seen, with no data position to
save beyond the step. The last `eval_fraction` of the tokens is held out for evaluation.
"""

import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from .config import ConfigError, DataConfig


def corpus_bytes(max_bytes: int) -> bytes:
    """The Python standard library's own `.py` sources (sorted, concatenated), up to `max_bytes`.

    Every Python installation ships them, so nothing is downloaded.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def _text_bytes(path: Path) -> bytes:
    """The bytes of a regular file, or of every regular file under a folder (sorted by path).

    Devices, FIFOs and sockets are refused (`/dev/zero` never ends, a FIFO blocks), and each
    file is read up to the size it had when listed, so a growing file cannot make the read unbounded.
    """
    if not (path.is_file() or path.is_dir()):
        raise ConfigError(f"--data.path must be a regular file or a folder (not a device, FIFO or socket): {path}")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    try:
        sizes = [p.stat().st_size for p in files]
        # The bytes plus their uint16 copy must fit in memory.
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if 3 * sum(sizes) > available:
            raise ConfigError(
                f"--data.path holds {sum(sizes) / 2**30:.1f} GiB of text, too much for this machine's "
                f"{available / 2**30:.1f} GiB of memory: use a token file (--data.source tokens)"
            )
        chunks = []
        for p, size in zip(files, sizes):
            with p.open("rb") as f:
                chunks.append(f.read(size))
        return b"".join(chunks)
    except OSError as e:
        raise ConfigError(f"--data.path is not readable: {e.filename}: {e.strerror}") from None


def synthetic_tokens(num_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """A learnable stream: each token usually follows a fixed random successor table."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab_size)
    tokens = np.empty(num_tokens, np.uint16)
    tokens[0] = 0
    noise = rng.random(num_tokens) < 0.1
    random_tokens = rng.integers(0, vocab_size, num_tokens)
    for i in range(1, num_tokens):
        tokens[i] = random_tokens[i] if noise[i] else successor[tokens[i - 1]]
    return tokens


TOKENS_FORMAT = "eqx_diloco.tokens/1"
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def token_meta_path(path: Path | str) -> Path:
    """The metadata JSON beside a token file: `<file>.json`."""
    return Path(f"{path}.json")


def read_token_meta(path: Path) -> dict:
    """The metadata of token file `path` ({"dtype": "uint16" | "uint32", "vocab_size": int, ...}).

    A file without `<file>.json` is read as uint16 with an unknown vocabulary (then every id is
    checked against `--model.vocab-size`).
    """
    meta_path = token_meta_path(path)
    if not meta_path.is_file():
        return {"dtype": "uint16", "vocab_size": None}
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data.path's metadata {meta_path} is not readable JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES:
        raise ConfigError(f"--data.path's metadata {meta_path} must give \"dtype\": \"uint16\" or \"uint32\"")
    vocab = meta.get("vocab_size")
    if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
        raise ConfigError(f"--data.path's metadata {meta_path} has an invalid vocab_size: {vocab!r}")
    return meta


def open_tokens(path: Path, vocab_size: int) -> np.ndarray:
    """Token file `path` as a read-only `np.memmap` (never read into memory as a whole).

    Its dtype and vocabulary size come from `<path>.json` (written by `python -m
    eqx_diloco.prepare`); without it the file is uint16 ids and every id is checked against
    `vocab_size` in a streaming pass.
    """
    meta = read_token_meta(path)
    dtype = np.dtype(TOKEN_DTYPES[meta["dtype"]])
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ConfigError(f"--data.path is not readable: {path}: {e.strerror}") from None
    if size == 0:
        raise ConfigError(f"--data.path holds no tokens: {path}")
    if size % dtype.itemsize:
        raise ConfigError(
            f"--data.path is {size} bytes, not a whole number of {meta['dtype']} token ids "
            f"({dtype.itemsize} bytes each): {path} is truncated or not a {meta['dtype']} token file"
        )
    file_vocab = meta.get("vocab_size")
    if file_vocab is not None and file_vocab > vocab_size:
        raise ConfigError(
            f"--model.vocab-size is {vocab_size} but {token_meta_path(path).name} gives vocab_size {file_vocab}: "
            f"pass --model.vocab-size {file_vocab}"
        )
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise ConfigError(f"--data.path is not readable: {path}: {e.strerror}") from None
    if file_vocab is None:
        # No metadata: check every id, streaming through the map chunk by chunk (no copy of the file).
        chunk = 1 << 24
        largest = max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
        if largest >= vocab_size:
            raise ConfigError(
                f"--model.vocab-size must exceed every token id in --data.path (found id {largest})"
            )
    return tokens


def load_tokens(config: DataConfig, vocab_size: int, seed: int) -> np.ndarray:
    """All tokens of the configured source as a flat array: uint16 in memory for `corpus`, `text` and
    `synthetic`; for `tokens`, a read-only memory map of the file (see `open_tokens`)."""
    if config.source == "corpus":
        tokens = np.frombuffer(corpus_bytes(config.max_corpus_bytes), np.uint8).astype(np.uint16)
    elif config.source == "text":
        if config.path is None or not config.path.exists():
            raise ConfigError(f"--data.path does not exist: {config.path}")
        tokens = np.frombuffer(_text_bytes(config.path), np.uint8).astype(np.uint16)
        if tokens.size == 0:
            raise ConfigError(f"--data.path holds no text: {config.path}")
    elif config.source == "tokens":
        if config.path is None or not config.path.is_file():
            raise ConfigError(f"--data.path must be a file of uint16 or uint32 token ids: {config.path}")
        return open_tokens(config.path, vocab_size)
    elif config.source == "synthetic":
        tokens = synthetic_tokens(200_000, vocab_size, seed)
    else:
        raise ConfigError(f"--data.source must be one of corpus, text, tokens, synthetic (got {config.source})")
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ConfigError(
            f"--model.vocab-size must exceed every token id in --data.path (found id {int(tokens.max())})"
        )
    return tokens


class TokenBatches:
    """Per-replica training batches and a fixed held-out evaluation batch.

    **Arguments:**

    - `tokens`: all tokens (uint16).
    - `num_replicas`: R; with `split="contiguous"` replica r reads only the r-th contiguous
      share of the train split.
    - `batch_size`: sequences per replica per step.
    - `seq_len`: tokens per sequence (windows hold seq_len + 1 tokens).
    - `eval_fraction`: share of tokens held out (from the end) for evaluation.
    - `seed`: seed of the window positions.
    - `split`: `"contiguous"` (replica r samples windows inside its own r-th share of the
      train split: islands with their own data) or `"iid"` (every replica samples windows
      from the whole train split, each with its own random stream).
    - `islands`: with elastic islands, the island each replica is (default: replica r is
      island r). An island keeps its own data share and random stream whichever islands are
      live; the train split is cut into `num_islands` shares.
    - `num_islands`: the run's full island count (default: `num_replicas`).
    """

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        num_replicas: int,
        batch_size: int,
        seq_len: int,
        eval_fraction: float,
        seed: int,
        split: str = "contiguous",
        islands: tuple[int, ...] | None = None,
        num_islands: int | None = None,
    ):
        if split not in ("contiguous", "iid"):
            raise ConfigError(f"--data.split must be contiguous or iid (got {split})")
        end = int(len(tokens) * (1.0 - eval_fraction))
        self.train, self.held_out = tokens[:end], tokens[end:]
        self.num_replicas, self.batch_size, self.seq_len, self.seed = num_replicas, batch_size, seq_len, seed
        self.split = split
        self.islands = tuple(range(num_replicas)) if islands is None else tuple(islands)
        num_islands = num_replicas if num_islands is None else num_islands
        if len(self.islands) != num_replicas or not all(0 <= i < num_islands for i in self.islands):
            raise ConfigError(f"islands {self.islands} must name one of {num_islands} islands per replica ({num_replicas})")
        # The region an island samples from: its own share, or the whole train split.
        self.share = len(self.train) // num_islands if split == "contiguous" else len(self.train)
        window = seq_len + 1
        if self.share < window:
            raise ConfigError(
                f"--train.seq-len is too long: each of {num_replicas} replicas has {self.share} training tokens, "
                f"a sequence needs {window}"
            )
        if len(self.held_out) < window:
            raise ConfigError(
                f"--data.eval-fraction leaves {len(self.held_out)} held-out tokens, fewer than one sequence ({window})"
            )

    def batch(self, step: int) -> np.ndarray:
        """Tokens for inner step `step` (0-based): int32 of shape (R, batch_size, seq_len + 1)."""
        window = self.seq_len + 1
        out = np.empty((self.num_replicas, self.batch_size, window), np.int32)
        for r, island in enumerate(self.islands):
            rng = np.random.default_rng([self.seed, island, step])
            offset = island * self.share if self.split == "contiguous" else 0
            starts = offset + rng.integers(0, self.share - window + 1, self.batch_size)
            out[r] = self.train[starts[:, None] + np.arange(window)]
        return out

    def eval_batch(self, num_sequences: int) -> np.ndarray:
        """`num_sequences` evenly spaced held-out windows: int32 (num_sequences, seq_len + 1)."""
        window = self.seq_len + 1
        starts = np.linspace(0, len(self.held_out) - window, num_sequences).astype(np.int64)
        return self.held_out[starts[:, None] + np.arange(window)].astype(np.int32)
