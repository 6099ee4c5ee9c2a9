"""The FastAPI application: routers, error handlers, and the shared context, from one settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api import (
    routes_anthropic,
    routes_batches,
    routes_chat_completions,
    routes_conversations,
    routes_files,
    routes_invocations,
    routes_jobs,
    routes_openai,
    routes_ops,
    routes_playground,
    routes_responses,
    routes_tgi,
    routes_tokenize,
    routes_webhooks,
)
from api.batch_runner import BatchRunner
from api.body_limit import BodyLimitMiddleware
from api.context import AppContext
from api.errors import install_error_handlers
from api.idempotency_key import REPLAYED_HEADER
from api.settings import ApiSettings

log = logging.getLogger(__name__)

# Answer headers a page's script may read across origins (CORS hides all but a few otherwise):
# the jobs an OpenAI request queued, an idempotent replay, when to retry, a new job's URL.
EXPOSED_HEADERS = ("X-Carpool-Job-Id", "X-Carpool-Job-Ids", REPLAYED_HEADER, "Retry-After",
                   "Location")

DESCRIPTION = """
Carpool serves language models as asynchronous jobs: submit a job, then follow its tokens as
Server-Sent Events (resumable with `Last-Event-ID`), or use the OpenAI-compatible routes with the
official `openai` client. When the server has API keys, send `Authorization: Bearer <key>`.
"""


def create_app(settings: ApiSettings, context: AppContext | None = None) -> FastAPI:
    """The API app; `context` lets a test hand in its own Redis clients (e.g. fakeredis)."""
    ctx = context or AppContext.build(settings)
    if ctx.auth.is_open:
        log.warning("no API keys configured (CARPOOL_API_KEYS): the API is OPEN, anyone who "
                    "reaches it may submit, read and cancel jobs")
    else:
        log.info("API keys required: %d key(s) configured", len(settings.api_keys))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = (asyncio.create_task(BatchRunner(ctx).run_forever())
                  if settings.batch_runner else None)
        yield
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        await ctx.close()

    docs = settings.public_docs
    app = FastAPI(
        title="Carpool", version="0.1.0", summary="Continuous-batching LLM jobs on Redis",
        description=DESCRIPTION, lifespan=lifespan,
        docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.context = ctx
    install_error_handlers(app, settings.retry_after_s)
    routers = [routes_jobs.router, routes_openai.router, routes_chat_completions.router,
               routes_responses.router, routes_conversations.router, routes_files.router,
               routes_batches.router, routes_tokenize.router, routes_tgi.router,
               routes_anthropic.router, routes_invocations.router,
               routes_ops.open_router, routes_ops.router, routes_webhooks.router,
               routes_playground.router]
    for router in routers:
        app.include_router(router)
    # An upload's body is the file plus its form's few hundred bytes.
    upload_limit = (settings.max_file_bytes + 64 * 1024, "CARPOOL_MAX_FILE_BYTES")
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       routes=[route for router in routers for route in router.routes],
                       path_limits={"/v1/files": upload_limit})
    if settings.cors_allowed_origins:
        # Outermost (added last): a preflight is answered before any limit, and every answer,
        # errors included, carries the headers a browser needs to read it. Keys travel in the
        # Authorization header, never in cookies: no credentials mode.
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allowed_origins,
                           allow_methods=["*"], allow_headers=["*"],
                           expose_headers=list(EXPOSED_HEADERS))
    return app
