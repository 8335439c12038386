"""Bearer-key auth and tenancy.

With `settings.api_keys` set, every `/v1` call must present one of them, and its rows belong to
an owner id derived from the key; without keys there is one tenant, `DEFAULT_OWNER`. Keys are
never stored: the owner id is a truncated hash, stable across restarts and key-list reorders.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends, Request

from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.store.models import DEFAULT_OWNER


def key_owner(key: str) -> str:
    """The owner id of rows created with `key`."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    """The configured keys, and which owner a request's `Authorization` header names."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._owners = [(key.encode(), key_owner(key)) for key in keys]

    @property
    def configured(self) -> bool:
        return bool(self._owners)

    def holds(self, token: str) -> bool:
        """Whether `token` is one of the keys (compared in constant time with each)."""
        presented = token.encode()
        return any([hmac.compare_digest(presented, key) for key, _ in self._owners])

    def owner(self, authorization: str | None) -> str:
        if not self._owners:
            return DEFAULT_OWNER
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized(
                "You didn't provide an API key. Provide it in an Authorization header using "
                "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        presented = token.strip().encode()
        # Compared with every key in constant time: timing must not tell how close a guess was.
        owners = [owner for key, owner in self._owners if hmac.compare_digest(presented, key)]
        if not owners:
            raise _unauthorized("Incorrect API key provided.")
        return owners[0]


def _unauthorized(message: str) -> OpenAIError:
    return OpenAIError(message, status_code=401, code="invalid_api_key")


def get_owner(request: Request) -> str:
    keys: KeyRing = request.app.state.keys
    return keys.owner(request.headers.get("authorization"))


OwnerDep = Annotated[str, Depends(get_owner)]


def _bears_admin_key(request: Request) -> bool:
    admins: KeyRing = request.app.state.admin_keys
    _, _, token = (request.headers.get("authorization") or "").partition(" ")
    return bool(token.strip()) and admins.holds(token.strip())


def get_usage_scope(request: Request) -> str | None:
    """Whose usage the caller may read: every tenant's (None) with an admin key, its own with a
    tenant's key; 401 for any other key."""
    if _bears_admin_key(request):
        return None
    owner = get_owner(request)
    if owner == DEFAULT_OWNER and request.app.state.admin_keys.configured:
        raise _unauthorized("This endpoint needs an admin key or a tenant's API key.")
    return owner


UsageScopeDep = Annotated[str | None, Depends(get_usage_scope)]


def is_admin(request: Request) -> bool:
    """Whether the request bears an admin key, or the service has no keys at all: then its one
    user runs it, and sees what an operator sees."""
    state = request.app.state
    if not state.admin_keys.configured and not state.keys.configured:
        return True
    return _bears_admin_key(request)


def admin_or_tenant(request: Request) -> bool:
    """True for an admin (`is_admin`), False for a tenant's key; 401 for any other key."""
    if is_admin(request):
        return True
    get_owner(request)
    return False


AdminOrTenantDep = Annotated[bool, Depends(admin_or_tenant)]


def require_admin(request: Request) -> None:
    """401 unless `is_admin`."""
    if not is_admin(request):
        raise _unauthorized("This endpoint needs an admin key.")
