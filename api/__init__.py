"""Carpool's REST API (FastAPI): jobs, resumable token streams, OpenAI-compatible routes.

Never imports torch or transformers: it validates, enqueues, reads streams and cancels.
"""

from api.app import create_app
from api.settings import ApiSettings

__all__ = ["ApiSettings", "create_app"]
