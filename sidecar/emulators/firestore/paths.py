"""Field paths: parsing the dotted, backtick-quoted strings of masks, filters and transforms.

Grammar (Firestore's): segments separated by ``.``; a segment is either a simple name
``[A-Za-z_][A-Za-z_0-9]*`` or backtick-quoted, where ``\\``` and ``\\\\`` escape a backtick and a
backslash. ``a.`b.c`.d`` is three segments ``a``, ``b.c``, ``d``. Splitting on "." alone would
break quoted names, a known mistake of other emulators. ``__name__`` is the document name.
Parsed paths are cached: the same few paths recur in every request of a workload.
"""

from __future__ import annotations

import re

from sidecar.emulators.firestore.errors import invalid

FieldPath = tuple[str, ...]

NAME_PATH: FieldPath = ("__name__",)
_SIMPLE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*\Z")
_CACHE: dict[str, FieldPath] = {}
_CACHE_MAX = 10_000
"""Bound on cached paths, so that a client sending endless distinct paths cannot grow memory."""


def parse_field_path(text: str) -> FieldPath:
    """Split a field path string into segments; raises INVALID_ARGUMENT naming the path."""
    cached = _CACHE.get(text)
    if cached is not None:
        return cached
    path = _parse(text)
    if len(_CACHE) < _CACHE_MAX:
        _CACHE[text] = path
    return path


def _parse(text: str) -> FieldPath:
    if not text:
        raise invalid("Invalid field path: the path is empty.")
    segments: list[str] = []
    i = 0
    n = len(text)
    while True:
        if i < n and text[i] == "`":
            i += 1
            chars: list[str] = []
            while True:
                if i >= n:
                    raise invalid(f"Invalid field path {text!r}: unterminated backtick.")
                ch = text[i]
                if ch == "\\":
                    if i + 1 >= n:
                        raise invalid(f"Invalid field path {text!r}: dangling escape.")
                    chars.append(text[i + 1])
                    i += 2
                    continue
                if ch == "`":
                    i += 1
                    break
                chars.append(ch)
                i += 1
            segment = "".join(chars)
            if not segment:
                raise invalid(f"Invalid field path {text!r}: empty quoted segment.")
            segments.append(segment)
        else:
            end = text.find(".", i)
            if end < 0:
                end = n
            segment = text[i:end]
            if not _SIMPLE.match(segment):
                raise invalid(f"Invalid field path {text!r}: segment {segment!r} must be quoted with backticks.")
            segments.append(segment)
            i = end
        if i == n:
            return tuple(segments)
        if text[i] != ".":
            raise invalid(f"Invalid field path {text!r}: expected '.' at offset {i}.")
        i += 1
        if i == n:
            raise invalid(f"Invalid field path {text!r}: trailing '.'.")


def format_field_path(path: FieldPath) -> str:
    """The canonical string of a path (simple segments bare, others quoted)."""
    out = []
    for segment in path:
        if _SIMPLE.match(segment):
            out.append(segment)
        else:
            out.append("`" + segment.replace("\\", "\\\\").replace("`", "\\`") + "`")
    return ".".join(out)
