"""A web dashboard for a queue: the four figures live and as charts, jobs and dead letters to browse and act on.

Needs the ``web`` extra (``pip install "sqla-jobs[web]"``)::

    from sqla_jobs.web import dashboard

    app.mount("/jobs", dashboard(engine, queue))        # FastAPI / Starlette: read-only

    app.mount("/jobs", dashboard(engine, queue, actions=True, auth=is_admin))   # your own login decides

or ``sqla-jobs dashboard --url ... --app ...`` (127.0.0.1:8080). Safe by
default: read-only unless ``actions=True`` with a credential (see
``sqla_jobs.web._security``); payloads and errors are escaped; every filter
is a bound parameter. Charts read the samples table (``sqla_jobs.web._samples``);
``record_sample`` writes one from cron when no dashboard is open.
See docs/howto/dashboard.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from .._admin import Admin
from ..drivers import sync_engine_for
from ..errors import ConfigError
from ._samples import KEEP, SAMPLE_INTERVAL, record_sample, samples_table

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from starlette.applications import Starlette
    from starlette.requests import Request

__all__ = ["dashboard", "record_sample", "samples_table"]


def dashboard(
    engine: Engine | AsyncEngine,
    queue: Admin[Any],
    *,
    actions: bool = False,
    token: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    auth: Callable[[Request], bool] | None = None,
    allow_anonymous_actions: bool = False,
    secret: bytes | None = None,
    title: str = "sqla-jobs",
    refresh: float = 5.0,
    sample_interval: float = SAMPLE_INTERVAL,
    keep: float = KEEP,
    record_samples: bool = True,
) -> Starlette:
    """The dashboard as an ASGI app for ``engine``'s tables of ``queue``, your ``JobQueue``.

    (Typed as its operations half, ``Admin``, which is all the dashboard uses: so the web package never
    imports the app's module, and ``JobQueue.dashboard`` can import this one.)

    ``engine``: a sync ``Engine`` or the ``AsyncEngine`` of an async app (the dashboard then
    reads and writes through a sync engine on the same database, its URL's sync twin:
    ``sqlite+aiosqlite`` -> ``sqlite``, ``postgresql+psycopg_async`` -> ``postgresql+psycopg``).

    ``actions``: allow cancel / retry / requeue / purge; needs ``token``
    (Bearer header or the login form), ``basic_auth=(user, password)``, or
    ``auth(request) -> bool`` (your own session or user check), unless
    ``allow_anonymous_actions=True``. ``secret``: the key of the login
    cookie (random per process by default; give the same one to every process
    behind a load balancer). ``refresh``: seconds between live updates.
    ``sample_interval`` / ``keep``: how often a sample is written and how
    long samples are kept (seconds). ``record_samples=False``: never write
    (a read-only database user); charts then show what ``record_sample`` wrote.
    """
    try:
        from ._app import build
    except ImportError as exc:
        raise ConfigError(f'the dashboard needs the web extra: pip install "sqla-jobs[web]" ({exc})') from None
    return build(sync_engine_for(engine), queue, actions=actions, token=token, basic_auth=basic_auth, auth=auth,
                 allow_anonymous_actions=allow_anonymous_actions, secret=secret, title=title, refresh=refresh,
                 sample_interval=sample_interval, keep=keep, record_samples=record_samples)
