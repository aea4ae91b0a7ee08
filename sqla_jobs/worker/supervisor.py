"""``sqla-jobs worker --processes N``: N worker processes, restarted when one dies.

Each child is one worker process (``_process.run_worker_process``) started with
``python -c`` on a function of this module, ``child_main``; its settings, already
parsed and checked, reach it pickled on its stdin, never as a rebuilt command line.

Signals. The children run in their own process group, so the terminal's
Ctrl-C (which goes to the whole foreground group) reaches only the
supervisor, and each stop reaches a child exactly once, from the supervisor:
the first SIGTERM or SIGINT is forwarded to every child as SIGTERM (a graceful
stop: running jobs get ``--grace`` seconds, then are handed back), a second one
again (the children exit at once, and the supervisor hands their jobs back).
A signal that comes while the supervisor or a child is starting is a stop
too. A child whose supervisor vanished (killed with SIGKILL) stops itself.

A child that dies (a poison job that kills its process, an OOM kill) is
started again after a pause; its running jobs are handed back at once, by the
lease reaper's rules (``sqla_jobs.worker.outcomes.hand_back_lost``), instead of after a whole lease. For
that the supervisor names each child, so it knows which jobs were its.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from .._app import JobQueue
from ..errors import ConnectionProblem, SqlaJobsError
from .outcomes import hand_back_lost
from .process import WorkerProcess, run_worker_process
from .signals import SIGNALS, stop_signals

__all__ = ["child_main", "supervise", "watch_parent"]

log = logging.getLogger("sqla_jobs")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as the CLI's
_CHILD = "from sqla_jobs.worker.supervisor import child_main; child_main()"


class _Child:
    def __init__(self, spec: WorkerProcess, prefix: str) -> None:
        # A fresh name per process started, so a replacement never answers for its predecessor's jobs.
        template = f"{prefix}:{{pid}}:{uuid.uuid4().hex[:6]}"
        # Started with the stop signals blocked (the mask is inherited): one that comes while the child
        # imports waits until child_main has its handlers, instead of killing it half-started.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, process_group=0)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        assert self.proc.stdin is not None
        with self.proc.stdin:
            self.proc.stdin.write(pickle.dumps((spec, template, os.getpid())))
        self.name = template.replace("{pid}", str(self.proc.pid))
        self.handled = False  # its exit was dealt with
        self.gone_before_stop = False  # it had exited on its own when the stop signal came

    def signal(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def supervise(spec: WorkerProcess, processes: int, queue: JobQueue[Any, Any], engine: Engine,
              name: str | None) -> int:
    """Run ``processes`` worker processes until stopped (or, with ``burst``, until all are done)."""
    prefix = name or socket.gethostname()
    # The supervisor's own connections (it hands back a dead child's jobs) get the workers' settings:
    # keepalives and timeouts, so a dead network cannot hang it, and a name in pg_stat_activity.
    queue.driver(engine).harden(engine, f"{prefix} supervisor")
    stopping = False
    children: list[_Child] = []
    # The stop runs on the signals' own thread (``signals.py``) while this one may be starting a child: a
    # child is listed and told of a stop under this lock, so each stop reaches it exactly once (a second
    # SIGTERM would make it exit at once, not gracefully). Without it a replacement started during the
    # stop was never told, and the supervisor waited for it forever (a CI run, under load).
    told = threading.Lock()

    def forward() -> None:
        nonlocal stopping
        with told:
            stopping = True
            for child in children:
                child.signal()

    def stop() -> None:
        # A child that had already exited (a crash, say a poison job) when the signal came is handled as
        # any crash is, by handing its jobs back: its status is not the stop's, though with the stop
        # under way nothing replaces it. Polling here also reaps one that died since the last look.
        # Only at the first signal: a child that failed during the graceful stop still fails it.
        if not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    child.gone_before_stop = True
        forward()

    signals = stop_signals()
    if signals is not None:
        signals.attach("supervisor", stop, on_again=stop)
    if stopping:
        return 0

    def start(replacing: int | None = None) -> None:
        child = _Child(spec, prefix)
        with told:
            if replacing is None:
                children.append(child)
            else:
                children[replacing] = child
            if stopping:  # a stop came while it was being started, and did not find it in the list
                child.signal()

    for _ in range(processes):
        start()
    log.info("supervising %d worker processes: %s", len(children), ", ".join(str(c.proc.pid) for c in children))

    def look() -> None:
        """Deal with each child that exited: hand back its jobs, replace it unless we stop."""
        for i, child in enumerate(children):
            code = child.proc.poll()
            if code is None or child.handled:
                continue
            child.handled = True
            if code != 0:
                _died(queue, engine, child)
            if stopping or (spec.burst and code == 0):
                continue
            if code == 2:  # bad configuration: another start would fail the same way
                log.error("worker process %d failed to start; stopping the others", child.proc.pid)
                forward()
                continue
            log.warning("worker process %d exited with %s; starting another in 1 s", child.proc.pid, code)
            time.sleep(1.0)
            if stopping:  # a signal came during the pause: no replacement
                continue
            start(replacing=i)

    while any(c.proc.poll() is None for c in children) or not (stopping or spec.burst):
        time.sleep(0.2)
        look()
    look()  # the last ones may have exited after the last look
    return max((_stop_status(c.proc.returncode, stopping) for c in children if not c.gone_before_stop), default=0)


def _died(queue: JobQueue[Any, Any], engine: Engine, child: _Child) -> None:
    """Hand back what the dead child was running; on a database error, its leases still cover it."""
    try:
        driver = queue.driver(engine)
        count = hand_back_lost(queue, engine, driver, lambda conn: driver.held_by(conn, child.name),
                               f"worker process {child.name} exited with {child.proc.returncode}")
    except DBAPIError as exc:
        log.warning("could not hand back the jobs of worker %s (%s); their leases will expire",
                    child.name, str(exc.orig or exc).strip().splitlines()[0])
        return
    if count:
        log.warning("handed back %d job(s) of worker process %d", count, child.proc.pid)


def _stop_status(code: int | None, stopping: bool) -> int:
    """A child's part in the supervisor's exit status: dying of the stop signal we forwarded (it came
    before the child set up its handlers, so it ran nothing) is a clean stop; another signal is a failure."""
    if code is None or (stopping and code in (-signal.SIGTERM, -signal.SIGINT)):
        return 0
    return 1 if code < 0 else code


# -- in the child ----------------------------------------------------------------------


def child_main() -> None:
    """A supervised worker process: read its settings from stdin, run, exit with its status."""
    spec, name, parent = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=spec.log_level, format=LOG_FORMAT)
    # Signals are still blocked (by the supervisor, inherited): a stop that came while this process
    # started waits here, and is handled (and logged) as a stop, not a kill.
    stop_signals()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    # The name's {pid} is this process's: WorkerConfig fills it in when it is made, so make it here.
    spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, name=name))
    threading.Thread(target=watch_parent, args=(parent,), daemon=True, name="sqla-jobs-parent").start()
    try:
        code = run_worker_process(spec)
    except ConnectionProblem as exc:
        print(f"sqla-jobs: {exc}", file=sys.stderr)
        code = 1
    except SqlaJobsError as exc:
        print(f"sqla-jobs: {exc}", file=sys.stderr)
        code = 2
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        print(f"sqla-jobs: database error: {first}", file=sys.stderr)
        code = 1
    sys.exit(code)


def watch_parent(parent: int) -> None:
    """Outside the terminal's process group, a child would outlive a supervisor killed with SIGKILL:
    when the supervisor is gone, stop as if it had forwarded a SIGTERM. (The bench's worker processes
    watch the bench the same way: ``sqla_jobs.bench.run``.)"""
    while os.getppid() == parent:
        time.sleep(1.0)
    log.warning("the supervisor (process %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
