"""``sqla-jobs migrations``: the job tables in your alembic history (needs ``sqla-jobs[alembic]``).

``migrations render --app module:queue [--alembic-ini PATH] [--url URL]``
    Write a revision into your versions folder, on top of your current head.
    Without a database it creates both job tables and their indexes; with
    ``--url`` (or ``SQLA_JOBS_URL``) it renders exactly what that database
    lacks compared with this sqla-jobs version, or writes nothing when it is
    up to date. Then run ``alembic upgrade head``.
``migrations init DIR [--alembic-ini PATH]``
    ``alembic init`` with the sqla-jobs template (env.py already wired).
``migrations template-path``
    Print the template's folder, for ``alembic init -t PATH DIR``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["add_migrations_parser"]


def _alembic() -> Any:
    # alembic logs each of its plugins at INFO; the command's own output says what happened.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        from . import alembic as support
    except ImportError as exc:
        raise ConfigError(f"`sqla-jobs migrations` needs alembic ({exc}): pip install 'sqla-jobs[alembic]'") from None
    return support


def cmd_render(args: argparse.Namespace) -> int:
    from ._bootstrap import load_app, make_engine

    support = _alembic()
    queue = load_app(args.app)
    if args.url:
        engine = make_engine(args.url)
        with engine.connect() as conn:
            result = support.render_revision(queue, args.alembic_ini, connection=conn, message=args.message)
        engine.dispose()
    else:
        result = support.render_revision(queue, args.alembic_ini, message=args.message)
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
        command.init(Config(str(ini)), args.directory, template=str(support.template_dir()))
    except CommandError as exc:
        raise ConfigError(str(exc)) from None
    print(f"set sqla_jobs.app (your JobQueue) and sqlalchemy.url in {ini}, then: "
          "sqla-jobs migrations render && alembic upgrade head")
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
    p.set_defaults(func=cmd_render)
    p = msub.add_parser("init", help="start an alembic project with sqla-jobs wired in")
    p.add_argument("directory", help="folder for env.py and versions/, e.g. migrations")
    p.add_argument("--alembic-ini", default="alembic.ini", help="where to write alembic.ini (default ./alembic.ini)")
    p.set_defaults(func=cmd_init)
    p = msub.add_parser("template-path", help="print the alembic template folder (for alembic init -t)")
    p.set_defaults(func=cmd_template_path)
