"""The webhook dispatcher: delivers the events of `Keys.webhook_events` (written by
protocol.webhook_events), signed per Standard Webhooks, with retries and dead letters.
Run it with `python -m webhooks`. Imports neither api nor worker."""

from webhooks.dispatcher import WebhookDispatcher
from webhooks.signing import WebhookSigner

__all__ = ["WebhookDispatcher", "WebhookSigner"]
