"""JSON inside a request field (a tool call's `arguments` text, a tool_use block's `input`, a
model's tool-call output) parsed and walked under one depth bound, limits.MAX_JSON_DEPTH.

Why: Python's parser and every renderer after it (json.dumps, a chat template's `tojson`)
recurse once per level, so text nested thousands deep raises RecursionError wherever it is
first touched, a 500 with a traceback. Here it is a ValueError naming the bound, before
anything renders it. The walk is a loop, never recursion.
"""

from __future__ import annotations

import json
from typing import Any

from kserve_paged_engine import limits


class JSONTooDeep(ValueError):
    """JSON nested deeper than limits.MAX_JSON_DEPTH. A ValueError, so a parser that reads
    unparseable text as "not JSON" (a model's output) treats it the same way."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is nested more than {limits.MAX_JSON_DEPTH} levels deep "
                         f"(the bound on JSON in a request field)")


def check_depth(value: Any, what: str) -> None:
    """Raise JSONTooDeep when ``value`` (parsed JSON) nests deeper than the bound."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, list) else None)
        if children is None:
            continue
        if depth > limits.MAX_JSON_DEPTH:
            raise JSONTooDeep(what)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))


def loads(text: str | bytes, what: str) -> Any:
    """``json.loads`` with the depth bound: JSONTooDeep (a ValueError) when deeper, the
    parser's own ValueError when not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than the interpreter's own limit: far past ours
        raise JSONTooDeep(what) from None
    check_depth(value, what)
    return value


def raw_decode(decoder: json.JSONDecoder, text: str, pos: int, what: str) -> tuple[Any, int]:
    """``decoder.raw_decode`` (one value at ``pos`` and where it ends) with the depth bound."""
    try:
        value, end = decoder.raw_decode(text, pos)
    except RecursionError:
        raise JSONTooDeep(what) from None
    check_depth(value, what)
    return value, end
