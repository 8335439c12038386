"""Webhook secrets and signatures, as Standard Webhooks (and OpenAI's SDK) define them.

A secret is `whsec_` + base64 of random bytes: the one form that openai-python's
`webhooks.unwrap` and the `standardwebhooks` library both decode to the same key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """`v1,` + base64 HMAC-SHA256 of `id.timestamp.body`, keyed by the decoded secret."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(
    signing_secrets: Sequence[str], message_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The three Standard Webhooks headers; one signature per secret, separated by spaces (a
    receiver accepts the delivery if any one matches its secret)."""
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(
            signature(secret, message_id, timestamp, body) for secret in signing_secrets
        ),
    }
