"""Stop signals as a user sends them: Ctrl-C in a real terminal, SIGTERM during start-up, a second Ctrl-C.

A terminal's Ctrl-C sends SIGINT to every process of its foreground process
group. These tests run ``sqla-jobs worker`` as the session leader of a
pseudo-terminal (``pty.fork``) and type Ctrl-C into it, with real worker
processes running real jobs in the database, then check the exit status, that
no job is left ``running``, and that the output holds no traceback.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.helpers import count, enqueue

pytestmark = pytest.mark.slow

WORKER = [sys.executable, "-m", "sqla_jobs.cli", "worker", "--app", "tests.app:queue", "--concurrency", "2",
          "--poll-interval", "0.1"]
NOISE = ("Traceback", "Exception ignored", "KeyboardInterrupt", "second signal", "received again")


class Terminal:
    """A command running as the session leader of a pseudo-terminal; its output is collected."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: become the command, with the pty as its controlling terminal
            os.chdir(ROOT)
            os.execve(argv[0], argv, env)
        self.pid, self.fd = pid, fd
        self.status: int | None = None
        self._output = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self.fd], [], [], 0.2)
                if ready:
                    chunk = os.read(self.fd, 65536)
                    if not chunk:
                        return
                    self._output += chunk
                elif self.status is not None:
                    return
            except OSError:  # EIO: every process holding the terminal has exited
                return

    @property
    def output(self) -> str:
        return self._output.decode(errors="replace")

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the terminal driver turns it into SIGINT for the foreground group

    def wait(self, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                self._reader.join(5)
                os.close(self.fd)
                return self.status
            time.sleep(0.05)
        os.killpg(self.pid, signal.SIGKILL)
        raise AssertionError(f"still running after {seconds}s:\n{self.output}")


def wait_until(condition: object, seconds: float, what: str, output: object = "") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{output() if callable(output) else output}")


def running(db: Database) -> int:
    return count(db.engine, app.Job, app.Job.state == "running")


def workers_of(pid: int) -> list[int]:
    """The worker processes a supervisor started (its children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_ctrl_c_in_a_terminal_stops_processes_gracefully_every_time(db: Database) -> None:
    """One Ctrl-C on `worker --processes 3`: exit 0, no job left running, no traceback; five times in a row."""
    for attempt in range(5):
        ids = [enqueue(db.engine, "sleep", {"seconds": 0.5}) for _ in range(12)]
        term = Terminal([*WORKER, "--processes", "3", "--grace", "20"], db.env())
        wait_until(lambda: running(db) >= 2, 60, "jobs to start running", lambda t=term: t.output)
        term.ctrl_c()
        code = term.wait(60)
        out = term.output
        assert code == 0, f"attempt {attempt + 1}: exit {code}\n{out}"
        assert running(db) == 0, f"attempt {attempt + 1}: a job was left running\n{out}"
        assert not [word for word in NOISE if word in out], f"attempt {attempt + 1}:\n{out}"
        assert out.count("received") == 4, out  # the supervisor and each of its 3 workers heard one signal
        # The grace period covers a 0.5 s job: those that ran finished, the rest wait for the next worker.
        assert count(db.engine, app.Job, app.Job.id.in_(ids), app.Job.state.in_(("finished", "pending"))) == 12
        with db.engine.begin() as conn:
            conn.execute(app.Job.__table__.delete())


def test_second_ctrl_c_exits_at_once_and_hands_the_jobs_back(db: Database) -> None:
    ids = [enqueue(db.engine, "sleep", {"seconds": 60}) for _ in range(3)]
    term = Terminal([*WORKER, "--processes", "2", "--grace", "60"], db.env())
    wait_until(lambda: running(db) == 3, 60, "the jobs to start", lambda: term.output)
    term.ctrl_c()
    wait_until(lambda: term.output.count("shutting down gracefully") == 3, 20, "the stop to reach every process",
               lambda: term.output)
    sent = time.monotonic()
    term.ctrl_c()
    code = term.wait(30)
    out = term.output
    assert time.monotonic() - sent < 15, "the second Ctrl-C must not wait for the grace period"
    assert code == 1, out
    # The supervisor handed the jobs of its children back at once, instead of after their lease.
    assert running(db) == 0, out
    assert count(db.engine, app.Job, app.Job.id.in_(ids), app.Job.state == "pending") == 3, out
    assert "Traceback" not in out and "Exception ignored" not in out, out


@pytest.mark.parametrize("processes", ["1", "2"])
def test_sigterm_during_start_up_is_a_clean_stop(db: Database, processes: str) -> None:
    """SIGTERM as soon as the process can catch it, before it has connected or claimed: a log line, exit 0."""
    enqueue(db.engine, "noop")
    proc = forkserver.Popen([*WORKER, "--processes", processes], env=db.env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mask = 1 << (signal.SIGTERM - 1)

    def catches_sigterm() -> bool:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
        return bool(int(caught.split()[1], 16) & mask)

    wait_until(catches_sigterm, 30, "the worker to set up its signal handlers")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "SIGTERM received" in out, out
    assert "Traceback" not in out, out
    assert running(db) == 0, out


def test_sigterm_while_the_worker_processes_start(db: Database) -> None:
    """SIGTERM to the supervisor the moment its worker processes exist, while they are still importing."""
    proc = forkserver.Popen([*WORKER, "--processes", "2"], env=db.env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: len(workers_of(proc.pid)) == 2, 30, "the worker processes to start")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    # The supervisor and both workers logged the stop: none was killed half-started.
    assert out.count("SIGTERM received") == 3 and "Traceback" not in out, out


def test_supervisor_with_sigint_ignored_stops_on_sigterm(db: Database) -> None:
    """A shell that starts a job in the background ignores SIGINT for it: SIGTERM still stops everything."""
    ids = [enqueue(db.engine, "sleep", {"seconds": 0.5}) for _ in range(4)]
    proc = forkserver.Popen([*WORKER, "--processes", "2", "--grace", "20"], env=db.env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_until(lambda: running(db) >= 1, 60, "jobs to start running")
        children = workers_of(proc.pid)
        assert len(children) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert running(db) == 0, out
    assert count(db.engine, app.Job, app.Job.id.in_(ids), app.Job.state == "running") == 0
    assert "Traceback" not in out, out


def test_a_worker_whose_supervisor_was_killed_stops(db: Database) -> None:
    """The children are outside the terminal's process group, so they watch their supervisor instead."""
    proc = forkserver.Popen([*WORKER, "--processes", "2"], env=db.env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: len(workers_of(proc.pid)) == 2, 30, "the worker processes to start")
    children = workers_of(proc.pid)
    time.sleep(1.0)
    proc.kill()
    proc.communicate(timeout=30)

    def gone(pid: int) -> bool:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        return "State:\tZ" in status

    wait_until(lambda: all(gone(pid) for pid in children), 30, "the orphaned workers to stop")


# The control loop's wait (Control.run: ``wake.clear()`` then ``wake.wait(...)``) and Worker.stop's ``wake.set()``,
# under the real StopSignals. ``wait(0)`` keeps the main thread inside the event's lock most of the time.
_SPINNING_WAIT = """
import threading
from sqla_jobs.worker import signals as _signals
wake, asked = threading.Event(), []
def stop():
    asked.append(True)
    wake.set()
_signals.stop_signals().attach("worker spin", stop)
print("ready", flush=True)
while not asked:
    wake.clear()
    wake.wait(0)
print("stopped", flush=True)
"""


def test_a_stop_signal_while_the_loop_holds_its_wake_up_lock_still_stops_it() -> None:
    """Python runs a signal handler on the main thread between two bytecodes, also while that thread holds the
    lock inside ``Event.wait``; a handler that called ``Event.set`` itself then waited for that lock forever
    (a worker hung on SIGTERM in CI, py-spy showed ``Event.set`` under ``Event.wait``). The handler only hands
    the signal to a thread now. Before that, 7 of 10 of these processes hung."""
    hung = []
    for attempt in range(20):
        proc = forkserver.Popen([sys.executable, "-c", _SPINNING_WAIT], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=10)[0]
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            hung.append(attempt)
            continue
        assert proc.returncode == 0 and "stopped" in out, out
    assert not hung, f"{len(hung)} of 20 processes never stopped on SIGTERM"


# The same wait in a child forked after StopSignals was installed: it inherits the handler, not the thread.
_FORKED_WAIT = _SPINNING_WAIT.replace('_signals.stop_signals().attach("worker spin", stop)', """\
signals = _signals.stop_signals()
import os, sys
if os.fork():
    os._exit(0)  # the parent goes; the child, with the inherited handler, runs the loop
signals.attach("worker spin", stop)""")


def test_a_process_forked_after_the_handlers_were_installed_still_stops_on_a_signal() -> None:
    """The handler only queues the signal; a forked child has no thread to take it from the queue unless
    one is started after the fork (``os.register_at_fork``): without it the child would ignore SIGTERM."""
    proc = forkserver.Popen([sys.executable, "-c", _FORKED_WAIT.replace('print("ready"', 'print(os.getpid(), "ready"')],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[1:] == ["ready"], line
    # A pidfd while the child is surely alive (it waits for the signal): it is not ours to reap, and a kill
    # by pid after its exit could reach whatever process the kernel gave the pid to next.
    child = os.pidfd_open(int(line[0]))
    try:
        time.sleep(0.05)
        signal.pidfd_send_signal(child, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=10)  # the pipe closes when the child exits
        except subprocess.TimeoutExpired:
            signal.pidfd_send_signal(child, signal.SIGKILL)
            out = proc.communicate()[0]
            pytest.fail(f"the forked child did not stop on SIGTERM: {out}")
    finally:
        os.close(child)
    assert "stopped" in out, out
