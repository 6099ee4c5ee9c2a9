"""`python -m api --host H --port P --redis-url URL`: serve the API with uvicorn.

Command-line options override the CARPOOL_* environment; everything else comes from ApiSettings.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import uvicorn

from api.app import create_app
from api.settings import ApiSettings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api", description="Carpool REST API")
    parser.add_argument("--host", help="interface to bind (CARPOOL_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (CARPOOL_PORT, default 8000)")
    parser.add_argument("--redis-url", help="Redis URL (CARPOOL_REDIS_URL)")
    parser.add_argument("--log-level", help="debug, info, warning... (CARPOOL_LOG_LEVEL)")
    args = parser.parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if value is not None}
    settings = ApiSettings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                timeout_keep_alive=settings.http_keep_alive_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
