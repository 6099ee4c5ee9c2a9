"""The FastAPI application: routers, error handlers, and the shared context, from one settings."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import (
    routes_jobs,
    routes_openai,
    routes_ops,
    routes_playground,
    routes_tokenize,
    routes_webhooks,
)
from api.body_limit import BodyLimitMiddleware
from api.context import AppContext
from api.errors import install_error_handlers
from api.settings import ApiSettings

log = logging.getLogger(__name__)

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
        yield
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
    routers = [routes_jobs.router, routes_openai.router, routes_tokenize.router,
               routes_ops.open_router, routes_ops.router, routes_webhooks.router,
               routes_playground.router]
    for router in routers:
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes,
                       routes=[route for router in routers for route in router.routes])
    return app
