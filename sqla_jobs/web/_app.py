"""Builds the Starlette app (imported only when the web extra is installed; see ``sqla_jobs.web``)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

import jinja2
from sqlalchemy import Engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .._admin import Admin
from ..errors import ConfigError
from . import _actions, _batch_pages, _pages
from ._format import when
from ._samples import KEEP, SAMPLE_INTERVAL
from ._security import Guard

__all__ = ["build"]


def build(
    engine: Engine,
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
    """The app ``sqla_jobs.web.dashboard`` returns; the arguments are documented there."""
    if refresh <= 0 or sample_interval <= 0 or keep < sample_interval:
        raise ConfigError("refresh and sample_interval must be > 0 seconds and keep at least sample_interval")
    guard = Guard(actions=actions, token=token, basic_auth=basic_auth, auth=auth,
                  allow_anonymous_actions=allow_anonymous_actions, **({"secret": secret} if secret else {}))
    here = resources.files(__package__ or "sqla_jobs.web")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(here / "templates")), autoescape=True)
    env.filters["when"] = when  # the one timestamp format of every page (sqla_jobs.web._format)
    templates = Jinja2Templates(env=env)
    site = _pages.Site(engine, queue, guard, templates, title=title, refresh=refresh,
                       sample_interval=sample_interval, keep=keep, record=record_samples)
    routes = [
        Route("/", _pages.overview, name="overview"),
        Route("/figures", _pages.figures, name="figures"),
        Route("/api/stats", _pages.stats_json, name="stats_json"),
        Route("/api/series", _pages.series_json, name="series_json"),
        Route("/jobs", _pages.jobs, name="jobs"),
        Route("/jobs/{job_id:int}", _pages.job, name="job"),
        Route("/dead", _pages.dead, name="dead"),
        Route("/batches", _batch_pages.batches, name="batches"),
        Route("/batches/{batch_id:int}", _batch_pages.batch, name="batch"),
        Route("/actions/{action}", _actions.act, methods=["POST"], name="act"),
        Route("/login", _actions.login_form, methods=["GET"], name="login_form"),
        Route("/login", _actions.login, methods=["POST"], name="login"),
        Route("/logout", _actions.logout, methods=["POST"], name="logout"),
        Mount("/static", StaticFiles(directory=str(here / "static")), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.site = site
    return app
