"""vLLM's request extras end to end: the official `openai` client (its `extra_body`, as vLLM's
users send them) against the real API and a real worker on the tiny model. The ids shown are
the ones the model ran, the whitelist and the bad words bind the real sampler, and the cache salt
splits the real prefix cache."""

from __future__ import annotations

import openai
import pytest

from tests.integration.test_api_e2e import ApiServer, api  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


def _tokenize(api: ApiServer, text: str) -> list[int]:  # noqa: F811
    with api.client() as client:
        return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def _one_token_word(api: ApiServer, ids: list[int]) -> tuple[int, str]:  # noqa: F811
    """The first of `ids` that a bad word of one token bans, by vLLM's tokenization of bad
    words (the word, and the word after a space when that is as many tokens), and that word."""
    for index, token_id in enumerate(ids):
        with api.client() as client:
            word = str(client.post("/detokenize", json={"tokens": [token_id]}).json()["prompt"]).strip()
        if not word:
            continue
        plain, spaced = _tokenize(api, word), _tokenize(api, " " + word)
        if len(plain) == 1 and token_id in (plain[0], spaced[0] if len(spaced) == 1 else None):
            return index, word
    raise AssertionError(f"none of {ids} is a word's one token")


def test_return_token_ids_are_the_ids_the_model_ran(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    answer = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=6,
                                       temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = answer.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == _tokenize(api, PROMPT)
    assert len(choice["token_ids"]) == 6
    # The same ids sent back as the prompt and its continuation continue where they left off.
    again = client.completions.create(model=api.model, prompt=choice["prompt_token_ids"],
                                      max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert again.model_dump()["choices"][0]["token_ids"] == choice["token_ids"]
    streamed = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=6,
                                         temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    ids: list[int] = []
    for chunk in streamed:
        for part in chunk.model_dump()["choices"]:
            ids += part.get("token_ids") or []
    assert ids == choice["token_ids"]


def test_allowed_token_ids_and_bad_words_bind_the_sampler(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    free = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=8,
                                     temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    free_ids = free.model_dump()["choices"][0]["token_ids"]
    # A whitelist without the free run's first token: every token drawn is from the list, and
    # the first is not what the model would have drawn freely.
    allowed = [free_ids[0] + 1, free_ids[0] + 2, 100, 200]
    sampled = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=8, seed=3,
                                        temperature=1.0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True,
                                                    "allowed_token_ids": allowed})
    assert set(sampled.model_dump()["choices"][0]["token_ids"]) <= set(allowed)
    # A bad word that is one token of the free run (as is or after a space): it never appears,
    # and greedy keeps the free run's tokens up to where it stood.
    index, word = _one_token_word(api, free_ids)
    banned = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=8,
                                       temperature=0.0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "bad_words": [word]})
    banned_ids = banned.model_dump()["choices"][0]["token_ids"]
    assert banned_ids[:index] == free_ids[:index] and free_ids[index] not in banned_ids
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model=api.model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"allowed_token_ids": [10**9]})


def test_a_cache_salt_splits_the_prefix_cache(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    # 40 token ids no other test sends: a second run finds its first 32 (two 16-token blocks) in
    # the worker's prefix cache, but only under the same salt.
    ids = [(6133 * i + 29) % 40000 + 100 for i in range(40)]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        answer = client.completions.create(model=api.model, prompt=ids, max_tokens=1,
                                           temperature=0.0, extra_body=extra)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens or 0

    assert [cached("tenant-a"), cached("tenant-a"), cached("tenant-b"), cached(None),
            cached(None), cached("tenant-b")] == [0, 32, 0, 0, 32, 32]
