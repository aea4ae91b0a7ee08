"""The one way the dashboard writes a moment: ISO-8601 to the second, in UTC, ``2026-12-03T19:44:26Z``.

The database hands back aware datetimes (PostgreSQL, SQLite), naive UTC ones
(MariaDB/MySQL's DATETIME(6)); a failure's ``at`` in ``errors`` is ISO text with
milliseconds. Shown as they came, one page had ``2026-12-03 19:44:26.123456+00:00``
beside ``2026-12-03T19:44:26.123+00:00`` and a list ``2026-12-03 19:44:26``.
"""

from __future__ import annotations

from datetime import datetime, timezone

__all__ = ["when"]


def when(value: datetime | str | float | None, missing: str = "-") -> str:
    """``value`` (a datetime, ISO text, or Unix seconds) as ``YYYY-MM-DDTHH:MM:SSZ``; ``missing`` for None."""
    if value is None or value == "":
        return missing
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return value  # not a moment: shown as it is, never hidden
    elif isinstance(value, (int, float)):
        value = datetime.fromtimestamp(value, timezone.utc)
    at = value if value.tzinfo else value.replace(tzinfo=timezone.utc)  # naive: UTC, as sqla-jobs stores it
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
