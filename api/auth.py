"""API keys, as a bearer token or (Anthropic's clients) an `x-api-key` header: who is calling, as
a stable id that is safe to store next to their jobs."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import AuthenticationError

# The owner id stored in JobSpec.owner; a hash prefix, so Redis never holds a usable key.
OWNER_ID_HEX_CHARS = 16


def owner_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:OWNER_ID_HEX_CHARS]


class ApiKeyAuth:
    """Maps a presented bearer key to its owner id; with no keys configured everyone is ""."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {hashlib.sha256(key.encode()).digest(): owner_id(key) for key in keys}

    @property
    def is_open(self) -> bool:
        return not self._digests

    def owner_for(self, presented: str | None) -> str:
        if self.is_open:
            return ""
        if not presented:
            raise AuthenticationError(
                "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
        digest = hashlib.sha256(presented.encode()).digest()
        # Compare against every digest with compare_digest so timing says nothing about near misses.
        found = ""
        for known, owner in self._digests.items():
            if hmac.compare_digest(known, digest):
                found = owner
        if not found:
            raise AuthenticationError("Invalid API key: it is not one of the keys this server accepts")
        return found


# auto_error=False: a missing header must answer our 401 message, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="One of the keys in CARPOOL_API_KEYS.")


async def caller_owner(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> str:
    """Dependency: the caller's owner id ("" when the API runs open); 401 otherwise."""
    auth: ApiKeyAuth = request.app.state.context.auth
    if auth.is_open:
        # Open, as vLLM without --api-key: any Authorization header is ignored. OpenAI-style
        # clients send one whatever the server (lm-eval's `Bearer ` with no key at all).
        return ""
    if credentials is None and request.headers.get("authorization"):
        raise AuthenticationError("Malformed Authorization header: expected 'Bearer <key>'")
    # The anthropic client sends its key as x-api-key.
    return auth.owner_for(credentials.credentials if credentials else request.headers.get("x-api-key"))
