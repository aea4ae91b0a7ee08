"""The dashboard is safe by default: read-only unless actions are enabled with a credential, every write a
confirmed POST with a CSRF token; mounted in FastAPI (the user's auth) and Flask (a2wsgi); the command."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from sqla_jobs import ConfigError
from sqla_jobs.web import dashboard
from tests import app, forkserver
from tests.conftest import ROOT, Database
from tests.dashboard_helpers import TOKEN, client, csrf, kill, post
from tests.helpers import dead, enqueue, job

BEARER = {"Authorization": f"Bearer {TOKEN}"}


def state(db: Database, job_id: int) -> str:
    row = job(db.engine, job_id)
    if row is None:
        return "dead" if dead(db.engine, job_id) is not None else "gone"
    return row.state


def test_read_only_by_default_refuses_every_action(db: Database) -> None:
    [dead_id] = kill(db)
    job_id = enqueue(db.engine, "record")
    web = client(db)
    for action, target in (("cancel", job_id), ("retry", job_id), ("requeue", dead_id), ("purge", dead_id)):
        r = post(web, action, ids=str(target), headers=BEARER)
        assert r.status_code == 403 and "Read-only" in r.text, action
    assert (state(db, job_id), state(db, dead_id)) == ("pending", "dead")
    assert "action-cancel" not in web.get(f"/jobs/{job_id}").text  # and no buttons are shown


def test_actions_without_a_credential_are_a_configuration_error(db: Database) -> None:
    with pytest.raises(ConfigError, match="actions=True needs a credential"):
        dashboard(db.engine, app.queue, actions=True)
    with pytest.raises(ConfigError, match="at least 16"):
        dashboard(db.engine, app.queue, actions=True, token="short")


def test_anonymous_actions_need_the_explicit_opt_in(db: Database) -> None:
    job_id = enqueue(db.engine, "record")
    web = client(db, actions=True, allow_anonymous_actions=True)
    assert post(web, "cancel", ids=str(job_id)).status_code == 303
    assert state(db, job_id) == "cancelled"


def test_token_guards_actions_and_the_confirmation_comes_first(db: Database) -> None:
    job_id = enqueue(db.engine, "record")
    web = client(db, actions=True, token=TOKEN)
    r = post(web, "cancel", ids=str(job_id))
    assert r.status_code == 403 and "needs a credential" in r.text
    r = post(web, "cancel", ids=str(job_id), headers={"Authorization": "Bearer wrong-token-of-some-length"})
    assert r.status_code == 403
    r = post(web, "cancel", ids=str(job_id), headers=BEARER, confirmed=False)
    assert r.status_code == 200 and "Cancel job" in r.text and 'name="confirmed" value="1"' in r.text
    assert state(db, job_id) == "pending"  # asking is not doing
    r = post(web, "cancel", ids=str(job_id), headers=BEARER)
    assert r.status_code == 303 and state(db, job_id) == "cancelled"


def test_login_form_sets_a_cookie_that_is_not_the_token(db: Database) -> None:
    job_id = enqueue(db.engine, "record")
    web = client(db, actions=True, token=TOKEN)
    r = web.post("/login", data={"csrf": csrf(web, "/login"), "token": "not-the-right-token"})
    assert r.status_code == 403 and "Wrong token" in r.text
    r = web.post("/login", data={"csrf": csrf(web, "/login"), "token": TOKEN}, follow_redirects=False)
    assert r.status_code == 303
    cookie = web.cookies.get("sqla_jobs_auth")
    assert cookie and TOKEN not in cookie
    assert post(web, "retry", ids=str(job_id)).status_code == 303  # the cookie is the credential now
    web.post("/logout", data={"csrf": csrf(web)})
    assert post(web, "cancel", ids=str(job_id)).status_code == 403


def test_basic_auth(db: Database) -> None:
    job_id = enqueue(db.engine, "record")
    web = client(db, actions=True, basic_auth=("admin", "s3cret"))
    r = post(web, "cancel", ids=str(job_id))
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    wrong = {"Authorization": "Basic " + base64.b64encode(b"admin:guess").decode()}
    assert post(web, "cancel", ids=str(job_id), headers=wrong).status_code == 401
    right = {"Authorization": "Basic " + base64.b64encode(b"admin:s3cret").decode()}
    assert post(web, "cancel", ids=str(job_id), headers=right).status_code == 303
    assert state(db, job_id) == "cancelled"


def test_csrf_token_and_origin_are_checked(db: Database) -> None:
    job_id = enqueue(db.engine, "record")
    web = client(db, actions=True, token=TOKEN)
    csrf(web)
    data = {"ids": str(job_id), "confirmed": "1"}
    assert web.post("/actions/cancel", data=data, headers=BEARER).status_code == 403  # no token in the form
    r = web.post("/actions/cancel", data={**data, "csrf": "forged"}, headers=BEARER)
    assert r.status_code == 403 and "CSRF" in r.text
    r = post(web, "cancel", ids=str(job_id), headers={**BEARER, "Origin": "https://evil.example"})
    assert r.status_code == 403
    fresh = client(db, actions=True, token=TOKEN)  # a browser that never opened a page has no cookie
    assert fresh.post("/actions/cancel", data={**data, "csrf": "x"}, headers=BEARER).status_code == 403
    assert state(db, job_id) == "pending"


def test_dead_letters_retry_one_selected_all_of_a_kind_and_purge(db: Database) -> None:
    ids = kill(db, n=5)
    web = client(db, actions=True, token=TOKEN)
    r = post(web, "requeue", ids=str(ids[0]), headers=BEARER)
    assert r.status_code == 303 and r.headers["location"].endswith(f"/jobs/{ids[0]}")
    assert state(db, ids[0]) == "pending"
    r = post(web, "requeue", ids=[str(ids[1]), str(ids[2])], headers=BEARER)
    assert r.status_code == 200 and "requeued 2 job(s)" in r.text
    assert [state(db, i) for i in ids] == ["pending", "pending", "pending", "dead", "dead"]
    assert post(web, "purge", ids=str(ids[3]), headers=BEARER).status_code == 200
    assert state(db, ids[3]) == "gone"
    r = post(web, "requeue", kind="fail", headers=BEARER)
    assert "requeued 1 job(s)" in r.text and state(db, ids[4]) == "pending"
    more = kill(db, n=2, kind="fail")  # the burst also runs the four requeued jobs into the dead letters again
    r = post(web, "purge", kind="fail", headers=BEARER)
    assert "purged 6 dead job(s) of kind" in r.text
    assert [state(db, i) for i in [*ids, *more]] == ["gone"] * 7


def test_an_action_the_job_cannot_take_says_why(db: Database) -> None:
    [dead_id] = kill(db)
    web = client(db, actions=True, token=TOKEN)
    r = post(web, "retry", ids=str(dead_id), headers=BEARER)
    assert r.status_code == 409 and "dead-letter table" in r.text
    r = post(web, "requeue", ids="abc", headers=BEARER)
    assert r.status_code == 400 and "must be numbers" in r.text


def test_mounted_in_fastapi_with_the_users_own_auth(db: Database) -> None:
    from fastapi import FastAPI

    job_id = enqueue(db.engine, "record")

    def is_admin(request: Request) -> bool:  # stands for the application's own session check
        return request.headers.get("x-user") == "admin"

    api = FastAPI()
    api.mount("/jobs", dashboard(db.engine, app.queue, actions=True, auth=is_admin))
    web = TestClient(api)
    html = web.get("/jobs/").text
    assert 'href="http://testserver/jobs/jobs"' in html  # links stay under the mount point
    assert web.get("/jobs/static/htmx-2.0.11.min.js").status_code == 200
    token = csrf(web, "/jobs/")
    data = {"csrf": token, "ids": str(job_id), "confirmed": "1"}
    assert web.post("/jobs/actions/cancel", data=data).status_code == 403
    r = web.post("/jobs/actions/cancel", data=data, headers={"x-user": "admin"}, follow_redirects=False)
    assert r.status_code == 303 and state(db, job_id) == "cancelled"


def test_mounted_in_flask_through_a2wsgi(db: Database) -> None:
    from a2wsgi import ASGIMiddleware
    from flask import Flask
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    enqueue(db.engine, "record")
    flask_app = Flask(__name__)
    flask_app.wsgi_app = DispatcherMiddleware(  # type: ignore[method-assign]
        flask_app.wsgi_app, {"/jobs": ASGIMiddleware(dashboard(db.engine, app.queue))})
    r = flask_app.test_client().get("/jobs/")
    assert r.status_code == 200
    body = r.get_data(as_text=True)
    assert 'id="fig-ready">1<' in body and "/jobs/static/htmx-2.0.11.min.js" in body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(db: Database, *args: str, **env: str) -> forkserver.Popen:
    return forkserver.Popen([sys.executable, "-m", "sqla_jobs.cli", "dashboard", "--app", "tests.app:queue", *args],
                            env=db.env(**env), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_command_refuses_actions_without_a_credential(db: Database) -> None:
    proc = _cli(db, "--actions", "--port", str(_free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--actions needs a credential: add --token-env VAR" in out
    assert "--basic-auth-env VAR" in out and "actions=True" not in out and len(out.strip().splitlines()) == 1
    proc = _cli(db, "--actions", "--token-env", "NOT_SET_ANYWHERE", "--port", str(_free_port()))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "NOT_SET_ANYWHERE is not set" in out


def test_command_serves_on_localhost_read_only(db: Database) -> None:
    port = _free_port()
    proc = _cli(db, "--port", str(port))
    try:
        body = _wait_for(f"http://127.0.0.1:{port}/", proc)
        assert 'id="fig-ready"' in body and "read-only" in body
        request = urllib.request.Request(f"http://127.0.0.1:{port}/actions/cancel", data=b"ids=1", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403
        addresses = _listening_addresses(port)
        assert addresses == {"127.0.0.1"}, addresses
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_for(url: str, proc: forkserver.Popen) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return str(response.read().decode())
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read() if proc.stdout else ""
                raise AssertionError(f"the dashboard did not start: {out}") from None
            time.sleep(0.2)


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of listening TCP sockets on ``port``, from /proc/net/tcp (IPv4) and tcp6."""
    found: set[str] = set()
    for name in ("tcp", "tcp6"):
        path = f"/proc/net/{name}"
        if not os.path.exists(path):
            continue
        with open(path) as table:
            lines = table.read().splitlines()[1:]
        for line in lines:
            local, st = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if st == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(_address(addr))
    return found


def _address(hex_addr: str) -> str:
    if len(hex_addr) == 8:
        return socket.inet_ntoa(bytes.fromhex(hex_addr)[::-1])
    return "ipv6:" + hex_addr
