"""The job tables in a user's alembic history, on real PostgreSQL and SQLite.

Every test builds a throwaway alembic project in ``tmp_path`` and drives it
with the ``alembic`` and ``sqla-jobs`` commands in subprocesses, as a user
would. PostgreSQL projects target the test's own schema through the URL's
search_path (the version table lands there too), so nothing outside it is
touched; a test that needs a second schema creates and drops its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    inspect,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from sqla_jobs.drivers.postgresql.vacuum import AUTOVACUUM
from tests import forkserver
from tests.conftest import BACKENDS, PG_URL, ROOT, Database, make_database, require_postgres
from tests.test_vacuum import table_settings

pytestmark = pytest.mark.timeout(300)

# A user's models: custom table names, a queue with one handler that works and one that always fails.
MODELS = '''
from sqlalchemy.orm import DeclarativeBase
from sqla_jobs import DeadJobMixin, JobMixin, JobQueue


class Base(DeclarativeBase):
    pass


class Task(JobMixin, Base):
    __tablename__ = "app_tasks"{job_args}


class DeadTask(DeadJobMixin, Base):
    __tablename__ = "app_dead_tasks"{dead_args}


queue = JobQueue(Task, DeadTask)


@queue.handler("ok")
def ok(payload):
    return [payload["n"]]  # stored in the result column (an older schema gets it by migration)


@queue.handler("broken")
def broken(payload):
    raise RuntimeError("broken on purpose")
'''

# What a user adds to alembic's stock env.py to use our options (both configure() calls).
ENV_IMPORT = "from sqla_jobs.alembic import configure_options\nimport jobmodels\n"


def write_models(project: Path, schema: str | None = None) -> None:
    job_args = dead_args = ""
    if schema:
        job_args = f"\n    __table_args__ = JobMixin.table_args(schema={schema!r})"
        dead_args = f"\n    __table_args__ = DeadJobMixin.table_args(schema={schema!r})"
    (project / "jobmodels.py").write_text(MODELS.format(job_args=job_args, dead_args=dead_args))


class Project:
    """A user's project folder with alembic.ini, migrations/ and jobmodels.py."""

    def __init__(self, path: Path, db: Database) -> None:
        self.path = path
        self.db = db

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{self.path}{os.pathsep}{ROOT}", "SQLA_JOBS_URL": self.db.url}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = forkserver.run(
            [sys.executable, *args], cwd=self.path, env=self.env(), capture_output=True, text=True, timeout=180
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def alembic(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("-m", "alembic", *args, check=check)

    def sqla_jobs(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("-m", "sqla_jobs.cli", *args, check=check)

    def check_clean(self) -> None:
        result = self.alembic("check", check=False)
        assert result.returncode == 0, f"alembic check found differences:\n{result.stdout}\n{result.stderr}"
        assert "No new upgrade operations detected" in result.stdout + result.stderr

    def revisions(self) -> list[Path]:
        return sorted((self.path / "migrations" / "versions").glob("*.py"))

    def enqueue_and_work(self, table: str = "app_tasks") -> None:
        """Enqueue through the ORM, run a worker process, and check every job reached its end."""
        self.run(
            "-c",
            "import os; from sqlalchemy import create_engine; from sqlalchemy.orm import Session; "
            "import jobmodels as m; e = create_engine(os.environ['SQLA_JOBS_URL']); s = Session(e); "
            "s.add_all([m.Task(kind='ok', payload={'n': i}) for i in range(5)]); "
            "s.add(m.Task(kind='broken', payload={}, max_attempts=1)); s.commit()",
        )
        self.sqla_jobs("worker", "--app", "jobmodels:queue", "--burst", "--concurrency", "2")
        with self.db.engine.connect() as conn:
            states = sorted(conn.execute(text(f"SELECT kind, state FROM {table}")).all())
            results = conn.execute(text(f"SELECT result FROM {table} WHERE kind = 'ok'")).scalars().all()
        assert states == [("ok", "finished")] * 5
        assert sorted(json.loads(r) if isinstance(r, str) else r for r in results) == [[0], [1], [2], [3], [4]]


def set_url(project: Project, db: Database) -> None:
    """Point the project's alembic.ini (and its SQLA_JOBS_URL) at ``db``."""
    project.db = db
    ini = project.path / "alembic.ini"
    url = db.url.replace("%", "%%")  # configparser interpolation
    ini.write_text(re.sub(r"(?m)^sqlalchemy\.url = .*$", lambda _: f"sqlalchemy.url = {url}", ini.read_text()))


def user_project(tmp_path: Path, db: Database) -> Project:
    """``alembic init`` with the stock template, then the documented env.py edits."""
    project = Project(tmp_path / "proj", db)
    project.path.mkdir()
    write_models(project.path)
    project.alembic("init", "migrations")
    set_url(project, db)
    env = project.path / "migrations" / "env.py"
    source = env.read_text()
    source = source.replace("target_metadata = None", "target_metadata = jobmodels.Base.metadata")
    wired = "target_metadata=target_metadata, **configure_options(target_metadata),"
    source = re.sub(r"target_metadata=target_metadata,?", wired, source)
    assert source.count("configure_options(target_metadata)") == 2, "alembic's env.py template changed shape"
    env.write_text(ENV_IMPORT + source)
    return project


@pytest.fixture(params=BACKENDS)
def empty_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty database (no tables at all), on each backend."""
    yield from make_database(request.param, tmp_path)


@pytest.fixture(params=[b for b in BACKENDS if b != "mariadb"])
def empty_partial_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty database with partial indexes. Not MariaDB/MySQL: the tests that take this rewrite a
    partial index (``WHERE state = ...``) or start from an older sqla-jobs schema, and no older
    version supported MariaDB, whose indexes have no WHERE (its own index rules are tested above)."""
    yield from make_database(request.param, tmp_path)


def index_names(db: Database, table: str, schema: str | None = None) -> set[str]:
    with db.engine.connect() as conn:
        if db.backend == "sqlite":  # reflection may leave out expression indexes on SQLite
            rows = conn.execute(text("SELECT name FROM sqlite_master WHERE type='index' AND tbl_name=:t"), {"t": table})
            return {r[0] for r in rows}
        return {ix["name"] for ix in inspect(conn).get_indexes(table, schema=schema)}


QUEUE_INDEXES = {"ix_app_tasks_pending", "ix_app_tasks_running", "ix_app_tasks_finished"}


def test_autogenerate_upgrade_check_downgrade(empty_db: Database, tmp_path: Path) -> None:
    project = user_project(tmp_path, empty_db)
    project.alembic("revision", "--autogenerate", "-m", "add job tables")
    [revision] = project.revisions()
    source = revision.read_text()
    assert "astext_type=sa.Text()" in source and "from sqlalchemy.dialects import postgresql" in source
    assert "ix_app_tasks_pending" in source, "the claim index must be in the revision on every backend"

    project.alembic("upgrade", "head")
    assert index_names(empty_db, "app_tasks") >= QUEUE_INDEXES
    project.check_clean()
    project.alembic("downgrade", "base")
    assert not inspect(empty_db.engine).has_table("app_tasks")
    project.alembic("upgrade", "head")
    project.check_clean()
    project.enqueue_and_work()


def test_autogenerated_revision_runs_on_the_other_backend(tmp_path: Path) -> None:
    """A revision generated against SQLite runs on PostgreSQL and the reverse, with no edits."""
    require_postgres()
    (tmp_path / "s").mkdir()
    (tmp_path / "p").mkdir()
    makers = {
        "sqlite": make_database("sqlite", tmp_path / "s"),
        "postgresql": make_database("postgresql", tmp_path / "p"),
    }
    dbs = {backend: next(maker) for backend, maker in makers.items()}
    try:
        for source, target in (("sqlite", "postgresql"), ("postgresql", "sqlite")):
            (tmp_path / source).mkdir()
            project = user_project(tmp_path / source, dbs[source])
            project.alembic("revision", "--autogenerate", "-m", "jobs")
            set_url(project, dbs[target])
            project.alembic("upgrade", "head")
            project.check_clean()
            project.alembic("downgrade", "base")
    finally:
        for maker in makers.values():
            for _ in maker:  # runs the generator's cleanup
                pass


def test_render_upgrade_check_and_work(empty_db: Database, tmp_path: Path) -> None:
    project = Project(tmp_path / "proj", empty_db)
    project.path.mkdir()
    write_models(project.path)
    project.sqla_jobs("migrations", "init", "migrations")
    ini = project.path / "alembic.ini"
    ini.write_text(ini.read_text().replace("sqla_jobs.app =", "sqla_jobs.app = jobmodels:queue"))

    # A revision of the user's own comes first: ours must go on top of it.
    project.alembic("revision", "-m", "the app's first revision", "--rev-id", "0001app")
    out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue").stdout
    assert "create table app_tasks" in out and "create index ix_app_tasks_pending" in out
    rendered = [p for p in project.revisions() if "0001app" not in p.name]
    assert len(rendered) == 1
    source = rendered[0].read_text()
    assert "down_revision: str | Sequence[str] | None = '0001app'" in source
    assert "op.drop_table('app_tasks')" in source and "op.drop_table('app_dead_tasks')" in source

    project.alembic("upgrade", "head")
    assert index_names(empty_db, "app_tasks") >= QUEUE_INDEXES
    if empty_db.backend == "postgresql":  # the revision gives the jobs table its autovacuum settings too
        assert "autovacuum_vacuum_threshold = 20000" in source
        assert table_settings(empty_db, "app_tasks") == AUTOVACUUM
    project.check_clean()
    # Nothing left to render once the database is up to date.
    again = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", empty_db.url)
    assert "up to date" in again.stdout and len(project.revisions()) == 2
    # Without a database it would render a second CREATE TABLE: it refuses and says what to do instead.
    twice = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", "", check=False)
    assert twice.returncode == 2 and "already creates table 'app_tasks'" in twice.stderr and "--url" in twice.stderr
    assert len(project.revisions()) == 2
    project.alembic("downgrade", "0001app")
    assert not inspect(empty_db.engine).has_table("app_tasks")
    project.alembic("upgrade", "head")
    project.check_clean()
    project.enqueue_and_work()


def test_changed_queue_index_is_detected_and_rebuilt(empty_partial_db: Database, tmp_path: Path) -> None:
    """An index that lost its DESC (as alembic's SQLite batch mode rebuilds it) or has another predicate."""
    project = user_project(tmp_path, empty_partial_db)
    project.alembic("revision", "--autogenerate", "-m", "jobs")
    project.alembic("upgrade", "head")
    with empty_partial_db.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_app_tasks_pending"))
        conn.execute(text("CREATE INDEX ix_app_tasks_pending ON app_tasks (queue, priority, run_at, id) "
                          "WHERE state = 'pending'"))
        conn.execute(text("DROP INDEX ix_app_tasks_running"))
        conn.execute(text("CREATE INDEX ix_app_tasks_running ON app_tasks (lease_expires_at) WHERE kind = 'x'"))
    check = project.alembic("check", check=False)
    assert check.returncode != 0 and "ix_app_tasks_pending" in check.stderr + check.stdout
    out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", empty_partial_db.url).stdout
    # Autogenerate cannot see the NOTIFY trigger, so on PostgreSQL render adds it too.
    trigger = ["create trigger app_tasks_notify (PostgreSQL)"] if empty_partial_db.backend == "postgresql" else []
    assert sorted(line.strip() for line in out.splitlines() if line.startswith("  ")) == [
        "create index ix_app_tasks_pending", "create index ix_app_tasks_running", *trigger,
        "drop index ix_app_tasks_pending", "drop index ix_app_tasks_running",
    ], out
    project.alembic("upgrade", "head")
    project.check_clean()
    if empty_partial_db.backend == "postgresql":  # SQLite cannot change a column's default in place
        with empty_partial_db.engine.begin() as conn:
            conn.execute(text("ALTER TABLE app_tasks ALTER COLUMN max_attempts SET DEFAULT 9"))
        changed = project.alembic("check", check=False)
        assert changed.returncode != 0 and "modify_default" in changed.stdout + changed.stderr
        fix = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue",
                                "--url", empty_partial_db.url).stdout
        assert "alter column app_tasks.max_attempts" in fix
        project.alembic("upgrade", "head")
        project.check_clean()
        project.alembic("downgrade", "-1")
    assert "DESC" in index_definition(empty_partial_db, "ix_app_tasks_pending").upper()
    # The downgrade puts back the definitions it replaced, not this version's.
    project.alembic("downgrade", "-1")
    assert "DESC" not in index_definition(empty_partial_db, "ix_app_tasks_pending").upper()
    assert "'x'" in index_definition(empty_partial_db, "ix_app_tasks_running")
    project.alembic("upgrade", "head")
    project.check_clean()


def index_definition(db: Database, name: str) -> str:
    with db.engine.connect() as conn:
        if db.backend == "sqlite":
            return str(conn.execute(text("SELECT sql FROM sqlite_master WHERE name = :n"), {"n": name}).scalar_one())
        query = text("SELECT indexdef FROM pg_indexes WHERE indexname = :n AND schemaname = :s")
        return str(conn.execute(query, {"n": name, "s": db.schema}).scalar_one())


def old_schema(metadata: MetaData, backend: str) -> None:
    """The job tables as an older sqla-jobs made them: no errors/cancelled_at/isolate, no ix_<table>_finished."""
    payload = JSON().with_variant(JSONB(), "postgresql")
    ident = BigInteger().with_variant(Integer(), "sqlite")
    now = text("CURRENT_TIMESTAMP")

    def common() -> list[Column]:  # type: ignore[type-arg]
        return [
            Column("kind", String(255), nullable=False),
            Column("queue", String(64), nullable=False, server_default="default"),
            Column("payload", payload, nullable=False),
            Column("priority", Integer, nullable=False, server_default="0"),
            Column("attempts", Integer, nullable=False, server_default="0"),
            Column("max_attempts", Integer, nullable=False, server_default="5"),
            Column("created_at", DateTime(timezone=True), nullable=False, server_default=now),
            Column("last_error", Text),
        ]

    jobs = Table(
        "app_tasks",
        metadata,
        Column("id", ident, primary_key=True, autoincrement=True),
        Column("state", String(16), nullable=False, server_default="pending"),
        Column("run_at", DateTime(timezone=True), nullable=False, server_default=now),
        Column("locked_at", DateTime(timezone=True)),
        Column("locked_by", String(255)),
        Column("claim_token", String(64)),
        Column("lease_expires_at", DateTime(timezone=True)),
        Column("finished_at", DateTime(timezone=True)),
        *common(),
        sqlite_autoincrement=True,
    )
    where = {"postgresql_where": text("state = 'pending'"), "sqlite_where": text("state = 'pending'")}
    Index("ix_app_tasks_pending", jobs.c.queue, text("priority DESC"), jobs.c.run_at, jobs.c.id, **where)
    running = {"postgresql_where": text("state = 'running'"), "sqlite_where": text("state = 'running'")}
    Index("ix_app_tasks_running", jobs.c.lease_expires_at, **running)
    dead = Table(
        "app_dead_tasks",
        metadata,
        Column("id", ident, primary_key=True, autoincrement=False),
        Column("run_at", DateTime(timezone=True)),
        Column("failed_at", DateTime(timezone=True), nullable=False, server_default=now),
        *common(),
    )
    Index("ix_app_dead_tasks_kind", dead.c.kind, dead.c.failed_at)


def test_upgrade_from_an_older_schema(empty_partial_db: Database, tmp_path: Path) -> None:
    metadata = MetaData()
    old_schema(metadata, empty_partial_db.backend)
    metadata.create_all(empty_partial_db.engine)  # the app made these with an older sqla-jobs
    project = user_project(tmp_path, empty_partial_db)

    refused = project.sqla_jobs("worker", "--app", "jobmodels:queue", "--burst", check=False)
    assert refused.returncode == 2
    assert ("lacks column(s) cancelled_at, errors, fair_key, has_dependents, isolate, on_upstream_failure, progress, "
            "result, sequence_key, trace_context, unique_held, unique_key, unique_states, "
            "waiting_for") in refused.stderr
    assert "sqla-jobs migrations render" in refused.stderr

    out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", empty_partial_db.url).stdout
    [revision] = project.revisions()
    source = revision.read_text()
    # Exactly the difference: nineteen columns (sequence_key and fair_key on both tables: sqla_jobs._sequence,
    # sqla_jobs._fair), the dependencies' table and its index, the batches' table and its three indexes, the durable
    # jobs' steps table with its index and events table (sqla_jobs._durable), the sequences' table, eight new
    # indexes (ix_app_tasks_sequence, ix_app_tasks_fair: the fair claim's, ix_app_tasks_by_queue_kind: the
    # dashboard's lists), the claim index rebuilt in its new
    # column order, and on PostgreSQL the NOTIFY trigger; nothing else.
    upgrade = source.split("def downgrade")[0]
    trigger = ["execute", "execute", "get_bind"] if empty_partial_db.backend == "postgresql" else []
    # get_bind: the unique_held column is stored on PostgreSQL only, decided when the revision runs
    expected = sorted(["add_column"] * 19 + ["create_table"] * 5 + ["create_index"] * 14 + ["drop_index"] + ["get_bind"]
                      + trigger)
    assert sorted(re.findall(r"op\.(\w+)\(", upgrade)) == expected, source
    assert sorted(re.findall(r"op\.add_column\('(\w+)', sa\.Column\('(\w+)'", upgrade)) == [
        ("app_dead_tasks", "errors"), ("app_dead_tasks", "fair_key"), ("app_dead_tasks", "sequence_key"),
        ("app_dead_tasks", "trace_context"), ("app_dead_tasks", "unique_key"),
        ("app_tasks", "cancelled_at"), ("app_tasks", "errors"), ("app_tasks", "fair_key"),
        ("app_tasks", "has_dependents"),
        ("app_tasks", "isolate"), ("app_tasks", "on_upstream_failure"), ("app_tasks", "progress"),
        ("app_tasks", "result"), ("app_tasks", "sequence_key"), ("app_tasks", "trace_context"),
        ("app_tasks", "unique_held"), ("app_tasks", "unique_key"), ("app_tasks", "unique_states"),
        ("app_tasks", "waiting_for"),
    ]
    assert "op.create_table('app_tasks_deps'" in upgrade  # job graphs (sqla_jobs._graph)
    assert "op.create_table('app_tasks_batches'" in upgrade  # batches (sqla_jobs._batch)
    assert "op.create_table('app_tasks_steps'" in upgrade and "op.create_table('app_tasks_events'" in upgrade
    assert "op.create_table('app_tasks_sequences'" in upgrade  # sequences (sqla_jobs._sequence)
    assert "op.create_index('ix_app_tasks_sequence'" in upgrade
    # NOT NULL with a server default, so the rows already there get false and the upgrade needs no data step.
    isolate = r"sa\.Column\('isolate', sa\.Boolean\(\), server_default=sa\.text\('\(?false\)?'\), nullable=False\)"
    assert re.search(isolate, upgrade), upgrade
    assert "op.create_index('ix_app_tasks_finished'" in upgrade
    assert "op.create_index('ix_app_tasks_cancelled'" in upgrade  # the dashboard's cancelled list (issue 31)
    assert "op.create_index('ix_app_tasks_blocked'" in upgrade  # stats' and the lists' blocked jobs (issue 33)
    assert "op.create_index('ix_app_tasks_fair'" in upgrade  # fair queues' claim (issue 35)
    assert "op.create_index('ix_app_tasks_by_queue_kind'" in upgrade  # the dashboard's lists by queue, kind (31)
    assert "add column app_tasks.errors" in out

    project.alembic("upgrade", "head")
    project.check_clean()
    project.enqueue_and_work()
    with empty_partial_db.engine.connect() as conn:
        errors = conn.execute(text("SELECT errors FROM app_dead_tasks WHERE kind = 'broken'")).scalar_one()
    assert "broken on purpose" in str(errors)

    project.alembic("downgrade", "base")  # back to exactly the old schema
    assert "ix_app_tasks_finished" not in index_names(empty_partial_db, "app_tasks")
    assert "errors" not in {c["name"] for c in inspect(empty_partial_db.engine).get_columns("app_tasks")}
    project.alembic("upgrade", "head")
    project.check_clean()


def test_worker_refuses_without_the_claim_index(db: Database) -> None:
    with db.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_jobs_pending" + (" ON jobs" if db.backend == "mariadb" else "")))
    from sqlalchemy.orm import Session

    from tests import app
    from tests.conftest import run_cli

    result = run_cli("worker", "--app", "tests.app:queue", "--burst", env=db.env())
    assert result.returncode == 2, result.stderr
    assert "lacks index(es) ix_jobs_pending" in result.stderr
    assert "sqla-jobs migrations render" in result.stderr and "alembic upgrade head" in result.stderr
    # Without alembic: create-tables adds the missing index to the existing table, and the worker runs.
    assert run_cli("create-tables", "--app", "tests.app:queue", env=db.env()).returncode == 0
    assert "ix_jobs_pending" in index_names(db, "jobs")
    with Session(db.engine) as session, session.begin():
        session.add(app.Job(kind="noop", payload={}))
    done = run_cli("worker", "--app", "tests.app:queue", "--burst", env=db.env())
    assert done.returncode == 0, done.stderr
    with db.engine.connect() as conn:
        assert conn.execute(text("SELECT state FROM jobs")).scalar_one() == "finished"


@pytest.fixture
def empty_pg(tmp_path: Path) -> Iterator[Database]:
    yield from make_database("postgresql", tmp_path)


def test_non_default_schema_end_to_end(empty_pg: Database, tmp_path: Path) -> None:
    """Tables in their own PostgreSQL schema with custom names: migrations, enqueue, worker, dead retry."""
    pg = empty_pg
    work = f"{pg.schema}_work"
    try:
        project = Project(tmp_path / "proj", pg)
        project.path.mkdir()
        write_models(project.path, schema=work)
        project.sqla_jobs("migrations", "init", "migrations")
        ini = project.path / "alembic.ini"
        ini.write_text(ini.read_text().replace("sqla_jobs.app =", "sqla_jobs.app = jobmodels:queue"))
        out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue").stdout
        assert f"CREATE SCHEMA IF NOT EXISTS {work}" in out
        project.alembic("upgrade", "head")
        assert inspect(pg.engine).has_table("app_tasks", schema=work)
        assert inspect(pg.engine).has_table("alembic_version", schema=pg.schema)
        project.check_clean()
        project.enqueue_and_work(table=f'"{work}".app_tasks')

        moved = project.sqla_jobs("dead", "retry", "--app", "jobmodels:queue", "--all").stdout
        assert "requeued 1 job(s)" in moved
        with pg.engine.connect() as conn:
            back = conn.execute(text(f'SELECT kind, state FROM "{work}".app_tasks WHERE kind = \'broken\'')).one()
        assert tuple(back) == ("broken", "pending")

        project.alembic("downgrade", "base")
        assert not inspect(pg.engine).has_table("app_tasks", schema=work)
    finally:
        admin = create_engine(PG_URL)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{work}" CASCADE'))
        admin.dispose()


def test_importing_sqla_jobs_does_not_import_alembic() -> None:
    code = "import sys, sqla_jobs, sqla_jobs.cli, sqla_jobs.worker.worker; print('alembic' in sys.modules)"
    result = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "False"


def test_user_render_item_is_kept(tmp_path: Path) -> None:
    from alembic.autogenerate import render_python_code
    from alembic.operations import ops

    from sqla_jobs.alembic import configure_options

    seen: list[str] = []

    def mine(type_: str, obj: object, autogen_context: object) -> str | bool:
        seen.append(type_)
        if type_ == "type" and isinstance(obj, String) and obj.length == 64:
            return "sa.String(length=64, collation='C')"
        return False

    metadata = MetaData()
    table = Table("t", metadata, Column("q", String(64)), Column("p", JSON().with_variant(JSONB(), "postgresql")))
    options = configure_options(metadata, render_item=mine)
    code = render_python_code(ops.UpgradeOps([ops.CreateTableOp.from_table(table)]), render_item=options["render_item"])
    assert "collation='C'" in code  # theirs
    assert "postgresql.JSONB(astext_type=sa.Text())" in code  # ours
    assert "type" in seen
    compile(code.replace("\n    ", "\n"), "<revision>", "exec")


@pytest.mark.slow
def test_wheel_ships_the_templates(tmp_path: Path) -> None:
    """Build the wheel, install it apart from the source tree, and ``alembic init`` from the installed template."""
    import shutil
    import zipfile

    source = tmp_path / "src"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info", "*.db")
    )
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)],
        check=True, capture_output=True, text=True, timeout=240,
    )
    [wheel] = dist.glob("sqla_jobs-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    template = "sqla_jobs/alembic_templates/sqla_jobs/"
    for name in ("env.py", "script.py.mako", "alembic.ini.mako", "README"):
        assert template + name in names, sorted(names)
    assert "sqla_jobs/alembic_templates/__init__.py" in names

    # Install it into a folder of its own (dependencies come from this environment) and use it from there.
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    work = tmp_path / "newproject"
    work.mkdir()

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=120, check=True
        )
        return done.stdout.strip()

    path = run("-m", "sqla_jobs.cli", "migrations", "template-path")
    assert Path(path).is_relative_to(site), f"template came from {path}, not the installed wheel"
    run("-m", "alembic", "init", "-t", path, "migrations")
    assert "configure_options" in (work / "migrations" / "env.py").read_text()
    assert "sqla_jobs.app" in (work / "alembic.ini").read_text()


# Columns an older schema could lack that SQLite can drop (nullable, in no index), per table of tests.app.
DROPPABLE_COLUMNS = [
    ("jobs", "cancelled_at"), ("jobs", "errors"), ("jobs", "last_error"), ("jobs", "locked_by"),
    ("jobs", "claim_token"), ("jobs", "isolate"), ("jobs", "result"), ("jobs", "progress"), ("dead_jobs", "errors"),
    ("dead_jobs", "last_error"),
]
QUEUE_INDEX_NAMES = ["ix_jobs_pending", "ix_jobs_running", "ix_jobs_finished", "ix_dead_jobs_kind"]


@pytest.mark.filterwarnings("ignore:autogenerate skipping metadata-specified expression-based index")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    columns=st.sets(st.sampled_from(DROPPABLE_COLUMNS)),
    indexes=st.sets(st.sampled_from(QUEUE_INDEX_NAMES)),
)
def test_render_writes_exactly_what_is_missing(
    tmp_path: Path, columns: set[tuple[str, str]], indexes: set[str]
) -> None:
    """Any older SQLite schema (some columns and indexes missing): render names exactly those, and after
    the upgrade alembic check is clean and the worker's schema check passes."""
    import tempfile

    from alembic import command
    from alembic.config import Config

    from sqla_jobs.alembic import render_revision, template_dir
    from tests import app

    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        root = Path(folder)
        url = f"sqlite:///{root / 'old.db'}"
        engine = create_engine(url)
        app.Base.metadata.create_all(engine)  # env.py's target_metadata is the whole test app
        with engine.begin() as conn:
            for name in indexes:
                conn.execute(text(f"DROP INDEX {name}"))
            for table, column in sorted(columns):
                conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        config = Config(str(root / "alembic.ini"))
        command.init(config, str(root / "migrations"), template=str(template_dir()))
        config.set_main_option("sqla_jobs.app", "tests.app:queue")
        config.set_main_option("sqlalchemy.url", url)
        with engine.connect() as conn:
            rendered = render_revision(app.queue, root / "alembic.ini", connection=conn)
        expected = {f"add column {t}.{c}" for t, c in columns} | {f"create index {n}" for n in indexes}
        assert set(rendered.summary) == expected and len(rendered.summary) == len(expected)
        if not expected:
            assert rendered.path is None
            return
        command.upgrade(config, "head")
        command.check(config)  # raises AutogenerateDiffsDetected on any difference
        app.queue.check_schema(engine)
        command.downgrade(config, "base")
        with engine.connect() as conn:
            again = render_revision(app.queue, root / "alembic.ini", connection=conn)
        assert set(again.summary) == expected  # the downgrade restored exactly the old schema
        engine.dispose()


def test_render_errors_are_one_line(tmp_path: Path) -> None:
    write_models(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    env.pop("SQLA_JOBS_URL", None)

    def render(*extra: str) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "sqla_jobs.cli", "migrations", "render", "--app", "jobmodels:queue", *extra]
        return forkserver.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    missing = render()
    assert missing.returncode == 2 and "no alembic config at 'alembic.ini'" in missing.stderr
    (tmp_path / "alembic.ini").write_text("[alembic]\nscript_location = nowhere\n")
    broken = render()
    assert broken.returncode == 2 and "nowhere" in broken.stderr
    for result in (missing, broken):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def downgrade_to_0_1(db: Database, jobs: str = "app_tasks", dead: str = "app_dead_tasks") -> None:
    """Turn this version's job tables into sqla-jobs 0.1's: no unique keys (their indexes first, then the
    generated column, then the columns it reads), no result or progress."""
    on = (lambda table: f" ON {table}") if db.backend == "mariadb" else (lambda table: "")
    with db.engine.begin() as conn:
        for index in (f"ux_{jobs}_unique", f"ix_{jobs}_unique_key"):
            conn.execute(text(f"DROP INDEX {index}{on(jobs)}"))
        for column in ("unique_held", "unique_states", "unique_key", "result", "progress"):
            conn.execute(text(f"ALTER TABLE {jobs} DROP COLUMN {column}"))
        conn.execute(text(f"ALTER TABLE {dead} DROP COLUMN unique_key"))


def test_upgrade_in_place_from_0_1(empty_db: Database, tmp_path: Path) -> None:
    """A 0.1 database with jobs in it gets the unique-key, result and progress columns and the indexes in
    place, on every backend: render writes exactly those, the rows stay, a worker runs them, results are
    stored, and unique enqueues work after."""
    project = user_project(tmp_path, empty_db)
    project.alembic("revision", "--autogenerate", "-m", "jobs")
    project.alembic("upgrade", "head")
    downgrade_to_0_1(empty_db)
    with empty_db.engine.begin() as conn:  # a job left from 0.1
        conn.execute(text("INSERT INTO app_tasks (kind, payload) VALUES ('ok', '{\"n\": 1}')"))
    out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", empty_db.url).stdout
    # (Autogenerate cannot see the NOTIFY trigger, so render adds it on PostgreSQL.)
    summary = sorted(line.strip() for line in out.splitlines() if line.startswith("  ") and "trigger" not in line)
    assert summary == [
        "add column app_dead_tasks.unique_key", "add column app_tasks.progress", "add column app_tasks.result",
        "add column app_tasks.unique_held", "add column app_tasks.unique_key", "add column app_tasks.unique_states",
        "create index ix_app_tasks_unique_key", "create index ux_app_tasks_unique",
    ], out
    project.alembic("upgrade", "head")
    project.check_clean()
    project.run("-c", "import os; from sqlalchemy import create_engine; from sqlalchemy.orm import Session; "
                "import jobmodels as m; e = create_engine(os.environ['SQLA_JOBS_URL']); "
                "s = Session(e); "
                "r = [m.queue.enqueue_unique(s, 'ok', {'n': 2}, unique_key='k').inserted for _ in 'ab']; "
                "s.commit(); assert r == [True, False], r")
    worker = project.sqla_jobs("worker", "--app", "jobmodels:queue", "--burst")
    with empty_db.engine.connect() as conn:
        rows = conn.execute(text("SELECT unique_key, state FROM app_tasks ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(None, "finished"), ("k", "finished")], worker.stderr
    with empty_db.engine.connect() as conn:  # and the upgraded table keeps the handlers' results
        results = conn.execute(text("SELECT result FROM app_tasks ORDER BY id")).scalars().all()
    assert [json.loads(r) if isinstance(r, str) else r for r in results] == [[1], [2]]
    project.alembic("downgrade", "-1")  # back to 0.1, and up again
    project.alembic("upgrade", "head")
    project.check_clean()


def test_create_tables_on_a_0_1_database_leaves_the_new_columns_to_a_migration(db: Database) -> None:
    """Without alembic: create-tables does not trip over the indexes of columns it cannot add, and the
    worker says which columns are missing and what to run."""
    from tests.conftest import run_cli

    downgrade_to_0_1(db, "jobs", "dead_jobs")
    created = run_cli("create-tables", "--app", "tests.app:queue", env=db.env())
    assert created.returncode == 0, created.stderr
    refused = run_cli("worker", "--app", "tests.app:queue", "--burst", env=db.env())
    assert refused.returncode == 2, refused.stderr
    assert "lacks column(s) progress, result, unique_held, unique_key, unique_states" in refused.stderr
    assert "sqla-jobs migrations render" in refused.stderr


def test_the_two_list_indexes_of_before_become_one(empty_db: Database, tmp_path: Path) -> None:
    """The dashboard's lists by queue and by kind had an index each; one, ``(queue, kind, id)``, serves both now
    (a write fewer per finish). A database made before gets a revision that builds it and drops the two."""
    project = user_project(tmp_path, empty_db)
    project.alembic("revision", "--autogenerate", "-m", "jobs")
    project.alembic("upgrade", "head")
    mariadb = empty_db.backend == "mariadb"
    with empty_db.engine.begin() as conn:  # as the version before made them
        conn.execute(text("DROP INDEX ix_app_tasks_by_queue_kind" + (" ON app_tasks" if mariadb else "")))
        for column in ("queue", "kind"):
            conn.execute(text(f"CREATE INDEX ix_app_tasks_by_{column} ON app_tasks (state, {column}, id)" if mariadb
                              else f"CREATE INDEX ix_app_tasks_by_{column} ON app_tasks ({column}, id) "
                                   "WHERE state <> 'running'"))
    out = project.sqla_jobs("migrations", "render", "--app", "jobmodels:queue", "--url", empty_db.url).stdout
    trigger = ["create trigger app_tasks_notify (PostgreSQL)"] if empty_db.backend == "postgresql" else []
    assert sorted(line.strip() for line in out.splitlines() if line.startswith("  ")) == [
        "create index ix_app_tasks_by_queue_kind", *trigger,
        "drop index ix_app_tasks_by_kind", "drop index ix_app_tasks_by_queue",
    ], out
    project.alembic("upgrade", "head")
    project.check_clean()
    names = index_names(empty_db, "app_tasks")
    assert "ix_app_tasks_by_queue_kind" in names and not names & {"ix_app_tasks_by_queue", "ix_app_tasks_by_kind"}
