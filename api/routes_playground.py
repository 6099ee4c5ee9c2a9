"""`/`: a one-page playground (plain HTML and JavaScript) to watch tokens stream in.

The page holds no data; it calls the same routes as any client, with the key typed into it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["playground"])

PAGE = Path(__file__).with_name("static") / "playground.html"


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, summary="The playground page")
async def playground() -> HTMLResponse:
    return HTMLResponse(_page())
