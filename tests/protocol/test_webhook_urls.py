"""The webhook allow-list: what the API and the dispatcher let through."""

from __future__ import annotations

import ipaddress

import pytest

from protocol.webhook_urls import (
    SETTING,
    WebhookAllowList,
    WebhookUrlRefused,
    is_public,
    parse_webhook_url,
)

ip = ipaddress.ip_address


def refusal(entries: list[str], url: str, *addresses: str) -> str | None:
    target = parse_webhook_url(url)
    resolved = [ip(a) for a in addresses] or [target.literal_address]
    return WebhookAllowList.parse(entries).refusal(target, resolved)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0",
    "100.64.0.1", "224.0.0.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1",
    "::"])
def test_non_public_addresses_are_refused_by_default(address: str) -> None:
    assert not is_public(ip(address))
    host = f"[{address}]" if ":" in address else address
    message = refusal([], f"http://{host}:8080/hook")
    assert message is not None and SETTING in message and "non-public" in message


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111",
                                     "::ffff:8.8.8.8"])
def test_public_addresses_pass_an_empty_allow_list(address: str) -> None:
    assert is_public(ip(address))
    host = f"[{address}]" if ":" in address else address
    assert refusal([], f"https://{host}/hook") is None


def test_a_name_passes_when_every_address_it_resolves_to_is_public() -> None:
    assert refusal([], "https://hooks.example.com/x", "93.184.216.34") is None
    # One internal address among public ones is enough to refuse (it could be the one used).
    message = refusal([], "https://hooks.example.com/x", "93.184.216.34", "10.0.0.5")
    assert message == ("webhook_url host 'hooks.example.com' is a non-public address (10.0.0.5: "
                       f"private, loopback or link-local); allow it in {SETTING}")


def test_listed_networks_allow_loopback_and_private_addresses() -> None:
    entries = ["127.0.0.1", "10.0.0.0/8", "::1"]
    assert refusal(entries, "http://127.0.0.1:9000/") is None
    assert refusal(entries, "http://10.200.3.4/") is None
    assert refusal(entries, "http://[::1]:9000/") is None
    assert refusal(entries, "http://[::ffff:127.0.0.1]/") is None  # mapped: judged as IPv4
    assert refusal(entries, "http://127.0.0.2/") is not None


def test_a_non_empty_list_refuses_every_host_it_does_not_name() -> None:
    entries = ["*.example.com", "hooks.partner.org"]
    assert refusal(entries, "https://a.example.com/", "93.184.216.34") is None
    assert refusal(entries, "https://HOOKS.partner.org/", "93.184.216.35") is None
    message = refusal(entries, "https://example.net/", "93.184.216.36")
    assert message == ("webhook_url host 'example.net' (93.184.216.36) is not in the webhook "
                       f"allow-list; add it to {SETTING}")
    # A pattern names its hosts, internal addresses included (the operator's call).
    assert refusal(entries, "http://internal.example.com/", "10.0.0.7") is None
    # ... but not hosts that merely end alike.
    assert refusal(entries, "http://evilexample.com/", "93.184.216.37") is not None


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://example.com/x", "webhook_url must be an http:// or https:// URL"),
    ("example.com/hook", "webhook_url must be an http:// or https:// URL"),
    ("http:///path", "webhook_url has no host"),
    ("http://example.com:99999/", "webhook_url is not a valid URL: Port out of range 0-65535"),
    ("http://example.com/" + "a" * 2048, "webhook_url is longer than 2048 characters"),
])
def test_malformed_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(WebhookUrlRefused) as caught:
        parse_webhook_url(url)
    assert str(caught.value) == message


def test_default_ports_and_ipv6_hosts() -> None:
    assert parse_webhook_url("https://Example.com/a").port == 443
    target = parse_webhook_url("http://[::1]/a")
    assert (target.host, target.port, target.literal_address) == ("::1", 80, ip("::1"))


def test_a_bad_entry_names_the_setting() -> None:
    with pytest.raises(ValueError, match=SETTING):
        WebhookAllowList.parse(["10.0.0.0/33"])
