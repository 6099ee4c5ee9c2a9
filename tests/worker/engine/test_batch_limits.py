"""Seats and step budget when the config leaves them open: from the device and the KV pool."""

from __future__ import annotations

from worker.engine.batch_limits import BatchLimits, resolve_batch_limits, seat_cap


def test_a_roomy_pool_gets_the_device_cap_and_eight_tokens_a_seat() -> None:
    assert resolve_batch_limits("cpu", 93_000, None, None) == BatchLimits(256, 2048)
    assert resolve_batch_limits("cuda", 10**6, None, None) == BatchLimits(256, 2048)
    assert seat_cap("cpu") == seat_cap("cuda") == 256


def test_a_small_pool_gives_each_seat_a_chat_sized_room() -> None:
    assert resolve_batch_limits("cpu", 40 * 256 + 100, None, None) == BatchLimits(40, 512)
    assert resolve_batch_limits("cpu", 100, None, None) == BatchLimits(1, 512)


def test_configured_values_win() -> None:
    assert resolve_batch_limits("cpu", 93_000, 64, None) == BatchLimits(64, 512)
    assert resolve_batch_limits("cpu", 93_000, None, 300) == BatchLimits(256, 300)
    assert resolve_batch_limits("cpu", 10, 8, 4096) == BatchLimits(8, 4096)
