"""The models workers have registered (ModelCards in Redis), and which one a request means."""

from __future__ import annotations

import redis.asyncio as aioredis

from api.errors import InvalidRequestError, ServiceUnavailableError
from protocol import Keys, ModelCard


class ModelRegistry:
    def __init__(self, redis: aioredis.Redis, keys: Keys, retry_after_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._retry_after_s = retry_after_s

    async def cards(self) -> list[ModelCard]:
        """Registered models, the first registered first (it is the default model)."""
        raw = await self._redis.hgetall(self._keys.models())
        cards = [ModelCard.from_json(payload) for payload in raw.values()]
        return sorted(cards, key=lambda card: (card.created_at, card.name))

    async def resolve(self, name: str | None, param: str = "model") -> ModelCard:
        cards = await self.cards()
        if not cards:
            raise ServiceUnavailableError(
                "No model is registered yet: no worker has started (start one with "
                "`python -m worker --model ...`)", self._retry_after_s)
        if name is None:
            return cards[0]
        for card in cards:
            if card.name == name:
                return card
        served = ", ".join(card.name for card in cards)
        raise InvalidRequestError(f"The model '{name}' does not exist; served models: {served}",
                                  param=param, code="model_not_found")
