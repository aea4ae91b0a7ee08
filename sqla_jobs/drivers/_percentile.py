"""Run-time percentiles in Python, for databases without ``percentile_cont`` (SQLite, MariaDB/MySQL)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["percentile", "run_times_in_python"]


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Linear interpolation between closest ranks: the same as PostgreSQL's ``percentile_cont``."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    position = fraction * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def run_times_in_python(rows: Iterable[Any]) -> list[tuple[str, int, float, float, float, float]]:
    """(kind, count, mean, p50, p95, max) from (kind, seconds) rows, for databases without ``percentile_cont``."""
    by_kind: dict[str, list[float]] = {}
    for kind, seconds in rows:
        by_kind.setdefault(kind, []).append(max(0.0, float(seconds)))
    result = []
    for kind in sorted(by_kind):
        values = sorted(by_kind[kind])
        result.append((kind, len(values), sum(values) / len(values), percentile(values, 0.5),
                       percentile(values, 0.95), values[-1]))
    return result
