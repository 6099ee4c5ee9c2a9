"""The models workers have registered (ModelCards in Redis), which of them a live worker serves
now, and which one a request means."""

from __future__ import annotations

import redis.asyncio as aioredis

from api.errors import NotFoundError, ServiceUnavailableError
from api.fleet import live_workers
from protocol import Keys, ModelCard


class ModelRegistry:
    def __init__(self, redis: aioredis.Redis, keys: Keys, retry_after_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._retry_after_s = retry_after_s

    async def cards(self) -> list[ModelCard]:
        """Every model ever registered here, the first registered first (the default model).
        Jobs for one whose workers are all gone wait in its queues until one comes back."""
        raw = await self._redis.hgetall(self._keys.models())
        cards = [ModelCard.from_json(payload) for payload in raw.values()]
        return sorted(cards, key=lambda card: (card.created_at, card.name))

    async def live_names(self) -> set[str]:
        """Models some live worker serves (its TTL'd stats name it): a card lives as long as its
        last worker's heartbeat."""
        return {worker.model for worker in await live_workers(self._redis, self._keys)}

    async def live_cards(self) -> list[ModelCard]:
        live = await self.live_names()
        return [card for card in await self.cards() if card.name in live]

    async def resolve(self, name: str | None, param: str = "model") -> ModelCard:
        cards = await self.cards()
        if not cards:
            raise ServiceUnavailableError(
                "No model is registered yet: no worker has started (start one with "
                "`python -m worker --model ...`)", self._retry_after_s)
        if name is None:
            # The first registered model that a live worker serves; else the first: it queues.
            live = await self.live_names()
            return next((card for card in cards if card.name in live), cards[0])
        for card in cards:
            if card.name == name:
                return card
        known = ", ".join(card.name for card in cards)
        raise NotFoundError(f"The model '{name}' does not exist; known models: {known}",
                            param=param, code="model_not_found")
