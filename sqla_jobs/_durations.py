"""Durations as people type them: ``90s``, ``15m``, ``12h``, ``30d``, ``1h30m``, or plain seconds.

Used by every CLI option that takes an age or a window (``--older-than``,
``--max-oldest-age``, ``--window``, ``--since``) and by ``Worker(prune_after=...)``
when given a string.
"""

from __future__ import annotations

import math
import re

from .errors import ConfigError

__all__ = ["format_duration", "parse_duration"]

_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|w|d|h|m|s)")


def parse_duration(text: str | float | int) -> float:
    """Seconds in ``text``; raises ConfigError with an example when it cannot be read."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().lower().replace(" ", "")
        try:
            seconds = float(raw)
        except ValueError:
            parts = _PART.findall(raw)
            if not raw or "".join(n + u for n, u in parts) != raw:
                raise ConfigError(
                    f"{text!r} is not a duration; write e.g. 90s, 15m, 12h, 30d or 1h30m"
                ) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"{text!r} is not a duration: it must be a finite number of seconds >= 0")
    return seconds


def format_duration(seconds: float | None) -> str:
    """A short readable form: ``850ms``, ``42s``, ``15m 3s``, ``2h 5m``, ``3d 4h``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    total = int(seconds)
    for big, small, b, s in ((86400, 3600, "d", "h"), (3600, 60, "h", "m"), (60, 1, "m", "s")):
        if total >= big:
            rest = (total % big) // small
            return f"{total // big}{b} {rest}{s}" if rest else f"{total // big}{b}"
    return f"{total}s"  # pragma: no cover
