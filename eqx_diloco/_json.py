"""Plain JSON values from configs and metadata (dataclasses, paths, numpy scalars, non-finite floats)."""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import ConfigError


def to_jsonable(obj: Any) -> Any:
    """`obj` as plain JSON values: dataclasses and dicts as objects, NaN and +-Inf as None (`null`)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # bare NaN / Infinity are not JSON
    return obj


def json_metadata(metadata: Any) -> Any:
    """A checkpoint's `metadata` as the JSON values it is stored as ({} for None), or a `ConfigError`
    naming the rule: found only in orbax's writer thread, a value JSON cannot hold was a traceback
    per thread after the arrays were already on their way."""
    value = to_jsonable(metadata if metadata is not None else {})
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata must be JSON: a dict or dataclass of strings, numbers, booleans, None, lists "
                          f"and dicts with string keys ({e})") from None
    return value
