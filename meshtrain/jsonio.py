"""JSON that users hand in (``config.json``, safetensors and prepared-corpus indexes, pipeline
tables, ``.jsonl`` lines): parsed with its nesting bounded, its numbers checked, and the file names
it holds kept inside their directory.

``loads`` raises a ``ValueError`` for every way the text can be bad, nesting deep enough to exhaust
Python's recursion (``[`` * 100000) included, so each reader's existing ``except ValueError`` turns
it into that reader's one-line ``ConfigError`` naming the file.
"""

from __future__ import annotations

import collections
import json
import math
from typing import Any

MAX_DEPTH = 64  # as the YAML loader's (meshtrain.yamlio)


def loads(text: str | bytes, *, max_depth: int | None = MAX_DEPTH) -> Any:
    """``json.loads(text)``; a ``ValueError`` when it is not JSON or nests more than ``max_depth``
    arrays and objects (``None``: any depth Python's recursion allows, for data such as ``.jsonl``
    lines, whose other fields are not ours to bound)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested more than {max_depth} levels deep" if max_depth is not None
                         else "nested too deeply for Python to parse") from None
    if max_depth is not None and _depth(value) > max_depth:
        raise ValueError(f"nested more than {max_depth} levels deep")
    return value


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0), without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def non_finite(value: Any) -> tuple[str, float] | None:
    """A NaN or infinite number in ``value`` (parsed JSON: Python's ``json`` reads ``NaN``,
    ``Infinity`` and ``1e999``), the shallowest first, as (its dotted key path, e.g.
    ``rope_scaling.factor`` or ``layers[2]``, the number); None when every number is finite."""
    pending = collections.deque([("", value)])
    while pending:
        path, item = pending.popleft()
        if isinstance(item, float) and not math.isfinite(item):
            return path, item
        if isinstance(item, dict):
            pending.extend((f"{path}.{key}" if path else str(key), child) for key, child in item.items())
        elif isinstance(item, (list, tuple)):
            pending.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None


def is_plain_file_name(name: Any) -> bool:
    """Whether ``name`` names a file directly inside the directory of the file that lists it: a
    non-empty string without a directory separator (``/`` or ``\\``) or NUL, and neither ``.`` nor
    ``..`` (so neither absolute nor a way out)."""
    return (isinstance(name, str) and name not in ("", ".", "..")
            and not any(char in name for char in "/\\\0"))
