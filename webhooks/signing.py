"""Standard Webhooks signatures (https://www.standardwebhooks.com, spec/standard-webhooks.md):
`webhook-signature: v1,<base64 HMAC-SHA256(key, "{webhook-id}.{webhook-timestamp}.{body}")>`,
the key being the base64 part of a `whsec_<base64>` secret."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

SECRET_PREFIX = "whsec_"


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret (the prefix is optional, as in the spec's
    libraries); raises ValueError for anything else."""
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("webhook secret must be 'whsec_' followed by base64") from exc
    if len(key) < 24:  # the spec asks for 24 to 64 bytes of randomness
        raise ValueError(f"webhook secret holds {len(key)} bytes; it needs 24 to 64")
    return key


class WebhookSigner:
    def __init__(self, secret: str) -> None:
        self._key = secret_key(secret)

    def signature(self, webhook_id: str, timestamp: int, body: bytes) -> str:
        """The webhook-signature header's value."""
        signed = f"{webhook_id}.{timestamp}.".encode() + body
        digest = hmac.new(self._key, signed, hashlib.sha256).digest()
        return "v1," + base64.b64encode(digest).decode()

    def headers(self, webhook_id: str, timestamp: int, body: bytes) -> dict[str, str]:
        return {"webhook-id": webhook_id, "webhook-timestamp": str(timestamp),
                "webhook-signature": self.signature(webhook_id, timestamp, body),
                "content-type": "application/json"}

    def verify(self, webhook_id: str, timestamp: int, body: bytes, header: str) -> bool:
        """Whether one of the space-separated signatures in `header` is ours for this message
        (what a receiver does; the timestamp's freshness is the receiver's own check)."""
        expected = self.signature(webhook_id, timestamp, body)
        return any(hmac.compare_digest(expected, candidate) for candidate in header.split(" "))
