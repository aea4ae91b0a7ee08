"""Helpers shared by the benchmark child scripts in this folder (standard library only).

The child scripts run under whatever interpreter has their queue installed (a
scratch virtualenv for the peers), so they cannot import sqla_jobs; they import
this module from their own folder instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

POLL_SECONDS = 0.02  # how often the coordinator checks whether a drain is over (as `sqla-jobs bench` does)


def base_parser(description: str) -> argparse.ArgumentParser:
    """Options every child takes: where to work, and how much."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dsn", required=True, help="libpq URI, e.g. postgresql://postgres@127.0.0.1:5432/test")
    p.add_argument("--schema", required=True, help="scratch schema to work in (must already exist and be empty)")
    p.add_argument("--jobs", type=int, default=10_000, help="jobs for the drain and bulk-enqueue measurements")
    p.add_argument("--single-jobs", type=int, default=2_000, help="jobs for the one-per-transaction enqueue")
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--drain-timeout", type=float, default=240.0, help="give up a drain after this many seconds")
    return p


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``"1x200,2x200"`` -> ``[(1, 200), (2, 200)]``: PROCESSESxSIZE pairs."""
    pairs = []
    for item in text.split(","):
        left, _, right = item.strip().lower().partition("x")
        if not left.isdigit() or not right.isdigit() or int(left) < 1 or int(right) < 1:
            raise SystemExit(f"bad drain setting {item!r}: expected PROCESSESxSIZE, e.g. 2x200")
        pairs.append((int(left), int(right)))
    return pairs


def percentile(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``done`` until true; return the seconds it took, or raise after ``timeout``."""
    start = time.perf_counter()
    while not done():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{what} did not finish within {timeout:.0f} s")
        time.sleep(POLL_SECONDS)
    return time.perf_counter() - start


def emit(result: dict[str, Any]) -> None:
    """The one JSON line the parent reads: always the last line of stdout."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
