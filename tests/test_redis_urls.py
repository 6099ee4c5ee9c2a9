"""Redis URLs in logs and on the console keep no password (protocol/redis_urls.py)."""

from __future__ import annotations

import pytest

from launcher.local_redis import LocalRedis, RedisUnavailableError
from protocol.redis_urls import shown_url


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:s3cr3t@127.0.0.1:6394/0", "redis://:***@127.0.0.1:6394/0"),
    ("rediss://carpool:s3cr3t@redis.internal:6380/2", "rediss://carpool:***@redis.internal:6380/2"),
    ("redis://:pa%40ss@[::1]:6379/0", "redis://:***@[::1]:6379/0"),
    ("redis://:s3cr3t@redis", "redis://:***@redis"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),  # nothing to hide
    ("redis://carpool@127.0.0.1:6379/0", "redis://carpool@127.0.0.1:6379/0"),
])
def test_a_password_is_never_shown(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_the_launcher_names_an_unreachable_redis_without_its_password() -> None:
    with pytest.raises(RedisUnavailableError) as caught:
        LocalRedis.ensure("redis://:s3cr3t@redis.invalid:6379/0")
    assert str(caught.value) == ("no Redis answers at redis://:***@redis.invalid:6379/0, and it "
                                 "is not a local address we could start one on")
