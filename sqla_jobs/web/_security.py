"""Who may act, and proof that a form came from the dashboard itself.

Reading is open to whoever reaches the app (the standalone server listens on
127.0.0.1; mounted, the host application's own middleware decides). Acting
(cancel, retry, requeue, purge) needs, in this order of checks:

1. ``actions=True`` when the app is built: without it every POST is refused;
2. a credential: ``auth(request) -> bool`` (your own, when mounted), a
   ``token`` (``Authorization: Bearer``, or the cookie the login form sets),
   or ``basic_auth=(user, password)``. ``actions=True`` with none of these is
   a configuration error unless ``allow_anonymous_actions=True`` says so;
3. a CSRF token: the form's hidden ``csrf`` field must equal the
   ``sqla_jobs_csrf`` cookie (SameSite=Strict, set by every page), and a
   cross-site ``Origin`` header is refused, so another site cannot make a
   logged-in browser post.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request

from ..errors import ConfigError

CSRF_COOKIE = "sqla_jobs_csrf"
AUTH_COOKIE = "sqla_jobs_auth"


@dataclass
class Guard:
    """The app's write policy; see the module docstring."""

    actions: bool = False
    token: str | None = None
    basic_auth: tuple[str, str] | None = None
    auth: Callable[[Request], bool] | None = None
    allow_anonymous_actions: bool = False
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < 16:
            raise ConfigError("the dashboard token must be at least 16 characters; "
                              "make one with `python -c 'import secrets; print(secrets.token_urlsafe())'`")
        if self.basic_auth is not None and (len(self.basic_auth) != 2 or not all(self.basic_auth)):
            raise ConfigError("basic_auth must be a (user, password) pair of non-empty strings")
        if self.actions and not self.has_credential and not self.allow_anonymous_actions:
            raise ConfigError(
                "actions=True needs a credential: token=..., basic_auth=(user, password) or auth=callable "
                "(your own login); pass allow_anonymous_actions=True only if something in front of the "
                "dashboard already authenticates every request"
            )

    @property
    def has_credential(self) -> bool:
        return any(c is not None for c in (self.token, self.basic_auth, self.auth))

    @property
    def needs_login(self) -> bool:
        """Whether the token login form is of use (a token is configured)."""
        return self.actions and self.token is not None

    # -- credentials ------------------------------------------------------------------

    def token_cookie(self) -> str:
        """The login cookie's value: a MAC of the token, so the token itself is never stored in a browser."""
        assert self.token is not None
        return hmac.new(self.secret, b"auth:" + self.token.encode(), hashlib.sha256).hexdigest()

    def token_matches(self, candidate: str) -> bool:
        return self.token is not None and hmac.compare_digest(candidate.encode(), self.token.encode())

    def authorised(self, request: Request) -> bool:
        """Whether ``request`` carries a credential that allows actions."""
        if not self.actions:
            return False
        if self.auth is not None and self.auth(request):
            return True
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if self.token is not None:
            if scheme.lower() == "bearer" and self.token_matches(value.strip()):
                return True
            cookie = request.cookies.get(AUTH_COOKIE, "")
            if cookie and hmac.compare_digest(cookie, self.token_cookie()):
                return True
        if self.basic_auth is not None and scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(value.strip()).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
            ok_user = hmac.compare_digest(user.encode(), self.basic_auth[0].encode())
            ok_password = hmac.compare_digest(password.encode(), self.basic_auth[1].encode())
            return ok_user and ok_password
        return not self.has_credential and self.allow_anonymous_actions

    # -- CSRF -------------------------------------------------------------------------

    @staticmethod
    def new_csrf() -> str:
        return secrets.token_urlsafe(24)

    @staticmethod
    def csrf_ok(request: Request, submitted: str) -> bool:
        cookie = request.cookies.get(CSRF_COOKIE, "")
        if not cookie or not submitted or not hmac.compare_digest(cookie.encode(), submitted.encode()):
            return False
        origin = request.headers.get("origin")
        # A browser sends Origin with every POST; a different host means another site made this request.
        if origin is None:
            return True
        return origin != "null" and urlsplit(origin).netloc == request.url.netloc
