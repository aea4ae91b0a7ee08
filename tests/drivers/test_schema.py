"""Creating the tables and checking them, on every driver."""

from __future__ import annotations

import pytest
from sqlalchemy.schema import DropIndex

from sqla_jobs.errors import SchemaError
from tests.drivers.conftest import Backend


def test_created_tables_pass_the_schema_check_and_create_is_idempotent(backend: Backend) -> None:
    with backend.write() as conn:
        backend.driver.create(conn)
        backend.driver.check_schema(conn)
    assert {f"ix_{backend.driver.jobs.name}_pending", f"ix_{backend.driver.jobs.name}_running"} <= (
        backend.driver.index_names(backend.db.engine.connect())
    )


def test_a_missing_claim_index_is_named(backend: Backend) -> None:
    with backend.write() as conn:
        # DropIndex, not text: MariaDB/MySQL spell it DROP INDEX … ON table.
        [index] = [ix for ix in backend.driver.jobs.indexes
                   if ix.name == f"ix_{backend.driver.jobs.name}_pending" and backend.driver.applies(ix)]
        conn.execute(DropIndex(index))
    with backend.db.engine.connect() as conn, pytest.raises(SchemaError, match="_pending"):
        backend.driver.check_schema(conn)


def test_wake_up_capabilities_agree(backend: Backend) -> None:
    d = backend.driver
    with backend.db.engine.connect() as conn:
        assert d.has_notify_trigger(conn) == d.supports_listen
        assert bool(d.channel) == d.supports_listen
        d.notify(conn)  # harmless where nobody listens
