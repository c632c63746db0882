"""Documents out of corpora as they ship: text files, jsonl (optionally gzipped) and parquet, one file or
folders of shards, read in pieces from any recorded position (so that `prepare` can resume).

A piece is a string to encode on its own; `Piece.document_end` says a document ends after it.
A text file is one document, cut into pieces of about `piece_bytes` after a newline (else after a
space, never inside a UTF-8 character); a jsonl line or a parquet row is one document, its
`text_field` one piece. Every bad input is a `PrepareError` naming the file and the line or row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import queue
import threading
from pathlib import Path
from typing import Iterator


class PrepareError(ValueError):
    """A one-line, user-facing reason why the corpus cannot be prepared."""


FORMATS = ("text", "jsonl", "parquet")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".json.gz")


def format_of(path: Path) -> str:
    """The format a file's name says: parquet, jsonl (`.jsonl`, `.ndjson`, gzipped too, and `.json.gz`), else text."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    return "text"


@dataclasses.dataclass(frozen=True)
class Position:
    """Where reading continues: file `file` of the input list, at `offset` (a byte offset of the
    decompressed text for text and jsonl, a row index for parquet); `line` is the 1-based line
    number there (for messages)."""

    file: int = 0
    offset: int = 0
    line: int = 1

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value) -> "Position":
        if not isinstance(value, dict) or set(value) != {"file", "offset", "line"}:
            raise ValueError(f"not a position: {value!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values()):
            raise ValueError(f"not a position: {value!r}")
        return cls(**value)


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str
    document_end: bool
    after: Position  # where reading continues after this piece
    done_bytes: int  # bytes of the current file's stored size read so far (for the rate and the bar)


def list_inputs(text_path: Path, fmt: str) -> list[tuple[Path, str]]:
    """(file, format) of every input, in sorted path order. A folder's hidden entries (`.name`) are skipped;
    when it holds jsonl or parquet files, only those are read (a dataset folder's README is not a document)."""
    if not text_path.exists():
        raise PrepareError(f"TEXT_PATH does not exist: {text_path}")
    if not (text_path.is_file() or text_path.is_dir()):  # /dev/zero never ends, a FIFO without a writer blocks
        raise PrepareError(f"TEXT_PATH must be a regular file or a folder (not a device, FIFO or socket): {text_path}")
    if text_path.is_dir():
        files = sorted(p for p in text_path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(text_path).parts))
    else:
        files = [text_path]
    if not files:
        raise PrepareError(f"TEXT_PATH holds no files: {text_path}")
    if fmt != "auto":
        return [(f, fmt) for f in files]
    formats = [(f, format_of(f)) for f in files]
    structured = {k for _, k in formats} - {"text"}
    if len(structured) > 1:
        first = {k: next(f for f, kk in formats if kk == k) for k in sorted(structured)}
        raise PrepareError(f"TEXT_PATH {text_path} mixes formats: {first['jsonl']} is jsonl, {first['parquet']} is "
                           f"parquet (prepare one format at a time, or choose one with --format)")
    if structured and text_path.is_dir():
        formats = [(f, k) for f, k in formats if k != "text"]
    return formats


def read_pieces(inputs: list[tuple[Path, str]], sizes: list[int], start: Position, *, text_field: str,
                piece_bytes: int) -> Iterator[Piece]:
    """Every piece of `inputs` from `start` on, in order. `sizes`: each file's size when listed (a text file is
    read up to it, so a growing file cannot make the read unbounded)."""
    for index in range(start.file, len(inputs)):
        file, fmt = inputs[index]
        at = start if index == start.file else Position(index, 0, 1)
        if fmt == "text":
            yield from _text_pieces(file, at, sizes[index], piece_bytes)
        elif fmt == "jsonl":
            yield from _jsonl_pieces(file, at, text_field)
        else:
            yield from _parquet_pieces(file, at, sizes[index], text_field)


def _opened(file: Path, action):
    try:
        return action()
    except OSError as e:
        raise PrepareError(f"cannot read {file}: {e.strerror}") from None


def _utf8_error(file: Path, data: bytes, error: UnicodeDecodeError, line: int, offset: int) -> PrepareError:
    bad = data[error.start : error.start + 4]
    line += data.count(b"\n", 0, error.start)
    return PrepareError(f"{file} line {line} (byte {offset + error.start:,}) is not UTF-8: {bad!r}")


def _text_pieces(file: Path, at: Position, size: int, piece_bytes: int) -> Iterator[Piece]:
    if size == 0:
        return  # an empty document: nothing to encode, no end-of-text
    f = _opened(file, lambda: file.open("rb"))
    with f:
        offset, line = at.offset, at.line
        f.seek(offset)
        while offset < size:
            data = _opened(file, lambda: f.read(min(piece_bytes, size - offset)))
            if not data:
                break  # shrank since it was listed
            if offset + len(data) < size:
                cut = data.rfind(b"\n") + 1 or data.rfind(b" ") + 1 or _whole_characters(data)
                while cut == 0 and offset + len(data) < size:  # less than one character: read on to its end
                    data += _opened(file, lambda: f.read(1))
                    cut = _whole_characters(data) if offset + len(data) < size else len(data)
                data = data[:cut]
                f.seek(offset + len(data))
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(file, data, e, line, offset) from None
            offset += len(data)
            line += data.count(b"\n")
            yield Piece(text, offset >= size, Position(at.file, offset, line), offset)


def _whole_characters(data: bytes) -> int:
    """The length of the longest prefix of `data` that ends with a whole UTF-8 character (invalid bytes count as
    whole: decoding names them)."""
    lead = len(data) - 1
    while lead > 0 and len(data) - lead < 4 and data[lead] & 0xC0 == 0x80:  # continuation bytes: back to the lead
        lead -= 1
    first = data[lead]
    length = 1 if first < 0xC0 else 2 if first < 0xE0 else 3 if first < 0xF0 else 4
    return len(data) if len(data) - lead >= length else lead


def _jsonl_pieces(file: Path, at: Position, text_field: str) -> Iterator[Piece]:
    compressed = file.name.lower().endswith(".gz")
    f = _opened(file, lambda: gzip.open(file, "rb") if compressed else file.open("rb"))
    with f:
        offset, line, documents = at.offset, at.line, 0
        try:
            f.seek(offset)
            raw = f.fileobj if compressed else f
            while record := f.readline():
                where = f"{file} line {line}"
                offset += len(record)
                line += 1
                if not record.strip():
                    continue
                documents += 1
                try:
                    value = json.loads(record.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise PrepareError(f"{where} is not UTF-8: {record[e.start : e.start + 4]!r}") from None
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{where} is not JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(value, dict):
                    raise PrepareError(f"{where} is a JSON {type(value).__name__}, not an object with a "
                                       f"{text_field!r} field")
                if text_field not in value:
                    fields = ", ".join(sorted(value)[:8]) or "none"
                    raise PrepareError(f"{where} has no field {text_field!r} (its fields: {fields}; choose one with "
                                       f"--text-field)")
                text = value[text_field]
                if not isinstance(text, str):
                    raise PrepareError(f"{where}: field {text_field!r} is a JSON {type(text).__name__}, not a string")
                yield Piece(text, True, Position(at.file, offset, line), raw.tell())
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise PrepareError(f"cannot read {file} near line {line}: {e}") from None
    if at.offset == 0 and documents == 0:
        raise PrepareError(f"{file} holds no documents (an empty jsonl shard)")


def batches(pieces: Iterator[Piece], batch_bytes: int) -> Iterator[list[Piece]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= batch_bytes or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def read_ahead(batches: Iterator[list[Piece]], depth: int = 2) -> Iterator[list[Piece]]:
    """`batches`, read and parsed on a background thread while the tokenizer encodes the previous ones (it
    releases the GIL): reading, JSON and parquet decoding no longer wait for the encoding, nor it for them."""
    slots: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    done = object()

    def offer(item) -> bool:
        """Hand `item` over unless the consumer has stopped (then it is dropped: False)."""
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                slots.put(item, timeout=0.1)
                return True
        return False

    def produce():
        try:
            for batch in batches:
                if not offer(batch):
                    return
            offer(done)
        except BaseException as e:  # handed to the consumer, which raises it
            offer(e)

    # A daemon thread: an interrupted run must not wait for it at exit.
    thread = threading.Thread(target=produce, name="prepare-reader", daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _open_parquet(file: Path, text_field: str):
    """`file` as a `pyarrow.parquet.ParquetFile` whose `text_field` is a string column holding rows."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError("reading parquet needs the `pyarrow` package: pip install pyarrow") from None
    try:
        parquet = pq.ParquetFile(file)
    except (OSError, pa.ArrowException) as e:
        raise PrepareError(f"{file} is not a readable parquet file: {str(e).splitlines()[0]}") from None
    schema = parquet.schema_arrow
    if text_field not in schema.names:
        parquet.close()
        columns = ", ".join(schema.names[:8]) or "none"
        raise PrepareError(f"{file} has no column {text_field!r} (its columns: {columns}; choose one with --text-field)")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        parquet.close()
        raise PrepareError(f"{file}: column {text_field!r} is {kind}, not a string column")
    if parquet.metadata.num_rows == 0:
        parquet.close()
        raise PrepareError(f"{file} holds no documents (an empty parquet shard)")
    return parquet


def check_parquet_schemas(inputs: list[tuple[Path, str]], text_field: str) -> None:
    """Refuse, before anything is encoded, a parquet shard whose footer shows it cannot be read (no such column,
    not a string column, no rows): a folder of shards with mixed schemas fails at once, not hours in."""
    for file, fmt in inputs:
        if fmt == "parquet":
            _open_parquet(file, text_field).close()


def _parquet_pieces(file: Path, at: Position, size: int, text_field: str) -> Iterator[Piece]:
    import pyarrow as pa

    with _open_parquet(file, text_field) as parquet:
        total = parquet.metadata.num_rows
        # Start at the row group holding row `at.offset`, and skip the rows before it inside that group.
        row, group = 0, 0
        while group < parquet.num_row_groups and row + parquet.metadata.row_group(group).num_rows <= at.offset:
            row += parquet.metadata.row_group(group).num_rows
            group += 1
        groups = list(range(group, parquet.num_row_groups))
        try:
            for batch in parquet.iter_batches(batch_size=1024, row_groups=groups, columns=[text_field]):
                column = batch.column(0)
                try:
                    values = column.to_pylist()
                except UnicodeDecodeError:
                    values = [_strict_utf8(file, column, i, row) for i in range(len(column))]
                for value in values:
                    row += 1
                    if row <= at.offset:
                        continue
                    if value is None:
                        raise PrepareError(f"{file} row {row}: {text_field!r} is null")
                    yield Piece(value, True, Position(at.file, row, row + 1), size * row // total)
        except pa.ArrowException as e:
            raise PrepareError(f"{file} near row {row + 1}: {str(e).splitlines()[0]}") from None


def _strict_utf8(file: Path, column, i: int, rows_before: int):
    try:
        return column[i].as_py()
    except UnicodeDecodeError as e:
        raise PrepareError(f"{file} row {rows_before + i + 1} is not UTF-8: {e.object[e.start : e.start + 4]!r}") from None
