"""The models workers have registered (ModelCards in Redis), which of them a live worker serves
now, and which one a request means."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from api.errors import NotFoundError, ServiceUnavailableError
from api.fleet import live_workers
from protocol import Keys, ModelCard

# [redis-cost] Every submission resolves its model: two round trips (the cards, and the live
# workers when it names none) for what changes only when a worker starts or stops. A submission's
# resolve() reuses what was read within this long; a name it does not find makes it read the
# cards again at once, so a model registered a moment ago is never refused for it.
RESOLVE_MAX_AGE_S = 1.0
# What huggingface_hub's InferenceClient, Text Generation Inference's own client, sends as the
# chat route's `model` when it reaches a server by URL ("dummy"; "tgi" in its older releases):
# TGI serves one model and ignores the field. Unless a model has that name, it means the model
# left out, so that client works here as it does against TGI.
TGI_CLIENT_PLACEHOLDER_MODELS = frozenset({"dummy", "tgi"})


class ModelRegistry:
    def __init__(self, redis: aioredis.Redis, keys: Keys, retry_after_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._retry_after_s = retry_after_s
        self._recent_cards: tuple[float, list[ModelCard]] | None = None  # (read at, cards)
        self._recent_live: tuple[float, set[str]] | None = None  # (read at, names)

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

    async def _cards_for_resolve(self, fresh: bool = False) -> tuple[list[ModelCard], bool]:
        """The cards, as read within RESOLVE_MAX_AGE_S unless `fresh`; and whether they were read
        just now."""
        now = time.monotonic()
        if not fresh and self._recent_cards is not None \
                and now - self._recent_cards[0] < RESOLVE_MAX_AGE_S:
            return self._recent_cards[1], False
        cards = await self.cards()
        self._recent_cards = (now, cards)
        return cards, True

    async def _live_names_for_resolve(self) -> set[str]:
        now = time.monotonic()
        if self._recent_live is None or now - self._recent_live[0] >= RESOLVE_MAX_AGE_S:
            self._recent_live = (now, await self.live_names())
        return self._recent_live[1]

    async def resolve(self, name: str | None, param: str = "model",
                      recent: bool = False) -> ModelCard:
        """The card `name` means (None, or a TGI client's placeholder: the default model).
        `recent`: what was read within RESOLVE_MAX_AGE_S will do (a submission, which needs Redis
        right after anyway); else read now (routes that answer from the card alone say 503 while
        Redis is down)."""
        cards, fresh = await self._cards_for_resolve(fresh=not recent)
        if not fresh and (not cards or (name is not None
                                        and all(card.name != name for card in cards))):
            cards, _ = await self._cards_for_resolve(fresh=True)
        if not cards:
            raise ServiceUnavailableError(
                "No model is registered yet: no worker has started (start one with "
                "`python -m worker --model ...`)", self._retry_after_s)
        if name in TGI_CLIENT_PLACEHOLDER_MODELS and all(card.name != name for card in cards):
            name = None
        if name is None:
            # The first registered model that a live worker serves; else the first: it queues.
            live = await (self._live_names_for_resolve() if recent else self.live_names())
            return next((card for card in cards if card.name in live), cards[0])
        for card in cards:
            if card.name == name:
                return card
        known = ", ".join(card.name for card in cards)
        raise NotFoundError(f"The model '{name}' does not exist; known models: {known}",
                            param=param, code="model_not_found")
