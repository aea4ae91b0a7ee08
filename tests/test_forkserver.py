"""The suite's fork server (tests/forkserver.py) gives a child what a cold ``python`` would.

Most subprocess tests start through it, so a difference here would be a difference in every one
of them: each check below runs the same command cold (``subprocess``) and warm and compares.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import ROOT
from tests.reliability.harness import WorkerProc

PROBE = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path_head": sys.path[:2], "env": os.environ.get("PROBE"),
    "ours": sorted(m for m in sys.modules if m.split(".")[0] in ("sqla_jobs", "tests", "alembic")),
    "main": sys.modules["__main__"].__name__, "stdin": sys.stdin.read(),
}))
sys.exit(int(sys.argv[1]))
"""


def both(args: list[str], **kw: object) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    cold = subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload]
    warm = forkserver.run(args, capture_output=True, text=True, timeout=60, **kw)
    return cold, warm


def test_argv_cwd_path_environment_stdin_and_exit_code_are_a_cold_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PROBE": "yes", "PYTHONPATH": str(tmp_path / "extra")}
    cold, warm = both([sys.executable, "-c", PROBE, "3"], cwd=tmp_path, env=env, input="from stdin")
    assert (warm.returncode, warm.stderr) == (cold.returncode, cold.stderr) == (3, "")
    assert json.loads(warm.stdout) == json.loads(cold.stdout)
    seen = json.loads(warm.stdout)
    # Nothing of ours is imported before the command runs: the code under test is loaded fresh.
    assert seen["ours"] == [] and seen["path_head"] == ["", str(tmp_path / "extra")], seen


def test_a_module_runs_as_main_and_an_uncaught_error_exits_1(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\nraise SystemExit(sys.argv[1])\n")
    cold, warm = both([sys.executable, "-m", "mod", "bye"], cwd=tmp_path)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.stdout == "__main__ ['bye']\n" and warm.stderr == "bye\n"
    cold, warm = both([sys.executable, "-c", "raise ValueError('boom')"])
    assert warm.returncode == cold.returncode == 1
    assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1] == "ValueError: boom"


def test_the_child_is_a_process_of_its_own_that_signals_reach() -> None:
    proc = forkserver.Popen([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert int(proc.stdout.readline()) == proc.pid != os.getpid()
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM
    proc.stdout.close()


def test_a_cli_command_gives_the_same_output_warm_and_cold() -> None:
    cold, warm = both([sys.executable, "-m", "sqla_jobs.cli", "--version"], cwd=ROOT)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert warm.returncode == 0 and warm.stdout.startswith("sqla-jobs")


def test_a_timeout_kills_the_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, "-c", code], timeout=2)
    # Not a speed bound: a child left running would hold run() for its whole 600 s sleep.
    assert time.monotonic() - started < 60
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed, and reaped by the server before run() returned
        os.kill(pid, 0)


def _take_pid(pid: int) -> subprocess.Popen[bytes] | None:
    """A sleeping process given ``pid`` (free again), through ``ns_last_pid`` (root only); None if the test
    processes running beside this one keep taking it first."""
    for _ in range(50):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        sleeper = subprocess.Popen(["sleep", "60"])
        if sleeper.pid == pid:
            return sleeper
        sleeper.kill()
        sleeper.wait()
    return None


def test_a_signal_after_the_child_exited_never_reaches_the_process_that_got_its_pid() -> None:
    """The server reaps its children, so a child's pid is free the moment it exits, and this suite goes
    round the whole pid space within minutes: a kill by pid sent later can land on any process, a database
    server's thread among them (a SIGKILL that took MariaDB down mid-run). Signals go through a pidfd."""
    if os.geteuid() != 0:
        pytest.skip("ns_last_pid is writable by root only")  # CI runs as root: there it always runs
    proc = forkserver.Popen([sys.executable, "-c", "pass"])
    pid = proc.pid
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # exited and reaped by the server
        time.sleep(0.01)
    sleeper = _take_pid(pid)
    assert sleeper is not None, f"no process could be given pid {pid} again"
    try:
        proc.send_signal(signal.SIGKILL)
        proc.kill()
        WorkerProc("sqlite://", Path(os.devnull), proc=proc).signal(signal.SIGKILL)  # the reliability suite's
        assert proc.wait(10) == 0
        time.sleep(0.1)
        assert sleeper.poll() is None, "the signal meant for the exited child killed the pid's new owner"
    finally:
        sleeper.kill()
        sleeper.wait()
