"""The outcome policy (sqla_jobs/worker/outcomes.py): one table of what each ending does to a job row,
and a scan that fails if any other module writes a run's job back to pending or to the dead letters.

Internal imports: the policy is an internal mechanism with no public handle (its effects are pinned end
to end by tests/reliability/, tests/relay/, tests/test_dead_letters.py, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sqla_jobs.worker.outcomes import (
    ENDINGS,
    MAX_UNCOUNTED_LOSSES,
    MAX_UNCOUNTED_OUTAGES,
    OUTAGE_MARK,
    RELAY_MARK,
    Verdict,
    decide,
)

RETRY = 7.0  # the app's backoff, as the policy is given it
PAUSE = 2.0  # the relay's reconnect pause
SNOOZE = 30.0
OM, RM = MAX_UNCOUNTED_OUTAGES, MAX_UNCOUNTED_LOSSES
E = "E"

# ending, attempt, max_attempts, refunds so far, cancel requested -> event, state, delay, refund, isolate, error
TABLE: list[tuple[str, int, int, int, bool, tuple[str, str, float, bool, bool | None, str | None]]] = [
    # success: the batched finish (worker), the acknowledged publish (relay), a transactional commit
    ("ok", 1, 3, 0, False, ("finished", "finished", 0.0, False, False, None)),
    ("ack", 3, 3, 0, False, ("finished", "finished", 0.0, False, False, None)),
    ("committed", 1, 1, 0, True, ("finished", "finished", 0.0, False, False, None)),
    # the job's own failure: retried with backoff, dead letter on the last attempt, a cancel request wins
    ("error", 1, 3, 0, False, ("failed", "pending", RETRY, False, False, E)),
    ("error", 2, 3, 5, False, ("failed", "pending", RETRY, False, False, E)),
    ("error", 3, 3, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("error", 5, 3, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("error", 3, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    ("timeout", 1, 2, 0, False, ("failed", "pending", RETRY, False, False, E)),
    ("timeout", 2, 2, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("nack", 1, 3, 0, False, ("failed", "pending", RETRY, False, False, E)),
    ("nack", 3, 3, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("unroutable", 1, 3, 0, False, ("failed", "pending", RETRY, False, False, E)),
    ("unroutable", 3, 3, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("unroutable", 1, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    # the queue database dropped during the run: refunded, at once, up to the bound; then it counts
    ("outage", 1, 3, 0, False, ("outage", "pending", 0.0, True, False, f"{E} {OUTAGE_MARK}")),
    ("outage", 3, 3, OM - 1, False, ("outage", "pending", 0.0, True, False, f"{E} {OUTAGE_MARK}")),
    ("outage", 1, 3, OM, False, ("failed", "pending", RETRY, False, False, E)),
    ("outage", 3, 3, OM, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("outage", 1, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    # the broker went away with the message in flight: refunded after the reconnect pause, bounded
    ("broker_lost", 2, 3, 0, False, ("outage", "pending", PAUSE, True, False, f"{E} {RELAY_MARK}")),
    ("broker_lost", 3, 3, RM - 1, False, ("outage", "pending", PAUSE, True, False, f"{E} {RELAY_MARK}")),
    ("broker_lost", 1, 3, RM, False, ("failed", "pending", PAUSE, False, False, E)),
    ("broker_lost", 3, 3, RM, False, ("dead_letter", "dead", 0.0, False, False, E)),
    # a relay died holding it: refunded at once, bounded; a cancel request honoured
    ("relay_lost", 1, 3, 0, False, ("outage", "pending", 0.0, True, False, f"{E} {RELAY_MARK}")),
    ("relay_lost", 1, 3, RM, False, ("failed", "pending", 0.0, False, False, E)),
    ("relay_lost", 3, 3, RM, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("relay_lost", 1, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    # a worker died holding it (crash, lease out, supervised process exited): counted, due now, run alone
    ("lost", 1, 3, 0, False, ("failed", "pending", 0.0, False, True, E)),
    ("lost", 1, 3, 99, False, ("failed", "pending", 0.0, False, True, E)),
    ("lost", 3, 3, 0, False, ("dead_letter", "dead", 0.0, False, False, E)),
    ("lost", 3, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    # grace over at shutdown: refunded, due now, no error entry, the isolation mark left as it was
    ("shutdown", 3, 3, 0, False, ("handed_back", "pending", 0.0, True, None, None)),
    ("shutdown", 1, 3, OM, True, ("handed_back", "pending", 0.0, True, None, None)),
    # the handler asked
    ("snooze", 3, 3, 0, False, ("snoozed", "pending", SNOOZE, True, False, None)),
    ("snooze", 1, 3, 0, True, ("cancelled", "cancelled", 0.0, False, False, E)),
    ("cancel", 1, 3, 0, False, ("cancelled", "cancelled", 0.0, False, False, E)),
    ("cancel", 3, 3, 0, False, ("cancelled", "cancelled", 0.0, False, False, E)),
]


@pytest.mark.parametrize(("ending", "attempt", "max_attempts", "refunds", "cancel", "expected"), TABLE)
def test_the_policy(ending: str, attempt: int, max_attempts: int, refunds: int, cancel: bool,
                    expected: tuple[str, str, float, bool, bool | None, str | None]) -> None:
    verdict = decide(ending, attempt, max_attempts, refunds, cancel_requested=cancel, error=E, snooze=SNOOZE,
                     retry_delay=lambda: RETRY, pause=PAUSE)
    assert verdict == Verdict(*expected)


def test_every_ending_is_in_the_table_and_nothing_else_is_accepted() -> None:
    assert {row[0] for row in TABLE} == set(ENDINGS)
    with pytest.raises(ValueError):
        decide("vanished", 1, 3)


def test_the_backoff_is_asked_only_for_a_counted_retry() -> None:
    asked: list[int] = []

    def backoff() -> float:
        asked.append(1)
        return RETRY

    for ending, attempt, max_attempts, refunds, cancel, (_, state, delay, refund, _, _) in TABLE:
        before = len(asked)
        decide(ending, attempt, max_attempts, refunds, cancel_requested=cancel, retry_delay=backoff, pause=PAUSE)
        wanted = state == "pending" and not refund and delay == RETRY
        assert len(asked) - before == wanted, (ending, attempt, refunds)


# -- only the policy ends a run unfinished ---------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "sqla_jobs"
#: The driver's statements that put a claimed job back to pending / cancelled or into the dead letters.
ENDING_STATEMENTS = frozenset({"release", "release_many", "dead_letter"})
POLICY = PACKAGE / "worker" / "outcomes.py"


def ending_calls(source: str) -> list[tuple[int, str]]:
    """Lines of ``source`` that call one of ENDING_STATEMENTS, by attribute (``driver.release(...)``)
    or through ``getattr``/a bound reference (``getattr(driver, "dead_letter")``, ``f = driver.release``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ENDING_STATEMENTS:
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in ENDING_STATEMENTS):
            found.append((node.lineno, node.args[1].value))
    return found


def test_the_scan_sees_a_stray_ending() -> None:
    assert ending_calls("def f(driver, conn, fence):\n    driver.release(conn, fence)\n") == [(2, "release")]
    assert ending_calls("x = getattr(driver, 'dead_letter')\n") == [(1, "dead_letter")]
    assert ending_calls("write = d.release_many\n") == [(1, "release_many")]
    assert ending_calls("driver.finish(conn, fences)\nemit('dead_letter')\n") == []


def test_no_module_but_the_policy_ends_a_run_unfinished() -> None:
    """Every write of a run's job to pending, cancelled or dead goes through sqla_jobs/worker/outcomes.py:
    the drivers define the statements (and call one another's), the policy module alone calls them."""
    stray = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == POLICY or (PACKAGE / "drivers") in path.parents:
            continue
        calls = ending_calls(path.read_text())
        if calls:
            stray[str(path.relative_to(PACKAGE.parent))] = calls
    assert stray == {}, f"only {POLICY.name} may end a run unfinished; found {stray}"
    assert ending_calls(POLICY.read_text()), "the policy itself must be where the statements are called"


def test_no_module_outside_the_drivers_builds_a_write_statement() -> None:
    """The other half of the guarantee above: a module that cannot build an UPDATE, DELETE or INSERT can
    change a job row only through a driver method, and the driver's methods that end a run are the ones
    only the policy calls. (Admin operations, which also set states, are driver methods of their own:
    ``drivers/_operations.py``, not run endings.)"""
    writes = {"update", "delete", "insert"}
    stray = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "drivers") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                names = {alias.name for alias in node.names} & writes
                if names:
                    stray[str(path.relative_to(PACKAGE.parent))] = sorted(names)
    assert stray == {}, f"write statements belong in sqla_jobs/drivers/; found imports of them in {stray}"
