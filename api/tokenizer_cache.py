"""Tokenizers of the served models, loaded from the tokenizer.json text workers put in Redis.

The `tokenizers` package is Rust with no torch, which keeps the API process light.
"""

from __future__ import annotations

import asyncio
import logging

import anyio.to_thread
import redis.asyncio as aioredis
from tokenizers import Tokenizer

from protocol import Keys, ModelCard

log = logging.getLogger(__name__)


class TokenizerCache:
    """One parsed Tokenizer per model, reloaded when a worker re-registers the model."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys
        # name -> (card.created_at it was loaded for, tokenizer or None when none is published)
        self._cache: dict[str, tuple[float, Tokenizer | None]] = {}
        self._lock = asyncio.Lock()

    async def get(self, card: ModelCard) -> Tokenizer | None:
        cached = self._cache.get(card.name)
        if cached is not None and cached[0] == card.created_at:
            return cached[1]
        async with self._lock:  # parsing a large tokenizer.json takes ~0.1 s: do it once
            cached = self._cache.get(card.name)
            if cached is not None and cached[0] == card.created_at:
                return cached[1]
            text = await self._redis.get(self._keys.model_tokenizer(card.name))
            tokenizer = await anyio.to_thread.run_sync(_parse, card.name, text) if text else None
            if tokenizer is None:
                log.warning("model %s has no usable tokenizer in Redis: prompt lengths are left "
                            "to the worker to check", card.name)
            self._cache[card.name] = (card.created_at, tokenizer)
            return tokenizer


def _parse(name: str, text: str | bytes) -> Tokenizer | None:
    try:
        return Tokenizer.from_str(text.decode() if isinstance(text, bytes) else text)
    except Exception as exc:  # the Rust side raises a plain Exception for any malformed JSON
        log.warning("tokenizer of %s does not parse: %s", name, exc)
        return None
