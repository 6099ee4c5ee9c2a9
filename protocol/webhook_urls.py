"""Which webhook URLs Carpool may POST to: the allow-list both the API (at submission) and the
dispatcher (at each delivery, on the addresses the host resolves to then) apply.

The setting (CARPOOL_WEBHOOK_ALLOWED_HOSTS) is a list of host name patterns (`hooks.example.com`,
`*.example.com`; shell-style, case-insensitive) and networks (`10.1.0.0/16`, `::1/128`,
`127.0.0.1`). Empty: any host whose addresses are all public. Not empty: the host must match a
pattern, or every address it resolves to must lie in a listed network. Private, loopback,
link-local and other non-public addresses are refused unless so listed (a pattern naming the host,
or a network holding the address): a job's URL must not reach the internal network by default
(SSRF). Checking the resolved addresses at delivery time, and connecting to exactly the checked
one, keeps a host that re-resolves to an internal address (DNS rebinding) out.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SETTING = "CARPOOL_WEBHOOK_ALLOWED_HOSTS"
MAX_URL_LENGTH = 2048


class WebhookUrlRefused(ValueError):
    """The URL may not be used; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class WebhookTarget:
    url: str
    scheme: str
    host: str  # lower case, IPv6 without brackets
    port: int

    @property
    def literal_address(self) -> IPAddress | None:
        """The host as an IP address when it is one (then no resolution is needed)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None


def parse_webhook_url(url: str) -> WebhookTarget:
    """An absolute http(s) URL with a host; raises WebhookUrlRefused naming what is wrong."""
    if len(url) > MAX_URL_LENGTH:
        raise WebhookUrlRefused(f"webhook_url is longer than {MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookUrlRefused(f"webhook_url is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https"):
        raise WebhookUrlRefused("webhook_url must be an http:// or https:// URL")
    host = (parts.hostname or "").lower()
    if not host:
        raise WebhookUrlRefused("webhook_url has no host")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return WebhookTarget(url=url, scheme=parts.scheme, host=host, port=port)


def is_public(address: IPAddress) -> bool:
    """Globally routable unicast: not private, loopback, link-local, multicast, reserved or
    unspecified (an IPv4-mapped IPv6 address is judged as its IPv4 address)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


@dataclass(frozen=True, slots=True)
class WebhookAllowList:
    patterns: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> WebhookAllowList:
        """From the setting's entries: a network (CIDR, or a bare address) or a name pattern."""
        patterns: list[str] = []
        networks: list[IPNetwork] = []
        for raw in entries:
            entry = raw.strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry or ":" in entry:
                    raise ValueError(f"{SETTING}: {raw!r} is neither a network (CIDR) nor a host "
                                     "pattern") from None
                patterns.append(entry)
        return cls(tuple(patterns), tuple(networks))

    @property
    def is_empty(self) -> bool:
        return not self.patterns and not self.networks

    def matches_name(self, host: str) -> bool:
        return any(fnmatch.fnmatchcase(host.lower(), pattern) for pattern in self.patterns)

    def listed(self, address: IPAddress) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            mapped: IPAddress = address.ipv4_mapped
            if any(mapped in network for network in self.networks):
                return True
        return any(address in network for network in self.networks)

    def refusal(self, target: WebhookTarget, addresses: Sequence[IPAddress]) -> str | None:
        """Why `target`, whose host resolves to `addresses`, may not be POSTed to (None: it may).
        The message names the setting to change."""
        if not addresses:
            return f"webhook_url host {target.host!r} has no address"
        named = self.matches_name(target.host)
        for address in addresses:
            if named or self.listed(address):
                continue
            if not self.is_empty:
                return (f"webhook_url host {target.host!r} ({address}) is not in the webhook "
                        f"allow-list; add it to {SETTING}")
            if not is_public(address):
                return (f"webhook_url host {target.host!r} is a non-public address ({address}: "
                        f"private, loopback or link-local); allow it in {SETTING}")
        return None
