"""The OpenAI drop-in fields (n, prompt lists, token-id prompts, echo, cached tokens, continuous
usage, stored chat completions, /tokenize, vLLM's metric names) end to end: the official `openai`
client against the real API and a real worker on the tiny model."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.integration.test_api_e2e import KEY_A, ApiServer, api  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


def _tokenize(api: ApiServer, text: str) -> list[int]:  # noqa: F811
    with api.client() as client:
        return list(client.post("/tokenize", json={"prompt": text}).json()["tokens"])


def test_n_seeded_choices_repeat_run_to_run(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()

    def run(n: int) -> list[str]:
        answer = client.completions.create(model=api.model, prompt=PROMPT, n=n, seed=1234,
                                           max_tokens=8, temperature=1.0,
                                           extra_body={"ignore_eos": True})
        assert [c.index for c in answer.choices] == list(range(n))
        assert answer.usage is not None and answer.usage.completion_tokens == 8 * n
        return [c.text for c in answer.choices]

    first = run(4)
    assert run(4) == first
    assert len(set(first)) > 1  # distinct seeds per choice: not four copies of one draw
    assert run(1) == first[:1]  # choice 0 keeps the request's seed


def test_streamed_n_choices_equal_the_plain_ones(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    messages = [{"role": "user", "content": "Say something"}]
    plain = client.chat.completions.create(model=api.model, messages=messages, n=3, seed=7,  # type: ignore[arg-type]
                                           max_tokens=6, temperature=1.0)
    stream = client.chat.completions.create(model=api.model, messages=messages, n=3, seed=7,  # type: ignore[arg-type]
                                            max_tokens=6, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True})
    texts = {0: "", 1: "", 2: ""}
    last = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        last = chunk
    assert [texts[i] for i in range(3)] == [c.message.content for c in plain.choices]
    assert last is not None and last.usage is not None and plain.usage is not None
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens  # the prompt counted once


def test_a_stored_streamed_completion_is_what_was_streamed(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say "},
                                             {"type": "text", "text": "something"}]}]
    stream = client.chat.completions.create(model=api.model, messages=messages, n=2, seed=3,  # type: ignore[arg-type]
                                            max_tokens=6, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True}, store=True,
                                            metadata={"suite": "dropin"}, logprobs=True,
                                            top_logprobs=2, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    logprobs: dict[int, list[tuple[str, float, list[str]]]] = {0: [], 1: []}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            for item in (choice.logprobs.content or []) if choice.logprobs else []:
                logprobs[choice.index].append(
                    (item.token, item.logprob, [top.token for top in item.top_logprobs]))
    # The stream's [DONE] came after it was kept: the client finds it at once.
    kept = client.chat.completions.retrieve(chunks[0].id)
    assert [c.message.content for c in kept.choices] == [texts[0], texts[1]]
    assert [[(item.token, item.logprob, [top.token for top in item.top_logprobs])
             for item in (c.logprobs.content if c.logprobs and c.logprobs.content else [])]
            for c in kept.choices] == [logprobs[0], logprobs[1]]
    assert all(len(logprobs[i]) == 6 for i in (0, 1))
    assert kept.usage == chunks[-1].usage and kept.metadata == {"suite": "dropin"}
    assert [c.id for c in client.chat.completions.list(metadata={"suite": "dropin"})] == [kept.id]
    assert [(m.role, m.content) for m in client.chat.completions.messages.list(kept.id)] == [
        ("system", "Be brief."), ("user", "Say something")]
    assert client.chat.completions.delete(kept.id).deleted


def test_token_id_prompts_and_echo(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    ids = _tokenize(api, PROMPT)
    answer = client.completions.create(model=api.model, prompt=[PROMPT, ids], max_tokens=6,  # type: ignore[arg-type]
                                       temperature=0.0, echo=True,
                                       extra_body={"ignore_eos": True})
    text_choice, ids_choice = answer.choices
    assert (text_choice.index, ids_choice.index) == (0, 1)
    # The same tokens, given as text or as ids, continue the same way; echo puts the prompt first.
    assert text_choice.text == ids_choice.text
    assert text_choice.text.startswith(PROMPT) and len(text_choice.text) > len(PROMPT)
    streamed = client.completions.create(model=api.model, prompt=ids, max_tokens=6,
                                         temperature=0.0, echo=True, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == text_choice.text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=api.model, prompt=[ids[0], 10**7], max_tokens=2)
    assert caught.value.param == "prompt"


def test_a_continued_final_message_is_what_the_model_continues(api: ApiServer) -> None:  # noqa: F811
    # vLLM's continue_final_message: the prompt ends inside the assistant's begun answer. The
    # worker renders it (transformers) as /tokenize does (the API): the same greedy tokens follow
    # those ids given as a completions prompt.
    client = api.openai()
    messages = [{"role": "user", "content": "Name a fruit"},
                {"role": "assistant", "content": "The fruit I like most is"}]
    with api.client() as http:
        ids = http.post("/tokenize", json={"messages": messages,
                                           "continue_final_message": True}).json()["tokens"]
    answer = client.chat.completions.create(model=api.model, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                            temperature=0.0, extra_body={
                                                "continue_final_message": True, "ignore_eos": True})
    same = client.completions.create(model=api.model, prompt=ids, max_tokens=6, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == same.choices[0].text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
    echoed = client.chat.completions.create(model=api.model, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                            temperature=0.0, extra_body={
                                                "continue_final_message": True, "echo": True,
                                                "ignore_eos": True})
    assert echoed.choices[0].message.content == messages[1]["content"] + same.choices[0].text
    opened = client.chat.completions.create(model=api.model, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                            temperature=0.0, extra_body={"ignore_eos": True})
    assert opened.usage is not None and opened.usage.prompt_tokens > len(ids)  # a new turn opened


def test_include_stop_str_in_output_keeps_the_stop_string(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    free = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]  # a word from the middle of the greedy text
    start = free.find(stop)

    def run(**extra: object) -> tuple[str, str | None]:
        choice = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=12,
                                           temperature=0.0, stop=[stop],
                                           extra_body={"ignore_eos": True, **extra}).choices[0]
        return choice.text, choice.finish_reason

    assert run() == (free[:start], "stop")
    assert run(include_stop_str_in_output=True) == (free[:start + len(stop)], "stop")
    streamed = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=12,
                                         temperature=0.0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True,
                                                     "include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == free[:start + len(stop)]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
    ids = _tokenize(api, long_prompt)
    assert len(ids) > 40
    truncated = client.completions.create(model=api.model, prompt=long_prompt, max_tokens=6,
                                          temperature=0.0, extra_body={
                                              "truncate_prompt_tokens": 16, "ignore_eos": True})
    last = client.completions.create(model=api.model, prompt=ids[-16:], max_tokens=6,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    assert truncated.usage is not None and truncated.usage.prompt_tokens == 16
    assert truncated.choices[0].text == last.choices[0].text


def test_skip_special_tokens_false_writes_them(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    (im_start,) = _tokenize(api, "<|im_start|>")
    forced = {"model": api.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0,
              "logit_bias": {str(im_start): 100}}
    assert client.completions.create(**forced).choices[0].text == ""  # type: ignore[call-overload]
    written = client.completions.create(**forced, extra_body={"skip_special_tokens": False})  # type: ignore[call-overload]
    assert written.choices[0].text == "<|im_start|>" * 3


def test_cached_tokens_and_continuous_usage(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    # 40 token ids no other test sends: the second run finds the first 32 (two 16-token blocks;
    # the last prompt token is always computed) in the worker's prefix cache.
    ids = [(7919 * i + 11) % 40000 + 100 for i in range(40)]
    first = client.completions.create(model=api.model, prompt=ids, max_tokens=2, temperature=0.0)
    second = client.completions.create(model=api.model, prompt=ids, max_tokens=2, temperature=0.0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 40
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    stream = client.completions.create(model=api.model, prompt=PROMPT, max_tokens=4,
                                       temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True,
                                                       "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts[-1] == 4 and counts == sorted(counts)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_tokenize_detokenize_and_vllm_metrics(api: ApiServer) -> None:  # noqa: F811
    with api.client() as client:
        tokens = client.post("/tokenize", json={"model": api.model, "prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        back = client.post("/detokenize", json={"model": api.model, "tokens": tokens["tokens"]})
        assert back.json() == {"prompt": PROMPT}
        chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.json()["count"] > 3
        api.openai().completions.create(model=api.model, prompt=PROMPT, max_tokens=2)
        text = httpx.get(f"{api.url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    label = f'model_name="{api.model}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert f"{name}{{{label}}}" in text, name
    success = [line for line in text.splitlines()
               if line.startswith(f'vllm:request_success_total{{{label},finished_reason="length"}}')]
    assert success and float(success[0].rsplit(" ", 1)[1]) >= 1
