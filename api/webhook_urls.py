"""The webhook URL a submission names, checked against the allow-list before the job is queued
(protocol.webhook_urls; the dispatcher checks again at each delivery)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping

from api.errors import InvalidRequestError
from protocol.webhook_urls import IPAddress, WebhookAllowList, WebhookUrlRefused, parse_webhook_url

RESOLVE_TIMEOUT_S = 3.0
# The OpenAI routes take the URL in this header too, for clients that cannot add body fields.
WEBHOOK_URL_HEADER = "X-Carpool-Webhook-Url"


class WebhookUrlError(InvalidRequestError):
    """A webhook URL the server's policy refuses: 422 on the jobs API, 400 on the OpenAI routes,
    as every invalid field (api/errors.py)."""


async def _resolve(host: str, port: int) -> list[IPAddress]:
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
                                   RESOLVE_TIMEOUT_S)
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0])
                              for info in infos))


async def checked_webhook_url(url: str, allow_list: WebhookAllowList,
                              param: str = "webhook_url") -> str:
    """`url` when the allow-list lets it through, else WebhookUrlError naming why and the setting.
    `param`: where it came from, as `webhook_url_of` says: the body's field or the header."""
    location = "header" if param == WEBHOOK_URL_HEADER else "body"
    try:
        target = parse_webhook_url(url)
    except WebhookUrlRefused as exc:
        raise WebhookUrlError(str(exc), param=param, location=location) from exc
    literal = target.literal_address
    if literal is not None:
        addresses = [literal]
    elif allow_list.matches_name(target.host):
        return url  # listed by name: its addresses are the operator's call
    else:
        try:
            addresses = await _resolve(target.host, target.port)
        except (OSError, TimeoutError, ValueError) as exc:
            raise WebhookUrlError(f"webhook_url host {target.host!r} does not resolve ({exc})",
                                  param=param, location=location) from exc
    refusal = allow_list.refusal(target, addresses)
    if refusal is not None:
        raise WebhookUrlError(refusal, param=param, location=location)
    return url


def webhook_url_of(body_url: str | None, headers: Mapping[str, str]) -> dict[str, str]:
    """GenerationRequest's webhook fields, from the body's webhook_url or the header; both,
    naming different URLs, is a 400 (which one the client meant is unknown)."""
    header_url = headers.get(WEBHOOK_URL_HEADER)
    if header_url is not None and body_url is not None and header_url != body_url:
        raise WebhookUrlError(f"give the webhook URL once: the body's webhook_url or the "
                              f"{WEBHOOK_URL_HEADER} header", param="webhook_url")
    if body_url is not None:
        return {"webhook_url": body_url}
    if header_url is not None:
        return {"webhook_url": header_url, "webhook_param": WEBHOOK_URL_HEADER}
    return {}
