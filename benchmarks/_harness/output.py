"""Artifacts: markdown tables, byte counts as text, and JSON / text files."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def markdown_table(
    rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str, Callable[[Any], str] | None]]
) -> str:
    """A GitHub markdown table. `columns` holds (header, key, formatter or None for str)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for _, key, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else (fmt(value) if fmt else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, pathlib.Path):
        return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / jax scalars
        return jsonable(obj.item())
    return obj


def write_json(path: str | os.PathLike, obj: Any) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(obj), indent=2) + "\n")
    return path


def write_text(path: str | os.PathLike, text: str) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
