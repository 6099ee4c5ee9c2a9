"""The Responses API end to end: the official openai client's `responses` against the real API,
a real worker on the tiny model and a real Redis. Greedy answers must equal the chat
completions' for the same chat, token for token, whole or streamed."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.integration.test_api_e2e import KEY_A, ApiServer, api  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

QUESTION = "What is 2+2?"


def _chat_text(api: ApiServer, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, Any]:  # noqa: F811
    answer = api.openai().chat.completions.create(model=api.model, messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=max_tokens, temperature=0.0)
    return answer.choices[0].message.content or "", answer


def test_a_response_is_the_chat_completion_of_the_same_chat(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    response = client.responses.create(model=api.model, input=QUESTION, instructions="Be brief.",
                                       max_output_tokens=12, temperature=0.0)
    text, chat = _chat_text(api, [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": QUESTION}], 12)
    assert response.output_text == text
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # The tiny model never stops on its own within 12 tokens: cut by max_output_tokens.
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]

    with client.responses.stream(model=api.model, input=QUESTION, instructions="Be brief.",
                                 max_output_tokens=12, temperature=0.0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == text


def test_vllms_sampling_extras_answer_as_on_chat(api: ApiServer) -> None:  # noqa: F811
    """A response with vLLM's extras (as guidellm and `vllm bench serve` send them) is the chat
    completion with the same fields: a seeded draw under top_k and a penalty, cut by a stop."""
    client = api.openai()
    extras = {"top_k": 5, "seed": 3, "repetition_penalty": 1.3, "ignore_eos": True}
    chat = client.chat.completions.create(model=api.model, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=12, temperature=0.9, extra_body=extras)
    full = chat.choices[0].message.content or ""
    stop = full[len(full) // 2:][:3]  # a stop string from the middle of the answer
    assert stop.strip() and stop in full
    answers = []
    for extra in (extras, {**extras, "stop": [stop]}):
        response = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=12,
                                           temperature=0.9, extra_body=extra)
        chat = client.chat.completions.create(
            model=api.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
            temperature=0.9, extra_body=extra)
        assert response.output_text == chat.choices[0].message.content
        answers.append(response.output_text)
    assert answers[0] == full and answers[1] == full[:full.index(stop)]


def test_continuing_with_previous_response_id_equals_the_whole_chat(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    first = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=6,
                                    temperature=0.0)
    second = client.responses.create(model=api.model, input="And 3+3?", max_output_tokens=6,
                                     temperature=0.0, previous_response_id=first.id)
    text, _ = _chat_text(api, [{"role": "user", "content": QUESTION},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "And 3+3?"}], 6)
    assert second.output_text == text
    assert client.responses.retrieve(second.id).output_text == text
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.content[0].text for item in items.data] == ["And 3+3?"]  # type: ignore[union-attr]


def test_turns_in_a_conversation_equal_the_whole_chat(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    conversation = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}])
    first = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=6,
                                    temperature=0.0, conversation=conversation.id)
    second = client.responses.create(model=api.model, input="And 3+3?", max_output_tokens=6,
                                     temperature=0.0, conversation={"id": conversation.id})
    chat = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text}]
    assert first.output_text == _chat_text(api, chat[:2], 6)[0]
    text, _ = _chat_text(api, [*chat, {"role": "user", "content": "And 3+3?"}], 6)
    assert second.output_text == text and second.conversation.id == conversation.id  # type: ignore[union-attr]
    items = client.conversations.items.list(conversation.id, order="asc")
    assert [item.content[0].text for item in items.data] == [  # type: ignore[union-attr]
        "My name is Ada.", QUESTION, first.output_text, "And 3+3?", text]
    # The count of a next turn is the input_tokens its response's usage reports.
    counted = client.responses.input_tokens.count(model=api.model, input="And 4+4?",
                                                  conversation=conversation.id)
    third = client.responses.create(model=api.model, input="And 4+4?", max_output_tokens=2,
                                    temperature=0.0, conversation=conversation.id)
    assert third.usage is not None and counted.input_tokens == third.usage.input_tokens


def test_a_background_response_polls_to_the_same_answer(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    created = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=8,
                                      temperature=0.0, background=True)
    assert created.background and created.status in ("queued", "in_progress", "incomplete")
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(created.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response never finished"
        time.sleep(0.1)
    text, _ = _chat_text(api, [{"role": "user", "content": QUESTION}], 8)
    assert (polled.status, polled.output_text) == ("incomplete", text)
    # A long one cancelled while it runs ends cancelled, keeping a prefix of what it would say.
    long = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=400,
                                   temperature=0.0, background=True)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    whole, _ = _chat_text(api, [{"role": "user", "content": QUESTION}], 400)
    assert whole.startswith(client.responses.retrieve(long.id).output_text)


def test_a_background_stream_resumes_where_it_broke_off(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    first_part = []
    with client.responses.create(model=api.model, input=QUESTION, max_output_tokens=40,
                                 temperature=0.0, background=True, stream=True) as stream:
        for event in stream:
            first_part.append(event.model_dump())
            if len(first_part) == 6:
                break  # the client leaves: the response goes on
    response_id = first_part[0]["response"]["id"]
    rest = [event.model_dump() for event in client.responses.retrieve(
        response_id, stream=True, starting_after=first_part[-1]["sequence_number"])]
    whole = [event.model_dump() for event in client.responses.retrieve(response_id, stream=True)]
    # Live tokens, then the stream's runs, read again: the same events under the same numbers.
    assert first_part + rest == whole
    assert [event["sequence_number"] for event in whole] == list(range(len(whole)))
    text, _ = _chat_text(api, [{"role": "user", "content": QUESTION}], 40)
    done = client.responses.retrieve(response_id)
    assert (done.status, done.output_text) == ("incomplete", text)
    assert "".join(event["delta"] for event in whole
                   if event["type"] == "response.output_text.delta") == text
    assert whole[-1]["response"] == done.model_dump()


def test_output_logprobs_are_the_chats(api: ApiServer) -> None:  # noqa: F811
    client = api.openai()
    response = client.responses.create(model=api.model, input=QUESTION, max_output_tokens=6,
                                       temperature=0.0, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=api.model, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    expected = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(lp.token, lp.logprob, len(lp.top_logprobs)) for lp in part.logprobs] == [  # type: ignore[union-attr]
        (lp.token, lp.logprob, 2) for lp in expected]  # type: ignore[union-attr]


def test_a_forced_function_call_and_its_result(api: ApiServer) -> None:  # noqa: F811
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                           "required": ["city"]}}
    client = api.openai()
    response = client.responses.create(model=api.model, input="Weather in Oslo?", tools=[tool],  # type: ignore[list-item]
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=200, temperature=0.8)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
    answer = client.responses.create(model=api.model, previous_response_id=response.id, tools=[tool],  # type: ignore[list-item]
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Sunny"}],
                                     max_output_tokens=4, temperature=0.0)
    assert answer.output[0].type == "message" and answer.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens  # type: ignore[union-attr]


def test_langchain_on_the_responses_api(api: ApiServer) -> None:  # noqa: F811
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{api.url}/v1", api_key=KEY_A, model=api.model,
                                      use_responses_api=True, max_tokens=8, temperature=0.0,
                                      max_retries=0)
    text, _ = _chat_text(api, [{"role": "user", "content": QUESTION}], 8)
    assert llm.invoke(QUESTION).text == text
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == text
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
                       "required": ["city"]}}}
    caller = langchain_openai.ChatOpenAI(base_url=f"{api.url}/v1", api_key=KEY_A, model=api.model,
                                         use_responses_api=True, max_tokens=200, max_retries=0)
    message = caller.bind_tools([weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [("get_weather", {"city": "Oslo"})]
