"""``sqla-jobs migrations``: the job tables in your alembic history (needs ``sqla-jobs[alembic]``).

``migrations render [--app module:queue] [--alembic-ini PATH] [--url URL]``
    Write a revision into your versions folder, on top of your current head.
    Without a database it creates both job tables and their indexes; with
    ``--url`` (or ``SQLA_JOBS_URL``, or ``sqlalchemy.url`` in alembic.ini) it
    renders exactly what that database lacks compared with this sqla-jobs
    version, or writes nothing when it is up to date. The app is ``--app``,
    ``SQLA_JOBS_APP`` or ``sqla_jobs.app`` in alembic.ini. Then run
    ``alembic upgrade head``.
``migrations init DIR [--alembic-ini PATH]``
    ``alembic init`` with the sqla-jobs template (env.py already wired).
``migrations template-path``
    Print the template's folder, for ``alembic init -t PATH DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["add_migrations_parser"]


def _alembic() -> Any:
    # alembic logs each of its plugins at INFO; the command's own output says what happened.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        from .. import alembic as support
    except ImportError as exc:
        raise ConfigError(f"`sqla-jobs migrations` needs alembic ({exc}): pip install 'sqla-jobs[alembic]'") from None
    return support


def _from_ini(ini: str, key: str) -> str | None:
    """A setting of the ``[alembic]`` section of ``ini`` (None when the file or the key is missing)."""
    if not Path(ini).is_file():
        return None
    from alembic.config import Config

    value = Config(ini).get_main_option(key)
    return value.strip() if value and value.strip() else None


def cmd_render(args: argparse.Namespace) -> int:
    from .._bootstrap import database_url, load_app, make_engine, missing_database

    support = _alembic()
    # What `migrations init` tells the user to set: --app, else SQLA_JOBS_APP, else sqla_jobs.app in
    # alembic.ini; --url, else SQLA_JOBS_URL, else sqlalchemy.url there (`--url ""`: no database).
    spec = args.app or _from_ini(args.alembic_ini, "sqla_jobs.app")
    if not spec:
        raise ConfigError(f"no app given: pass --app module:attr, set SQLA_JOBS_APP, or set sqla_jobs.app "
                          f"in {args.alembic_ini} naming your JobQueue")
    queue = load_app(spec)
    raw = args.url
    if raw is None:
        raw = _from_ini(args.alembic_ini, "sqlalchemy.url")
        if raw is not None and "driver://" in raw:  # alembic's own placeholder: not set
            raw = None
    if raw and missing_database(database_url(raw)) is not None:
        raw = None  # an SQLite file not created yet lacks everything: render the creation, leave no empty file
    if raw:
        engine = make_engine(raw)
        with engine.connect() as conn:
            result = support.render_revision(queue, args.alembic_ini, connection=conn, message=args.message,
                                             partitioned=args.partitioned)
        engine.dispose()
    else:
        result = support.render_revision(queue, args.alembic_ini, message=args.message, partitioned=args.partitioned)
    if result.path is None:
        print("the job tables are up to date: no revision written")
        return 0
    print(f"wrote {result.path} (revision {result.revision}, down_revision {result.down_revision}):")
    for line in result.summary:
        print(f"  {line}")
    print("apply it with: alembic upgrade head")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    support = _alembic()
    from alembic import command
    from alembic.config import Config
    from alembic.util import CommandError

    ini = Path(args.alembic_ini)
    if ini.exists():
        raise ConfigError(f"{ini} already exists: this folder already has an alembic project")
    try:
        # Without alembic's own "Creating ... done" lines (not all of which its quiet option silences):
        # the one line below says what was made and what to do next.
        with contextlib.redirect_stdout(io.StringIO()):
            command.init(Config(str(ini)), args.directory, template=str(support.template_dir()))
    except CommandError as exc:
        raise ConfigError(str(exc)) from None
    print(f"created {args.directory}/ and {ini}: set sqla_jobs.app (your JobQueue) and sqlalchemy.url in {ini}, "
          "then: sqla-jobs migrations render && alembic upgrade head")
    return 0


def cmd_template_path(args: argparse.Namespace) -> int:
    print(_alembic().template_dir())
    return 0


def add_migrations_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``migrations render|init|template-path`` to the ``sqla-jobs`` parser."""
    mig = sub.add_parser("migrations", help="alembic revisions for the job tables")
    msub = mig.add_subparsers(dest="migrations_command", required=True, metavar="COMMAND")
    p = msub.add_parser("render", help="write an alembic revision for the job tables (or what your database lacks)")
    common(p)
    p.add_argument("--alembic-ini", default=os.environ.get("ALEMBIC_CONFIG", "alembic.ini"),
                   help="your alembic.ini (default ./alembic.ini, env ALEMBIC_CONFIG)")
    p.add_argument("-m", "--message", help="the revision's message")
    p.add_argument("--partitioned", action="store_true",
                   help="PostgreSQL: create the jobs table partitioned (docs/howto/partitioning.md)")
    p.set_defaults(func=cmd_render)
    p = msub.add_parser("init", help="start an alembic project with sqla-jobs wired in")
    p.add_argument("directory", help="folder for env.py and versions/, e.g. migrations")
    p.add_argument("--alembic-ini", default="alembic.ini", help="where to write alembic.ini (default ./alembic.ini)")
    p.set_defaults(func=cmd_init)
    p = msub.add_parser("template-path", help="print the alembic template folder (for alembic init -t)")
    p.set_defaults(func=cmd_template_path)
