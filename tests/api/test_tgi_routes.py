"""Text Generation Inference's routes (/generate, /generate_stream, POST /, /info) in TGI's shapes,
from token entries a stand-in worker writes: the answer, its details (tokens, logprobs, top
tokens, the prompt's tokens, finish reasons as TGI names them), best_of, the stream's events with
the last one carrying the text and details, TGI's parameters reaching the job spec (greedy unless
sampling is asked for), and errors as TGI writes them (422 naming the field). The word tokenizer
decodes 3 as "hello", 4 "world", 8 "the"; 1 and 2 are special."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from api_support import KEY_A, MODEL, Harness, make_harness, parse_sse

from protocol import FinishReason, TokenLogprobs
from protocol.generation import MAX_SEED, PromptLogprobs
from protocol.job_reader import PROMPT_LOGPROBS_FIELD

pytestmark = pytest.mark.anyio

CONTEXT = 256  # room for TGI's default of 100 new tokens


@pytest.fixture
def harness() -> Harness:
    h = make_harness()
    h.register_model(context=CONTEXT)
    return h

# (token id, text released, logprobs): the second token's text is held back, then released.
TOKENS = [
    (3, "hello", TokenLogprobs(-0.5, ((3, -0.5), (4, -1.25)))),
    (4, "", TokenLogprobs(-2.0, ((8, -0.125), (4, -2.0)))),
    (8, " world the", TokenLogprobs(-0.25, ((8, -0.25), (3, -3.0)))),
]


def _token(token_id: int, text: str, logprob: float | None, special: bool = False) -> dict[str, Any]:
    return {"id": token_id, "text": text, "logprob": logprob, "special": special}


async def _serve(harness: Harness, tokens: list[tuple[int, str, TokenLogprobs | None]] = TOKENS,
                 reason: FinishReason = FinishReason.LENGTH, prompt_tokens: int = 2,
                 error: str = "", prompt: PromptLogprobs | None = None) -> dict[str, Any]:
    """Play the worker for the next job: its tokens, then its end; the job's spec."""
    job_id = await harness.take_job()
    if prompt is not None:
        harness.sync.hset(harness.keys.state(job_id), PROMPT_LOGPROBS_FIELD, prompt.encode())
    harness.publish_entries(job_id, tokens)
    harness.publish_done(job_id, len(tokens), reason, prompt_tokens, error=error,
                         text="".join(t for _, t, _ in tokens))
    return harness.job_spec(job_id)


async def _post(harness: Harness, path: str, body: dict[str, Any],
                tokens: list[tuple[int, str, TokenLogprobs | None]] = TOKENS,
                **serve: Any) -> tuple[Any, dict[str, Any]]:
    """The route's answer (JSON, or the SSE events' data) and the job's spec."""
    worker = asyncio.create_task(_serve(harness, tokens, **serve))
    async with harness.client() as client:
        response = await client.post(path, json=body)
    spec = await worker
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        return [json.loads(e["data"]) for e in parse_sse(response.text) if "data" in e], spec
    return response.json(), spec


async def test_generate_answers_the_text_greedily_by_default(harness: Harness) -> None:
    answer, spec = await _post(harness, "/generate", {"inputs": "hello world"})
    assert answer == {"generated_text": "hello world the"}
    assert spec["prompt"] == "hello world" and spec["sampling"]["max_tokens"] == 100  # TGI's default
    sampling = spec["sampling"]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.0, 1.0, 0)
    assert "logprobs" not in sampling  # nothing shows them: not worked out


async def test_details_name_the_tokens_logprobs_and_top_tokens(harness: Harness) -> None:
    answer, spec = await _post(harness, "/generate", {"inputs": "hello", "parameters": {
        "details": True, "top_n_tokens": 2, "seed": 9, "max_new_tokens": 3}})
    assert answer == {"generated_text": "hello world the", "details": {
        "finish_reason": "length", "generated_tokens": 3, "seed": 9, "prefill": [],
        "tokens": [_token(3, "hello", -0.5), _token(4, "", -2.0), _token(8, " world the", -0.25)],
        "top_tokens": [[_token(3, "hello", -0.5), _token(4, "world", -1.25)],
                       [_token(8, "the", -0.125), _token(4, "world", -2.0)],
                       [_token(8, "the", -0.25), _token(3, "hello", -3.0)]]}}
    assert spec["sampling"]["logprobs"] == 2 and spec["sampling"]["max_tokens"] == 3


async def test_a_sampled_request_without_a_seed_is_answered_with_the_seed_drawn(harness: Harness) -> None:
    answer, spec = await _post(harness, "/generate", {"inputs": "hello", "parameters": {
        "do_sample": True, "details": True, "max_new_tokens": 3}})
    seed = spec["sampling"]["seed"]
    assert isinstance(seed, int) and 0 <= seed <= MAX_SEED
    assert answer["details"]["seed"] == seed  # what the job was drawn with, as TGI reports it
    events, spec = await _post(harness, "/generate_stream", {"inputs": "hello", "parameters": {
        "temperature": 0.5, "max_new_tokens": 3}})
    assert events[-1]["details"]["seed"] == spec["sampling"]["seed"] is not None
    answer, spec = await _post(harness, "/generate", {"inputs": "hello", "parameters": {
        "details": True, "max_new_tokens": 3}})
    assert answer["details"]["seed"] is None and spec["sampling"]["seed"] is None  # greedy


@pytest.mark.parametrize(("texts", "reason", "expected"), [
    (["hello", " world"], FinishReason.STOP, "stop_sequence"),  # the stop string ended it: kept
    (["hello", ""], FinishReason.STOP, "eos_token"),  # (the end of sequence writes no text)
    (["hello", " world"], FinishReason.LENGTH, "length"),
])
async def test_finish_reasons_as_tgi_names_them(harness: Harness, texts: list[str], reason: FinishReason,
                                               expected: str) -> None:
    tokens = [(3, texts[0], TokenLogprobs(-0.5)), (2 if not texts[1] else 4, texts[1], TokenLogprobs(-0.1))]
    answer, spec = await _post(harness, "/generate", {
        "inputs": "hello", "parameters": {"details": True, "stop": ["world"]}}, tokens, reason=reason)
    assert answer["details"]["finish_reason"] == expected
    assert answer["generated_text"] == "".join(texts)
    assert answer["details"]["tokens"][-1]["special"] is (not texts[1])  # <|im_end|> is special
    assert spec["sampling"]["include_stop_str_in_output"] is True  # TGI's text keeps it


async def test_prefill_is_the_prompts_tokens_with_their_logprobs(harness: Harness) -> None:
    prompt = PromptLogprobs((3, 4), (None, TokenLogprobs(-1.5, ((8, -0.5),), rank=2)))
    answer, spec = await _post(harness, "/generate", {"inputs": "hello world", "parameters": {
        "details": True, "decoder_input_details": True}}, prompt=prompt)
    assert answer["details"]["prefill"] == [{"id": 3, "text": "hello", "logprob": None},
                                            {"id": 4, "text": "world", "logprob": -1.5}]
    assert spec["sampling"]["prompt_logprobs"] == 0


async def test_return_full_text_puts_the_prompt_first(harness: Harness) -> None:
    answer, _ = await _post(harness, "/generate", {
        "inputs": "hello ", "parameters": {"return_full_text": True}})
    assert answer == {"generated_text": "hello hello world the"}


async def test_the_compatible_route_answers_a_list_or_a_stream(harness: Harness) -> None:
    answer, _ = await _post(harness, "/", {"inputs": "hello", "stream": False})
    assert answer == [{"generated_text": "hello world the"}]
    events, _ = await _post(harness, "/", {"inputs": "hello", "stream": True})
    assert [event["token"]["text"] for event in events] == ["hello", "", " world the"]


async def test_a_stream_sends_each_token_and_ends_on_the_last_with_the_details(harness: Harness) -> None:
    events, spec = await _post(harness, "/generate_stream", {
        "inputs": "hello", "parameters": {"seed": 4, "return_full_text": True}}, prompt_tokens=1)
    assert events == [
        {"index": 1, "token": _token(3, "hello", -0.5), "generated_text": None, "details": None},
        {"index": 2, "token": _token(4, "", -2.0), "generated_text": None, "details": None},
        {"index": 3, "token": _token(8, " world the", -0.25), "generated_text": "hellohello world the",
         "details": {"finish_reason": "length", "generated_tokens": 3, "seed": 4, "input_length": 1}}]
    assert spec["sampling"]["logprobs"] == 0  # every streamed token carries its logprob


async def test_a_stream_with_top_n_tokens_sends_them_with_each_token(harness: Harness) -> None:
    events, _ = await _post(harness, "/generate_stream", {
        "inputs": "hello", "parameters": {"top_n_tokens": 1}})
    assert [event["top_tokens"] for event in events] == [
        [_token(3, "hello", -0.5), _token(4, "world", -1.25)],
        [_token(8, "the", -0.125), _token(4, "world", -2.0)],
        [_token(8, "the", -0.25), _token(3, "hello", -3.0)]]


async def test_a_failed_job_is_an_error_event_in_a_stream_and_a_424_otherwise(harness: Harness) -> None:
    events, _ = await _post(harness, "/generate_stream", {"inputs": "hello"}, TOKENS[:1],
                            reason=FinishReason.ERROR, error="out of memory")
    assert events == [{"error": "The job failed: out of memory", "error_type": "generation"}]
    worker = asyncio.create_task(_serve(harness, TOKENS[:1], reason=FinishReason.ERROR,
                                        error="out of memory"))
    async with harness.client() as client:
        response = await client.post("/generate", json={"inputs": "hello"})
    await worker
    assert response.status_code == 424
    assert response.json() == {"error": "The job failed: out of memory", "error_type": "generation"}


async def test_a_stream_whose_job_keys_go_ends_with_an_error_event(harness: Harness) -> None:
    async def lose() -> None:  # a Redis that lost its data, or a retention shorter than the job
        job_id = await harness.take_job()
        harness.publish_tokens(job_id, ["a", "b"])
        await asyncio.sleep(0.2)
        harness.sync.delete(harness.keys.state(job_id), harness.keys.stream(job_id))

    worker = asyncio.create_task(lose())
    async with harness.client() as client:
        response = await client.post("/generate_stream", json={"inputs": "hello"})
    await worker
    events = [json.loads(line.removeprefix("data:")) for line in response.text.splitlines()
              if line.startswith("data:")]
    job_id = response.headers["x-carpool-job-id"]
    # The first token went (the second, held until the next entry shows whether it is the last,
    # never does), then the error.
    assert [event.get("token", {}).get("text") for event in events[:1]] == ["a"]
    assert events[1:] == [{"error": f"Job '{job_id}' expired before it ended",
                           "error_type": "incomplete_generation"}]


async def test_best_of_answers_the_sequence_of_highest_logprob(harness: Harness) -> None:
    likely = [(3, "hello", TokenLogprobs(-0.1)), (4, " world", TokenLogprobs(-0.2))]
    unlikely = [(8, "the", TokenLogprobs(-3.0))]

    async def serve_both() -> list[dict[str, Any]]:
        return [await _serve(harness, unlikely, reason=FinishReason.STOP),
                await _serve(harness, likely)]

    worker = asyncio.create_task(serve_both())
    async with harness.client() as client:
        response = await client.post("/generate", json={"inputs": "hello", "parameters": {
            "best_of": 2, "do_sample": True, "seed": 5, "details": True}})
    specs = await worker
    assert response.status_code == 200, response.text
    details = response.json()["details"]
    assert response.json()["generated_text"] == "hello world"
    assert (details["seed"], details["generated_tokens"]) == (6, 2)  # the second choice: seed + 1
    assert details["best_of_sequences"] == [{
        "generated_text": "the", "finish_reason": "eos_token", "generated_tokens": 1,
        "seed": 5, "prefill": [], "tokens": [_token(8, "the", -3.0)]}]
    assert [spec["sampling"]["temperature"] for spec in specs] == [1.0, 1.0]


@pytest.mark.parametrize(("parameters", "expected"), [
    ({"temperature": 0.7}, {"temperature": 0.7, "top_p": 1.0, "top_k": 0}),
    ({"do_sample": True, "top_k": 5, "top_p": 0.9}, {"temperature": 1.0, "top_p": 0.9, "top_k": 5}),
    ({"do_sample": False, "temperature": 1.0}, {"temperature": 0.0}),  # 1.0 is no warper: greedy
    ({"typical_p": 0.5}, {"temperature": 1.0, "typical_p": 0.5}),
    ({"repetition_penalty": 1.2, "frequency_penalty": 0.5, "truncate": 4, "stop": ["a", "the"]},
     {"temperature": 0.0, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
      "truncate_prompt_tokens": 4, "stop": ["a", "the"]}),
    ({"grammar": {"type": "regex", "value": "[0-9]+"}},
     {"structured_output": {"kind": "regex", "spec": "[0-9]+"}}),
    ({"grammar": {"type": "json", "value": {"type": "object"}}},
     {"structured_output": {"kind": "json_schema", "spec": '{"type":"object"}'}}),
    ({"grammar": {"type": "json_object", "value": '{"type": "object"}'}},  # json's alias, JSON text
     {"structured_output": {"kind": "json_schema", "spec": '{"type":"object"}'}}),
    # TGI's json_schema wraps the schema: {"name": optional, "schema": ...}.
    ({"grammar": {"type": "json_schema", "value": {"name": "n", "schema": {"enum": ["yes", "no"]}}}},
     {"structured_output": {"kind": "json_schema", "spec": '{"enum":["yes","no"]}'}}),
])
async def test_parameters_reach_the_job_as_tgi_means_them(harness: Harness, parameters: dict[str, Any],
                                                          expected: dict[str, Any]) -> None:
    nulls = {"max_new_tokens": None, "best_of": None, "watermark": False, "adapter_id": None,
             "details": False, "decoder_input_details": False, "top_n_tokens": None}
    _, spec = await _post(harness, "/generate", {"inputs": "hello",
                                                 "parameters": {**nulls, **parameters}})
    assert {name: spec["sampling"].get(name) for name in expected} == expected
    # A null max_new_tokens: as many as the context leaves after the one-token prompt.
    assert spec["sampling"]["max_tokens"] == CONTEXT - 1


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/generate", {"inputs": "hello", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ("/generate", {"inputs": "hello", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ("/generate", {"inputs": ""}, "inputs"),
    ("/generate", {"inputs": "hello", "parameters": {"nucleus": 0.5}}, "parameters.nucleus"),
    ("/generate", {"inputs": "hello", "stream": True}, "stream"),
    ("/generate", {"inputs": "hello", "parameters": {"watermark": True}}, "parameters.watermark"),
    ("/generate", {"inputs": "hello", "parameters": {"adapter_id": "x"}}, "parameters.adapter_id"),
    ("/generate", {"inputs": "hello", "parameters": {"best_of": 2}}, "parameters.best_of"),
    ("/generate_stream", {"inputs": "hello", "parameters": {"best_of": 2, "do_sample": True}},
     "parameters.best_of"),
    ("/generate_stream", {"inputs": "hello", "parameters": {"details": True,
                                                            "decoder_input_details": True}},
     "parameters.decoder_input_details"),
    ("/generate", {"inputs": "hello", "parameters": {"top_n_tokens": 500}}, "parameters.top_n_tokens"),
    ("/generate", {"inputs": "hello", "parameters": {"grammar": {"type": "regex", "value": "("}}},
     "parameters.grammar.value"),
    ("/generate", {"inputs": "hello", "parameters": {"grammar": {"type": "json_schema",
                                                                 "value": {"type": "object"}}}},
     "parameters.grammar.value"),
    ("/generate", {"inputs": "hello", "parameters": {"grammar": {"type": "xml", "value": "a"}}},
     "parameters.grammar.type"),
    ("/", {"inputs": "hello", "model": "nope"}, "model"),
])
async def test_bad_requests_are_422s_naming_the_field(harness: Harness, path: str, body: dict[str, Any],
                                                      field: str) -> None:
    async with harness.client() as client:
        response = await client.post(path, json=body)
    assert response.status_code == (404 if field == "model" else 422), response.text
    error = response.json()
    assert error["error_type"] == ("not_found" if field == "model" else "validation")
    assert field in error["error"], error
    assert set(error) == {"error", "error_type"}


async def test_a_missing_key_is_tgis_error_shape(keyed_harness: Harness) -> None:
    async with keyed_harness.client() as client:
        response = await client.post("/generate", json={"inputs": "hello"})
    assert response.status_code == 401
    assert response.json()["error_type"] == "authentication"
    async with keyed_harness.client(KEY_A) as client:
        info = await client.get("/info")
    assert info.status_code == 200


async def test_info_describes_the_default_model_and_limits(harness: Harness) -> None:
    async with harness.client() as client:
        info = (await client.get("/info")).json()
    assert {key: info[key] for key in ("model_id", "max_total_tokens", "max_input_tokens",
                                       "max_best_of", "max_stop_sequences", "router",
                                       "model_pipeline_tag")} == {
        "model_id": MODEL, "max_total_tokens": CONTEXT, "max_input_tokens": CONTEXT - 1,
        "max_best_of": harness.context.settings.max_n, "max_stop_sequences": 16,
        "router": "carpool", "model_pipeline_tag": "text-generation"}
