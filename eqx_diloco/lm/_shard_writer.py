"""The writing side of `prepare`: shards of bounded size renamed into place when complete, a progress record
after each (what was written, with CRC-32Cs, and where reading continues), and the checks that let a re-run keep
what verifies. Every file is written under a temporary name, flushed to disk, then renamed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import crc32c
import numpy as np

from ._corpus_readers import Position, PrepareError
from .data import write_scan_cache
from .token_shards import PROGRESS_NAME, shard_name

PROGRESS_FORMAT = "eqx_diloco.prepare-progress/1"


def fsynced_replace(partial: Path, final: Path) -> None:
    with partial.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, final)


def write_json(path: Path, value: dict) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    fsynced_replace(partial, path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _shard_crc(path: Path) -> int:
    value = 0
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            value = crc32c.crc32c(block, value)
    return value


class ShardWriter:
    """Writes the token stream into shards of `shard_tokens`, each renamed into place when full and flushed,
    and records after each one what was written and where the next shard starts (the progress file).

    A shard starts at (`position`, `skip`, `documents`): the batch read from `position`, less its first `skip`
    tokens, with `documents` documents before it. Encoding is deterministic, so that is enough to resume."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, fingerprint: dict, shards: list[dict]):
        self.out, self.dtype, self.shard_tokens, self.fingerprint = out, dtype, shard_tokens, fingerprint
        self.shards = shards
        self.file = None

    def write(self, ids: np.ndarray, position: Position, skip: int, document_ends: np.ndarray, documents: int) -> None:
        """`ids`: the batch read from `position`; its first `skip` were written before. `document_ends`: the
        offsets in `ids` just after each document's end; `documents`: documents before the batch."""
        done = skip
        while done < len(ids):
            if self.file is None:
                self._open(position, done, documents + int(np.searchsorted(document_ends, done, side="right")))
            take = min(len(ids) - done, self.shard_tokens - self.count)
            part = ids[done : done + take]
            data = part.tobytes()
            self.file.write(data)
            self.crc = crc32c.crc32c(data, self.crc)
            self.count += take
            self.largest = max(self.largest, int(part.max()))
            done += take
            if self.count == self.shard_tokens:
                after = documents + int(np.searchsorted(document_ends, done, side="right"))
                self.close({"position": position.to_json(), "skip": done, "documents": after})

    def _open(self, position: Position, skip: int, documents: int) -> None:
        name = shard_name(len(self.shards))
        self.partial = self.out / f"{name}.partial"
        self.file = self.partial.open("wb")
        self.start = {"position": position.to_json(), "skip": skip, "documents": documents}
        self.count, self.crc, self.largest = 0, 0, 0

    def close(self, next_start: dict) -> None:
        """Finish the open shard (if any), and record that reading continues at `next_start`."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
            final = self.out / shard_name(len(self.shards))
            os.replace(self.partial, final)
            write_scan_cache(final, self.dtype.name, self.largest)
            self.shards.append({"file": final.name, "num_tokens": self.count, "max_id": self.largest,
                                "crc32c": self.crc, "start": self.start})
        write_json(self.out / PROGRESS_NAME, {"format": PROGRESS_FORMAT, "prepare": self.fingerprint,
                                               "shards": self.shards, "next": next_start})

    def abandon(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
            with contextlib.suppress(OSError):
                self.partial.unlink()


def resume_state(out: Path, fingerprint: dict, itemsize: int) -> tuple[list[dict], dict]:
    """The shards of an interrupted run on OUT that verify (size and CRC-32C), and where reading continues."""
    try:
        record = json.loads((out / PROGRESS_NAME).read_text())
        if not isinstance(record, dict) or record.get("format") != PROGRESS_FORMAT:
            raise ValueError("not a progress file")
        Position.from_json(record["next"]["position"])
        shards, next_start = list(record["shards"]), record["next"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise PrepareError(f"{out / PROGRESS_NAME} is damaged: remove OUT {out} and prepare again") from None
    if record.get("prepare") != fingerprint:
        changed = sorted(k for k in fingerprint if fingerprint[k] != (record.get("prepare") or {}).get(k))
        raise PrepareError(f"OUT {out} holds an unfinished prepare of other inputs or options ({', '.join(changed)} "
                           f"differ): remove it, or choose another OUT")
    for k, shard in enumerate(shards):
        path = out / shard_name(k)
        try:
            intact = (path.stat().st_size == shard["num_tokens"] * itemsize and _shard_crc(path) == shard["crc32c"])
        except OSError:
            intact = False
        if not intact:  # this shard and the ones after it are written again
            return shards[:k], shard["start"]
    return shards, next_start
