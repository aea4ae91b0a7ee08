"""What the partial index ``ix_<jobs>_cancelled`` costs an enqueue and a finish (a manual benchmark, not a test).

In a scratch schema it drops afterwards: 6 rounds, alternating the index
dropped and created, each enqueuing 10,000 jobs with ``add_all`` in one
transaction and finishing them in batches of 64 (as a worker does); prints
the medians and every round::

    python docs/bench/cancelled_index_cost.py [postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, make_url, text, update
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from tests.app import Base, Job

URL = sys.argv[1] if len(sys.argv) > 1 else "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def main() -> None:
    schema = f"ixcost_{uuid.uuid4().hex[:8]}"
    admin = create_engine(URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine = create_engine(make_url(URL).update_query_dict({"options": f"-csearch_path={schema}"}))
    Base.metadata.create_all(engine)
    rates: dict[bool, dict[str, list[float]]] = {k: {"add_all": [], "finish": []} for k in (True, False)}
    try:
        for round_ in range(6):
            for with_index in (True, False) if round_ % 2 == 0 else (False, True):
                with engine.begin() as conn:
                    conn.execute(text("DROP INDEX IF EXISTS ix_jobs_cancelled"))
                    if with_index:
                        conn.execute(text("CREATE INDEX ix_jobs_cancelled ON jobs (id) WHERE state = 'cancelled'"))
                    conn.execute(text("TRUNCATE jobs"))
                t0 = time.perf_counter()
                with Session(engine) as session, session.begin():
                    session.add_all([Job(kind="noop", payload={"n": i}) for i in range(10_000)])
                rates[with_index]["add_all"].append(10_000 / (time.perf_counter() - t0))
                with engine.connect() as conn:
                    ids = list(conn.scalars(text("SELECT id FROM jobs")))
                t0 = time.perf_counter()
                with engine.connect() as conn:
                    for start in range(0, len(ids), 64):
                        with conn.begin():
                            conn.execute(update(Job.__table__).where(Job.id.in_(ids[start:start + 64]))
                                         .values(state="finished", finished_at=text("now()")))
                rates[with_index]["finish"].append(10_000 / (time.perf_counter() - t0))
        for with_index in (False, True):
            print("with ix_jobs_cancelled" if with_index else "without the index     ", "  ".join(
                f"{name}: median {statistics.median(v):,.0f} jobs/s ({', '.join(f'{x:,.0f}' for x in v)})"
                for name, v in rates[with_index].items()))
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


if __name__ == "__main__":
    main()
