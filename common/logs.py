"""One logging set-up for every Tandem service.

Text lines by default (readable in a terminal); JSON lines with
``TANDEM_LOG_FORMAT=json`` for log pipelines. ``TANDEM_LOG_LEVEL`` sets the level.

Modules name their logger after themselves (``logging.getLogger(__name__)``);
this configures the loggers of Tandem's packages, not the root logger, so
vLLM's, uvicorn's and other libraries' logging stay as those libraries set it.
"""

from __future__ import annotations

import logging
import os
import sys

PACKAGES = ("tandem", "services", "operators", "kernels", "common")


def setup_logging(service: str) -> None:
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("TANDEM_LOG_FORMAT", "text") == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s", static_fields={"service": service}
            )
        )
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    for package in PACKAGES:
        logger = logging.getLogger(package)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
