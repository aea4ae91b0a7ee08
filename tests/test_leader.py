"""The leader lease (sqla_jobs.leader): one leader at a time, terms, hand-over, takeover after a death,
and a leader that cannot renew stops leading before anyone else can start."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from sqla_jobs.drivers import _leadership
from sqla_jobs.errors import ConfigError
from sqla_jobs.leader import Leadership, leader_table
from tests import app, forkserver
from tests.conftest import ROOT, Database

LEASE = 1.5


def seconds_left(db: Database) -> float:
    with db.engine.connect() as conn:
        row = _leadership.current(app.queue.driver(conn), conn, leader_table(app.queue), "maintenance")
    assert row is not None
    return float(row.seconds_left)


def test_one_leader_terms_and_hand_over(db: Database) -> None:
    a = Leadership(db.engine, app.queue, "a", lease=LEASE)
    b = Leadership(db.engine, app.queue, "b", lease=LEASE)
    assert a.renew() and a.term == 1 and a.is_leader
    assert not b.renew() and not b.is_leader and b.term is None
    assert a.renew() and a.term == 1  # a renewal keeps the term
    assert 0 < seconds_left(db) <= LEASE
    a.resign()
    assert not a.is_leader and seconds_left(db) < 0
    assert b.renew() and b.term == 2  # taken over at once, in a new term
    assert not a.renew()


def test_an_expired_lease_is_taken_over_in_a_new_term(db: Database) -> None:
    a = Leadership(db.engine, app.queue, "a", lease=LEASE)
    b = Leadership(db.engine, app.queue, "b", lease=LEASE)
    assert a.renew()
    time.sleep(LEASE + 0.2)  # a died without resigning
    assert not a.is_leader  # and even its own clock no longer trusts it
    assert b.renew() and b.term == 2
    assert not a.renew()
    with pytest.raises(ConfigError, match="lease must be > 0"):
        Leadership(db.engine, app.queue, "c", lease=0)


def test_a_leader_that_cannot_renew_stops_leading_before_its_lease_ends(db: Database) -> None:
    a = Leadership(db.engine, app.queue, "a", lease=LEASE)
    assert a.renew()
    renewed = time.monotonic()
    # Another session holds the row (a cut link or a stalled server looks the same from the leader).
    blocker = db.engine.connect()
    table = leader_table(app.queue)
    if db.backend == "sqlite":
        blocker.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        blocker.execute(table.select().with_for_update())
    result: list[bool] = []
    renewal = threading.Thread(target=lambda: result.append(a.renew()), daemon=True)
    renewal.start()
    try:
        while a.is_leader:
            time.sleep(0.01)
        stepped_down_after = time.monotonic() - renewed
        assert stepped_down_after < LEASE  # it stopped before the database would let anyone else in
        assert renewal.is_alive() or result == [False]
    finally:
        blocker.rollback()
        blocker.close()
    renewal.join(30)


WORKER = """
import json, signal, sys, threading, time
from sqlalchemy import create_engine
from sqla_jobs.leader import Leadership
from tests import app

name, url = sys.argv[1], sys.argv[2]
lease = {lease}
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
me = Leadership(create_engine(url), app.queue, name, lease=lease)
reign = None  # [term, first renewal's start, end of the trust the last renewal gave]


def report(end):
    print(json.dumps([name, reign[0], reign[1], min(end, reign[2])]), flush=True)


while not stop.is_set():
    began = time.time()
    if me.renew():
        if reign is None:
            reign = [me.term, began, 0.0]
        reign[2] = began + lease * 0.8  # what Leadership trusts: measured from before the renewal
    elif reign is not None:
        report(began)
        reign = None
    stop.wait(lease / 5)
if reign is not None:
    report(time.time())
"""


def wait_for_leader(db: Database, accept: Callable[[Any], bool]) -> Any:
    deadline = time.time() + 60
    while True:
        with db.engine.connect() as conn:
            row = conn.execute(text(f"SELECT holder, term FROM {leader_table(app.queue).name}")).first()
        if row is not None and accept(row):
            return row
        assert time.time() < deadline, "no leader (or no new one) within 60 s"
        time.sleep(0.05)


def test_four_processes_never_lead_at_once_and_a_killed_leader_is_replaced(db: Database) -> None:
    Leadership(db.engine, app.queue, "setup", lease=LEASE)._ensure_table()
    procs = {
        name: forkserver.Popen([sys.executable, "-c", WORKER.format(lease=LEASE), name, db.url],
                               env=db.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("w0", "w1", "w2", "w3")
    }
    first = wait_for_leader(db, lambda row: True)
    time.sleep(1)
    procs[first.holder].send_signal(signal.SIGKILL)  # the leader dies without handing over
    killed_at = time.time()
    wait_for_leader(db, lambda row: row.holder != first.holder)
    time.sleep(1)
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    reigns, errors = [], []
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        errors.append(err[-2000:])
        if name != first.holder:
            assert proc.returncode == 0, err
            reigns += [json.loads(line) for line in out.splitlines()]
    # The reigns of the survivors, as each trusted itself: never two at once, each in a new term.
    reigns.sort(key=lambda r: r[2])
    for earlier, later in itertools.pairwise(reigns):
        assert earlier[3] <= later[2], (earlier, later)
        assert later[1] > earlier[1], (earlier, later)
    successors = [r for r in reigns if r[1] > first.term]
    assert successors, f"nobody took over from the killed leader: {errors}"
    assert successors[0][2] - killed_at < LEASE + LEASE / 5 + 1.0  # within a lease and a renewal interval
