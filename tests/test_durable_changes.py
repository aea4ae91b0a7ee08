"""Changing a durable handler's code while jobs are parked or half done: one test per rule of
docs/howto/durable.md ("Changing the code"). Each test deploys ``v1``, parks a job, deploys ``v2`` and
resumes the job; ``make_due`` (sqla_jobs.testing) ends the park, as its due time would."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

from sqla_jobs import current_job
from sqla_jobs.testing import make_due
from tests import durable_app
from tests.conftest import Database
from tests.helpers import enqueue, job, run_burst

queue = durable_app.queue
#: The deployed code of ``d_change``: a test sets it, then sets it again.
CODE: list[Callable[[], Any]] = []
CALLS: Counter[str] = Counter()


@queue.handler("d_change")
def changing(payload: dict[str, Any]) -> Any:
    return CODE[-1]()


def call(name: str, value: Any = None) -> Any:
    return current_job().step(name, lambda: CALLS.update([name]) or (name if value is None else value))


def deploy(db: Database, v1: Callable[[], Any], v2: Callable[[], Any]) -> tuple[int, Any]:
    """Run v1 until it parks, then v2 until it parks or ends; the job and what the second run returned."""
    CALLS.clear()
    CODE[:] = [v1]
    job_id = enqueue(db.engine, "d_change")
    run_burst(db.engine)
    assert job(db.engine, job_id).state == "pending"  # type: ignore[union-attr]  # parked
    CODE.append(v2)
    make_due(db.engine, queue)
    run_burst(db.engine)
    return job_id, job(db.engine, job_id)


def names(db: Database, job_id: int) -> dict[str, Any]:
    with Session(db.engine) as session:
        return {row.name: row for row in queue.job_steps(session, job_id)}


def test_steps_are_known_by_name_a_renamed_one_runs_again_and_a_removed_ones_value_is_ignored(db: Database) -> None:
    def v1() -> Any:
        call("a")
        call("b")
        current_job().sleep(3600)

    def v2() -> Any:
        # Reordered: b's stored value follows its name. "a" renamed "a2": a new step. "a" removed: ignored.
        return [call("b"), call("a2"), current_job().sleep(3600)]

    job_id, row = deploy(db, v1, v2)
    assert row.state == "finished" and row.result == ["b", "a2", None]
    assert CALLS == {"a": 1, "b": 1, "a2": 1}
    assert names(db, job_id)["a"].value == "a"  # kept (jobs show lists it), read by no one, pruned with the job


def test_a_step_added_before_where_a_job_parked_runs_when_it_resumes(db: Database) -> None:
    def v1() -> Any:
        call("a")
        current_job().sleep(3600, name="nap")

    def v2() -> Any:
        call("a")
        call("new")
        current_job().sleep(3600, name="nap")
        return call("after")

    _, row = deploy(db, v1, v2)
    assert row.state == "finished" and row.result == "after"
    assert CALLS == {"a": 1, "new": 1, "after": 1}


def test_unnamed_sleeps_are_numbered_in_order_so_one_added_before_another_takes_its_number(db: Database) -> None:
    def v1() -> Any:
        current_job().sleep(3600)  # sleep:1

    def v2() -> Any:
        current_job().sleep(3600)  # sleep:1: the one the job parked in, ended
        call("x")
        current_job().sleep(3600)  # sleep:2: new, so the job sleeps again for its whole hour

    job_id, row = deploy(db, v1, v2)
    assert row.state == "pending" and CALLS == {"x": 1}
    stored = names(db, job_id)
    assert stored["sleep:1"].finished_at is not None and stored["sleep:2"].finished_at is None


def test_a_step_whose_value_changed_meaning_gets_a_new_name_and_runs_again(db: Database) -> None:
    def v1() -> Any:
        call("price", 10)  # euros
        current_job().sleep(3600)

    def v2() -> Any:
        cents = call("price:v2", 1000)  # a new name: the old value (euros) is not read as cents
        current_job().sleep(3600)
        return cents

    job_id, row = deploy(db, v1, v2)
    assert row.state == "finished" and row.result == 1000 and CALLS == {"price": 1, "price:v2": 1}
    assert names(db, job_id)["price"].value == 10
