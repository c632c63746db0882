"""Plain JSON values from configs and metadata (dataclasses, paths, numpy scalars, non-finite floats)."""

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np


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
