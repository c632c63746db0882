"""Token folders: the shards `python -m eqx_diloco.prepare` writes, read as one token stream.

A token folder holds

- `shard-00000.bin`, `shard-00001.bin`, ...: little-endian uint16 or uint32 token ids, each at
  most `--shard-mb`; the folder's token stream is their concatenation in name order;
- `tokens.json`: the one metadata file (`TOKEN_FOLDER_FORMAT`): dtype, vocab_size, num_tokens,
  the end-of-text id between documents, the tokenizer, and each shard's token count, largest id
  and CRC-32C. It is written last, so a folder without it is unfinished and never read;
- `tokenizer.json`: a copy of the tokenizer the ids came from (`tokenizer_for_tokens`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .config import ConfigError

TOKEN_FOLDER_FORMAT = "eqx_diloco.token-shards/1"
FOLDER_META_NAME = "tokens.json"
FOLDER_TOKENIZER_NAME = "tokenizer.json"
PROGRESS_NAME = "prepare-progress.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def read_folder_meta(folder: Path) -> dict:
    """The checked `tokens.json` of token folder `folder` (a one-line `ConfigError` naming what is wrong)."""
    meta_path = folder / FOLDER_META_NAME
    if not meta_path.is_file():
        if (folder / PROGRESS_NAME).exists():
            raise ConfigError(f"--data.path {folder} is an unfinished prepare (no {FOLDER_META_NAME} yet): "
                              f"run the same `python -m eqx_diloco.prepare` command again to finish it")
        raise ConfigError(f"--data.path {folder} is a folder without {FOLDER_META_NAME}: give a token file, or a "
                          f"folder written by `python -m eqx_diloco.prepare`")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--data.path's metadata {meta_path} is not readable JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != TOKEN_FOLDER_FORMAT:
        raise ConfigError(f"--data.path's metadata {meta_path} is not a {TOKEN_FOLDER_FORMAT} file")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ConfigError(f"--data.path's metadata {meta_path} must give \"dtype\": \"uint16\" or \"uint32\"")
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        raise ConfigError(f"--data.path's metadata {meta_path} lists no shards")
    for i, shard in enumerate(shards):
        name = shard.get("file") if isinstance(shard, dict) else None
        count = shard.get("num_tokens") if isinstance(shard, dict) else None
        # A plain name: the metadata may not point outside its folder.
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ConfigError(f"--data.path's metadata {meta_path} has an invalid file name in shard {i}: {name!r}")
        if not _positive_int(count):
            raise ConfigError(f"--data.path's metadata {meta_path} has an invalid num_tokens in shard {i}: {count!r}")
    for key in ("vocab_size", "num_tokens"):
        if not _positive_int(meta.get(key)):
            raise ConfigError(f"--data.path's metadata {meta_path} has an invalid {key}: {meta.get(key)!r}")
    if sum(s["num_tokens"] for s in shards) != meta["num_tokens"]:
        raise ConfigError(f"--data.path's metadata {meta_path}: its shards hold {sum(s['num_tokens'] for s in shards):,} "
                          f"tokens, not its num_tokens {meta['num_tokens']:,}")
    return meta


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class ShardedTokens:
    """The token stream of several shard files as one read-only 1-D array.

    Supports what the data pipeline asks of a token array: `len`, `dtype`, contiguous slices
    (a view, nothing read), an integer index, and integer-array indexing (a gather that reads
    only the windows asked for, across shard boundaries where they fall). Each shard stays a
    memory map, so the corpus is never read into memory as a whole.

    **Arguments:**

    - `shards`: the shards' token arrays in stream order (memory maps), one dtype.
    - `start`, `stop`: the part of the concatenated stream this array is (default: all of it).
    """

    def __init__(self, shards: list[np.ndarray], start: int = 0, stop: int | None = None):
        self.shards = list(shards)
        self.dtype = self.shards[0].dtype
        # bounds[k] is where shard k starts in the concatenated stream; bounds[-1] is its length.
        self.bounds = np.concatenate([[0], np.cumsum([len(s) for s in self.shards])]).astype(np.int64)
        self.start = start
        self.stop = int(self.bounds[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def ndim(self) -> int:
        return 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            first, last, step = index.indices(len(self))
            if step != 1:
                return np.asarray(self)[index]
            return ShardedTokens(self.shards, self.start + first, self.start + max(first, last))
        if isinstance(index, (int, np.integer)):
            position = int(index) + (len(self) if index < 0 else 0)
            if not 0 <= position < len(self):
                raise IndexError(f"index {int(index)} is out of bounds for {len(self)} tokens")
            return self._gather(np.array([position]))[0]
        return self._gather(np.asarray(index))

    def _gather(self, positions: np.ndarray) -> np.ndarray:
        if positions.dtype.kind not in "iu":
            raise IndexError(f"only integer positions index tokens (got {positions.dtype})")
        positions = positions.astype(np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"positions out of bounds for {len(self)} tokens")
        flat = positions.reshape(-1) + self.start
        which = np.searchsorted(self.bounds, flat, side="right") - 1
        out = np.empty(flat.shape, self.dtype)
        for k in np.unique(which):  # windows are contiguous runs: a batch touches few shards
            mask = which == k
            out[mask] = self.shards[k][flat[mask] - self.bounds[k]]
        return out.reshape(positions.shape)

    def _parts(self):
        """This array's part of each shard it overlaps, in order (memory-map slices: nothing is read)."""
        first = int(np.searchsorted(self.bounds, self.start, side="right") - 1)
        position = self.start
        for k in range(first, len(self.shards)):
            if position >= self.stop:
                break
            end = min(self.stop, int(self.bounds[k + 1]))
            yield self.shards[k][position - int(self.bounds[k]) : end - int(self.bounds[k])]
            position = end

    def __array__(self, dtype=None, copy=None):
        parts = [np.asarray(part) for part in self._parts()]
        stream = np.concatenate(parts) if parts else np.zeros((0,), self.dtype)
        return stream if dtype is None else stream.astype(dtype)

    def max(self, initial=None) -> int:  # noqa: A003 - the name numpy arrays use
        """The largest id, shard by shard (never the whole stream in memory at once)."""
        values = [int(part.max()) for part in self._parts() if len(part)]
        if initial is not None:
            values.append(initial)
        if not values:
            raise ValueError("max of an empty token array without an initial value")
        return max(values)


def named_tokenizer_file(path: Path | str) -> Path | None:
    """The `tokenizers` JSON file the metadata of the ids at `path` names, whether or not it still exists;
    None when none is named or the metadata is missing or unreadable.

    `path` is what `--data.path` takes with `--data.source tokens`: a token folder (its
    `tokens.json` names the copy of the tokenizer beside the shards) or a single token file
    (its `<file>.json` names the tokenizer file `prepare` read).
    """
    path = Path(path)
    try:
        if path.is_dir():
            meta = json.loads((path / FOLDER_META_NAME).read_text())
            named = meta.get("tokenizer") if isinstance(meta, dict) else None
            return path / named if isinstance(named, str) and Path(named).name == named else None
        meta = json.loads(Path(f"{path}.json").read_text())
        named = meta.get("tokenizer") if isinstance(meta, dict) else None
        return Path(named) if isinstance(named, str) and named else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def tokenizer_file_for_tokens(path: Path | str) -> Path | None:
    """The `tokenizers` JSON file the ids at `path` came from (`named_tokenizer_file`), or None when none is
    named or the named file no longer exists."""
    file = named_tokenizer_file(path)
    return file if file is not None and file.is_file() else None


def tokenizer_for_tokens(path: Path | str):
    """The `tokenizers.Tokenizer` the ids at `path` came from (`tokenizer_file_for_tokens`), or None
    when they name none or the `tokenizers` package is not installed; a tokenizer file that exists
    but cannot be read is a one-line `ConfigError`.
    """
    file = tokenizer_file_for_tokens(path)
    if file is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
        raise ConfigError(f"the tokenizer of {path}, {file}, cannot be read: {str(e).splitlines()[0]}") from None
