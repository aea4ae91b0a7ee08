"""Side-by-side benchmark: sqla-jobs against pgqueuer, procrastinate and raw SQL, on one PostgreSQL.

::

    python docs/bench/compare.py --url postgresql://postgres@127.0.0.1:5432/test \\
        [--jobs 10000] [--runs 3] [--peers pgqueuer,procrastinate] [--json out.json] [--venv PATH]

Run it with the interpreter that has sqla-jobs installed. It

1. creates a scratch virtualenv (a temporary one, or ``--venv PATH`` to keep and
   reuse it) and installs the peers there with pip at pinned versions; they never
   become dependencies of sqla-jobs;
2. for each of ``--runs`` runs, measures every system in a child process with a
   timeout: sqla-jobs through ``sqla-jobs bench --json`` (its own scratch schema),
   the raw-SQL baselines through ``raw_sql.py``, each peer through
   ``peer_<name>.py`` run by the scratch virtualenv's python; each child gets a
   fresh scratch schema ``sqla_jobs_cmp_<system>_<pid>`` that is dropped right
   after it, whatever happened;
3. prints one table of medians, and the ratios issue #4's targets are about.

With ``--soak SECONDS --rate R`` it instead runs the soak (issue #11) of
sqla-jobs (``sqla-jobs bench --soak``) and of pgqueuer (``soak_pgqueuer.py``),
one after the other, and writes both into one JSON, CSV and plot (compare_soak.py).

``--private-cluster`` instead of ``--url``: the same on a PostgreSQL ``initdb``ed into a
temporary folder with the server's defaults (autovacuum on, as users run it), removed at the end.

A peer that fails to install or to run is reported and left out; the others go
on. See docs/bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent

# Pinned so that a re-run months later measures the same code.
PEERS: dict[str, list[str]] = {
    "pgqueuer": ["pgqueuer==1.6.0", "asyncpg==0.32.0"],
    "procrastinate": ["procrastinate==3.10.0", "psycopg[binary]==3.3.9"],
}
DEFAULT_DRAIN = {"sqla-jobs": "2x64,2x256,2x512", "pgqueuer": "1x200,2x200,2x1000", "procrastinate": "1x10,2x10"}

# `sqla-jobs bench --json` medians -> the comparison's metric names.
SQLA_JOBS_KEYS = {
    "enqueue one per transaction (jobs/s)": "single_enqueue",
    "enqueue add_all (jobs/s)": "bulk_enqueue",
    "add_all, plain mapped class: the floor (jobs/s)": "bulk_enqueue_floor",
    "job added to a business transaction (us)": "business_job_us",
    "plain mapped row added to a business transaction (us)": "business_plain_us",
    "raw INSERT added to a business transaction (us)": "business_raw_us",
    "enqueue_many (jobs/s)": "enqueue_many",
    "raw SQL insert one per transaction (jobs/s)": "bench_raw_single_insert",
    "driver alone, one per transaction (jobs/s)": "single_driver",
    "pickup p50 (ms)": "pickup_p50_ms",
    "pickup p95 (ms)": "pickup_p95_ms",
    "worker peak RSS (MB)": "worker_peak_rss_mb",
}


class ChildFailed(Exception):
    """A benchmark child exited non-zero, timed out, or printed no result."""


@dataclass
class System:
    name: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    def medians(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        keys = {k for run in self.runs for k in run if k not in ("drain", "system")}
        for key in sorted(keys):
            values = [run[key] for run in self.runs if isinstance(run.get(key), (int, float))]
            if values:
                out[key] = statistics.median(values)
        drains: dict[str, list[float]] = {}
        for run in self.runs:
            for setting, rate in run.get("drain", {}).items():
                drains.setdefault(setting, []).append(rate)
        if drains:
            out["drain"] = {s: statistics.median(v) for s, v in drains.items()}
            best = max(out["drain"], key=out["drain"].get)
            out["drain_best"], out["drain_best_setting"] = out["drain"][best], best
        labels = [run["system"] for run in self.runs if "system" in run]
        if labels:
            out["label"] = labels[0]
        return out


# -- plumbing ----------------------------------------------------------------------------


def libpq_dsn(url: str) -> str:
    """``postgresql+psycopg://...`` (SQLAlchemy spelling) -> ``postgresql://...`` for psycopg/asyncpg."""
    return re.sub(r"^postgres(ql)?\+\w+://", "postgresql://", url)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_child(cmd: list[str], timeout: float, on_failure: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run one benchmark child and return the JSON object it printed last.

    ``on_failure(pid)`` runs if the child did not succeed, e.g. to drop what a killed child left behind.
    """
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=HERE, start_new_session=True)
    except OSError as exc:
        raise ChildFailed(f"could not start {cmd[0]}: {exc}") from None
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: this takes its worker processes too
            proc.communicate()
            raise ChildFailed(f"timed out after {timeout:.0f} s (raise --child-timeout, or lower --jobs)") from None
        if proc.returncode != 0:
            raise ChildFailed(f"exited with {proc.returncode}:\n{tail(err)}")
        result = parse_result(out)
        if result is None:
            raise ChildFailed(f"printed no JSON result. stdout:\n{tail(out)}\nstderr:\n{tail(err)}")
        return result
    except ChildFailed:
        if on_failure:
            on_failure(proc.pid)
        raise


def parse_result(out: str) -> dict[str, Any] | None:
    lines = [line for line in out.splitlines() if line.strip()]
    if lines:
        try:
            value = json.loads(lines[-1])
            if isinstance(value, dict):
                return value
        except json.JSONDecodeError:
            pass
    start = re.search(r"^\{", out, re.M)  # `sqla-jobs bench --json` prints indented JSON after progress lines
    if start:
        try:
            value = json.loads(out[start.start():])
            if isinstance(value, dict):
                return value
        except json.JSONDecodeError:
            return None
    return None


def tail(text: str, lines: int = 15) -> str:
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


@contextmanager
def scratch_schema(dsn: str, system: str) -> Iterator[str]:
    """A fresh, empty schema for one child, dropped afterwards even if the child failed."""
    schema = "sqla_jobs_cmp_" + re.sub(r"\W", "_", system.lower()) + f"_{os.getpid()}"
    ident = sql.Identifier(schema)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident))
    try:
        yield schema
    finally:
        drop_schema(dsn, schema)


def drop_schema(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET client_min_messages = warning")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# -- the peers' virtualenv ---------------------------------------------------------------


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def prepare_venv(path: Path, peers: list[str], timeout: float) -> dict[str, str]:
    """Create (or reuse) the scratch virtualenv and install each peer; return {peer: error} for failures."""
    failures: dict[str, str] = {}
    if not venv_python(path).exists():
        say(f"creating scratch virtualenv {path}")
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    for peer in peers:
        reqs = PEERS[peer]
        say(f"installing {' '.join(reqs)} into {path}")
        try:
            proc = subprocess.run([str(venv_python(path)), "-m", "pip", "install", "--quiet",
                                   "--disable-pip-version-check", *reqs],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            failures[peer] = f"pip install {' '.join(reqs)} timed out after {timeout:.0f} s"
            continue
        if proc.returncode != 0:
            failures[peer] = f"pip install {' '.join(reqs)} failed:\n{tail(proc.stderr)}"
    return failures


# -- one run of each system ------------------------------------------------------------------


def run_sqla_jobs(args: argparse.Namespace) -> dict[str, Any]:
    """One run of `sqla-jobs bench --json` per drain setting; enqueue and latency come from the first."""
    result: dict[str, Any] = {"drain": {}}
    for i, (processes, concurrency) in enumerate(parse_settings(args.sqla_jobs_drain)):
        cmd = [sys.executable, "-m", "sqla_jobs.cli", "--log-level", "WARNING", "bench", "--url", args.url,
               "--jobs", str(args.jobs), "--runs", "1", "--processes", str(processes),
               "--concurrency", str(concurrency), "--latency-samples", str(args.latency_samples), "--json"]
        if args.sqla_jobs_vacuum_dead_rows:
            cmd += ["--vacuum-dead-rows", str(args.sqla_jobs_vacuum_dead_rows)]
        if args.sqla_jobs_discard_finished:
            cmd += ["--discard-finished"]
        say(f"  sqla-jobs bench, {processes} process(es) x {concurrency} threads")
        # The bench drops its scratch schema itself, unless it is killed: then we do.
        proc_result = run_child(cmd, args.child_timeout,
                                lambda pid: drop_schema(libpq_dsn(args.url), f"sqla_jobs_bench_{pid}"))
        medians = proc_result.get("medians")
        if not isinstance(medians, dict) or "drain (jobs/s)" not in medians:
            raise ChildFailed(f"`sqla-jobs bench --json` output has no medians['drain (jobs/s)']: {proc_result}")
        result["drain"][f"{processes}x{concurrency}"] = medians["drain (jobs/s)"]
        if i == 0:
            for key, name in SQLA_JOBS_KEYS.items():
                if key in medians:
                    result[name] = medians[key]
    try:
        from importlib.metadata import version

        result["system"] = f"sqla-jobs {version('sqla-jobs')}"
    except Exception:
        result["system"] = "sqla-jobs"
    return result


def run_script(python: str, script: str, system: str, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    dsn = libpq_dsn(args.url)
    with scratch_schema(dsn, system) as schema:
        cmd = [python, str(HERE / script), "--dsn", dsn, "--schema", schema, "--jobs", str(args.jobs),
               "--single-jobs", str(min(args.jobs, 2000)), "--latency-samples", str(args.latency_samples),
               "--drain-timeout", str(args.child_timeout), *extra]
        return run_child(cmd, args.child_timeout)


def parse_settings(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        left, _, right = item.strip().lower().partition("x")
        if not (left.isdigit() and right.isdigit() and int(left) > 0 and int(right) > 0):
            raise SystemExit(f"bad drain setting {item!r}: expected PROCESSESxSIZE, e.g. 2x8")
        pairs.append((int(left), int(right)))
    return pairs


# -- report --------------------------------------------------------------------------------


def fmt(value: Any, digits: int = 0) -> str:
    return "—" if not isinstance(value, (int, float)) else f"{value:,.{digits}f}"


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def ratios(sq: dict[str, Any], raw: dict[str, Any], pgq: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [
        ("sqla-jobs drain / pgqueuer best drain", ratio(sq.get("drain_best"), pgq.get("drain_best")), 2.0),
        ("sqla-jobs drain / raw claim-100 ceiling", ratio(sq.get("drain_best"), raw.get("claim100_drain")), 0.4),
        ("sqla-jobs add_all / pgqueuer bulk enqueue", ratio(sq.get("bulk_enqueue"), pgq.get("bulk_enqueue")), 1.0),
        ("sqla-jobs enqueue_many (jobs/s)", sq.get("enqueue_many"), 100_000.0),
        ("sqla-jobs one-per-transaction / raw single insert",
         ratio(sq.get("single_enqueue"), raw.get("single_insert")), 0.7),
        ("sqla-jobs one-per-transaction / pgqueuer single", ratio(sq.get("single_enqueue"), pgq.get("single_enqueue")),
         1.0),
        ("sqla-jobs add_all / plain mapped class (floor)", ratio(sq.get("bulk_enqueue"), sq.get("bulk_enqueue_floor")),
         1.0),
        # Issue 11: a job added to a business transaction costs <= 1.5 x a raw INSERT; shown the other way
        # up (raw / job >= 1 / 1.5) so that every target reads "at least".
        ("raw INSERT / sqla-jobs job, added to a business txn", ratio(sq.get("business_raw_us"),
                                                                    sq.get("business_job_us")), 1 / 1.5),
    ]
    return [{"name": n, "value": v, "target": t, "met": None if v is None else v >= t} for n, v, t in rows]


def render(systems: dict[str, System], args: argparse.Namespace) -> tuple[str, list[dict[str, Any]]]:
    med = {name: s.medians() for name, s in systems.items()}
    sq, raw, pgq = med.get("sqla-jobs", {}), med.get("raw", {}), med.get("pgqueuer", {})
    header = ("system", "drain jobs/s (best setting)", "pickup p50 / p95 ms", "bulk enqueue jobs/s",
              "one-per-transaction enqueue jobs/s")
    rows: list[tuple[str, ...]] = []
    if "sqla-jobs" in systems:
        rows.append((
            sq.get("label", "sqla-jobs"),
            f"{fmt(sq.get('drain_best'))} ({sq.get('drain_best_setting', '?')} procs x threads)",
            f"{fmt(sq.get('pickup_p50_ms'), 1)} / {fmt(sq.get('pickup_p95_ms'), 1)}",
            f"add_all {fmt(sq.get('bulk_enqueue'))}; enqueue_many {fmt(sq.get('enqueue_many'))}",
            fmt(sq.get("single_enqueue")),
        ))
    if "raw" in systems:
        rows.append(("raw SQL, claim 1 + finish 1 per job, 1 process", fmt(raw.get("claim1_drain")), "—", "—",
                     f"{fmt(raw.get('single_insert'))} (autocommit {fmt(raw.get('single_insert_autocommit'))})"))
        rows.append(("raw SQL, claim 100 + finish 100, 4 processes", fmt(raw.get("claim100_drain")), "—",
                     f"COPY {fmt(raw.get('copy_insert'))}", "—"))
    for name in PEERS:
        if name in systems:
            m = med[name]
            unit = "procs x batch_size" if name == "pgqueuer" else "procs x concurrency"
            rows.append((
                m.get("label", name),
                f"{fmt(m.get('drain_best'))} ({m.get('drain_best_setting', '?')} {unit})",
                f"{fmt(m.get('pickup_p50_ms'), 1)} / {fmt(m.get('pickup_p95_ms'), 1)}",
                fmt(m.get("bulk_enqueue")), fmt(m.get("single_enqueue")),
            ))
    labels = {"sqla-jobs": "sqla-jobs", "raw": "raw SQL", **{p: p for p in PEERS}}
    rows = [r for r in rows if not any(r[0].startswith(labels[n]) for n, s in systems.items() if not s.runs)]
    rows += [(labels[n], "failed: see below", "—", "—", "—") for n, s in systems.items() if not s.runs]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"
    out = [f"\n{args.jobs} no-op jobs, median of {args.runs} run(s)\n", line,
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    for name in systems:
        drains = med[name].get("drain", {})
        if len(drains) > 1:
            out.append(f"  {name} drain by setting: " + ", ".join(f"{k}: {fmt(v)}" for k, v in drains.items()))
    checks = ratios(sq, raw, pgq)
    if "business_job_us" in sq:
        out.append(f"  sqla-jobs, added to a transaction that writes a business row: job {fmt(sq['business_job_us'])} "
                   f"us, plain mapped row {fmt(sq.get('business_plain_us'))} us, raw INSERT "
                   f"{fmt(sq.get('business_raw_us'))} us")
    out.append("\nTargets (issues 4 and 11):")
    for c in checks:
        verdict = "n/a (missing input)" if c["met"] is None else ("met" if c["met"] else "MISSED")
        digits = 0 if c["target"] >= 100 else 2
        out.append(f"  {c['name']:<52} {fmt(c['value'], digits):>10}  target >= {fmt(c['target'], digits):<8} "
                   f"{verdict}")
    ceiling = ratio(sq.get("single_driver"), pgq.get("single_enqueue"))
    if ceiling is not None:
        # A Session's transaction is the driver's BEGIN, INSERT and COMMIT plus SQLAlchemy's work, so it
        # cannot beat the driver alone: below 1 here, the single-enqueue target is out of any ORM's reach.
        out.append(f"  (ceiling: psycopg alone, BEGIN + INSERT + COMMIT / pgqueuer single {fmt(ceiling, 2):>8})")
    errors = [f"  {name}: {s.error}" for name, s in systems.items() if s.error]
    if errors:
        out.append("\nFailures (left out above or partial):")
        out += errors
    return "\n".join(out), checks


# -- main --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Details: docs/bench/README.md")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="PostgreSQL URL, e.g. postgresql://postgres@127.0.0.1:5432/test")
    where.add_argument("--private-cluster", action="store_true",
                       help="initdb a throwaway PostgreSQL with the server's defaults (autovacuum on), measure "
                            "there, remove it (history_cost.py's)")
    p.add_argument("--jobs", type=int, default=10_000, help="jobs per drain / bulk enqueue (default 10000)")
    p.add_argument("--runs", type=int, default=3, help="runs per system; medians are reported (default 3)")
    p.add_argument("--peers", default="pgqueuer,procrastinate",
                   help=f"comma-separated peers to include, from {', '.join(PEERS)}; '' for none")
    p.add_argument("--no-raw", action="store_true", help="skip the raw-SQL baselines")
    p.add_argument("--no-sqla-jobs", action="store_true", help="skip sqla-jobs itself")
    p.add_argument("--json", metavar="PATH", help="also write every run and the medians to this file")
    p.add_argument("--venv", metavar="PATH", help="virtualenv for the peers: created if missing, kept, reused")
    p.add_argument("--latency-samples", type=int, default=200, help="jobs for the pickup latency (default 200)")
    p.add_argument("--child-timeout", type=float, default=300.0,
                   help="seconds one system's run may take before it is killed (default 300)")
    p.add_argument("--install-timeout", type=float, default=300.0, help="seconds for pip per peer (default 300)")
    p.add_argument("--sqla-jobs-drain", default=DEFAULT_DRAIN["sqla-jobs"],
                   help="PROCESSESxTHREADS settings for sqla-jobs bench (default %(default)s)")
    p.add_argument("--sqla-jobs-vacuum-dead-rows", type=int, metavar="N",
                   help="sqla-jobs' drain workers VACUUM the jobs table at N dead rows (`--vacuum-dead-rows`); "
                        "pgqueuer has no such setting and is left to autovacuum")
    p.add_argument("--sqla-jobs-discard-finished", action="store_true",
                   help="sqla-jobs' drain workers keep no finished jobs (`--prune-finished-older-than 0`), as "
                        "pgqueuer deletes each job from its queue table when it is done")
    p.add_argument("--pgqueuer-drain", default=DEFAULT_DRAIN["pgqueuer"],
                   help="PROCESSESxBATCH_SIZE settings for pgqueuer (default %(default)s)")
    p.add_argument("--soak", type=float, metavar="SECONDS",
                   help="run the soak instead: each system takes --rate jobs/s for SECONDS (see compare_soak.py)")
    p.add_argument("--rate", default="2000", help="with --soak: jobs per second, or 'max' (default 2000)")
    p.add_argument("--window", type=float, default=10.0, help="with --soak: seconds per window (default 10)")
    p.add_argument("--soak-prune", default="60s",
                   help="with --soak: sqla-jobs deletes finished jobs older than this (default 60s; pgqueuer "
                        "deletes each job as it finishes)")
    p.add_argument("--soak-vacuum", default="none",
                   help="with --soak: VACUUM each system's queue table every this often (e.g. 10s), for a server "
                        "whose autovacuum is off; 'none' leaves it to autovacuum (default)")
    p.add_argument("--out", default="soak-results", help="with --soak: where compare-soak.json/.csv/.png go")
    p.add_argument("--sqla-jobs-soak", default="2x64", help="with --soak: PROCESSESxTHREADS (default 2x64)")
    p.add_argument("--pgqueuer-soak", default="2x200", help="with --soak: PROCESSESxBATCH_SIZE (default 2x200)")
    p.add_argument("--procrastinate-drain", default=DEFAULT_DRAIN["procrastinate"],
                   help="PROCESSESxCONCURRENCY settings for procrastinate (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.private_cluster:
        return run(args)
    sys.path.insert(0, str(HERE))
    from history_cost import private_cluster

    with private_cluster() as url:
        args.url = url
        return run(args)


def run(args: argparse.Namespace) -> int:
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        say(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEERS)}")
        return 2
    if args.jobs < 10 or args.runs < 1:
        say("--jobs must be at least 10 and --runs at least 1")
        return 2
    if args.soak is not None:
        peers = [p for p in peers if p == "pgqueuer"]  # the soak has a pgqueuer side only
    for text in (args.sqla_jobs_drain, args.pgqueuer_drain, args.procrastinate_drain, args.sqla_jobs_soak,
                 args.pgqueuer_soak):
        parse_settings(text)
    dsn = libpq_dsn(args.url)
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        say(f"cannot connect to {args.url}: {str(exc).strip()}")
        return 2

    started = time.perf_counter()
    systems: dict[str, System] = {}
    if not args.no_sqla_jobs:
        systems["sqla-jobs"] = System("sqla-jobs")
    if not args.no_raw:
        systems["raw"] = System("raw")
    for p in peers:
        systems[p] = System(p)

    temp_dir = None
    if peers:
        if args.venv:
            venv_path = Path(args.venv).resolve()
        else:
            temp_dir = tempfile.mkdtemp(prefix="sqla-jobs-compare-")
            venv_path = Path(temp_dir) / "venv"
        try:
            for peer, error in prepare_venv(venv_path, peers, args.install_timeout).items():
                systems[peer].error = error
                say(f"{peer}: {error}\n  (continuing without it)")
        except Exception as exc:  # e.g. no venv/ensurepip support in this Python
            for peer in peers:
                systems[peer].error = f"could not create the virtualenv {venv_path}: {exc}"
            say(f"could not create the virtualenv {venv_path}: {exc} (continuing without the peers)")
        peer_python = str(venv_python(venv_path))

    if args.soak is not None:
        sys.path.insert(0, str(HERE))  # compare.py may have been loaded by path (the tests do)
        import compare_soak

        try:
            return compare_soak.run(args, sys.modules[__name__], peer_python if peers else None, peers)
        finally:
            if temp_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)

    try:
        for run in range(args.runs):
            say(f"run {run + 1}/{args.runs}")
            # Rotate who goes first, so that a slow patch of the machine doesn't always hit the same system.
            names = list(systems)
            shift = run % len(names) if names else 0
            for name in names[shift:] + names[:shift]:
                system = systems[name]
                if system.error:
                    continue  # failed to install, or failed in an earlier run: don't spend time on it again
                say(f"  {name}")
                try:
                    if name == "sqla-jobs":
                        result = run_sqla_jobs(args)
                    elif name == "raw":
                        result = run_script(sys.executable, "raw_sql.py", "raw", args, [])
                    else:
                        drain = getattr(args, f"{name}_drain")
                        result = run_script(peer_python, f"peer_{name}.py", name, args, ["--drain", drain])
                except ChildFailed as exc:
                    system.error = f"run {run + 1} failed: {exc}"
                    say(f"  {name} {system.error}\n  (continuing without it)")
                    continue
                system.runs.append(result)
    finally:
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)

    table, checks = render(systems, args)
    print(table)
    print(f"\n(took {time.perf_counter() - started:.0f} s)")
    if args.json:
        report = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "systems": {n: {"medians": s.medians(), "runs": s.runs, "error": s.error} for n, s in systems.items()},
            "targets": checks,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        say(f"wrote {args.json}")
    return 1 if any(s.error for s in systems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
