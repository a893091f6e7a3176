"""Durations and byte sizes as written in the config file, parsed into integers.

Durations (result in milliseconds):

- one or more ``<digits><unit>`` parts, units ``d`` ``h`` ``m`` ``s`` ``ms``: ``500ms``, ``30s``,
  ``5m``, ``2h``, ``7d``, ``1m30s``, ``1h30m``. In a combination the units go from largest to
  smallest and each appears at most once (``30s1m`` and ``1s1s`` are typos, not durations).
- A unit is always required. A bare number (``60`` or ``"60"``) is rejected rather than read as
  seconds: ``ack_deadline: 60`` could just as well mean milliseconds, and a silent factor of 1,000
  in a timeout is worse than a clear error at start.
- No fractions (``1.5s``: write ``1500ms``), no signs, no spaces, lower-case units only.
- At most ``MAX_DURATION_MS`` (3650 days): anything larger is a typo, and expiry times computed
  from it must stay within what Firestore timestamps can hold.

Byte sizes (result in bytes): an integer (bytes), or ``<digits><unit>`` with ``B``, ``KB``/``MB``/
``GB`` (powers of 1000) or ``KiB``/``MiB``/``GiB`` (powers of 1024): ``100MiB``.

Both parsers raise ``ValueError`` with a message fit to show the user after the field path.
"""

from __future__ import annotations

import re

MAX_DURATION_MS = 3650 * 24 * 3600 * 1000
"""Ten years: far above any sensible timeout or TTL, far below Firestore's year-9999 timestamp limit."""

_UNIT_MS: dict[str, int] = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}
_UNIT_ORDER = ("d", "h", "m", "s", "ms")

_DURATION_RE = re.compile(r"(?:[0-9]+(?:ms|s|m|h|d))+")
# "ms" must be tried before "m" so that "500ms" is one part, not "500m" followed by garbage.
_PART_RE = re.compile(r"([0-9]+)(ms|s|m|h|d)")

_SIZE_RE = re.compile(r"([0-9]+)(B|KB|MB|GB|KiB|MiB|GiB)")
_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}

_MAX_DIGITS = 18
"""Longer digit runs are out of range anyway; checked before int() so huge inputs stay cheap."""


def parse_duration_ms(value: object) -> int:
    """Milliseconds of a duration such as ``"30s"`` or ``"1m30s"``; raises ValueError."""
    if isinstance(value, bool) or isinstance(value, int | float):
        raise ValueError(f"a duration needs a unit, e.g. '{value}s' or '{value}ms' (got the bare number {value!r})")
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as '30s', got {type(value).__name__}")
    if not _DURATION_RE.fullmatch(value):
        if value.strip().isdigit():
            raise ValueError(f"a duration needs a unit, e.g. '{value.strip()}s' (got {value!r})")
        raise ValueError(f"expected a duration such as '500ms', '30s', '5m', '2h', '7d' or '1m30s', got {value!r}")
    total = 0
    last_rank = -1
    for digits, unit in _PART_RE.findall(value):
        rank = _UNIT_ORDER.index(unit)
        if rank <= last_rank:
            raise ValueError(f"in {value!r} the units must go from largest to smallest, each at most once")
        last_rank = rank
        if len(digits.lstrip("0")) > _MAX_DIGITS:
            raise ValueError(f"duration {value!r} is longer than the maximum of 3650d")
        total += int(digits) * _UNIT_MS[unit]
    if total > MAX_DURATION_MS:
        raise ValueError(f"duration {value!r} is longer than the maximum of 3650d")
    return total


def parse_optional_duration_ms(value: object) -> int | None:
    """Like ``parse_duration_ms`` but ``None`` (YAML ``null``) stays None."""
    return None if value is None else parse_duration_ms(value)


def parse_byte_size(value: object) -> int:
    """Bytes of a size such as ``104857600`` or ``"100MiB"``; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 100MiB or a number of bytes, got {value!r}")
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 100MiB or a number of bytes, got {type(value).__name__}")
    match = _SIZE_RE.fullmatch(value)
    if match is None:
        raise ValueError(f"expected a size such as 100MiB, 10MB or 4096B, got {value!r}")
    digits, unit = match.groups()
    if len(digits.lstrip("0")) > _MAX_DIGITS:
        raise ValueError(f"size {value!r} is too large")
    return int(digits) * _SIZE_UNITS[unit]


def format_duration_ms(ms: int) -> str:
    """The shortest config spelling of ``ms`` (``90000`` -> ``"1m30s"``), for docs and messages."""
    if ms == 0:
        return "0s"
    parts = []
    for unit in _UNIT_ORDER:
        count, ms = divmod(ms, _UNIT_MS[unit])
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
