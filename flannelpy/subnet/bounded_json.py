"""JSON from other machines, parsed within bounds: size and nesting are checked first.

``json.loads`` recurses per nesting level, so a value nested a few thousand
deep raises ``RecursionError`` (not ``ValueError``) from deep inside the
parser, and a caller that catches only ``ValueError`` dies. The depth is
therefore measured by a flat scan before anything is parsed.
"""

from __future__ import annotations

import json
from typing import Any

MAX_VALUE_BYTES = 64 * 1024  # a real lease value is a few hundred bytes
MAX_DEPTH = 16  # a lease is three levels deep (value, BackendData, its fields)


def nesting_depth(text: str) -> int:
    """The deepest ``[``/``{`` nesting of ``text``, outside strings (one pass, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def loads_bounded(
    raw: str | bytes, max_bytes: int = MAX_VALUE_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """``json.loads`` for input from another machine; raises ValueError naming the bound."""
    if len(raw) > max_bytes:
        raise ValueError(f"value is {len(raw)} bytes, more than the {max_bytes} allowed")
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ValueError(f"value is not UTF-8: {e}") from e
    depth = nesting_depth(text)
    if depth > max_depth:
        raise ValueError(f"value is nested {depth} deep, more than the {max_depth} allowed")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"value is not JSON: {e}") from e
