"""The matrix of scenarios by configurations (tests/reliability/test_matrix.py): what a cell measures, and its table.

Each cell drains the same jobs through three worker processes while one fault scenario is injected, then
reads back what happened and fills a :class:`Report`:

``lost``
    jobs neither in the jobs table nor dead-lettered.
``run twice``
    transactional jobs (``once_slow``) whose effect committed other than exactly once.
``overlapping``
    jobs two of whose runs (``span``: each run logs its start and end, wall clock, one host) were executing
    at the same instant. A run on a process the scenario froze (SIGSTOP) is not executing while frozen, nor
    in its first ``RESUME_SLACK`` seconds back: a resumed thread runs on from where it stopped before any
    check can reach it (fencing discards what it writes; a handler's next look at ``job.cancelled`` stops
    it), so the scenario counts a stale run that goes on past that.
``misreported``
    runs a worker logged as finished that did not finish, or a job reported finished twice.
``wrongly charged``
    attempts charged that the scenario did not earn: an attempt is charged only for a run lost with its
    process or its link (a SIGKILL, a poison job's crash, a freeze or a silent partition past the lease), and
    then its error entry says ``WorkerLost``; connection kills, SIGTERM, server restarts, outages and bad
    payloads charge nothing.
``recovery``
    after each fault, the seconds until every job that was running when it struck has finished (run again
    elsewhere, or finished by its own worker); the worst fault's.

``python -m tests.reliability.matrix REPORTS.jsonl`` prints the Markdown table of docs/guarantees.md from the
lines a run wrote with ``SQLA_JOBS_MATRIX_REPORT=REPORTS.jsonl``.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from tests import app

from .harness import FINISHED_LINE, states

SCENARIOS = {
    "kill": "SIGKILL storm",
    "connections": "connection kills",
    "sigterm": "graceful SIGTERM",
    "stale": "stale worker past its lease",
    "fuzz": "fuzzed payloads",
    "restart": "server crash and restart",
    "outage": "outage twice the lease",
    "partition": "silent partition of a worker",
    "poison": "poison job under --processes",
}
#: The relay's own fault test reports into the same table: kills of the relay and cuts of its broker connection.
RELAY_BROKERS = ("rabbitmq", "nats")
RELAY_SCENARIO = "relay kills and broker cuts"
CONFIGURATIONS = ("sqlite", "postgresql", "postgresql-partitioned", "mariadb", "pgbouncer")
FLAVOURS = ("threaded", "async")
#: Cells that cannot apply, and why (the note and the docs repeat these).
NOT_APPLICABLE = {
    ("connections", "sqlite"): "a SQLite file has no connections to cut",
    ("restart", "sqlite"): "a SQLite file has no server to restart (its outage is the write lock held)",
    ("partition", "sqlite"): "a SQLite file is local: no network between worker and database",
}


@dataclass
class Report:
    scenario: str
    configuration: str
    flavour: str
    jobs: int = 0
    faults: int = 0
    lost: int = 0
    run_twice: int = 0
    overlapping: int = 0
    misreported: int = 0
    wrongly_charged: int = 0
    recovery_s: float = 0.0
    reruns: int = 0  # runs beyond the first of a job: at-least-once at work, not a fault
    struck: int = 0  # faults that came while a run was going: a cell whose faults all missed proved nothing
    problems: list[str] = field(default_factory=list)

    def clean(self) -> bool:
        return not (self.lost or self.run_twice or self.overlapping or self.misreported or self.wrongly_charged)


@dataclass
class Span:
    job_id: int
    pid: int
    start: float
    end: float | None = None


def read_spans(path: Path) -> list[Span]:
    """Each run's interval from the ``span`` handlers' lines; a run whose process died has no end line."""
    runs: dict[tuple[int, int, int], Span] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        what, job_id, attempt, pid, at, *_ = line.split()
        key = (int(job_id), int(attempt), int(pid))
        if what == "start":
            runs[key] = Span(int(job_id), int(pid), float(at))
        elif key in runs:
            runs[key].end = float(at)
    return list(runs.values())


def read_deaths(path: Path) -> dict[int, float]:
    """When each process a ``poison_span`` run ended died (its ``died`` line), by pid."""
    lines = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return {int(pid): float(at) for what, _, _, pid, at, *_ in lines if what == "died"}


#: Seconds of a frozen process's run just after it resumes that do not count as executing (see ``overlapping``).
RESUME_SLACK = 0.1


def executing(span: Span, died: dict[int, float], frozen: dict[int, list[tuple[float, float]]],
              now: float) -> list[tuple[float, float]]:
    """The intervals in which ``span`` was really executing: up to its end (or its process's death), minus
    the times its process was frozen."""
    end = span.end if span.end is not None else died.get(span.pid, now)
    pieces = [(span.start, end)]
    for stopped, resumed in frozen.get(span.pid, []):
        pieces = [part for a, b in pieces for part in ((a, min(b, stopped)), (max(a, resumed + RESUME_SLACK), b))
                  if part[0] < part[1]]
    return pieces


def overlapping_jobs(spans: list[Span], died: dict[int, float], frozen: dict[int, list[tuple[float, float]]],
                     now: float) -> list[int]:
    by_job: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for span in spans:
        by_job[span.job_id] += executing(span, died, frozen, now)
    overlapping = []
    for job_id, pieces in by_job.items():
        reached = float("-inf")  # the latest end so far: a start before it overlaps an earlier run
        for start, end in sorted(pieces):
            if start < reached:
                overlapping.append(job_id)
                break
            reached = max(reached, end)
    return sorted(overlapping)


def measure(report: Report, engine: Engine, span_ids: list[int], once_ids: list[int], other_ids: list[int],
            spans: list[Span], logs: list[str], faults: list[float], died: dict[int, float],
            frozen: dict[int, list[tuple[float, float]]], charges_for_lost_runs: bool, now: float) -> Report:
    """Fill ``report`` from the database, the span lines and the workers' logs."""
    ids = span_ids + once_ids + other_ids
    report.jobs, report.faults = len(ids), len(faults)
    found = states(engine, ids)
    missing = sorted(set(ids) - set(found))
    report.lost = len(missing)
    if missing:
        report.problems.append(f"lost: {missing[:10]}")
    t = app.Job.__table__
    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(t.c.id, t.c.attempts, t.c.errors).where(t.c.id.in_(ids)))}
        once_rows = Counter(conn.execute(select(app.Once.job_id).where(app.Once.job_id.in_(once_ids))).scalars())
    twice = [i for i in once_ids if once_rows.get(i, 0) != (1 if found.get(i) == "finished" else 0)]
    report.run_twice = len(twice)
    if twice:
        report.problems.append(f"once jobs committed other than once: {twice[:10]}")
    overlapping = overlapping_jobs(spans, died, frozen, now)
    report.overlapping = len(overlapping)
    if overlapping:
        t0 = min(span.start for span in spans)
        report.problems.append("runs at once: " + "; ".join(
            f"job {job_id}: " + ", ".join(f"pid {s.pid} {s.start - t0:.3f}-"
                                          f"{'' if s.end is None else f'{s.end - t0:.3f}'}"
                                          for s in spans if s.job_id == job_id)
            for job_id in overlapping[:5]))
        report.problems.append(f"frozen: {({p: [(a - t0, b - t0) for a, b in f] for p, f in frozen.items()})}")
    runs = Counter(span.job_id for span in spans)
    report.reruns = sum(n - 1 for n in runs.values())
    finishes = Counter(int(m) for text in logs for m in FINISHED_LINE.findall(text))
    wrong = sorted({i for i, n in finishes.items() if n > 1} | {i for i in finishes if found.get(i, "finished")
                                                                 != "finished"})
    report.misreported = len(wrong)
    if wrong:
        report.problems.append(f"reported finished twice or wrongly: {wrong[:10]}")
    charged = []
    for job_id in span_ids + once_ids:
        row = rows.get(job_id)
        if row is None or found.get(job_id) != "finished":
            charged.append(job_id)  # every such job must finish: anything else is a charge it did not earn
            continue
        lost_runs = sum("WorkerLost" in str(entry.get("error", "")) for entry in row.errors or [])
        earned = lost_runs if charges_for_lost_runs else 0
        if row.attempts - 1 != earned or (lost_runs and not charges_for_lost_runs):
            charged.append(job_id)
    report.wrongly_charged = len(charged)
    if charged:
        report.problems.append(f"attempts charged wrongly: {charged[:10]}")
    recoveries = []
    for fault in faults:
        hit = {span.job_id: span for span in spans
               if span.start <= fault and (span.end is None or span.end >= fault)}
        report.struck += bool(hit)
        for job_id, struck in hit.items():  # done when its next run ends, or the struck run itself if none came
            later = [s.end for s in spans if s.job_id == job_id and s.start > fault and s.end is not None]
            done = min(later) if later else struck.end if struck.end is not None else now
            recoveries.append(done - fault)
    report.recovery_s = round(max(recoveries, default=0.0), 2)
    return report


def save(report: Report, path: str | None) -> None:
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(asdict(report)) + "\n")


COLUMNS = ("lost", "run twice", "overlapping", "misreported", "wrongly charged", "reruns", "recovery")


def table(reports: list[dict[str, Any]]) -> str:
    """The Markdown table of docs/guarantees.md: one row per cell (configuration, worker, scenario), the
    problems counted by kind, the reruns (at-least-once at work) and the worst recovery in seconds."""
    cells = {(r["scenario"], r["configuration"], r["flavour"]): r for r in reports}
    lines = ["| configuration | worker | scenario | jobs | faults | " + " | ".join(COLUMNS) + " |",
             "|" + "---|" * (len(COLUMNS) + 5)]
    for configuration in CONFIGURATIONS:
        for flavour in FLAVOURS:
            for scenario, title in SCENARIOS.items():
                applies = (scenario, configuration) not in NOT_APPLICABLE
                lines.append(_row([configuration, flavour, title], cells.get((scenario, configuration, flavour)),
                                  applies))
    for broker in RELAY_BROKERS:  # tests/relay/test_relay_faults.py
        lines.append(_row(["postgresql", f"relay to {broker}", RELAY_SCENARIO],
                          cells.get(("relay", "postgresql", broker)), True, blank=("run_twice", "overlapping")))
    return "\n".join(lines)


def _row(head: list[str], r: dict[str, Any] | None, applies: bool, blank: tuple[str, ...] = ()) -> str:
    """One cell's row; ``blank``: the columns that mean nothing there (a relay runs no handler: nothing runs
    twice or at once)."""
    row = list(head)
    if not applies:
        row += ["n/a"] * (len(COLUMNS) + 2)
    elif r is None:
        row += ["not run"] * (len(COLUMNS) + 2)
    else:
        row += ["n/a" if k in blank else str(r[k]) for k in ("jobs", "faults", "lost", "run_twice", "overlapping",
                                                             "misreported", "wrongly_charged", "reruns")]
        row.append(f"{r['recovery_s']:.1f} s" if r["faults"] else "no fault")
    return "| " + " | ".join(row) + " |"


if __name__ == "__main__":
    print(table([json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]))
