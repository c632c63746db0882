"""Token streams: the embedded corpus, text files, token files and a synthetic pattern.

Each replica samples windows from its own contiguous, disjoint share of the training
tokens. The batch of step t is a pure function of (seed, replica, t), so a resumed run
sees exactly the batches an uninterrupted run would have seen, with no data position to
save beyond the step. The last `eval_fraction` of the tokens is held out for evaluation.
"""

import contextlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from .config import ConfigError, DataConfig
from .token_shards import FOLDER_META_NAME, ShardedTokens, read_folder_meta


def corpus_bytes(max_bytes: int) -> bytes:
    """The Python standard library's own `.py` sources (sorted by path, concatenated), up to `max_bytes`.

    Every Python installation ships them, so nothing is downloaded.
    """
    chunks, total = [], 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = _stdlib_sources(stdlib) if not _NOT_THE_STDLIB.intersection(stdlib.parts) else ()
    for path in sources:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


_NOT_THE_STDLIB = {"site-packages", "test", "tests"}


def _stdlib_sources(root: Path):
    """The `.py` files under `root` in sorted path order, without the installed packages and the test
    suites. A walk that never enters those folders and stops when the reader does: listing the
    whole tree first (site-packages included) took longer than the reading."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:  # files and folders by name, together: the order of sorted paths
        try:
            if entry.is_dir() and not entry.is_symlink():
                if entry.name not in _NOT_THE_STDLIB:
                    yield from _stdlib_sources(Path(entry.path))
            elif entry.name.endswith(".py"):
                yield Path(entry.path)
        except OSError:
            continue


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
    """The metadata JSON of a token file (`<file>.json`) or of a token folder (`<folder>/tokens.json`)."""
    return Path(path) / FOLDER_META_NAME if Path(path).is_dir() else Path(f"{path}.json")


def read_token_meta(path: Path) -> dict:
    """The metadata of token file `path` ({"dtype": "uint16" | "uint32", "vocab_size": int, ...}).

    A file without `<file>.json` is read as uint16 with an unknown vocabulary (then every id is
    checked against `--model.vocab-size`). A token folder's is its `tokens.json` (see `token_shards`).
    """
    if Path(path).is_dir():
        return read_folder_meta(Path(path))
    meta_path = token_meta_path(path)
    if not meta_path.is_file():
        return {"dtype": "uint16", "vocab_size": None}
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data.path's metadata {meta_path} is not readable JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES:
        raise ConfigError(f"--data.path's metadata {meta_path} must give \"dtype\": \"uint16\" or \"uint32\"")
    for key in ("vocab_size", "num_tokens"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"--data.path's metadata {meta_path} has an invalid {key}: {value!r}")
    return meta


# Bytes read per step of a token-file scan: memory stays bounded by this whatever the file's size.
SCAN_CHUNK_BYTES = 1 << 24
SCAN_FORMAT = "eqx_diloco.token-scan/1"


def token_scan_path(path: Path | str) -> Path:
    """The cached scan verdict beside a token file: `<file>.scan.json` (its largest id)."""
    return Path(f"{path}.scan.json")


def scan_max_id(path: Path, dtype: np.dtype, size: int) -> int:
    """The largest id among the first `size` bytes of token file `path`, read in chunks of
    `SCAN_CHUNK_BYTES` into one reused buffer. Not through a memory map: every page of a map that
    has been read stays in the process's resident memory (a 2 GB file took 2.5 GB)."""
    buffer = np.empty(max(1, SCAN_CHUNK_BYTES // dtype.itemsize), dtype)
    view = memoryview(buffer).cast("B")
    largest, left = 0, size
    with path.open("rb") as f:  # buffered: readinto fills the whole view unless the file ends
        while left > 0:
            n = f.readinto(view[: min(left, len(view))])
            if not n:
                break  # shrank since it was measured: what is left is checked by the size rules next start
            largest = max(largest, int(buffer[: n // dtype.itemsize].max(initial=0)))
            left -= n
    return largest


def _scan_key(stat: os.stat_result, dtype_name: str) -> dict:
    # The verdict holds for these bytes read as this dtype; any write changes the size or the mtime.
    return {"format": SCAN_FORMAT, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": dtype_name}


def write_scan_cache(path: Path, dtype_name: str, max_id: int, stat: os.stat_result | None = None) -> None:
    """Record `max_id` for token file `path` as `stat` (default: as it is now) describes it, if its folder is
    writable (else nothing)."""
    cache = token_scan_path(path)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")  # processes of one run may write at once
    try:
        record = {**_scan_key(stat or path.stat(), dtype_name), "max_id": int(max_id)}
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, cache)
    except OSError:  # a read-only data folder (or a full disk): the next start scans again
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def max_token_id(path: Path, dtype_name: str) -> int:
    """The largest id in token file `path`: from `<file>.scan.json` when it was written for the file's
    current size, mtime and dtype, else by a bounded-memory scan whose verdict is then cached there."""
    stat = path.stat()
    try:
        cached = json.loads(token_scan_path(path).read_text())
        key = _scan_key(stat, dtype_name)
        if isinstance(cached, dict) and {k: cached.get(k) for k in key} == key:
            value = cached.get("max_id")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass  # no cache, or a damaged one: scan
    largest = scan_max_id(path, np.dtype(TOKEN_DTYPES[dtype_name]), stat.st_size)
    # Keyed by the stat taken before the scan: a file changed meanwhile no longer matches, and is scanned again.
    write_scan_cache(path, dtype_name, largest, stat)
    return largest


def open_tokens(path: Path, vocab_size: int) -> np.ndarray:
    """Token file `path` as a read-only `np.memmap` (never read into memory as a whole).

    Its dtype and vocabulary size come from `<path>.json` (written by `python -m
    eqx_diloco.prepare`); without it the file is uint16 ids. The file's size must match the
    metadata's dtype and `num_tokens`, and its largest id (see `max_token_id`) must be below both
    the metadata's `vocab_size` and `vocab_size`.

    A token folder written by `prepare` (shards plus `tokens.json`) is read as one stream: a
    `ShardedTokens` over the shards' memory maps, each shard checked as a file is.
    """
    if Path(path).is_dir():
        return _open_token_folder(Path(path), vocab_size)
    meta = read_token_meta(path)
    meta_path = token_meta_path(path)
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
    num_tokens = meta.get("num_tokens")
    if num_tokens is not None and num_tokens * dtype.itemsize != size:
        raise ConfigError(
            f"--data.path {path} is {size:,} bytes, but {meta_path} gives num_tokens {num_tokens:,} of "
            f"{meta['dtype']} ({num_tokens * dtype.itemsize:,} bytes): the file is truncated or its dtype is wrong"
        )
    file_vocab = meta.get("vocab_size")
    if file_vocab is not None and file_vocab > vocab_size:
        raise ConfigError(
            f"--model.vocab-size is {vocab_size} but {meta_path} gives vocab_size {file_vocab}: "
            f"pass --model.vocab-size {file_vocab} (or leave the flag out to take it from that file)"
        )
    try:
        tokens = np.memmap(path, dtype=dtype, mode="r")
        largest = max_token_id(path, meta["dtype"])
    except OSError as e:
        raise ConfigError(f"--data.path is not readable: {path}: {e.strerror}") from None
    # An id beyond the embedding becomes NaN in the gather, which would be reported as a diverged loss.
    if file_vocab is not None and largest >= file_vocab:
        raise ConfigError(
            f"--data.path {path} holds token id {largest}, but {meta_path} gives vocab_size {file_vocab}: "
            f"the metadata's vocab_size or dtype ({meta['dtype']}) is wrong"
        )
    if largest >= vocab_size:
        raise ConfigError(
            f"--model.vocab-size must exceed every token id in --data.path (found id {largest} in {path})"
        )
    return tokens


def _open_token_folder(folder: Path, vocab_size: int) -> np.ndarray | ShardedTokens:
    """The shards of token folder `folder` as one stream, each checked against `tokens.json` (size, token
    count, dtype) and its largest id against both vocabularies (one cached scan per shard, as for a file)."""
    meta = read_folder_meta(folder)
    meta_path = folder / FOLDER_META_NAME
    dtype = np.dtype(TOKEN_DTYPES[meta["dtype"]])
    file_vocab = meta["vocab_size"]
    if file_vocab > vocab_size:
        raise ConfigError(
            f"--model.vocab-size is {vocab_size} but {meta_path} gives vocab_size {file_vocab}: "
            f"pass --model.vocab-size {file_vocab} (or leave the flag out to take it from that file)"
        )
    shards = []
    for entry in meta["shards"]:
        shard = folder / entry["file"]
        try:
            size = shard.stat().st_size
            if size != entry["num_tokens"] * dtype.itemsize:
                raise ConfigError(
                    f"--data.path shard {shard} is {size:,} bytes, but {meta_path} gives it {entry['num_tokens']:,} "
                    f"{meta['dtype']} tokens ({entry['num_tokens'] * dtype.itemsize:,} bytes): it is truncated or replaced"
                )
            tokens = np.memmap(shard, dtype=dtype, mode="r")
            largest = max_token_id(shard, meta["dtype"])
        except OSError as e:
            raise ConfigError(f"--data.path is not readable: {e.filename or shard}: {e.strerror}") from None
        if largest >= file_vocab:
            raise ConfigError(f"--data.path shard {shard} holds token id {largest}, but {meta_path} gives vocab_size "
                              f"{file_vocab}: the shard or the metadata is not what prepare wrote")
        if largest >= vocab_size:
            raise ConfigError(
                f"--model.vocab-size must exceed every token id in --data.path (found id {largest} in {shard})"
            )
        shards.append(tokens)
    return shards[0] if len(shards) == 1 else ShardedTokens(shards)


def load_tokens(config: DataConfig, vocab_size: int, seed: int) -> np.ndarray:
    """All tokens of the configured source as a flat array: uint16 in memory for `corpus`, `text` and
    `synthetic`; for `tokens`, a read-only memory map of the file, or a `ShardedTokens` over the shards
    of a token folder (see `open_tokens`)."""
    if config.source == "corpus":
        tokens = np.frombuffer(corpus_bytes(config.max_corpus_bytes), np.uint8).astype(np.uint16)
    elif config.source == "text":
        if config.path is None or not config.path.exists():
            raise ConfigError(f"--data.path does not exist: {config.path}")
        tokens = np.frombuffer(_text_bytes(config.path), np.uint8).astype(np.uint16)
        if tokens.size == 0:
            raise ConfigError(f"--data.path holds no text: {config.path}")
    elif config.source == "tokens":
        if config.path is None or not (config.path.is_file() or config.path.is_dir()):
            raise ConfigError(f"--data.path must be a file of uint16 or uint32 token ids, or a token folder "
                              f"written by `python -m eqx_diloco.prepare`: {config.path}")
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
