"""The write side: cancel, retry now, requeue, purge, and the token login; every one a POST.

Each action is checked in this order (``_security`` explains the policy):
actions enabled and a credential (403 otherwise, before anything is read),
CSRF token (403), then a confirmation page: the first POST shows what will
happen and a button that posts again with ``confirmed=1``. Only that second
POST changes anything, in one transaction through the queue's own admin
methods, so the dashboard follows the same rules as ``sqla-jobs jobs`` and
``sqla-jobs dead``. Each says what it did: a page "Done" with the jobs it
changed, or, for one job, the job's page with that line above it.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from sqlalchemy.orm import Session
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ..drivers import _dashboard as sql_dashboard
from ..errors import SqlaJobsError
from ._pages import FLASH_COOKIE, _cookie_path, _site
from ._security import AUTH_COOKIE

#: action -> (what the confirmation page asks, whether a kind may stand for ids)
ACTIONS: dict[str, tuple[str, bool]] = {
    "cancel": ("Cancel {what}? A pending or blocked job will never run (its dependents then do what their "
               "on_upstream_failure says); a running one is told to stop at its "
               "worker's next heartbeat and ends cancelled (a handler that ignores it runs to its end).",
               False),
    "retry": ("Make {what} due now?", False),
    "requeue": ("Move {what} from the dead letters back to the queue (attempts start again)?", True),
    "purge": ("Delete {what} from the dead letters for good?", True),
}


def _ids(form: Any) -> list[int] | None:
    raw = [v for v in form.getlist("ids") if str(v).strip()]
    if not raw:
        return None
    if not all(str(v).strip().isdigit() for v in raw):
        raise SqlaJobsError("job ids must be numbers")
    return sorted({int(str(v)) for v in raw})


async def act(request: Request) -> Response:
    site = _site(request)
    name = request.path_params["action"]
    if name not in ACTIONS:
        return site.render(request, "message.html", 404, heading="No such action", message=f"unknown action {name!r}")
    if not site.guard.actions:
        return site.render(request, "message.html", 403, heading="Read-only dashboard",
                           message="Actions are disabled: this dashboard was started without actions enabled.")
    if not site.guard.authorised(request):
        return _refused(request)
    form = await request.form()
    if not site.guard.csrf_ok(request, str(form.get("csrf", ""))):
        return site.render(request, "message.html", 403, heading="Refused",
                           message="The form's CSRF token is missing or stale: reload the page and try again.")
    question, kind_ok = ACTIONS[name]
    try:
        ids = _ids(form)
    except SqlaJobsError as exc:
        return site.render(request, "message.html", 400, heading="Bad request", message=str(exc))
    kind = str(form.get("kind", "")).strip() or None
    if ids is None and not (kind_ok and kind):
        what = "job ids" + (" or a kind" if kind_ok else "")
        return site.render(request, "message.html", 400, heading="Nothing selected", message=f"Choose {what} first.")
    what = (f"job {ids[0]}" if ids and len(ids) == 1 else f"{len(ids)} jobs ({', '.join(map(str, ids))})"
            if ids else f"every dead job of kind {kind!r}")
    if form.get("confirmed") != "1":
        fields = [("ids", str(i)) for i in ids or []] + ([("kind", kind)] if kind and not ids else [])
        return site.render(request, "confirm.html", question=question.format(what=what), action=name, fields=fields,
                           back=request.headers.get("referer", ""))
    try:
        done = _run(site, name, ids, kind)
    except SqlaJobsError as exc:
        return site.render(request, "message.html", 409, heading="Not done", message=str(exc))
    if ids and len(ids) == 1 and name != "purge":
        # Back to the job, which says what was done above it (the flash cookie, read once by the next page).
        response = RedirectResponse(request.url_for("job", job_id=ids[0]), status_code=303)
        response.set_cookie(FLASH_COOKIE, quote(done), max_age=60, httponly=True, samesite="strict",
                            path=_cookie_path(request))
        return response
    return site.render(request, "message.html", heading="Done", message=done)


def _run(site: Any, name: str, ids: list[int] | None, kind: str | None) -> str:
    queue = site.queue
    with Session(site.engine) as session, session.begin():
        if name == "cancel":
            said = {"cancelled": "cancelled (it will never run)",
                    "requested": "asked to stop (it ends cancelled when its handler stops)"}
            return "; ".join(f"job {i}: {said.get(r, r)}" for i in ids or [] for r in [queue.cancel(session, i)])
        if name == "retry":
            for i in ids or []:
                queue.retry_now(session, i)
            return f"made {len(ids or [])} job(s) due now: {', '.join(map(str, ids or []))}"
        if name == "requeue":
            moved = queue.requeue_dead(session, ids=ids, kind=None if ids else kind)
            return f"requeued {len(moved)} job(s)" + (f": {', '.join(map(str, moved))}" if moved else "")
        if ids:
            conn = session.connection()
            gone = sql_dashboard.delete_dead(queue.driver(conn), conn, ids)
            return f"purged {len(gone)} dead job(s)" + (f": {', '.join(map(str, gone))}" if gone else "")
        count = queue.purge_dead(session, older_than=0.0, kind=kind)
        return f"purged {count} dead job(s) of kind {kind!r}"


def _refused(request: Request) -> Response:
    site = _site(request)
    response = site.render(request, "message.html", 401 if site.guard.basic_auth else 403, heading="Refused",
                           message="This action needs a credential. "
                                   + ("Log in with the dashboard token first." if site.guard.needs_login else ""))
    if site.guard.basic_auth is not None:
        response.headers["WWW-Authenticate"] = 'Basic realm="sqla-jobs dashboard"'
    return response


def login_form(request: Request) -> Response:
    return _site(request).render(request, "login.html", failed=False)


async def login(request: Request) -> Response:
    site = _site(request)
    form = await request.form()
    if not site.guard.csrf_ok(request, str(form.get("csrf", ""))):
        return site.render(request, "message.html", 403, heading="Refused",
                           message="The form's CSRF token is missing or stale: reload the page and try again.")
    if not site.guard.needs_login or not site.guard.token_matches(str(form.get("token", ""))):
        return site.render(request, "login.html", 403, failed=True)
    response = RedirectResponse(request.url_for("overview"), status_code=303)
    response.set_cookie(AUTH_COOKIE, site.guard.token_cookie(), httponly=True, samesite="strict",
                        path=_cookie_path(request))
    return response


async def logout(request: Request) -> Response:
    site = _site(request)
    form = await request.form()
    if not site.guard.csrf_ok(request, str(form.get("csrf", ""))):
        return site.render(request, "message.html", 403, heading="Refused", message="Stale form: reload the page.")
    response = RedirectResponse(request.url_for("overview"), status_code=303)
    response.delete_cookie(AUTH_COOKIE, path=_cookie_path(request))
    return response
