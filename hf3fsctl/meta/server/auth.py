"""Auth of the service: one dependency, checked before a body is looked at.

When a token is configured, every `/v1` route and `/metrics` need
`Authorization: Bearer <token>` (the simplest rule that cannot leak a namespace's
contents); `/healthz` stays open for load balancers.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.security import HTTPBearer

from hf3fsctl.errors import AuthError


class BearerToken(HTTPBearer):
    """The auth dependency: `AuthError` (401) unless `Authorization: Bearer <token>`.

    An `HTTPBearer`, so that `/openapi.json` declares the scheme on every route that needs it.
    """

    def __init__(self, token: str) -> None:
        super().__init__(auto_error=False, description="the token of `serve --token-file`")
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self.expected):
            raise AuthError("missing or wrong bearer token")
