"""``sqla-jobs dashboard``: serve the dashboard with uvicorn (the ``web`` extra).

Kept out of ``sqla_jobs.cli`` so the command's parser is one call there and
the web dependencies load only when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .._bootstrap import load_app, make_engine
from .._durations import parse_duration
from ..errors import ConfigError

log = logging.getLogger("sqla_jobs.web")


def add_dashboard_parser(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("dashboard", help="serve the web dashboard (needs sqla-jobs[web]); read-only by default")
    common(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--actions", action="store_true",
                   help="allow cancel/retry/requeue/purge; needs --token-env or --basic-auth-env")
    p.add_argument("--token-env", metavar="VAR",
                   help="environment variable holding the action token (log in with it on /login)")
    p.add_argument("--basic-auth-env", metavar="VAR", help="environment variable holding USER:PASSWORD for actions")
    p.add_argument("--sample-every", default="60s", metavar="AGE", help="write a chart sample this often (default 60s)")
    p.add_argument("--keep", default="2d", metavar="AGE", help="keep chart samples this long (default 2d)")
    p.set_defaults(func=cmd_dashboard)


def _secret_from(var: str | None, option: str) -> str | None:
    """Credentials come from the environment, never the command line (which `ps` shows to every user)."""
    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise ConfigError(f"{option} {var}: the environment variable {var} is not set or empty")
    return value


def options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``dashboard()`` keyword arguments the command line asks for."""
    token = _secret_from(args.token_env, "--token-env")
    basic = _secret_from(args.basic_auth_env, "--basic-auth-env")
    pair: tuple[str, str] | None = None
    if basic is not None:
        user, sep, password = basic.partition(":")
        if not (sep and user and password):
            raise ConfigError(f"--basic-auth-env {args.basic_auth_env}: the value must be USER:PASSWORD, "
                              "neither of them empty")
        pair = (user, password)
    if (token or pair) and not args.actions:
        raise ConfigError("a credential without --actions has nothing to protect: add --actions")
    if args.actions and not (token or pair):
        raise ConfigError("--actions needs a credential: add --token-env VAR (VAR holds a token to log in with) "
                          "or --basic-auth-env VAR (VAR holds USER:PASSWORD)")
    return {"actions": args.actions, "token": token, "basic_auth": pair,
            "sample_interval": parse_duration(args.sample_every), "keep": parse_duration(args.keep)}


def cmd_dashboard(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ConfigError('sqla-jobs dashboard needs the web extra: pip install "sqla-jobs[web]"') from None
    from ..web import dashboard, record_sample

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {args.port}")
    kwargs = options(args)
    queue = load_app(args.app)
    engine = make_engine(args.url)
    queue.check_schema(engine)
    app = dashboard(engine, queue, **kwargs)
    stop = threading.Event()

    def sample() -> None:
        # The standalone server keeps the history even while no page is open.
        while not stop.wait(kwargs["sample_interval"]):
            try:
                record_sample(engine, queue, interval=kwargs["sample_interval"], keep=kwargs["keep"])
            except Exception as exc:
                log.warning("could not write a chart sample: %s", str(exc).splitlines()[0])

    threading.Thread(target=sample, name="sqla-jobs-samples", daemon=True).start()
    mode = "actions enabled" if kwargs["actions"] else "read-only"
    log.info("dashboard on http://%s:%d/ (%s)", args.host, args.port, mode)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        stop.set()
    return 0
