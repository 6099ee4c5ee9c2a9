"""Structured-output fields on both route families: each becomes the one constraint the job spec
carries, compiled at submit; a constraint that does not compile is refused, naming the field,
and nothing is queued."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from api_support import MODEL, Harness
from rq.job import Job
from rq.serializers import JSONSerializer

from protocol import Priority
from protocol.rq_keys import RQKeys

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
SCHEMA_TEXT = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false}'
ANY_OBJECT = {"kind": "json_schema", "spec": '{"type":"object"}'}


def _spec(harness: Harness, job_id: str) -> dict[str, Any]:
    args = Job.fetch(job_id, connection=harness.context.sync, serializer=JSONSerializer).args
    spec: dict[str, Any] = args[0]
    return spec


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, ANY_OBJECT),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, ANY_OBJECT),
    # JSON Schema's `true` (any value) as `{}`: the worker's compile options need an object.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": True}}},
     {"kind": "json_schema", "spec": "{}"}),
    ({"structured_outputs": {"json": SCHEMA}}, {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"structured_outputs": {"regex": "[0-9]+"}}, {"kind": "regex", "spec": "[0-9]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"kind": "choice", "spec": '["yes", "no"]'}),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, {"kind": "grammar", "spec": 'start: "a"+'}),
    ({"structured_outputs": {"json_object": True, "regex": None}}, ANY_OBJECT),
    ({"guided_json": json.dumps(SCHEMA)}, {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"guided_regex": "a|b"}, {"kind": "regex", "spec": "a|b"}),
    ({"guided_choice": ["x"]}, {"kind": "choice", "spec": '["x"]'}),
    ({"guided_grammar": 'start: "a"'}, {"kind": "grammar", "spec": 'start: "a"'}),
    # Text Generation Inference's forms, the constraint in `value` (huggingface_hub's
    # InferenceClient sends OpenAI's json_schema as json_object with the schema in `value`).
    ({"response_format": {"type": "json_object", "value": SCHEMA}}, {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    # Together AI's, Fireworks' and Anyscale's: the schema beside the type (instructor's
    # JSON_SCHEMA mode).
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"response_format": {"type": "json_object", "schema": None}}, ANY_OBJECT),
    ({"response_format": {"type": "json", "value": SCHEMA_TEXT}}, {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"response_format": {"type": "json_schema", "value": {"name": "a", "schema": SCHEMA}}},
     {"kind": "json_schema", "spec": SCHEMA_TEXT}),
    ({"response_format": {"type": "regex", "value": "[0-9]+"}}, {"kind": "regex", "spec": "[0-9]+"}),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/jobs"])
async def test_constraints_reach_the_job_spec(harness: Harness, client: httpx.AsyncClient, route: str,
                                              fields: dict[str, Any], expected: dict[str, str]) -> None:
    body = {"messages": CHAT} if route == "/v1/chat/completions" else {"prompt": "hello"}
    if route == "/v1/jobs":
        response = await client.post(route, json={**body, **fields})
        assert response.status_code == 202, response.text
        job_id = response.json()["job_id"]
    else:
        worker = asyncio.create_task(harness.serve_next_job(['{"a": 1}']))
        response = await client.post(route, json={**body, **fields})
        job_id = await worker
        assert response.status_code == 200, response.text
    assert _spec(harness, job_id)["sampling"]["structured_output"] == expected


async def test_text_format_leaves_the_spec_unconstrained(harness: Harness, client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "x", "response_format": {"type": "text"}})
    assert response.status_code == 202
    assert "structured_output" not in _spec(harness, response.json()["job_id"])["sampling"]


def _queued(harness: Harness) -> int:
    return sum(int(harness.sync.llen(RQKeys.queue(harness.keys.queue_name(MODEL, p)))) for p in Priority.ordered())


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}},
     "response_format.json_schema.schema", "does not compile to a grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": False}}},
     "response_format.json_schema.schema", "is false, which no output can satisfy"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format.json_schema",
     "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml", "unsupported keys: xml"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "must be a string"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar",
     "does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
    ({"guided_regex": "("}, "guided_regex", "does not compile"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "'response_format', 'guided_regex'"),
    ({"response_format": {"type": "json"}}, "response_format.value", "needs its constraint in 'value'"),
    ({"response_format": {"type": "regex", "value": 5}}, "response_format.value", "must be a string"),
    ({"response_format": {"type": "regex", "value": "a(b"}}, "response_format.value", "unclosed group"),
    ({"response_format": {"type": "json_schema", "value": SCHEMA}}, "response_format.value",
     "must be an object with 'schema'"),
    ({"response_format": {"type": "json_schema", "value": {"schema": {"type": "frob"}}}},
     "response_format.value.schema", "does not compile to a grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA},
                          "value": {"schema": SCHEMA}}}, "response_format.value", "give one"),
    ({"response_format": {"type": "xml", "value": "a"}}, "response_format.type", "got 'xml'"),
    ({"response_format": {"type": "json_object", "schema": {"type": "frob"}}},
     "response_format.schema", "does not compile to a grammar"),
    ({"response_format": {"type": "json_object", "schema": "x"}}, "response_format.schema",
     "is not valid JSON"),
    ({"response_format": {"type": "json_object", "schema": [1]}}, "response_format.schema",
     "must be a JSON schema"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA, "json_schema": {"schema": SCHEMA}}},
     "response_format.schema", "give one"),
])
async def test_openai_routes_refuse_bad_constraints_before_queueing(
        harness: Harness, client: httpx.AsyncClient, fields: dict[str, Any], param: str, words: str) -> None:
    response = await client.post("/v1/chat/completions", json={"messages": CHAT, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]
    assert _queued(harness) == 0


async def test_jobs_route_refuses_a_bad_schema_naming_the_field(harness: Harness,
                                                               client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/jobs", json={"prompt": "x", "guided_json": {"type": "frob"}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", "guided_json"]
    assert "does not compile to a grammar" in detail[0]["msg"]
    assert _queued(harness) == 0
