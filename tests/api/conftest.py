"""Fixtures of the API tests; the builders themselves are in api_support.py."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from api_support import KEY_A, KEY_B, Harness, make_harness


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = make_harness()
    h.register_model()
    yield h


@pytest.fixture
def keyed_harness() -> Iterator[Harness]:
    h = make_harness(api_keys=[KEY_A, KEY_B])
    h.register_model()
    yield h


@pytest.fixture
async def client(harness: Harness) -> AsyncIterator[httpx.AsyncClient]:
    async with harness.client() as c:
        yield c


