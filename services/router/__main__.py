"""`tandem-router` / `python -m services.router`: run the router with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn

from common.logs import setup_logging
from services.router.app import create_app
from services.router.config import parse_settings
from services.router.errors import WithholdMessages


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    setup_logging("router")
    logging.getLogger("uvicorn.error").addFilter(WithholdMessages())
    # uvicorn stops accepting on SIGTERM and lets in-flight requests finish
    # for the grace period before closing connections.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
