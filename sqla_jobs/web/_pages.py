"""The read-only pages: overview, live figures, chart data, jobs, one job, dead letters."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote

from sqlalchemy import Engine
from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from .._admin import Admin
from .._durations import format_duration, parse_duration
from .._models import STATES
from .._neighbourhood import neighbourhood, policy_text, sequence_place
from ..drivers import _dashboard as sql_dashboard
from ..errors import ConfigError
from . import _samples
from ._graph_svg import neighbourhood_svg
from ._security import CSRF_COOKIE, Guard

log = logging.getLogger("sqla_jobs.web")

PAGE_SIZE = 50
#: Upstreams and dependents a job's page lists (each); its picture draws fewer (``_graph_svg.DRAWN``).
NEIGHBOURS = 50
#: What the last action did, for the page it redirects to (read once, then deleted).
FLASH_COOKIE = "sqla_jobs_flash"
SPANS = {"hour": 3600.0, "day": 86400.0}


@dataclass
class Site:
    """Everything a request handler needs: the database, the queue, the policy, the templates."""

    engine: Engine
    queue: Admin[Any]
    guard: Guard
    templates: Jinja2Templates
    title: str = "sqla-jobs"
    refresh: float = 5.0
    sample_interval: float = _samples.SAMPLE_INTERVAL
    keep: float = _samples.KEEP
    record: bool = True
    _checked: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def render(self, request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or self.guard.new_csrf()
        flash = request.cookies.get(FLASH_COOKIE)
        context.update(
            flash=unquote(flash) if flash else None,
            title=self.title, csrf=csrf, can_act=self.guard.authorised(request), actions=self.guard.actions,
            needs_login=self.guard.needs_login, refresh=self.refresh, duration=format_duration,
        )
        response = self.templates.TemplateResponse(request, name, context, status_code=status_code)
        if CSRF_COOKIE not in request.cookies:
            response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict", path=_cookie_path(request))
        if flash:
            response.delete_cookie(FLASH_COOKIE, path=_cookie_path(request))
        return response

    def maybe_sample(self) -> None:
        """Write a sample when the latest is older than the interval; checks the database at most every 10 s."""
        if not self.record:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._checked < min(10.0, self.sample_interval):
                return
            self._checked = now
        try:
            if _samples.due(self.engine, self.queue, self.sample_interval):
                _samples.record_sample(self.engine, self.queue, interval=self.sample_interval, keep=self.keep)
        except Exception as exc:  # a read-only database user: show the figures, skip the history
            log.warning("dashboard: cannot write samples (%s); charts keep no history", str(exc).splitlines()[0])
            self.record = False


def _cookie_path(request: Request) -> str:
    return request.scope.get("root_path") or "/"


def _site(request: Request) -> Site:
    site: Site = request.app.state.site
    return site


def overview(request: Request) -> Response:
    site = _site(request)
    site.maybe_sample()
    stats = site.queue.stats(site.engine)
    return site.render(request, "overview.html", stats=stats, span=request.query_params.get("span", "hour"))


def figures(request: Request) -> Response:
    """The live part of the overview, fetched by htmx every ``refresh`` seconds."""
    site = _site(request)
    site.maybe_sample()
    return site.render(request, "_figures.html", stats=site.queue.stats(site.engine))


def stats_json(request: Request) -> Response:
    site = _site(request)
    return JSONResponse(site.queue.stats(site.engine).to_dict())


def series_json(request: Request) -> Response:
    site = _site(request)
    span = SPANS.get(request.query_params.get("span", "hour"), SPANS["hour"])
    site.maybe_sample()
    return JSONResponse(_samples.series(site.engine, site.queue, span, site.sample_interval))


def _filters(request: Request) -> dict[str, Any]:
    """The jobs page's filters from the query string, checked; raises ConfigError with what to fix."""
    q = request.query_params
    state = q.get("state") or None
    if state is not None and state not in STATES:
        raise ConfigError(f"unknown state {state!r}; choose from {', '.join(STATES)}")
    since_text = q.get("since") or None
    since = parse_duration(since_text) if since_text else None
    before = q.get("before") or None
    if before is not None and not before.isdigit():
        raise ConfigError(f"before must be a job id, got {before!r}")
    after = q.get("after") or None
    return {"state": state, "kind": q.get("kind") or None, "queue": q.get("queue") or None,
            "unique_key": q.get("unique_key") or None, "sequence_key": q.get("sequence_key") or None,
            "since": since, "before_id": int(before) if before else None,
            "after": _parse_after(after) if after else None}


def _after(row: Any) -> str:
    """The cursor of the next page of pending jobs: the last row's place in claim order."""
    run_at = row.run_at if row.run_at.tzinfo else row.run_at.replace(tzinfo=timezone.utc)
    return f"{row.priority}~{run_at.isoformat()}~{row.id}"


def _parse_after(text: str) -> tuple[int, datetime, int]:
    try:
        priority, run_at, last_id = text.split("~")
        at = datetime.fromisoformat(run_at)
        return int(priority), at if at.tzinfo else at.replace(tzinfo=timezone.utc), int(last_id)
    except ValueError:
        raise ConfigError(f"after must be priority~run_at~id (the next-page link's), got {text!r}") from None


def jobs(request: Request) -> Response:
    site = _site(request)
    wanted = request.query_params.get("id", "").strip()
    if wanted:
        if not wanted.isdigit():
            return site.render(request, "message.html", 400, heading="Bad job id",
                               message=f"{wanted!r} is not a job id: type the number only")
        return RedirectResponse(request.url_for("job", job_id=int(wanted)), status_code=303)
    try:
        filters = _filters(request)
    except ConfigError as exc:
        return site.render(request, "message.html", 400, heading="Bad filter", message=str(exc))
    with site.engine.connect() as conn:
        rows = sql_dashboard.job_page(site.queue.driver(conn), conn, limit=PAGE_SIZE + 1, **filters)
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    params = {k: v for k, v in request.query_params.items() if k not in ("before", "after") and v}
    next_params = None
    if more:
        cursor = {"after": _after(rows[-1])} if filters["state"] == "pending" else {"before": str(rows[-1].id)}
        next_params = {**params, **cursor}
    return site.render(request, "jobs.html", rows=rows, states=STATES, params=params, next_params=next_params,
                       kinds=sorted(site.queue.handlers))


def job(request: Request) -> Response:
    site = _site(request)
    job_id = int(request.path_params["job_id"])
    with Session(site.engine) as session:
        row = site.queue.get_job(session, job_id)
        dead = row is None
        if dead:
            row = site.queue.get_dead(session, job_id)
        conn = session.connection()
        timings = None if dead else sql_dashboard.job_timings(site.queue.driver(conn), conn, job_id)
        hood = None if row is None else neighbourhood(site.queue.driver(conn), conn, job_id, limit=NEIGHBOURS)
        batch = site.queue.driver(conn).batch_of(conn, job_id) if hood else None  # a member's or a callback's
        place = None if row is None else sequence_place(site.queue.driver(conn), conn, job_id, row.sequence_key,
                                                        getattr(row, "state", "dead"))
        steps = site.queue.job_steps(session, job_id)  # a durable job's (sqla_jobs._durable)
    if row is None or hood is None:
        return site.render(request, "message.html", 404, heading="No such job",
                           message=f"There is no job {job_id} in the jobs table or the dead-letter table "
                                   "(it may have been pruned or purged).")
    data = dict(row._mapping)
    state = "dead" if dead else data["state"]
    # The job's place in its graph (docs/howto/dashboard.md, "A job's graph"), when it has one.
    graph = neighbourhood_svg(job_id, data["kind"], state, hood,
                              lambda i: str(request.url_for("job", job_id=i))) if hood else None
    return site.render(
        request, "job.html", job=data, dead=dead, state=state, timings=timings,
        hood=hood, graph=graph, policy=policy_text(data.get("on_upstream_failure")), batch=batch, place=place,
        waiting=[n.id for n in hood.dependents if n.state == "blocked" and n.ended is None] if dead else [],
        payload=json.dumps(data.get("payload"), indent=2, ensure_ascii=False, default=str),
        errors=data.get("errors") or [], steps=steps,
        step_values={r.name: json.dumps(r.value, ensure_ascii=False, default=str) for r in steps},
        # What the handler returned and how far it got (docs/howto/results.md); a dead job has neither.
        documents={name: json.dumps(data[name], indent=2, ensure_ascii=False, default=str)
                   for name in ("progress", "result") if data.get(name) is not None},
    )


def dead(request: Request) -> Response:
    site = _site(request)
    kind = request.query_params.get("kind") or None
    with Session(site.engine) as session:
        rows = site.queue.list_dead(session, kind=kind, limit=200)
        conn = session.connection()
        kinds = sql_dashboard.dead_kinds(site.queue.driver(conn), conn)
    return site.render(request, "dead.html", rows=rows, kinds=kinds, kind=kind)
