"""One POST of a signed event, to an address checked against the allow-list at that moment."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from protocol.webhook_urls import (
    IPAddress,
    WebhookAllowList,
    WebhookTarget,
    WebhookUrlRefused,
    parse_webhook_url,
)

Resolver = Callable[[str, int], list[IPAddress]]


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to (the check must see them all: any could be used)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])  # drop an IPv6 scope id
        if address not in addresses:
            addresses.append(address)
    return addresses


@dataclass(frozen=True, slots=True)
class Delivery:
    """What one attempt came to: `ok` (a 2xx), else `error`; `refused` when the URL may never
    be delivered to (not retried)."""

    ok: bool
    status_code: int = 0
    error: str = ""
    refused: bool = False


class WebhookSender:
    def __init__(self, allow_list: WebhookAllowList, timeout_s: float,
                 resolver: Resolver = resolve) -> None:
        self._allow_list = allow_list
        self._resolve = resolver
        # No redirects (a 3xx is a failure: following one would skip the allow-list check) and
        # no proxy from the environment (the checked address must be the one connected to).
        self._client = httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False)

    def close(self) -> None:
        self._client.close()

    def _target(self, url: str) -> tuple[WebhookTarget, IPAddress] | Delivery:
        try:
            target = parse_webhook_url(url)
        except WebhookUrlRefused as exc:
            return Delivery(ok=False, error=str(exc), refused=True)
        literal = target.literal_address
        try:
            addresses = [literal] if literal is not None else self._resolve(target.host, target.port)
        except (OSError, ValueError) as exc:
            return Delivery(ok=False, error=f"cannot resolve {target.host!r}: {exc}")
        refusal = self._allow_list.refusal(target, addresses)
        if refusal is not None:
            return Delivery(ok=False, error=refusal, refused=True)
        return target, addresses[0]

    def post(self, url: str, headers: dict[str, str], body: bytes) -> Delivery:
        checked = self._target(url)
        if isinstance(checked, Delivery):
            return checked
        target, address = checked
        original = httpx.URL(url)
        # Connect to the address just checked, not to whatever the name resolves to next
        # (DNS rebinding); Host and, for https, SNI and certificate checks keep the name.
        pinned = original.copy_with(host=str(address), port=target.port)
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            with self._client.stream("POST", pinned, content=body, extensions=extensions,
                                     headers={**headers, "host": original.netloc.decode()}) as response:
                status = response.status_code  # the body is never read: it could be huge
        except httpx.HTTPError as exc:
            return Delivery(ok=False, error=f"{type(exc).__name__}: {exc}")
        if 200 <= status < 300:
            return Delivery(ok=True, status_code=status)
        return Delivery(ok=False, status_code=status, error=f"HTTP {status}")
