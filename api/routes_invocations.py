"""SageMaker's POST /invocations, as vLLM and TGI serve it: one route for every request kind,
told apart by the body's fields (`messages`: a chat completion, `prompt`: a completion, `inputs`:
TGI's generate), each then answered by its own route, validation included."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response

from api import routes_openai, routes_tgi
from api.auth import caller_owner
from api.context import AppContext, get_context
from api.errors import OPENAI_TAG, InvalidRequestError, validated
from api.openai_schemas import ChatCompletionRequest, CompletionRequest, openai_error_docs
from api.tgi_schemas import GenerateRequest

router = APIRouter(tags=[OPENAI_TAG], dependencies=[Depends(caller_owner)])

Owner = Annotated[str, Depends(caller_owner)]
Context = Annotated[AppContext, Depends(get_context)]

_ERRORS = openai_error_docs(
    (400, "Invalid request (the message names the field), or a body of no known kind."),
    (401, "Missing or wrong API key."), (404, "No model of that name is served."),
    (413, "Body over the size limit."), (429, "Queue full (see Retry-After)."),
    (500, "The job failed."), (503, "Redis unreachable or no model registered yet."))


@router.post("/invocations", summary="Any generation request (SageMaker's route)",
             responses={**_ERRORS, 200: {
                 "content": {"application/json": {}, "text/event-stream": {}},
                 "description": "What /v1/chat/completions, /v1/completions or TGI's POST / "
                                "answers for the same body."}},
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"anyOf": [{"$ref": f"#/components/schemas/{name}"} for name in (
                     "ChatCompletionRequest", "CompletionRequest", "GenerateRequest")],
                     "description": "A /v1/chat/completions body (messages), a /v1/completions "
                                    "body (prompt) or a TGI generate body (inputs)."}}}}})
async def invocations(request: Request, owner: Owner, ctx: Context) -> Response:
    body = await _json_object(request)
    if "messages" in body:
        return await routes_openai.create_chat_completion(
            validated(ChatCompletionRequest, body), request, owner, ctx)
    if "prompt" in body:
        return await routes_openai.create_completion(validated(CompletionRequest, body), request,
                                                     owner, ctx)
    if "inputs" in body:
        return await routes_tgi.compat_generate(validated(GenerateRequest, body), request, owner, ctx)
    raise InvalidRequestError("The body must be a chat completion request (with 'messages'), a "
                              "completion request (with 'prompt') or a TGI generate request "
                              "(with 'inputs')", param=None)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The request body must be a JSON object")
    return body
