"""The other API families end to end, against a real worker on the tiny model and a real Redis:
Text Generation Inference's routes through huggingface_hub's `InferenceClient` (pointed at the
API as at a TGI endpoint), and Anthropic's Messages API through the official `anthropic` client."""

from __future__ import annotations

import json
import re

import anthropic
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from tests.integration.test_api_e2e import KEY_A, ApiServer, api  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"


def _client(api: ApiServer) -> InferenceClient:  # noqa: F811
    return InferenceClient(model=api.url, api_key=KEY_A, timeout=120)


def test_greedy_text_generation_is_the_openai_routes_greedy_text(api: ApiServer) -> None:  # noqa: F811
    output = _client(api).text_generation(PROMPT, max_new_tokens=8, details=True,
                                          decoder_input_details=True, top_n_tokens=2)
    completion = api.openai().completions.create(model=api.model, prompt=PROMPT, max_tokens=8,
                                                 temperature=0.0)
    assert output.generated_text == completion.choices[0].text
    details = output.details
    assert details is not None and completion.usage is not None
    assert details.generated_tokens == len(details.tokens) == completion.usage.completion_tokens
    assert "".join(token.text for token in details.tokens) == output.generated_text
    expected_reason = "length" if details.generated_tokens == 8 else "eos_token"
    assert details.finish_reason == expected_reason
    # The prompt's tokens, as /tokenize counts them, the first without a logprob.
    with api.client() as client:
        prompt_ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert [token.id for token in details.prefill] == prompt_ids
    assert details.prefill[0].logprob is None and all(t.logprob < 0 for t in details.prefill[1:])
    # Greedy: each token is the most likely of its top tokens (the client leaves those as dicts).
    assert details.top_tokens is not None
    assert [top[0]["id"] for top in details.top_tokens] == [token.id for token in details.tokens]


def test_a_stream_is_the_plain_answer_token_by_token(api: ApiServer) -> None:  # noqa: F811
    client = _client(api)
    plain = client.text_generation(PROMPT, max_new_tokens=10, details=True)
    events = list(client.text_generation(PROMPT, max_new_tokens=10, stream=True, details=True))
    assert [event.token.id for event in events] == [token.id for token in plain.details.tokens]
    assert [event.index for event in events] == list(range(1, len(events) + 1))
    last = events[-1]
    assert last.generated_text == plain.generated_text
    assert last.details is not None and last.details.generated_tokens == len(events)
    with api.client() as http:
        assert last.details.input_length == http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert all(event.generated_text is None for event in events[:-1])


def test_tgis_tokenize_body_lists_the_prompts_tokens_with_their_spans(api: ApiServer) -> None:  # noqa: F811
    text = "Héllo wörld, 2+2=4"  # characters past ASCII: the spans count characters, not bytes
    with api.client() as http:
        tokens = http.post("/tokenize", json={"inputs": text}).json()
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        last_two = http.post("/tokenize", json={"inputs": text, "parameters": {"truncate": 2}}).json()
        refused = http.post("/tokenize", json={"inputs": text, "parameters": {"truncate": -1}})
    assert [token["id"] for token in tokens] == ids
    assert "".join(token["text"] for token in tokens) == text
    assert all(text[token["start"]:token["stop"]] == token["text"] for token in tokens)
    assert [token["stop"] for token in tokens[:-1]] == [token["start"] for token in tokens[1:]]
    assert last_two == tokens[-2:]
    assert refused.status_code == 422 and refused.json()["error_type"] == "validation"


def test_seeded_sampling_with_typical_p_repeats(api: ApiServer) -> None:  # noqa: F811
    client = _client(api)

    def sample() -> str:
        return client.text_generation(PROMPT, max_new_tokens=12, do_sample=True, typical_p=0.9,
                                      top_k=20, seed=17, stop=["\n\n"])

    assert sample() == sample()


def test_the_clients_chat_keeps_to_its_json_schema_and_regex(api: ApiServer) -> None:  # noqa: F811
    # Pointed at a URL, the client sends the model "dummy" and OpenAI's json_schema as TGI's
    # {"type": "json_object", "value": schema}; a regex goes as TGI's {"type": "regex", ...}.
    client = _client(api)
    messages = [{"role": "user", "content": "Yes or no?"}]
    schema = {"enum": ["yes", "no"]}
    answer = client.chat_completion(messages, max_tokens=10, temperature=0.0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert answer.model == api.model
    assert json.loads(answer.choices[0].message.content) in ("yes", "no")
    same = api.openai().chat.completions.create(
        model=api.model, messages=messages, max_tokens=10, temperature=0.0,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert answer.choices[0].message.content == same.choices[0].message.content
    digits = client.chat_completion(messages, max_tokens=10, temperature=0.0,
                                    response_format={"type": "regex", "value": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].message.content)


def test_bad_parameters_raise_the_clients_validation_error(api: ApiServer) -> None:  # noqa: F811
    with pytest.raises(ValidationError, match="parameters.best_of"):
        _client(api).text_generation(PROMPT, best_of=2)  # best_of without sampling
    with pytest.raises(ValidationError, match="parameters.temperature"):
        _client(api).text_generation(PROMPT, temperature=-1.0)


def _anthropic(api: ApiServer) -> anthropic.Anthropic:  # noqa: F811
    return anthropic.Anthropic(base_url=api.url, api_key=KEY_A, max_retries=0, timeout=120)


CHAT = [{"role": "user", "content": "Say something"}]


def test_a_greedy_message_is_the_chat_routes_greedy_answer(api: ApiServer) -> None:  # noqa: F811
    message = _anthropic(api).messages.create(model=api.model, max_tokens=10, messages=CHAT,  # type: ignore[arg-type]
                                              system="Be brief.", extra_body={"temperature": 0.0})
    chat = api.openai().chat.completions.create(
        model=api.model, max_tokens=10, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."}, *CHAT])  # type: ignore[list-item]
    assert chat.usage is not None
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0),
            message.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_a_streamed_message_is_the_whole_one(api: ApiServer) -> None:  # noqa: F811
    client = _anthropic(api)
    whole = client.messages.create(model=api.model, max_tokens=12, messages=CHAT,  # type: ignore[arg-type]
                                   extra_body={"temperature": 0.0})
    with client.messages.stream(model=api.model, max_tokens=12, messages=CHAT,  # type: ignore[arg-type]
                                extra_body={"temperature": 0.0}) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == "".join(block.text for block in whole.content if block.type == "text")
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    counted = client.messages.count_tokens(model=api.model, messages=CHAT)  # type: ignore[arg-type]
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
