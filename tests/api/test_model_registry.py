"""ModelRegistry.resolve for submissions (`recent`): what was read within RESOLVE_MAX_AGE_S serves
the next ones; a model it does not know yet is looked up again at once."""

from __future__ import annotations

import fakeredis
import pytest

import api.model_registry as model_registry
from api.errors import NotFoundError, ServiceUnavailableError
from api.model_registry import ModelRegistry
from protocol import Keys, ModelCard

pytestmark = pytest.mark.anyio

KEYS = Keys()


class CountingRedis(fakeredis.FakeAsyncRedis):
    card_reads = 0

    async def hgetall(self, name):  # type: ignore[no-untyped-def, override]
        if name == KEYS.models():
            CountingRedis.card_reads += 1
        return await super().hgetall(name)


class CountingRegistry(ModelRegistry):
    live_reads = 0
    live: set[str] = set()

    async def live_names(self) -> set[str]:
        CountingRegistry.live_reads += 1
        return set(self.live)


async def _register(redis: fakeredis.FakeAsyncRedis, name: str, created_at: float,
                    max_model_len: int = 32) -> None:
    card = ModelCard(name=name, max_model_len=max_model_len, eos_token="</s>",
                     created_at=created_at)
    await redis.hset(KEYS.models(), name, card.to_json())


async def test_resolve_reuses_recent_cards_and_reads_again_for_a_new_name(monkeypatch) -> None:
    CountingRedis.card_reads = CountingRegistry.live_reads = 0
    clock = [1000.0]
    monkeypatch.setattr(model_registry.time, "monotonic", lambda: clock[0])
    redis = CountingRedis()
    registry = CountingRegistry(redis, KEYS, retry_after_s=1)
    CountingRegistry.live = {"small"}
    await _register(redis, "small", created_at=1.0)

    assert (await registry.resolve("small", recent=True)).name == "small"
    assert (await registry.resolve(None, recent=True)).name == "small"
    assert (await registry.resolve("small", recent=True)).max_model_len == 32
    assert (CountingRedis.card_reads, CountingRegistry.live_reads) == (1, 1)

    # A card that changed is seen once the cards are RESOLVE_MAX_AGE_S old.
    await _register(redis, "small", created_at=1.0, max_model_len=64)
    assert (await registry.resolve("small", recent=True)).max_model_len == 32
    clock[0] += model_registry.RESOLVE_MAX_AGE_S
    assert (await registry.resolve("small", recent=True)).max_model_len == 64
    assert (await registry.resolve(None, recent=True)).name == "small"
    assert (CountingRedis.card_reads, CountingRegistry.live_reads) == (2, 2)

    # A model registered a moment ago is found at once; a name nobody registered is 404 after
    # one fresh read.
    await _register(redis, "large", created_at=2.0)
    assert (await registry.resolve("large", recent=True)).name == "large"
    assert CountingRedis.card_reads == 3
    with pytest.raises(NotFoundError, match="'missing' does not exist; known models: small, large"):
        await registry.resolve("missing", recent=True)
    assert CountingRedis.card_reads == 4

    # The default follows the live workers, as read within the same age.
    CountingRegistry.live = {"large"}
    assert (await registry.resolve(None, recent=True)).name == "small"
    clock[0] += model_registry.RESOLVE_MAX_AGE_S
    assert (await registry.resolve(None, recent=True)).name == "large"
    assert CountingRegistry.live_reads == 3


async def test_resolve_with_no_card_yet_reads_again_before_answering_503(monkeypatch) -> None:
    CountingRedis.card_reads = 0
    monkeypatch.setattr(model_registry.time, "monotonic", lambda: 5.0)
    redis = CountingRedis()
    registry = CountingRegistry(redis, KEYS, retry_after_s=1)
    CountingRegistry.live = set()
    with pytest.raises(ServiceUnavailableError, match="No model is registered yet"):
        await registry.resolve("small", recent=True)
    await _register(redis, "small", created_at=1.0)
    # Not the empty list read at 5.0, though as recent.
    assert (await registry.resolve("small", recent=True)).name == "small"
    assert CountingRedis.card_reads == 2
    # Without `recent` (a route that answers from the card alone) it reads now.
    assert (await registry.resolve("small")).name == "small"
    assert CountingRedis.card_reads == 3


@pytest.mark.parametrize("placeholder", sorted(model_registry.TGI_CLIENT_PLACEHOLDER_MODELS))
async def test_a_tgi_clients_placeholder_means_the_default_model_unless_one_has_its_name(
        monkeypatch, placeholder: str) -> None:
    monkeypatch.setattr(model_registry.time, "monotonic", lambda: 5.0)
    redis = CountingRedis()
    registry = CountingRegistry(redis, KEYS, retry_after_s=1)
    CountingRegistry.live = {"large"}
    await _register(redis, "small", created_at=1.0)
    await _register(redis, "large", created_at=2.0)
    # The default: the first registered model a live worker serves.
    assert (await registry.resolve(placeholder)).name == "large"
    assert (await registry.resolve(placeholder, recent=True)).name == "large"
    with pytest.raises(NotFoundError, match="'Dummy' does not exist"):  # the exact names only
        await registry.resolve("Dummy")
    # A model registered under that name is that model.
    await _register(redis, placeholder, created_at=3.0)
    assert (await registry.resolve(placeholder)).name == placeholder
