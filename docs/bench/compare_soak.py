"""``compare.py --soak SECONDS --rate R``: the soak of sqla-jobs and of pgqueuer, one after the other, one plot.

Called by compare.py's ``main`` with compare.py itself as ``plumbing`` (its child
runner, scratch schemas, option parsing), so neither module imports the other.
sqla-jobs runs through ``sqla-jobs bench --soak ... --json``, pgqueuer through
``soak_pgqueuer.py`` in the peers' virtualenv; both write the same windows,
which go to ``compare-soak.json`` / ``.csv`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from sqla_jobs._durations import parse_duration
from sqla_jobs.bench.soak_report import SoakReport, write_outputs


def _sqla_jobs(args: argparse.Namespace, plumbing: ModuleType) -> SoakReport:
    processes, concurrency = plumbing.parse_settings(args.sqla_jobs_soak)[0]
    with tempfile.TemporaryDirectory(prefix="sqla-jobs-soak-") as out:
        cmd = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url", args.url,
               "--soak", str(args.soak), "--rate", args.rate, "--window", str(args.window),
               "--processes", str(processes), "--concurrency", str(concurrency),
               "--soak-prune", args.soak_prune, "--soak-vacuum", args.soak_vacuum, "--out", out, "--json"]
        plumbing.say(f"  sqla-jobs bench --soak {args.soak:g} --rate {args.rate}, {processes} x {concurrency}")
        result = plumbing.run_child(cmd, args.soak + args.child_timeout,
                                    lambda pid: plumbing.drop_schema(plumbing.libpq_dsn(args.url),
                                                                     f"sqla_jobs_bench_{pid}"))
    return SoakReport.from_dict(result)


def _pgqueuer(args: argparse.Namespace, plumbing: ModuleType, python: str) -> SoakReport:
    processes, batch = plumbing.parse_settings(args.pgqueuer_soak)[0]
    dsn = plumbing.libpq_dsn(args.url)
    plumbing.say(f"  pgqueuer soak --rate {args.rate}, {processes} process(es) x batch {batch}")
    with plumbing.scratch_schema(dsn, "pgqueuer_soak") as schema:
        cmd = [python, str(plumbing.HERE / "soak_pgqueuer.py"), "--dsn", dsn, "--schema", schema,
               "--soak", str(args.soak), "--rate", args.rate, "--window", str(args.window),
               "--processes", str(processes), "--batch-size", str(batch)]
        if args.soak_vacuum != "none":
            cmd += ["--vacuum-every", str(parse_duration(args.soak_vacuum))]
        return SoakReport.from_dict(plumbing.run_child(cmd, args.soak + args.child_timeout))


def _row(name: str, report: SoakReport) -> str:
    s, t = report.summary(), report.totals

    def f(value: Any, digits: int = 0) -> str:
        return "—" if not isinstance(value, (int, float)) else f"{value:,.{digits}f}"

    size = "—"
    if "bytes_after_first_minute_min" in s:
        size = (f"{s['bytes_after_first_minute_min'] / 1e6:.1f} to {s['bytes_after_first_minute_max'] / 1e6:.1f} MB "
                f"(last {s['bytes_last'] / 1e6:.1f})")
    return (f"| {report.system or name} | {f(t['enqueued'])} | {f(s.get('run_per_s_median'))} | "
            f"{f(s.get('pickup_p50_ms_median'), 1)} / {f(s.get('pickup_p99_ms_worst'), 1)} | "
            f"{f(s.get('pending_max'))} / {f(s.get('pending_last'))} | {size} | {f(s.get('autovacuum_runs'))} | "
            f"{'yes' if report.complete else 'NO'} |")


def run(args: argparse.Namespace, plumbing: ModuleType, peer_python: str | None, peers: list[str]) -> int:
    """Both soaks, the table, the files; 0 when each ran every job it enqueued, exactly once."""
    reports: dict[str, SoakReport] = {}
    failed = False
    steps: list[tuple[str, Any]] = []
    if not args.no_sqla_jobs:
        steps.append(("sqla-jobs", lambda: _sqla_jobs(args, plumbing)))
    if "pgqueuer" in peers and peer_python:
        steps.append(("pgqueuer", lambda: _pgqueuer(args, plumbing, peer_python)))
    for name, step in steps:
        try:
            reports[name] = step()
        except plumbing.ChildFailed as exc:
            plumbing.say(f"  {name} soak failed: {exc}")
            failed = True
    if not reports:
        return 1
    for report in reports.values():
        report.settings.setdefault("window", args.window)
        report.settings.setdefault("seconds", args.soak)
        report.settings.setdefault("rate", None if args.rate == "max" else float(args.rate))
        failed = failed or not report.complete
    files = write_outputs(reports, Path(args.out), "compare-soak")
    print(f"\nSoak: {args.soak:g} s at {args.rate} jobs/s, windows of {args.window:g} s "
          "(medians and extremes over the producer's windows; sizes after the first minute)\n")
    print("| system | jobs | run/s (median window) | pickup p50 median / p99 worst, ms | pending max / last | "
          "table + indexes | autovacuums | every job ran once |")
    print("|---|---|---|---|---|---|---|---|")
    for name, report in reports.items():
        print(_row(name, report))
    for kind, path in files.items():
        plumbing.say(f"wrote {kind}: {path}")
    return 1 if failed else 0
